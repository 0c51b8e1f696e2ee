"""What a chat player reads: an observation rendered as its next user turn. The rollout worker
plays every task with it, and a task's supervised transcripts are written with it, so that
both hold the same text; and the JSONL writer of those transcripts."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from deltarl.env_server.core.models import StepResult


def observation_text(previous: StepResult | None, result: StepResult) -> str:
    """Default rendering of an observation as the next user turn.

    The transcript messages that ``result`` added since ``previous`` (all of them for the first
    observation), leaving out the player's own moves (``sender_id == current_player_id``),
    joined by blank lines; the observation's ``prompt`` if that leaves nothing. For Wordle: the
    game's instructions first, then each step's feedback ("You submitted [crane]. ...").
    """
    obs = result.observation
    start = len(previous.observation.messages) if previous is not None else 0
    texts = [m.content for m in obs.messages[start:] if m.sender_id != obs.current_player_id]
    return "\n\n".join(texts) if texts else obs.prompt


def write_transcripts(path: Path, records: Iterable[dict[str, Any]]) -> int:
    """Write transcript records (``{"messages": [...], ...}``, what ``deltarl sft`` reads) as
    JSONL; return how many."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
            n += 1
    return n
