"""Helpers of the environment-server tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI

from deltarl.env_server.settings import EnvSettings
from deltarl.env_server.wordle.game import WordLists, answer_for_seed


def settings(**overrides: Any) -> EnvSettings:
    """Settings independent of the caller's DELTARL_ENV_* environment."""
    return EnvSettings.model_validate(overrides)


def answer(seed: int) -> str:
    return answer_for_seed(WordLists.load(), seed)


def wrong_guesses(seed: int, n: int) -> list[str]:
    """``n`` distinct allowed words that are not the answer of ``seed`` nor in the prompt."""
    secret = answer(seed)
    picks = [
        w for w in ("crane", "slate", "pious", "dumpy", "fight", "blown", "tulip") if w != secret
    ]
    return picks[:n]


class LiveServer:
    """uvicorn in a thread on a free loopback port."""

    def __init__(self, app: FastAPI, ws_max_size: int = 16 * 1024 * 1024) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", ws_max_size=ws_max_size, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})
        self.app = app

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
