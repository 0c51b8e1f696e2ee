"""Learning-rate schedule by hand, AdamW on fp32 master weights, gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch

from deltarl.trainer.learn.optim import build_optimizer, clip_gradients, lr_factor
from deltarl.trainer.settings import OptimizerSettings


def test_warmup_then_constant() -> None:
    s = OptimizerSettings(warmup_steps=4)
    assert [lr_factor(i, s, 100) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, OptimizerSettings(), 10) == 1.0
    with pytest.raises(ValueError):
        lr_factor(-1, s, 10)


def test_linear_and_cosine_decay() -> None:
    lin = OptimizerSettings(warmup_steps=2, schedule="linear", min_lr_ratio=0.1)
    # after warm-up, 10 steps of decay from 1 to 0.1
    assert lr_factor(2, lin, 12) == 1.0
    assert lr_factor(7, lin, 12) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_factor(12, lin, 12) == pytest.approx(0.1)
    assert lr_factor(50, lin, 12) == pytest.approx(0.1)
    cos = OptimizerSettings(schedule="cosine")
    assert lr_factor(5, cos, 10) == pytest.approx(0.5)
    assert lr_factor(10, cos, 10) == pytest.approx(0.0, abs=1e-12)


def test_build_optimizer_steps_with_schedule() -> None:
    model = torch.nn.Linear(3, 2)
    s = OptimizerSettings(lr=0.1, warmup_steps=2)
    opt, sched = build_optimizer(model.parameters(), s, 10)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="float32"):
        build_optimizer(torch.nn.Linear(2, 2).to(torch.bfloat16).parameters(), s, 10)


def test_clip_gradients() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_gradients([p], OptimizerSettings(grad_clip=1.0)) == pytest.approx(5.0)
    assert p.grad.tolist() == pytest.approx([0.6, 0.8])
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_gradients([p], OptimizerSettings(grad_clip=None)) == pytest.approx(5.0)
    assert p.grad.tolist() == [3.0, 4.0]
    p.grad = torch.tensor([math.inf, 0.0])
    assert not math.isfinite(clip_gradients([p], OptimizerSettings()))
