"""Wordle's hint: the game's feedback replayed over the episode's moves, naming the first move
that ignored what earlier feedback established (a letter known absent, a green moved, a yellow
left out or put back where it was yellow, a repeated word), or the first move without a
bracketed 5-letter word. Deterministic, instant, always right about the rules."""

from __future__ import annotations

from collections.abc import Sequence

FORMAT_HINT = (
    "Reply with exactly one 5-letter word in square brackets, like [crane], and nothing else."
)


def move_hint(guess: str | None, earlier: Sequence[tuple[str, str]]) -> str | None:
    """The hint for a move whose guess is ``guess`` (the bracketed word, lowercase; None when
    the reply held none), after the scored guesses ``earlier`` ((word, ``GYX`` pattern) in
    order); None when the move fits their feedback."""
    if guess is None or len(guess) != 5:
        return FORMAT_HINT
    known_absent: set[str] = set()
    greens: dict[int, str] = {}
    yellows: dict[str, set[int]] = {}
    for word, pattern in earlier:
        for pos, (ch, mark) in enumerate(zip(word, pattern, strict=True)):
            if mark == "G":
                greens[pos] = ch
            elif mark == "Y":
                yellows.setdefault(ch, set()).add(pos)
        for ch, mark in zip(word, pattern, strict=True):
            if mark == "X" and ch not in greens.values() and ch not in yellows:
                known_absent.add(ch)
    seen = {word for word, _ in earlier}
    return _contradiction(guess, known_absent, greens, yellows, seen)


def _contradiction(
    guess: str,
    absent: set[str],
    greens: dict[int, str],
    yellows: dict[str, set[int]],
    seen: set[str],
) -> str | None:
    if guess in seen:
        return f"[{guess}] was already guessed; every guess must be a new word."
    for ch in sorted(set(guess) & absent):
        return (
            f"{ch.upper()} is not in the word (the feedback marked it X), yet this guess uses it."
        )
    for pos, ch in sorted(greens.items()):
        if guess[pos] != ch:
            return f"Letter {pos + 1} is known to be {ch.upper()} (green); keep it there in every guess."
    for ch, bad in sorted(yellows.items()):
        if ch not in guess:
            return f"{ch.upper()} is in the word (yellow); the guess must include it."
        for pos in sorted(bad):
            if guess[pos] == ch:
                return (
                    f"{ch.upper()} was yellow at position {pos + 1}: it is in the word but not "
                    "there; move it."
                )
    return None
