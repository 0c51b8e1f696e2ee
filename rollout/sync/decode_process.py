"""Decode deltas in a child process, out of reach of the engine's Python threads.

Why: a rollout engine's generation loop is Python (the transformers engine's per-token loop, or
vLLM's scheduler) and holds the GIL most of the time. The compact decoder's kernels release the
GIL, but its per-chunk glue (parsing, numpy) needs it dozens of times per chunk, and each time it
waits for the generation thread to let go (up to the 5 ms switch interval). Measured on 2 cores
with a Qwen3-0.6B-shaped delta (7 M changes): 0.93 s alone, 3.4-17.5 s next to a busy Python
thread. In a child process the decoder has a GIL of its own and decodes at its full speed.

Shape of the arrangement:

* The parent (the worker's sync thread) keeps the host mirror of the weights — the copy the
  decoder reads old values from — in one POSIX shared-memory block (:class:`SharedMirror`), and
  patches it in place after each verified apply, as it would a private mirror. The child maps
  the same block read-only in spirit (it never writes it): no second copy of the model.
* Requests and replies are length-prefixed msgpack frames over the child's stdin/stdout; bulk
  data travels as msgpack ``bin`` (the delta's bytes in, the decoded indices and values out).
  Nothing is pickled. The child's own stdout is moved off fd 1 first, so a stray print in a
  library cannot corrupt the protocol.
* Order of calls (all from one thread, the sync thread)::

      DecodeProcess()                      # spawns the child; its imports run in the background
      .attach(mirror)                      # after every anchor load: the child maps the block
      .decode(data, base_digests) -> Delta # base checked by digest, every checksum verified
      ... parent applies, verifies, patches mirror in place, next decode ...
      .decode(data, base_digests, context=ctx)   # a chained delta (if .holds(ctx))
      .decode(part, slice_digests, layout=l)    # one part of a sharded version
      .close()

* Chained deltas need the :class:`~deltarl.weightsync.codec.context.DeltaContext` of the
  delta applied before them (~10 bytes per changed element). It does not cross the pipe: after
  each decode the child builds the context of the delta it just decoded itself, from the mirror
  (still at the delta's base, the parent patches it only after verification), keeps the latest
  :data:`KEPT_CONTEXTS` and names it by digest in its reply. A chained decode sends only the
  digest of the parent's context; :meth:`DecodeProcess.holds` says whether the child has it
  (when not, e.g. after a restart, the parent decodes in process).

Guarantees: :meth:`DecodeProcess.decode` returns exactly what
:func:`~deltarl.weightsync.codec.decode_delta` returns in process (same checks, same
errors: a :class:`~deltarl.weightsync.errors.DeltaError` raised in the child is raised
again in the parent with its class and message). If the child dies or answers nonsense, the
call raises :class:`DecodeProcessError` (not a ``DeltaError``: the object is not at fault) and
the next call starts a fresh child; the caller may decode in process meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from multiprocessing import shared_memory
from typing import IO, Any

import msgpack
import numpy as np
import torch

from deltarl.weightsync import errors as delta_errors
from deltarl.weightsync.codec.bits import float_format
from deltarl.weightsync.codec.context import DeltaContext
from deltarl.weightsync.delta import UNKNOWN_DIGEST, Delta, TensorPatch
from deltarl.weightsync.sharding import layout_view

logger = logging.getLogger(__name__)

FRAME = struct.Struct("<Q")
ALIGN = 64
MAX_FRAME = 1 << 36  # 64 GiB: a length beyond this is a broken stream, not a delta
KEPT_CONTEXTS = 2  # delta contexts the child keeps (the latest decoded deltas')


def _widen_pipe(fd: int) -> None:
    """Ask Linux for a pipe buffer of up to 1 MiB (fewer GIL-releasing writes per delta)."""
    with contextlib.suppress(ImportError, AttributeError, OSError):
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)


class DecodeProcessError(RuntimeError):
    """The decoding child died, timed out or broke the protocol (not the delta's fault)."""


class SharedMirror:
    """A host copy of a state dict in one shared-memory block.

    ``tensors`` are ordinary CPU tensors viewing the block (patch them in place like any
    tensor); ``layout`` tells another process how to map the same tensors. The creator owns the
    block: :meth:`close` unlinks it.
    """

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        layout: list[dict[str, Any]] = []
        offset = 0
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            layout.append(
                {
                    "name": name,
                    "dtype": float_format(t.dtype).name,
                    "shape": list(t.shape),
                    "offset": offset,
                    "nbytes": nbytes,
                }
            )
            offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        self._shm = shared_memory.SharedMemory(create=True, size=max(offset, ALIGN))
        self.name = self._shm.name
        self.layout = layout
        self.tensors = _views(self._shm, layout)
        with torch.no_grad():
            for name, t in state.items():
                self.tensors[name].copy_(t)

    def close(self) -> None:
        """Drop the views and unlink the block (the child must have let go of it first)."""
        self.tensors = {}
        try:
            self._shm.close()
        except BufferError:  # a view is still alive somewhere: the OS frees it at exit
            logger.warning("shared mirror %s still has views; leaving it mapped", self.name)
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()


def _views(
    shm: shared_memory.SharedMemory, layout: list[dict[str, Any]]
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for entry in layout:
        dtype = float_format(entry["dtype"]).torch_dtype
        shape = tuple(int(s) for s in entry["shape"])
        if entry["nbytes"] == 0:
            out[entry["name"]] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(
            shm.buf, dtype=torch.uint8, count=int(entry["nbytes"]), offset=int(entry["offset"])
        )
        out[entry["name"]] = flat.view(dtype).view(shape)
    return out


def _write_frame(f: IO[bytes], obj: Any, *, flush: bool = True) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    f.write(FRAME.pack(len(body)))
    f.write(body)
    if flush:
        f.flush()


def _read_exact(f: IO[bytes], n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not k:
            raise EOFError(f"stream ended after {got} of {n} bytes")
        got += k
    return buf


def _read_frame(f: IO[bytes]) -> Any:
    (n,) = FRAME.unpack(_read_exact(f, FRAME.size))
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes announced: the stream is broken")
    return msgpack.unpackb(_read_exact(f, n), raw=False)


def _write_delta(
    f: IO[bytes], delta: Delta, decode_s: float, context_digest: str | None = None
) -> None:
    """Write every patch's indices then values into a fresh shared-memory block (which the
    parent copies out and unlinks) and answer with a header naming it: one copy, no pipe
    traffic proportional to the delta."""
    arrays: list[np.ndarray] = []
    meta = []
    for p in delta.patches.values():
        index = np.ascontiguousarray(p.index, np.int64)
        value = np.ascontiguousarray(p.value)
        arrays += [index, value]
        meta.append(
            {
                "name": p.name,
                "dtype": p.dtype,
                "shape": list(p.shape),
                "base_digest": p.base_digest,
                "result_digest": p.result_digest,
                "value_dtype": value.dtype.str,
                "changed": int(index.size),
            }
        )
    total = sum(a.nbytes for a in arrays)
    shm = _untracked(shared_memory.SharedMemory(create=True, size=max(total, 1)))
    try:
        out = np.ndarray((total,), np.uint8, buffer=shm.buf)
        offset = 0
        for a in arrays:
            out[offset : offset + a.nbytes] = a.view(np.uint8).reshape(-1)
            offset += a.nbytes
        del out
    finally:
        shm.close()
    header: dict[str, Any] = {
        "ok": True,
        "base_version": delta.base_version,
        "version": delta.version,
    }
    header |= {"patches": meta, "shm": shm.name, "nbytes": total, "decode_s": decode_s}
    header["context_digest"] = context_digest
    _write_frame(f, header)


def _read_delta(header: dict[str, Any]) -> Delta:
    """Copy the child's result block out (then unlink it) and build the delta from it."""
    n = int(header["nbytes"])
    shm = shared_memory.SharedMemory(name=str(header["shm"]))
    try:
        if shm.size < n:
            raise ValueError(f"result block holds {shm.size} bytes, the header says {n}")
        payload = np.empty(n, np.uint8)  # writable, owned here
        src = np.ndarray((n,), np.uint8, buffer=shm.buf)
        payload[:] = src
        del src
    finally:
        shm.close()
        shm.unlink()
    patches: dict[str, TensorPatch] = {}
    offset = 0
    for p in header["patches"]:
        k = int(p["changed"])
        vdt = np.dtype(p["value_dtype"])
        index = payload[offset : offset + 8 * k].view(np.int64)
        offset += index.nbytes
        value = payload[offset : offset + vdt.itemsize * k].view(vdt)
        offset += value.nbytes
        if index.size != k or value.size != k:
            raise ValueError("the result block is shorter than its header says")
        patches[p["name"]] = TensorPatch(
            name=p["name"],
            dtype=p["dtype"],
            shape=tuple(int(s) for s in p["shape"]),
            index=index,
            value=value,
            base_digest=p["base_digest"] or UNKNOWN_DIGEST,
            result_digest=p["result_digest"],
        )
    if offset != n:
        raise ValueError(f"result block holds {n} bytes, the header accounts for {offset}")
    return Delta(base_version=header["base_version"], version=header["version"], patches=patches)


def _error_from_reply(reply: dict[str, Any]) -> Exception:
    cls = getattr(delta_errors, str(reply.get("error")), None)
    message = str(reply.get("message", "no message"))
    if isinstance(cls, type) and issubclass(cls, delta_errors.DeltaError):
        return cls(message)
    return DecodeProcessError(f"decoding child failed: {reply.get('error')}: {message}")


class DecodeProcess:
    """One decoding child; see the module docstring. Not thread-safe: one caller at a time."""

    def __init__(self, threads: int | None = None, *, timeout_s: float = 600.0) -> None:
        self.threads = threads
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._mirror: SharedMirror | None = None
        self._contexts: list[str] = []  # digests of the contexts the child keeps, newest last
        self._start()

    def _start(self) -> None:
        cmd = [sys.executable, "-m", "deltarl.rollout.sync.decode_process"]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._contexts = []  # a fresh child holds none
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert self._proc.stdin is not None
        _widen_pipe(self._proc.stdin.fileno())  # the delta's bytes go in through it
        if self._mirror is not None:
            self._send_attach(self._mirror)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _call(self, request: dict[str, Any]) -> tuple[dict[str, Any], Delta | None]:
        """Send one request; the reply header and, for a decoded delta, the delta."""
        if not self.alive:
            self._start()
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        timer = threading.Timer(self.timeout_s, proc.kill)  # a hung child must not hang the sync
        timer.start()
        try:
            _write_frame(proc.stdin, request)
            reply = _read_frame(proc.stdout)
            delta = None
            if isinstance(reply, dict) and reply.get("ok") and "patches" in reply:
                delta = _read_delta(reply)
        except (
            OSError,
            EOFError,
            ValueError,
            KeyError,
            TypeError,
            msgpack.UnpackException,
        ) as err:
            self._kill()
            raise DecodeProcessError(
                f"the decoding child broke off ({err}; exit code {proc.poll()})"
            ) from err
        finally:
            timer.cancel()
        if not isinstance(reply, dict):
            self._kill()
            raise DecodeProcessError(f"the decoding child answered {type(reply).__name__}")
        return reply, delta

    def _send_attach(self, mirror: SharedMirror) -> None:
        reply, _ = self._call({"op": "attach", "shm": mirror.name, "layout": mirror.layout})
        if not reply.get("ok"):
            raise _error_from_reply(reply)

    def attach(self, mirror: SharedMirror) -> None:
        """Decode against ``mirror`` from now on (the caller keeps and later closes it). The
        child forgets its delta contexts (they described the previous weights)."""
        self._mirror = mirror
        self._contexts = []
        self._send_attach(mirror)

    def holds(self, context: DeltaContext) -> bool:
        """Whether the child keeps ``context`` (built by it from a delta it decoded)."""
        return self.alive and context.digest in self._contexts

    def decode(
        self,
        data: bytes | memoryview,
        base_digests: Mapping[str, str],
        *,
        context: DeltaContext | None = None,
        layout: tuple[str, ...] | None = None,
    ) -> Delta:
        """Decode ``data`` against the attached mirror, refusing a base whose digests differ.

        ``context``: the context of the delta that brought the mirror to its state, for a
        chained delta (only its digest is sent: the child must :meth:`hold <holds>` it, else
        :class:`DecodeProcessError`). As in process, a chained delta whose context is not the
        one given raises :class:`~deltarl.weightsync.errors.ContextMismatchError`.

        ``layout``: one part of a sharded version (:mod:`deltarl.weightsync.sharding`): it is
        decoded against the mirror's row views under ``layout``, those named by
        ``base_digests`` (the part's slices); the child builds no context from it (sharded
        versions are not chained).
        """
        if self._mirror is None:
            raise RuntimeError("attach() a mirror before decoding")
        if layout is not None and context is not None:
            raise ValueError("a part of a sharded version is not chained: no context")
        if context is not None and not self.holds(context):
            raise DecodeProcessError(
                f"the decoding child does not hold the context of delta {context.base_version} "
                f"-> {context.version}"
            )
        request: dict[str, Any] = {"op": "decode", "data": bytes(data)}
        request |= {"digests": dict(base_digests)}
        request["context"] = None if context is None else context.digest
        request["layout"] = None if layout is None else list(layout)
        reply, delta = self._call(request)
        if not reply.get("ok"):
            raise _error_from_reply(reply)
        if delta is None:
            raise DecodeProcessError("the decoding child answered a decode without a delta")
        kept = reply.get("context_digest")
        if isinstance(kept, str):
            self._contexts = [*self._contexts, kept][-KEPT_CONTEXTS:]
        return delta

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self) -> None:
        """Stop the child (the mirror stays the caller's)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None and proc.stdin is not None:
                _write_frame(proc.stdin, {"op": "exit"})
                proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# ------------------------------------------------------------------------------ the child


def _untracked(shm: shared_memory.SharedMemory) -> shared_memory.SharedMemory:
    """Stop this process's resource tracker from unlinking ``shm`` when the child exits: every
    block the child maps or creates is the parent's to unlink."""
    from multiprocessing import resource_tracker

    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _attach_block(name: str) -> shared_memory.SharedMemory:
    """Map the parent's block without taking ownership (the parent unlinks it)."""
    return _untracked(shared_memory.SharedMemory(name=name))


class _ContextUnavailable(Exception):
    """The parent asked for a delta context the child does not keep (not the delta's fault:
    the parent raises :class:`DecodeProcessError` and decodes in process)."""


def _context_of(delta: Delta, mirror: Mapping[str, torch.Tensor]) -> DeltaContext | None:
    try:
        return DeltaContext.of(delta, mirror)
    except (ValueError, KeyError, TypeError, RuntimeError) as err:  # an optimization only
        logger.warning("no delta context for %s -> %s: %s", delta.base_version, delta.version, err)
        return None


def _serve(inp: IO[bytes], out: IO[bytes], threads: int | None) -> None:
    from deltarl.weightsync.codec.formats import decode_delta

    shm: shared_memory.SharedMemory | None = None
    mirror: dict[str, torch.Tensor] = {}
    contexts: dict[str, DeltaContext] = {}  # by digest, oldest first (KEPT_CONTEXTS at most)
    views: dict[tuple[str, ...], Mapping[str, torch.Tensor]] = {}  # the mirror under a layout
    while True:
        try:
            req = _read_frame(inp)
        except EOFError:
            return
        op = req.get("op") if isinstance(req, dict) else None
        try:
            if op == "exit":
                return
            if op == "attach":
                mirror = {}
                contexts = {}
                views.clear()
                if shm is not None:
                    try:
                        shm.close()
                    except BufferError:
                        logger.warning("previous mirror still has views; leaving it mapped")
                shm = _attach_block(req["shm"])
                mirror = _views(shm, req["layout"])
                _write_frame(out, {"ok": True})
            elif op == "decode":
                t0 = time.perf_counter()
                want = req.get("context")
                if want is not None and want not in contexts:
                    raise _ContextUnavailable(f"no kept delta context has digest {want}")
                layout = req.get("layout")
                base: Mapping[str, torch.Tensor] = mirror
                if layout is not None:  # a sharded version's part: its slices' row views
                    key = tuple(layout)
                    if key not in views:
                        views.clear()  # one layout at a time (a trainer's world size)
                        views[key] = layout_view(mirror, key)
                    base = {k: views[key][k] for k in req["digests"]}
                delta = decode_delta(
                    req["data"],
                    base,
                    check_base=True,
                    base_digests=req["digests"],
                    threads=threads,
                    context=None if want is None else contexts[want],
                )
                decode_s = time.perf_counter() - t0
                # the mirror is still at the delta's base: what a chained successor needs
                ctx = _context_of(delta, mirror) if layout is None else None
                if ctx is not None:
                    contexts.pop(ctx.digest, None)
                    contexts[ctx.digest] = ctx
                    while len(contexts) > KEPT_CONTEXTS:
                        del contexts[next(iter(contexts))]
                _write_delta(out, delta, decode_s, None if ctx is None else ctx.digest)
            else:
                _write_frame(out, {"ok": False, "error": "ValueError", "message": f"op {op!r}?"})
        except Exception as err:  # reported to the parent, which raises it there
            _write_frame(out, {"ok": False, "error": type(err).__name__, "message": str(err)})


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="deltarl's delta-decoding child (internal)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    # The protocol owns the original stdout; anything printed goes to stderr instead.
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(sys.stdin.buffer, proto_out, args.threads)


if __name__ == "__main__":
    main()
