"""Derive the shipped Wordle word lists from SCOWL (Debian package ``wamerican``).

Reproduce the files in ``env_server/wordle/data/``::

    apt-get install -y wamerican
    python -m deltarl.env_server.wordle.derive_wordlists /usr/share/dict/american-english

Rules (deterministic, no randomness, output sorted):

* **allowed guesses** (``allowed.txt``): every line of the dictionary that is exactly five
  lowercase ASCII letters. Capitalised entries (proper nouns), possessives (``'s``) and words
  with accents are dropped.
* **answers** (``answers.txt``): the allowed words minus the obvious inflections that the real
  game never uses as answers: plurals / third-person forms ending in ``s`` whose stem (minus
  ``s`` or ``es``) is itself a dictionary word, and past tenses ending in ``ed`` whose stem
  (minus ``d`` or ``ed``) is a dictionary word. Words ending in ``ss`` are kept (``glass``).

The input's SHA-256 is written into each file's header so that a reviewer can check which
``wamerican`` release produced it (2020.12.07-2 for the shipped files).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent / "data"
_FIVE = re.compile(r"[a-z]{5}")


def is_inflection(word: str, dictionary: set[str]) -> bool:
    """True if ``word`` is a plural / -s form or an -ed past tense of another dictionary word."""
    plural = word.endswith("s") and not word.endswith("ss")
    if plural and (word[:-1] in dictionary or (word.endswith("es") and word[:-2] in dictionary)):
        return True
    return word.endswith("ed") and (word[:-1] in dictionary or word[:-2] in dictionary)


def derive(lines: list[str]) -> tuple[list[str], list[str]]:
    """Return ``(answers, allowed)`` from the lines of a SCOWL dictionary file."""
    dictionary = {line.strip() for line in lines if line.strip()}
    allowed = sorted(w for w in dictionary if _FIVE.fullmatch(w))
    answers = [w for w in allowed if not is_inflection(w, dictionary)]
    return answers, allowed


def _write(path: Path, words: list[str], what: str, source: str, digest: str) -> None:
    header = (
        f"# {what}: {len(words)} words, one per line, sorted.\n"
        f"# Derived by env_server/wordle/derive_wordlists.py from {source}\n"
        f"# (Debian package wamerican, SCOWL; sha256 {digest}).\n"
        "# Licence: see WORDLISTS.md next to this file.\n"
    )
    path.write_text(header + "\n".join(words) + "\n", encoding="ascii")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dictionary", nargs="?", default="/usr/share/dict/american-english")
    parser.add_argument("--out", type=Path, default=DATA_DIR)
    args = parser.parse_args(argv)
    raw = Path(args.dictionary).read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    answers, allowed = derive(raw.decode("utf-8").splitlines())
    args.out.mkdir(parents=True, exist_ok=True)
    _write(args.out / "answers.txt", answers, "Wordle answers", args.dictionary, digest)
    _write(args.out / "allowed.txt", allowed, "Wordle allowed guesses", args.dictionary, digest)
    logging.basicConfig(level=logging.INFO)
    logger.info(
        "wrote %d answers and %d allowed guesses to %s", len(answers), len(allowed), args.out
    )


if __name__ == "__main__":
    main()
