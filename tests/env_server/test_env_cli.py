"""``deltarl env``: registered, lists every setting in --help, refuses bad settings."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from deltarl.cli import app
from deltarl.env_server.settings import EnvSettings


def test_help_lists_every_setting() -> None:
    result = CliRunner().invoke(app, ["env", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for name in EnvSettings.model_fields:
        assert f"DELTARL_ENV_{name.upper()}" in result.output
    assert "--host" in result.output and "--port" in result.output


def test_bad_setting_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTARL_ENV_MAX_SESSIONS", "0")
    result = CliRunner().invoke(app, ["env"])
    assert result.exit_code != 0
    assert "max_sessions" in result.output


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTARL_ENV_TOKEN", "tok3n-Qw8-zZ-4k7p")
    monkeypatch.setenv("DELTARL_ENV_ALLOW_REPEATS", "true")
    s = EnvSettings()
    assert s.token is not None and s.token.get_secret_value() == "tok3n-Qw8-zZ-4k7p"
    assert s.rules().allow_repeats and "tok3n-Qw8-zZ-4k7p" not in repr(s)


def test_token_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTARL_ENV_TOKEN", "")
    assert EnvSettings().token is None  # empty means unset
    monkeypatch.setenv("DELTARL_ENV_TOKEN", "short")
    with pytest.raises(ValueError, match="at least 16 printable ASCII characters"):
        EnvSettings()
    monkeypatch.setenv("DELTARL_ENV_TOKEN", " " * 20)  # no client can send it in a header
    with pytest.raises(ValueError, match="is blank"):
        EnvSettings()
