"""Which environment variables each Space's service reads, from its settings classes.

The settings classes are the single source of truth: a Space variable or secret must be one of
the names they read (or a client-wide variable such as ``DELTARL_HF_PROXY_TOKEN``), and its
description in the Space's settings is the field's own description. The classes are imported
inside :func:`service_vars`, so importing this module stays light.
"""

from __future__ import annotations

from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from deltarl.services.common.client_headers import HF_PROXY_TOKEN_ENV
from deltarl.services.common.tls import CA_BUNDLE_ENV

# Read by every client outside any settings class (services/common/client_headers.py, services/common/tls.py).
CLIENT_VARS: dict[str, str] = {
    HF_PROXY_TOKEN_ENV: "Hugging Face token sent as X-HF-Authorization to https://*.hf.space "
    "services (private Spaces).",
    CA_BUNDLE_ENV: "PEM bundle of CAs that clients trust.",
}


def settings_classes(service: str) -> tuple[type[BaseSettings], ...]:
    """The settings classes a Space's service reads (``coordinator``, ``env``, ``rollout``)."""
    if service == "coordinator":
        from deltarl.services.coordinator.settings import CoordinatorSettings

        return (CoordinatorSettings,)
    if service == "env":
        from deltarl.env_server.settings import EnvSettings

        return (EnvSettings,)
    if service == "rollout":
        from deltarl.buckets.settings import BucketSettings
        from deltarl.rollout.settings import RolloutSettings

        return (RolloutSettings, BucketSettings)
    raise ValueError(f"unknown service {service!r}: coordinator, env or rollout")


def env_names(cls: type[BaseSettings]) -> dict[str, str]:
    """Every environment variable ``cls`` reads (prefix + field, or the field's aliases) ->
    the field's description."""
    prefix = str(cls.model_config.get("env_prefix", ""))
    out: dict[str, str] = {}
    for name, f in cls.model_fields.items():
        description = " ".join((f.description or "").split())
        alias = f.validation_alias
        if isinstance(alias, AliasChoices):
            names = [c for c in alias.choices if isinstance(c, str)]
        elif isinstance(alias, str):
            names = [alias]
        else:
            names = [prefix + name]
        for n in names:
            out[n.upper()] = description
    return out


def service_vars(service: str) -> dict[str, str]:
    """Every variable the service reads -> its description (client-wide variables for the
    rollout worker, the one Space that is a client)."""
    out: dict[str, str] = {}
    for cls in settings_classes(service):
        out.update(env_names(cls))
    if service == "rollout":
        out.update(CLIENT_VARS)
    return out
