"""HTTPS for deltarl's services and clients.

Servers: a service serves TLS itself when its ``tls_certfile`` and ``tls_keyfile`` settings name
a PEM certificate chain and key (:class:`TLSServerSettings`); otherwise it speaks plain HTTP,
for a deployment behind a TLS-terminating proxy (a Hugging Face Space) or on loopback.

Clients: every client verifies certificates. :func:`client_verify` builds what httpx needs:
the system's trust store (certifi) by default, or a custom CA bundle (a private CA, a throwaway
test CA) from an explicit path or the ``DELTARL_CA_BUNDLE`` environment variable. Verification
can't be switched off through settings.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any, Self

from pydantic import Field, model_validator

from deltarl.services.common.settings import ServiceSettings

CA_BUNDLE_ENV = "DELTARL_CA_BUNDLE"


class TLSServerSettings(ServiceSettings):
    """Settings every HTTP service adds: serve HTTPS with a certificate and key."""

    tls_certfile: Path | None = Field(
        default=None,
        description="PEM certificate chain: serve HTTPS (needs tls_keyfile). Unset: plain HTTP "
        "(loopback, or behind a TLS-terminating proxy such as a Hugging Face Space).",
    )
    tls_keyfile: Path | None = Field(
        default=None,
        description="PEM private key of tls_certfile (keep it readable by the service only).",
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> Self:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("set both tls_certfile and tls_keyfile to serve HTTPS, or neither")
        for p in (self.tls_certfile, self.tls_keyfile):
            if p is not None and not p.is_file():
                raise ValueError(f"TLS file {p} does not exist")
        return self

    @property
    def scheme(self) -> str:
        return "https" if self.tls_certfile is not None else "http"

    def uvicorn_tls(self) -> dict[str, Any]:
        """Keyword arguments for ``uvicorn.run``: the certificate and key, or nothing."""
        if self.tls_certfile is None or self.tls_keyfile is None:
            return {}
        return {"ssl_certfile": str(self.tls_certfile), "ssl_keyfile": str(self.tls_keyfile)}


def client_verify(ca_bundle: str | os.PathLike[str] | None = None) -> ssl.SSLContext | bool:
    """What an httpx client passes as ``verify``: a context trusting ``ca_bundle`` (or
    ``$DELTARL_CA_BUNDLE``) if one is given, else ``True`` (the default trust store)."""
    path = ca_bundle if ca_bundle is not None else os.environ.get(CA_BUNDLE_ENV) or None
    if path is None:
        return True
    if not Path(path).is_file():
        raise ValueError(f"CA bundle {path} does not exist (set {CA_BUNDLE_ENV} to a PEM file)")
    return ssl.create_default_context(cafile=str(path))
