"""settings_help renders every field of a settings class, never a secret's default."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from deltarl.services.common.settings import ServiceSettings, settings_help


class Example(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="DELTARL_EX_")

    port: int = Field(default=8000, description="TCP port.")
    token: str | None = Field(default="s3cret-value", description="Shared secret.")
    worker_id: str = Field(default_factory=lambda: "w-123", description="Worker id.")


def test_every_field_is_listed_with_its_default() -> None:
    text = settings_help(Example)
    assert "DELTARL_EX_PORT (default 8000): TCP port." in text
    assert "DELTARL_EX_TOKEN (default ***)" in text and "s3cret" not in text
    assert "DELTARL_EX_WORKER_ID (default computed at start)" in text
    assert "PydanticUndefined" not in text
