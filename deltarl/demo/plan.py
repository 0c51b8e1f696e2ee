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

from deltarl.run.config import RunConfig
from deltarl.services.common.models import ModelKind

__all__ = ["DemoPlan", "DemoTask", "demo_environment", "new_token"]

DemoTask = Literal["capitals", "wordle", "charset"]

#: The ``capitals`` task's charset target: the charset task scoring a reply's share of capital
#: letters (``charset`` keeps the env server's default target, a-z).
CAPITALS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoPlan:
    """The experiment the demo runs (chosen to finish within minutes on 2 CPU cores)."""

    model_kind: ModelKind
    steps: int
    workers: int
    task: DemoTask = "capitals"
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
    warmup_steps: int | None = None  # None: the trainer's default
    # The trainer's compute dtype. SmolLM2 runs in fp32 on CPU: bf16 autocast there took ~3x
    # as long per forward+backward (12 x 110 tokens, one thread: 97-101 s vs 31-32 s on 2
    # shared cores); the published weights are the bf16 cast either way.
    precision: str | None = None  # None: the trainer's default (bf16)
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
        cls, tiny: bool, steps: int | None, workers: int, task: DemoTask = "capitals"
    ) -> DemoPlan:
        """The default experiment of SmolLM2 (``tiny`` false) or of the tiny random model, on
        the capitals task (the default), Wordle or the charset task."""
        if task in ("charset", "capitals") and tiny:
            # A random Llama over bytes: a reply of 16 byte tokens, about 10% of them in the
            # target set at first. lr 1e-2 (not SmolLM2's): a random 91k-parameter model has no
            # pretrained knowledge to preserve, and AdamW moves each weight by about lr per
            # step, so 1e-2 shifts a logit by O(0.1-1) per step and the reward rises within a
            # few dozen steps (1e-3 needs hundreds).
            return cls(
                model_kind="tiny-bytes",
                steps=steps if steps is not None else 30,
                workers=workers,
                task=task,
                group_size=8,
                groups_per_step=2,
                max_new_tokens=16,
                max_turns=1,
                lr=1e-2,
            )
        if task == "capitals":
            # SmolLM2 asked to reply in capital letters only: about 10% of its characters are
            # capitals at first, with a wide spread within a group (0.01-0.3), so GRPO has a
            # signal from the first step. lr 1e-4 (100x a production lr), no warm-up: the
            # workers sample from the bf16 cast of the trainer's fp32 weights, and bf16 rounds
            # away any change below half its spacing (6e-5 for a weight of 0.02): at 2e-5 a
            # step moved the fp32 policy (an fp32 loop learned) but almost none of the bf16
            # weights the workers sample with, and runs of 10-12 steps did not learn
            # (docs/demo.md). 24 new tokens: full marks need 8 characters, and short
            # replies keep a step short on 2 cores.
            return cls(
                model_kind="smollm2",
                steps=steps if steps is not None else 10,
                workers=workers,
                task="capitals",
                group_size=6,
                groups_per_step=2,
                max_new_tokens=24,
                max_turns=1,
                lr=1e-4,
                warmup_steps=0,
                precision="fp32",
            )
        if task == "charset":
            return cls(
                model_kind="smollm2",
                steps=steps if steps is not None else 8,
                workers=workers,
                task="charset",
                max_new_tokens=32,
                max_turns=1,
                precision="fp32",
            )
        if tiny:
            return cls(
                model_kind="tiny",
                steps=steps if steps is not None else 3,
                workers=workers,
                task="wordle",
                group_size=4,
                max_new_tokens=16,
                lr=1e-3,
                weight_decay=0.1,
            )
        return cls(
            model_kind="smollm2",
            steps=steps if steps is not None else 8,
            workers=workers,
            task="wordle",
            group_size=6,
            max_new_tokens=32,
            precision="fp32",
        )

    def run_config(self) -> RunConfig:
        """This experiment as a run config (what ``deltarl run`` reads from a TOML file)."""
        env: dict[str, Any] = {"task": "wordle" if self.task == "wordle" else "charset"}
        episodes: dict[str, Any] = {"sampling": {"max_new_tokens": self.max_new_tokens}}
        rollout: dict[str, Any] = {
            "workers": self.workers,
            "in_flight_groups": 1,
            "shutdown_grace_s": 2.0,
            "submit_timeout_s": 10.0,
            "engine": {"device": "cpu"},
            "episodes": episodes,
        }
        # the system prompt and turn limit: the env server's (charset: none, one reply)
        if self.task != "wordle":  # full marks from 8 characters of the target set
            if self.task == "capitals":
                env["charset_target"] = CAPITALS
        else:
            episodes["max_turns"] = self.max_turns
            env |= {
                "max_guesses": self.env_max_guesses,
                "max_invalid_moves": self.max_turns - 1,
                "allow_non_words": True,
            }
        trainer: dict[str, Any] = {
            "device": "cpu",
            "max_steps": self.steps,
            **({} if self.precision is None else {"precision": self.precision}),
            "optimizer": {
                "lr": self.lr,
                "weight_decay": self.weight_decay,
                **({} if self.warmup_steps is None else {"warmup_steps": self.warmup_steps}),
            },
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
