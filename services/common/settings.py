"""Deployment settings shared by every service.

Each service declares one ``pydantic_settings.BaseSettings`` subclass of :class:`ServiceSettings`
(prefix ``DELTARL_``); that class is the single source of truth for its environment variables, and
:func:`settings_help` renders it for ``--help``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_settings import BaseSettings, SettingsConfigDict

MIN_TOKEN_CHARS = 16
_NEW_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def validate_token(value: str | None, name: str) -> str | None:
    """A shared-secret token setting as a service may start with it: None when unset or empty;
    else ``value``, or ValueError (never echoing the value) when it is blank, shorter than
    :data:`MIN_TOKEN_CHARS`, or something no client can send in an HTTP header (characters
    outside printable ASCII, leading or trailing spaces, which headers drop).

    The coordinator's tokens and the env server's use it."""
    if not value:
        return None
    if not value.strip():
        raise ValueError(
            f"{name} is blank: no client can send it; leave it unset or generate one with "
            f"{_NEW_TOKEN}"
        )
    if (
        len(value) < MIN_TOKEN_CHARS
        or value != value.strip()
        or not (value.isascii() and value.isprintable())
    ):
        raise ValueError(
            f"{name} needs at least {MIN_TOKEN_CHARS} printable ASCII characters, without "
            f"leading or trailing spaces; generate one with {_NEW_TOKEN}"
        )
    return value


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


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override to a nested dict in place.

    ``value`` is parsed as JSON when it is valid JSON (numbers, booleans, null, lists, quoted
    strings), else kept as a plain string: ``loss.clip_high=0.28``, ``publish.format=trl-gap``.
    """
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {item!r} must look like section.key=value")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    try:
        parsed: Any = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    node[parts[-1]] = parsed
