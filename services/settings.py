"""Deployment settings shared by every service.

Each service declares one ``pydantic_settings.BaseSettings`` subclass of :class:`ServiceSettings`
(prefix ``DELTARL_``); that class is the single source of truth for its environment variables, and
:func:`settings_help` renders it for ``--help``.
"""

from __future__ import annotations

from typing import Any

from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    """Base class: reads ``DELTARL_<FIELD>`` environment variables (case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="DELTARL_", extra="ignore", case_sensitive=False)


def _default_text(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, str) and value == "":
        return '""'
    return str(value)


def settings_help(
    cls: type[BaseSettings], secret_words: tuple[str, ...] = ("token", "secret", "password", "key")
) -> str:
    """Render every field of a settings class as ``DELTARL_NAME (default): description`` lines.

    Defaults of secret-looking fields are never printed.
    """
    prefix = str(cls.model_config.get("env_prefix", ""))
    lines = ["Settings (environment variables):", ""]
    for name, field in cls.model_fields.items():
        env = (prefix + name).upper()
        secret = any(w in name.lower() for w in secret_words)
        if field.default_factory is not None:
            default = "computed at start"
        elif field.is_required():
            default = "required"
        else:
            default = "***" if secret and field.default else _default_text(field.default)
        desc = (field.description or "").strip()
        lines.append(f"  {env} (default {default}): {desc}")
        lines.append("")
    return "\n".join(lines)
