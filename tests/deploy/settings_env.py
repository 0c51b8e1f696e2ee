"""Which environment variables a settings class reads (shared by the container and Spaces
cross-checks)."""

from __future__ import annotations

from pydantic import AliasChoices
from pydantic_settings import BaseSettings


def env_names(cls: type[BaseSettings]) -> set[str]:
    """Every environment variable name a settings class reads (prefix + field, or its aliases)."""
    prefix = str(cls.model_config.get("env_prefix", ""))
    names: set[str] = set()
    for name, f in cls.model_fields.items():
        alias = f.validation_alias
        if isinstance(alias, AliasChoices):
            names |= {c.upper() for c in alias.choices if isinstance(c, str)}
        elif isinstance(alias, str):
            names.add(alias.upper())
        else:
            names.add((prefix + name).upper())
    return names
