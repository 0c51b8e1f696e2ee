"""The product speaks of what it is, not of how it was developed.

Every tracked file (code, docs, tests, examples, docker, compose, bench scripts and results),
every new file git does not ignore, and all their names are searched for traces of the
development history: numbered working sessions, issue and review-finding numbers, machine leases
and the names of the rented machine kinds, and result files named by attempt. History belongs in
git, not in the product.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def numbered(word: str) -> str:
    """``word N`` or ``word-N``. A command-line flag and its value (``--sessions 1000``,
    ``--idle-sessions 5000``: the env server benchmark's game sessions) is not history; a word
    joined to its number by a hyphen (an anchor such as ``#...-session-N-...``) always is."""
    return rf"(?<!-)\b{word} #?\d+|\b{word}-\d+"


# Each pattern is a trace of development history; matched case-insensitively.
PATTERNS: dict[str, re.Pattern[str]] = {
    name: re.compile(regex, re.IGNORECASE)
    for name, regex in {
        "numbered session": numbered("sessions?"),
        "session range": r"(?<!-)\bsessions? \d+\s*-\s*\d+",
        "issue number": numbered("issues?"),
        "finding number": numbered("findings?"),
        "numbered lease": numbered("leases?") + r"|\blease\d",
        "machine on loan": r"\blent (?:GPU|machine)",
        "machine kind name": r"nvidia-h[12]00-x\d",
        "result file named by attempt": r"_s\d+[a-z]?(?:_[\w.-]*)?\.(?:jsonl?|txt|log|png|csv)\b",
    }.items()
}

# Legitimate matches: (path, the matched text). Keep this list short, and say why each is here.
ALLOWED: set[tuple[str, str]] = set()


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    # tracked files and new ones not ignored: what the next commit can hold
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return sorted({p for p in out.decode().split("\0") if p})


def hits_in(path: str, text: str) -> list[str]:
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for name, pattern in PATTERNS.items():
            for m in pattern.finditer(line):
                if (path, m.group(0)) not in ALLOWED:
                    found.append(f"{path}:{lineno}: {name}: {m.group(0)!r}")
    return found


@pytest.mark.slow
def test_no_development_history_in_tracked_files() -> None:
    hits: list[str] = []
    for path in tracked_files():
        file = ROOT / path
        if not file.is_file():  # deleted in the work tree, not yet in the index
            continue
        hits += [f"file name {h}" for h in hits_in(path, path)]
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # images, archives
            continue
        hits += hits_in(path, text)
    assert not hits, (
        f"{len(hits)} traces of development history (say what the product does, with current "
        "numbers; history lives in git):\n" + "\n".join(hits)
    )


# The examples are assembled at run time so that this file holds none of them literally.
N = 12
HISTORY_EXAMPLES = [
    f"as measured in session {N}",
    f"sessions {N - 4}-{N + 1} left the same gap",
    f"its GPU test passed in sessions {N - 2} and {N + 3}",
    f"issues {N} and {N + 2}",
    f"[benchmarks](benchmarks.md#a-run-twice-as-long-session-{N}-the-wins-rise)",
    f"[the run](benchmarks.md#smollm2-learning-wordle-issue-{N})",
    f"the review's findings {N + 4}-{N + 12}",
    f"Issue {N} asked for a demo",
    f"see issue #{N}",
    f"the review's finding {N}",
    f"a fifth lease {N % 10} reran it",
    "on the project's lent " + "GPU machines",
    "one GPU of an nvidia-h100-x" + str(N // 3),
    "raw: bench/results/vllm_tp_h100x4_s" + "7b.json",
    "fsdp_publish_7b_4xh100_s" + "10_final.jsonl",
]


@pytest.mark.parametrize("text", HISTORY_EXAMPLES)
def test_each_pattern_catches_what_it_is_for(text: str) -> None:
    assert hits_in("example.md", text)


@pytest.mark.parametrize(
    "text",
    [
        "sessions (HTTP and WS together) are capped at max_sessions",
        "a lease of 120 s; `lease_s` is the batch lease",
        "the env server frees a session left behind after its idle time-out",
        "4x H100 80GB, bench/results/fsdp_publish_7b_4xh100.json",
        "https://github.com/vllm-project/vllm/issues/12345",
        "Issues are tracked on GitHub",
        "python bench/env_bench.py --sessions 1000 --rates 1000,2000 --idle-sessions 5000",
    ],
)
def test_product_words_are_not_history(text: str) -> None:
    assert not hits_in("example.md", text)
