"""The instructions a chat model gets to play Wordle: the system turn the env server advertises in
``GET /metadata`` (``system_prompt``), which workers use unless told otherwise."""

from __future__ import annotations

__all__ = ["SYSTEM_PROMPT", "system_prompt"]


def system_prompt(max_guesses: int = 6) -> str:
    """The Wordle player's system prompt for games of ``max_guesses`` guesses (in the spirit of
    TRL's Wordle example: guesses in square brackets)."""
    return (
        f"You are an expert Wordle player. Guess the secret 5-letter English word in at most "
        f"{max_guesses} {'guess' if max_guesses == 1 else 'guesses'}. After each guess you get feedback per letter: G = right letter "
        "in the right place, Y = letter in the word but elsewhere, X = letter not in the word. "
        "Use the feedback to narrow down the word. Reply with your next guess as one 5-letter "
        "word in square brackets, for example [crane], and nothing else."
    )


SYSTEM_PROMPT = system_prompt()
"""The prompt of the default game (6 guesses)."""
