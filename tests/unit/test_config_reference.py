"""docs/configuration.md is generated from the settings classes and must match them."""

from __future__ import annotations

from pathlib import Path

from deltarl.config_reference import DEPLOYMENT, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_is_up_to_date() -> None:
    assert DOC.read_text() == render(), (
        "docs/configuration.md is stale: run "
        "`python -m deltarl.config_reference > docs/configuration.md`"
    )


def test_every_deployment_variable_is_listed() -> None:
    import importlib

    text = render()
    for _, module, name, _ in DEPLOYMENT:
        cls = getattr(importlib.import_module(module), name)
        prefix = str(cls.model_config.get("env_prefix", "")).upper()
        for field in cls.model_fields:
            assert f"`{prefix}{field.upper()}`" in text
    assert "`optimizer.lr`" in text and "`batch.group_size`" in text


def test_secrets_are_hidden_by_type_not_by_name() -> None:
    from pydantic import BaseModel, Field, SecretStr

    from deltarl.config_reference import _default

    class Example(BaseModel):
        api_token: SecretStr | None = Field(default=SecretStr("s3cret"))
        max_new_tokens: int = 128
        monkey: str = "not a key"

    fields = Example.model_fields
    assert _default("api_token", fields["api_token"]) == "(secret)"
    assert _default("max_new_tokens", fields["max_new_tokens"]) == "`128`"
    assert _default("monkey", fields["monkey"]) == "`not a key`"
    text = render()
    assert "| `episodes.sampling.max_new_tokens` | `128` |" in text
    assert "s3cret" not in text
