"""Sessions: one task environment (:class:`~.tasks.TextEnvironment`) per HTTP session id or per
WebSocket connection.

Guarantees:

* At most ``max_sessions`` sessions exist (HTTP and WS together); :meth:`SessionStore.open`
  first drops expired ones, then refuses with ``CAPACITY_REACHED``.
* A session idle for ``timeout_s`` seconds is gone: :meth:`SessionStore.get` treats it as unknown
  even before the reaper (:meth:`SessionStore.run_reaper`) frees it; a WS session's ``on_expire``
  callback closes its socket.
* Steps of one session never overlap: :meth:`Session.claim` refuses a second one with
  ``SESSION_BUSY`` instead of queueing it (a client that sends concurrent steps on one session
  has a bug; queueing would hide it and could hang).
* Session ids are 128-bit random (``secrets.token_urlsafe``): one client cannot guess another's.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from deltarl.env_server.core.models import EnvError, ErrorCode

if TYPE_CHECKING:
    from deltarl.env_server.core.task import TextEnvironment

logger = logging.getLogger(__name__)

Transport = Literal["http", "ws"]


@dataclass(slots=True, eq=False)
class Session:
    """A live session. ``last_request_id``/``last_response`` make a retried step idempotent."""

    id: str
    env: TextEnvironment
    transport: Transport
    last_active: float
    on_expire: Callable[[], None] | None = None
    busy: bool = False
    playing: bool = False  # an episode was reset and has not ended
    last_request_id: str | None = None
    last_response: str | None = field(default=None, repr=False)

    @contextmanager
    def claim(self) -> Iterator[None]:
        """Hold the session for one request; refuse (``SESSION_BUSY``) if another holds it."""
        if self.busy:
            raise EnvError(ErrorCode.SESSION_BUSY, f"session {self.id} is processing another step")
        self.busy = True
        try:
            yield
        finally:
            self.busy = False


class SessionStore:
    """All sessions of one server process (single event loop: no locks needed)."""

    def __init__(
        self,
        factory: Callable[[], TextEnvironment],
        *,
        max_sessions: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory = factory
        self._sessions: dict[str, Session] = {}
        self.max_sessions = max_sessions
        self.timeout_s = timeout_s
        self._clock = clock
        self.expired_total = 0
        # episodes that never ended: their session closed, timed out or was reset mid-game
        self.unfinished_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def count(self, transport: Transport) -> int:
        return sum(1 for s in self._sessions.values() if s.transport == transport)

    def open(self, transport: Transport, on_expire: Callable[[], None] | None = None) -> Session:
        """Create a session (its environment not reset yet) or raise ``CAPACITY_REACHED``."""
        if len(self._sessions) >= self.max_sessions:
            self.reap()
        if len(self._sessions) >= self.max_sessions:
            raise EnvError(
                ErrorCode.CAPACITY_REACHED,
                f"{self.max_sessions} sessions are open (the server's max_sessions); close "
                "finished sessions or retry later",
            )
        sid = secrets.token_urlsafe(16)
        session = Session(sid, self._factory(), transport, self._clock(), on_expire)
        self._sessions[sid] = session
        return session

    def get(self, session_id: str | None) -> Session:
        """The live HTTP session with this id, or ``SESSION_REQUIRED`` / ``UNKNOWN_SESSION``."""
        if not session_id:
            raise EnvError(
                ErrorCode.SESSION_REQUIRED,
                "pass the session_id returned by POST /reset (body field, query parameter or "
                "X-Deltarl-Session header), or play over WS /ws",
            )
        session = self._sessions.get(session_id)
        if session is not None and self._expired(session, self._clock()):
            self._drop(session)
            session = None
        if session is None or session.transport != "http":
            raise EnvError(
                ErrorCode.UNKNOWN_SESSION,
                f"no session {session_id[:64]!r}: it was never opened, was closed, or timed out "
                f"after {self.timeout_s:g} s idle; call POST /reset for a new one",
            )
        return session

    def touch(self, session: Session) -> None:
        session.last_active = self._clock()

    def started(self, session: Session) -> None:
        """``session``'s environment was reset: a new episode (an unfinished one is counted)."""
        self._leave(session)
        session.playing = True

    def _leave(self, session: Session) -> None:
        if session.playing:
            self.unfinished_total += 1
            session.playing = False

    def close(self, session_id: str, transport: Transport = "http") -> bool:
        """Free a session of this transport now; False if there was none."""
        session = self._sessions.get(session_id)
        if session is None or session.transport != transport:
            return False
        del self._sessions[session_id]
        self._leave(session)
        return True

    def _expired(self, session: Session, now: float) -> bool:
        return not session.busy and now - session.last_active > self.timeout_s

    def _drop(self, session: Session) -> None:
        if self._sessions.pop(session.id, None) is None:
            return
        self.expired_total += 1
        self._leave(session)
        if session.on_expire is not None:
            session.on_expire()

    def reap(self) -> int:
        """Free every expired session now; return how many."""
        now = self._clock()
        expired = [s for s in self._sessions.values() if self._expired(s, now)]
        for session in expired:
            self._drop(session)
        if expired:
            logger.info("freed %d idle sessions (%d left)", len(expired), len(self._sessions))
        return len(expired)

    async def run_reaper(self, interval_s: float | None = None) -> None:
        """Reap forever (cancel the task to stop); default interval min(timeout/4, 30 s)."""
        interval = interval_s if interval_s is not None else min(self.timeout_s / 4, 30.0)
        while True:
            await asyncio.sleep(interval)
            self.reap()
