"""Headers every deltarl HTTP client sends: the service token and, for private Hugging Face
Spaces, the Hub token the Spaces proxy asks for.

A private Space answers only requests that carry a Hugging Face token. The proxy reads it from
``Authorization: Bearer hf_...`` *or* from ``X-HF-Authorization: Bearer hf_...``; deltarl's
clients use the second, so that ``Authorization`` stays free, and deltarl's own token travels in
``X-Deltarl-Token`` (:data:`TOKEN_HEADER`): neither clashes.

The Hub token comes from the environment variable ``DELTARL_HF_PROXY_TOKEN`` (read when a client
is built, like ``DELTARL_CA_BUNDLE``) and is sent **only** to ``https://*.hf.space`` base URLs:
a coordinator or env server anywhere else never sees the user's Hub token.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

# Header of every deltarl service's shared-secret token (coordinator, env server, teacher). Not
# Authorization, which the Hugging Face Spaces proxy consumes for private Spaces.
TOKEN_HEADER = "X-Deltarl-Token"
HF_PROXY_TOKEN_ENV = "DELTARL_HF_PROXY_TOKEN"
HF_PROXY_HEADER = "X-HF-Authorization"
SPACES_APP_DOMAIN = "hf.space"


def is_space_url(base_url: str) -> bool:
    """Whether ``base_url`` is a Space's app URL (``https://<subdomain>.hf.space``)."""
    parts = urlsplit(base_url)
    host = (parts.hostname or "").lower()
    return parts.scheme == "https" and host.endswith("." + SPACES_APP_DOMAIN)


def client_headers(
    base_url: str, token: str | None, *, hf_proxy_token: str | None = None
) -> dict[str, str]:
    """Default headers of a client of the service at ``base_url``.

    * ``X-Deltarl-Token: <token>`` when ``token`` is non-empty;
    * ``X-HF-Authorization: Bearer <hub token>`` when ``base_url`` is an ``https://*.hf.space``
      URL and a Hub token is known: ``hf_proxy_token``, else ``$DELTARL_HF_PROXY_TOKEN``.
    """
    headers = {TOKEN_HEADER: token} if token else {}
    hub_token = hf_proxy_token if hf_proxy_token is not None else os.environ.get(HF_PROXY_TOKEN_ENV)
    if hub_token and is_space_url(base_url):
        headers[HF_PROXY_HEADER] = f"Bearer {hub_token.strip()}"
    return headers
