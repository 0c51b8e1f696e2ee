"""The coordinator service: versions, anchors, staleness, workers and the trajectory queue.

* :mod:`.app` — the FastAPI application (``create_app(settings)``), routers in :mod:`.routers`.
* :mod:`.client` — :class:`CoordinatorClient` / :class:`AsyncCoordinatorClient`, the only way other
  processes talk to it (imports neither the server modules nor fastapi).
* :mod:`.store` — durable state behind one interface (SQLite default, Redis).
* :mod:`.cli` — ``deltarl coordinator`` and ``deltarl status``.

Nothing heavy is imported here, so that importing the client stays cheap.
"""
