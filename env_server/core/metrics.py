"""Prometheus metrics of the environment server (``GET /metrics``), one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deltarl.env_server.core.sessions import SessionStore


class EnvMetrics:
    """Counters are pre-bound to their labels so that a step costs a few attribute look-ups."""

    def __init__(self, store: SessionStore) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        requests = Counter(
            "deltarl_env_requests",
            "Requests answered without error",
            ["op", "transport"],
            registry=r,
        )
        self.step = {t: requests.labels("step", t) for t in ("http", "ws")}
        self.reset = {t: requests.labels("reset", t) for t in ("http", "ws")}
        games = Counter(
            "deltarl_env_games", "Episodes that ended, by outcome", ["outcome"], registry=r
        )
        self.games = {o: games.labels(o) for o in ("won", "lost", "forfeit")}
        self.errors = Counter("deltarl_env_errors", "Error responses by code", ["code"], registry=r)
        self.step_seconds = Histogram(
            "deltarl_env_step_seconds",
            "Server-side time to apply a step and serialise the answer",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1),
            registry=r,
        )
        sessions = Gauge("deltarl_env_sessions", "Open sessions", ["transport"], registry=r)
        sessions.labels("http").set_function(lambda: store.count("http"))
        sessions.labels("ws").set_function(lambda: store.count("ws"))
        expired = Gauge("deltarl_env_sessions_expired", "Sessions freed by time-out", registry=r)
        expired.set_function(lambda: store.expired_total)
        unfinished = Gauge(
            "deltarl_env_games_unfinished",
            "Episodes reset but never ended: their session closed, timed out or was reset "
            "mid-game (a client that gave up on them); not in deltarl_env_games",
            registry=r,
        )
        unfinished.set_function(lambda: store.unfinished_total)
        capacity = Gauge("deltarl_env_sessions_max", "max_sessions setting", registry=r)
        capacity.set(store.max_sessions)

    def game_over(self, outcome: str) -> None:
        """Count an episode that ended: ``won``, ``lost`` or ``forfeit``."""
        self.games[outcome].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
