"""Experiment settings: defaults, TOML + overrides, resolved copy, loud errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from deltarl.services.common.settings import apply_override
from deltarl.trainer.settings import ExperimentSettings


def test_defaults_are_the_documented_ones() -> None:
    s = ExperimentSettings()
    assert s.optimizer.lr == 1e-6 and s.optimizer.grad_clip == 1.0
    assert s.loss.importance_sampling == "token_truncate" and s.loss.importance_sampling_cap == 3
    assert s.batch.group_size == 8 and s.batch.max_staleness == 4
    assert s.publish.format == "compact" and s.publish.anchor_every == 10
    for model in (s, s.optimizer, s.loss, s.batch, s.publish):
        for name, field in type(model).model_fields.items():
            assert field.description or name in ("optimizer", "loss", "batch", "publish"), name


def test_toml_overrides_and_resolved_copy(tmp_path: Path) -> None:
    cfg = tmp_path / "exp.toml"
    cfg.write_text(
        'model = "tiny"\nmax_steps = 30\n[optimizer]\nlr = 2e-6\nwarmup_steps = 5\n'
        '[publish]\nformat = "trl-gap"\n'
    )
    s = ExperimentSettings.load(
        cfg, ["loss.clip_high=0.28", "batch.max_staleness=null", "publish.anchor_every=0"]
    )
    assert s.model == "tiny" and s.optimizer.lr == 2e-6 and s.publish.format == "trl-gap"
    assert s.loss.clip_high == 0.28 and s.batch.max_staleness is None
    out = s.write_resolved(tmp_path / "run")
    back = ExperimentSettings.load(out)
    assert back == s
    assert json.loads(out.read_text())["loss"]["aggregation"] == "token_mean"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss.clip_hihg=0.3"], "clip_hihg"),
        (["publish.format=zip"], "format"),
        (["optimizer.warmup_steps=500"], "warmup_steps"),
        (["loss.importance_sampling=token"], "importance_sampling"),
    ],
)
def test_mistakes_fail_loudly(overrides: list[str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ExperimentSettings.load(None, overrides)


def test_override_syntax() -> None:
    data: dict[str, object] = {"loss": 3}
    with pytest.raises(ValueError, match=r"section\.key=value"):
        apply_override(data, "no-equals")
    with pytest.raises(ValueError, match="not a section"):
        apply_override(data, "loss.kl_coef=0.1")
    apply_override(data, "publish.format=trl-raw")
    assert data["publish"] == {"format": "trl-raw"}
    with pytest.raises(ValueError, match=r"\.toml or \.json"):
        ExperimentSettings.load("exp.yaml")


def test_settings_import_no_torch() -> None:
    code = "import sys, deltarl.trainer.settings; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fp8_publication_turns_the_onpolicy_check_off_unless_set() -> None:
    """fp8 workers' on-policy tokens come from the quantized weights, which the trainer does not
    score with: the bf16 bound would refuse every honest fp8 worker's group."""
    assert ExperimentSettings().sampling.max_onpolicy_mismatch_kl == 0.03
    fp8 = ExperimentSettings.load(None, ["publish.fp8=true"])
    assert fp8.sampling.max_onpolicy_mismatch_kl is None
    kept = ExperimentSettings.load(
        None, ["publish.fp8=true", "sampling.max_onpolicy_mismatch_kl=0.5"]
    )
    assert kept.sampling.max_onpolicy_mismatch_kl == 0.5
    resolved = ExperimentSettings.model_validate_json(fp8.model_dump_json())
    assert resolved == fp8  # a resolved settings file reads back the same
