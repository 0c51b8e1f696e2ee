"""Shared fixtures: small random states in every supported dtype (tests/states.py)."""

from __future__ import annotations

import os

import pytest
import torch
from states import make_state

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    return make_state()
