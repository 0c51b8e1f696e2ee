"""What the demo runs: :class:`DemoPlan` (the experiment sized for 2 CPU cores) and the
environment its children share. The command is :mod:`deltarl.demo.cli`, the run
:mod:`deltarl.demo.runner`.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from deltarl.demo.model import ModelKind
from deltarl.run.config import RunConfig

__all__ = ["DemoPlan", "DemoTask", "demo_environment", "new_token"]

DemoTask = Literal["wordle", "charset"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoPlan:
    """The experiment the demo runs (chosen to finish within minutes on 2 CPU cores)."""

    model_kind: ModelKind
    steps: int
    workers: int
    task: DemoTask = "wordle"
    # worker i samples with engine seed seed * workers + i; the trainer gets this seed too
    seed: int = 0
    group_size: int = 6
    groups_per_step: int = 2
    max_new_tokens: int = 32
    # One scored guess per game (partial credit: greens + yellows/2 of 5 letters), and one
    # invalid reply tolerated before it (a warning, then a second turn): every episode ends with
    # the environment's reward, none is cut by max_turns.
    env_max_guesses: int = 1
    max_turns: int = 2
    max_staleness: int = 2
    lr: float = 1e-6
    # AdamW's decoupled decay moves weights even when every advantage is 0 (a random --tiny
    # model never scores): it keeps --tiny's deltas realistic in density.
    weight_decay: float = 0.0
    anchor_every: int = 0  # only version 0 carries an anchor
    # On-policy distillation (`--distill`): a teacher service (the run's model unless
    # teacher_model names another directory) that the workers ask, and loss.distill = "jsd"
    distill: bool = False
    teacher_model: str | None = None

    @classmethod
    def for_model(
        cls, tiny: bool, steps: int | None, workers: int, task: DemoTask = "wordle"
    ) -> DemoPlan:
        """The default experiment of SmolLM2 (``tiny`` false) or of the tiny random model, on
        Wordle or on the charset task."""
        if task == "charset" and tiny:
            # A random Llama over bytes: a reply of 16 byte tokens, about 10% of them in the
            # target set a-z at first. lr 1e-2 (not SmolLM2's 1e-6): a random 91k-parameter
            # model has no pretrained knowledge to preserve, and AdamW moves each weight by
            # about lr per step, so 1e-2 shifts a logit by O(0.1-1) per step and the reward
            # rises within a few dozen steps (1e-3 needs hundreds).
            return cls(
                model_kind="tiny-bytes",
                steps=steps if steps is not None else 30,
                workers=workers,
                task="charset",
                group_size=8,
                groups_per_step=2,
                max_new_tokens=16,
                max_turns=1,
                lr=1e-2,
            )
        if task == "charset":
            return cls(
                model_kind="smollm2",
                steps=steps if steps is not None else 8,
                workers=workers,
                task="charset",
                max_new_tokens=32,
                max_turns=1,
            )
        if tiny:
            return cls(
                model_kind="tiny",
                steps=steps if steps is not None else 3,
                workers=workers,
                group_size=4,
                max_new_tokens=16,
                lr=1e-3,
                weight_decay=0.1,
            )
        return cls(
            model_kind="smollm2",
            steps=steps if steps is not None else 8,
            workers=workers,
            group_size=6,
            max_new_tokens=32,
        )

    def run_config(self) -> RunConfig:
        """This experiment as a run config (what ``deltarl run`` reads from a TOML file)."""
        env: dict[str, Any] = {"task": self.task}
        rollout: dict[str, Any] = {
            "workers": self.workers,
            "device": "cpu",
            "max_turns": self.max_turns,
            "max_new_tokens": self.max_new_tokens,
            "in_flight_groups": 1,
            "shutdown_grace_s": 2.0,
            "submit_timeout_s": 10.0,
        }
        if self.task == "charset":  # target a-z, full marks from 8 characters
            rollout["system_prompt"] = ""  # the env's own instructions, not the Wordle prompt
        else:
            env |= {
                "max_guesses": self.env_max_guesses,
                "max_invalid_moves": self.max_turns - 1,
                "allow_non_words": True,
            }
        trainer: dict[str, Any] = {
            "device": "cpu",
            "max_steps": self.steps,
            "optimizer": {"lr": self.lr, "weight_decay": self.weight_decay},
            "batch": {
                "groups_per_step": self.groups_per_step,
                "micro_batch_size": self.group_size * self.groups_per_step,
            },
            "publish": {"anchor_every": self.anchor_every},
            "checkpoint": {"every": 0, "keep": 1},
        }
        teacher: dict[str, Any] | None = None
        if self.distill:
            trainer["loss"] = {"distill": "jsd"}
            teacher = {"device": "cpu", "dtype": "float32"}
            if self.teacher_model is not None:
                teacher["model"] = self.teacher_model
        return RunConfig.model_validate(
            {
                "run": {
                    "model": self.model_kind,
                    "group_size": self.group_size,
                    "max_staleness": self.max_staleness,
                    "seed": self.seed,
                },
                "env": env,
                # a few steps' worth of groups: workers idle instead of filling a long queue
                "coordinator": {"target_queue_groups": 2 * self.groups_per_step},
                "rollout": rollout,
                "trainer": trainer,
                "teacher": teacher,
            }
        )


def new_token() -> str:
    """A random token for one run's roles (URL-safe, 43 characters)."""
    return secrets.token_urlsafe(32)


def demo_environment() -> dict[str, str]:
    """Environment shared by every child: quiet tokenizers, one thread each (two workers, a
    trainer and two services share the cores)."""
    return {
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "DELTARL_LOG_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
    }


def elapsed(t0: float) -> float:
    """Seconds since ``t0`` (``time.monotonic``)."""
    return time.monotonic() - t0
