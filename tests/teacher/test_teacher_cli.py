"""``deltarl teacher``: registered, lists every setting in --help, refuses bad settings."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from deltarl.cli import app
from deltarl.teacher.settings import TeacherSettings


def test_help_lists_every_setting() -> None:
    result = CliRunner().invoke(app, ["teacher", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for name in TeacherSettings.model_fields:
        assert f"DELTARL_TEACHER_{name.upper()}" in result.output
    assert "--host" in result.output and "--port" in result.output


def test_python_dash_m_is_the_same_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deltarl.teacher", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "DELTARL_TEACHER_TOKEN" in out.stdout


def test_the_token_is_required_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELTARL_TEACHER_TOKEN", raising=False)
    result = CliRunner().invoke(app, ["teacher"])
    assert result.exit_code != 0 and "token" in result.output.lower()
    monkeypatch.setenv("DELTARL_TEACHER_TOKEN", "short")
    with pytest.raises(ValueError, match="at least 16"):
        TeacherSettings()
    monkeypatch.setenv("DELTARL_TEACHER_TOKEN", "")
    with pytest.raises(ValueError, match="required"):
        TeacherSettings()
    monkeypatch.setenv("DELTARL_TEACHER_TOKEN", "tok3n-Qw8-zZ-4k7p-teacher")
    s = TeacherSettings()
    assert s.top_k == 20 and s.engine == "transformers" and "tok3n" not in repr(s)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"DELTARL_TEACHER_TOP_K": "129"}, "top_k"),
        ({"DELTARL_TEACHER_MAX_TOP_K": "8"}, "exceeds max_top_k"),
        ({"DELTARL_TEACHER_MAX_SEQ_LEN": "99999"}, "max_batch_tokens"),
        ({"DELTARL_TEACHER_ENGINE": "vllm"}, "DELTARL_TEACHER_MODEL"),
    ],
)
def test_inconsistent_settings_are_refused(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], words: str
) -> None:
    monkeypatch.setenv("DELTARL_TEACHER_TOKEN", "tok3n-Qw8-zZ-4k7p-teacher")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=words):
        TeacherSettings()
