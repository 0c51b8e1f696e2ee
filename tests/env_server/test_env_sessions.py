"""SessionStore: capacity, time-outs with a fake clock, expiry callbacks, overlap refusal."""

from __future__ import annotations

import pytest

from deltarl.env_server.core.models import EnvError, ErrorCode
from deltarl.env_server.core.sessions import SessionStore
from deltarl.env_server.wordle.environment import WordleEnvironment
from deltarl.env_server.wordle.game import WordleRules, WordLists


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def store(max_sessions: int = 3, timeout_s: float = 10.0) -> tuple[SessionStore, Clock]:
    clock = Clock()
    words = WordLists.load()
    s = SessionStore(
        lambda: WordleEnvironment(WordleRules(), words),
        max_sessions=max_sessions,
        timeout_s=timeout_s,
        clock=clock,
    )
    return s, clock


def code(exc: pytest.ExceptionInfo[EnvError]) -> ErrorCode:
    return exc.value.code


def test_capacity_and_close() -> None:
    s, _ = store(max_sessions=2)
    a = s.open("http")
    s.open("ws")
    with pytest.raises(EnvError) as err:
        s.open("http")
    assert code(err) is ErrorCode.CAPACITY_REACHED
    assert s.close(a.id, "ws") is False  # wrong transport: untouched
    assert s.close(a.id, "http") is True and s.close(a.id, "http") is False
    assert s.open("http").id != a.id and len(s) == 2


def test_timeouts_expire_and_free_capacity() -> None:
    s, clock = store(max_sessions=2, timeout_s=10)
    expired: list[str] = []
    a = s.open("http")
    s.open("ws", on_expire=lambda: expired.append("b"))
    clock.now += 6
    s.touch(a)
    clock.now += 6  # b idle 12 s, a idle 6 s
    assert s.get(a.id) is a
    assert s.reap() == 1 and expired == ["b"] and s.expired_total == 1
    clock.now += 11
    with pytest.raises(EnvError) as err:  # expired before any reaper ran
        s.get(a.id)
    assert code(err) is ErrorCode.UNKNOWN_SESSION and len(s) == 0
    s.open("http")
    s.open("http")
    clock.now += 11
    assert s.open("http") is not None  # the expired ones were reaped to make room


def test_get_errors_and_ws_sessions_are_not_http() -> None:
    s, _ = store()
    with pytest.raises(EnvError) as err:
        s.get(None)
    assert code(err) is ErrorCode.SESSION_REQUIRED
    w = s.open("ws")
    with pytest.raises(EnvError) as err:
        s.get(w.id)
    assert code(err) is ErrorCode.UNKNOWN_SESSION


def test_claim_refuses_overlap_and_busy_sessions_do_not_expire() -> None:
    s, clock = store(timeout_s=1)
    a = s.open("http")
    with a.claim():
        with pytest.raises(EnvError) as err, a.claim():
            pass
        assert code(err) is ErrorCode.SESSION_BUSY
        clock.now += 5
        assert s.reap() == 0  # held by a request: not expired under its feet
    assert not a.busy
    assert s.reap() == 1


def test_ids_are_unguessable() -> None:
    s, _ = store(max_sessions=1000)
    ids = {s.open("http").id for _ in range(500)}
    assert len(ids) == 500 and all(len(i) >= 22 for i in ids)
