"""Child processes of ``deltarl demo``: start, watch, stop.

Every service runs as its own ``python -m deltarl <command>`` process in a new session (so a
Ctrl-C in the terminal reaches only the demo, which then stops the children in order), with its
stdout and stderr in ``<run_dir>/logs/<name>.log``.

Shutdown order (:meth:`ProcessGroup.stop_all`): the clients (trainer, workers) first, then the
services they talk to (env server, coordinator); each is sent SIGTERM, gets ``timeout_s`` to
exit, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a text file ('' if it does not exist)."""
    if not path.is_file():
        return ""
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 64 * 1024))
        text = fh.read().decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Child:
    """One started service process and its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def exit_code(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.proc.poll()


class ProcessDiedError(RuntimeError):
    """A child process exited while the demo still needed it."""

    def __init__(self, child: Child, code: int) -> None:
        self.child = child
        self.code = code
        super().__init__(f"{child.name} exited with code {code} (log: {child.log})")


@dataclass
class ProcessGroup:
    """The demo's children, in start order."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def start(
        self,
        name: str,
        args: list[str],
        env: Mapping[str, str],
        python_args: Sequence[str] = (),
        module: str = "deltarl",
    ) -> Child:
        """Start ``python [python_args] -m <module> <args>`` with ``env`` added to this
        process's environment (``python_args``: e.g. ``-m torch.distributed.run
        --nproc_per_node 2``)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        full_env = {**os.environ, **env}
        with log.open("ab") as fh:
            proc = subprocess.Popen(
                [sys.executable, *python_args, "-m", module, *args],
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
            )
        child = Child(name, proc, log)
        self.children.append(child)
        logger.info("started %s (pid %d), log %s", name, proc.pid, log)
        return child

    def check_alive(self, allowed_done: Mapping[str, int] | None = None) -> None:
        """Raise :class:`ProcessDiedError` for the first child that exited, unless it is in
        ``allowed_done`` with that exit code (the trainer, once it finished its steps)."""
        for child in self.children:
            code = child.exit_code()
            if code is None:
                continue
            if allowed_done is not None and allowed_done.get(child.name) == code:
                continue
            raise ProcessDiedError(child, code)

    def stop_all(
        self, timeout_s: float = 20.0, first: Collection[str] = ()
    ) -> dict[str, int | None]:
        """Stop the children named in ``first`` (the clients: trainer, workers), then the others
        (the services they talk to): SIGTERM to each still running, last started first, SIGKILL
        to those still running ``timeout_s`` later. Returns each child's exit code.

        A second interrupt while waiting (Ctrl-C again, SIGTERM turned into
        ``KeyboardInterrupt``) kills every child still running at once and is re-raised: no
        child is left behind, whatever interrupts the stop."""
        try:
            self._stop([c for c in self.children if c.name in first], timeout_s)
            self._stop(self.children, timeout_s)
        except KeyboardInterrupt:
            self.kill_all()
            raise
        return {c.name: c.exit_code() for c in self.children}

    def kill_all(self) -> None:
        """SIGKILL every child still running and reap it."""
        for child in self.children:
            if child.exit_code() is None:
                _signal(child, signal.SIGKILL)
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=10)

    def _stop(self, children: list[Child], timeout_s: float) -> None:
        running = [c for c in reversed(children) if c.exit_code() is None]
        for child in running:
            _signal(child, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in running:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s: killing it", child.name, timeout_s)
                _signal(child, signal.SIGKILL)
                child.proc.wait(timeout=10)


def _signal(child: Child, signum: int) -> None:
    """Signal the child's whole process group (its own session), tolerating a race with exit."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.proc.pid, signum)


def wait_healthy(url: str, child: Child, timeout_s: float = 60.0) -> None:
    """Wait until ``GET url`` answers 200; raise if the child exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = child.exit_code()
        if code is not None:
            raise ProcessDiedError(child, code)
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{child.name} did not answer {url} within {timeout_s:.0f} s")
