"""``deltarl train``: settings are parsed and written before any heavy import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deltarl", "train", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dry_run_writes_resolved_settings_without_importing_torch(tmp_path: Path) -> None:
    cfg = tmp_path / "exp.toml"
    cfg.write_text('max_steps = 7\n[publish]\nformat = "trl-raw"\n')
    run_dir = tmp_path / "run"
    code = (
        "import sys; from typer.testing import CliRunner; from deltarl.cli import app; "
        f"r = CliRunner().invoke(app, ['train', '--dry-run', '-c', {str(cfg)!r}, "
        f"'--set', 'run_dir={run_dir}', '--set', 'loss.kl_coef=0.05']); "
        "assert r.exit_code == 0, r.output; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    resolved = json.loads((run_dir / "settings.json").read_text())
    assert resolved["max_steps"] == 7 and resolved["publish"]["format"] == "trl-raw"
    assert resolved["loss"]["kl_coef"] == 0.05 and resolved["optimizer"]["lr"] == 1e-6


def test_bad_settings_are_reported() -> None:
    r = run("--dry-run", "--set", "loss.clip_hihg=0.3")
    assert r.returncode != 0 and "clip_hihg" in r.stdout + r.stderr
    r = run("--help")
    assert r.returncode == 0 and "DELTARL_TRAINER_COORDINATOR_URL" in r.stdout


def test_resume_without_a_checkpoint_is_refused_before_importing_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from typer.testing import CliRunner; from deltarl.cli import app; "
        f"r = CliRunner().invoke(app, ['train', '--resume', '--set', 'run_dir={tmp_path}']); "
        "assert r.exit_code == 2, r.output; assert 'no checkpoint to resume from' in r.output, "
        "r.output; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
