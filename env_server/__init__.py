"""The Wordle environment server (OpenEnv protocol) and its client; see docs/env_server.md.

* ``models``: wire schemas and error codes (pydantic only; shared by server and client)
* ``client``: :class:`EnvClient` (async) and :class:`SyncEnvClient` for rollout workers
* ``wordle``: the pure game; ``environment``: one session as the wire sees it
* ``app`` (FastAPI factory), ``sessions``, ``guard`` (token, body size), ``metrics``,
  ``settings`` (``DELTARL_ENV_*``), ``cli`` (``deltarl env``)

Nothing is imported here, so ``import deltarl.env_server.core.client`` loads no server code.
"""
