"""Compact delta files written by an attacker: compression bombs, deep nesting, retyped footer
fields, a file joined to a copy of itself. Each must give a one-line error and exit 2 from
``deltarl delta``, with memory bounded and nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import xxhash
import zstandard
from safetensors.torch import save_file
from states import make_state, perturb
from support import deltarl

from deltarl.weightsync.anchor import decode_anchor, encode_anchor
from deltarl.weightsync.codec.compact import (
    TRAILER,
    TRAILER_MAGIC,
    check_integrity,
    read_footer,
)
from deltarl.weightsync.codec.formats import describe, encode_delta
from deltarl.weightsync.delta import compute_delta
from deltarl.weightsync.errors import CorruptDeltaError

GIB = 1 << 30


@pytest.fixture(scope="module")
def delta_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    root = tmp_path_factory.mktemp("hostile")
    old = make_state(seed=3)
    new = perturb(old, 0.02)
    save_file(old, str(root / "base.safetensors"))
    return root, encode_delta(compute_delta(old, new, 1, 2), old, "compact")


def split(data: bytes) -> tuple[bytes, dict[str, Any]]:
    """(everything before the footer, the footer)"""
    flen, _, _ = TRAILER.unpack(data[-TRAILER.size :])
    return data[: len(data) - TRAILER.size - flen], read_footer(data)


def with_packed_footer(head: bytes, packed: bytes) -> bytes:
    return (
        head + packed + TRAILER.pack(len(packed), xxhash.xxh3_64_intdigest(packed), TRAILER_MAGIC)
    )


def with_footer(head: bytes, footer: Any) -> bytes:
    raw = json.dumps(footer).encode() if not isinstance(footer, bytes) else footer
    return with_packed_footer(head, zstandard.ZstdCompressor(level=3).compress(raw))


def bomb(size: int, fill: bytes = b" ") -> bytes:
    """One zstd frame of ``size`` bytes of ``fill`` (a few KB), written in pieces."""
    out = zstandard.ZstdCompressor(level=3).compressobj()
    piece = fill * (1 << 20)
    parts = [out.compress(piece) for _ in range(size >> 20)]
    return b"".join(parts) + out.flush()


PEAK = "deltarl-test-peak-rss-kb"
# VmHWM, not ru_maxrss: the high-water mark of this program's own memory (ru_maxrss outlives exec
# and starts at the size of the pytest process that forked it)
WRAPPER = f"""
import re, runpy, sys
sys.argv = ["deltarl", "delta", "verify", *sys.argv[1:]]
code = 0
try:
    runpy.run_module("deltarl", run_name="__main__")
except SystemExit as e:
    code = e.code
status = open("/proc/self/status").read()
print("{PEAK}", re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1), file=sys.stderr)
sys.exit(code)
"""


def verify_measured(path: Path, *args: str) -> tuple[int, str, int]:
    """``deltarl delta verify`` in a child: (exit code, stderr, its peak memory in MB)."""
    r = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(path), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = r.stderr.splitlines()
    peak = [int(x.split()[1]) for x in lines if x.startswith(PEAK)]
    return r.returncode, "\n".join(x for x in lines if not x.startswith(PEAK)), peak[0] // 1024


def verify(path: Path, *args: str) -> tuple[int, str]:
    """``deltarl delta verify`` in this process: (exit code, stderr)."""
    r = deltarl("delta", "verify", str(path), *args)
    return r.returncode, r.stderr


@pytest.mark.slow
def test_a_footer_bomb_is_refused_with_bounded_memory(delta_file: tuple[Path, bytes]) -> None:
    root, data = delta_file
    head, _ = split(data)
    packed = bomb(GIB, b"{")  # 1 GiB of JSON text from a frame of ~35 KB
    assert len(packed) < 100_000
    with pytest.raises(CorruptDeltaError, match="expands past"):
        check_integrity(with_packed_footer(head, packed))
    path = root / "footer-bomb.drl"
    path.write_bytes(with_packed_footer(head, packed))
    code, err, peak_mb = verify_measured(path)
    assert code == 2 and "expands past" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert peak_mb < 900, peak_mb  # torch's import included; the bomb alone is 1 GiB


def test_an_index_bomb_is_refused_before_it_is_inflated(delta_file: tuple[Path, bytes]) -> None:
    _, data = delta_file
    head, footer = split(data)
    off, _, raw_len, _ = footer["index"]
    packed = bomb(GIB)
    footer["index"] = [off, len(packed), raw_len, xxhash.xxh3_64_intdigest(packed)]
    with pytest.raises(CorruptDeltaError, match=rf"index expands past {raw_len} bytes"):
        check_integrity(with_footer(head[:off] + packed, footer))


def test_a_deeply_nested_footer_is_a_one_line_error(delta_file: tuple[Path, bytes]) -> None:
    root, data = delta_file
    head, _ = split(data)
    nested = b"[" * 5_000 + b"]" * 5_000  # 10 KB: within the size bound, past the recursion limit
    with pytest.raises(CorruptDeltaError, match="nested too deeply"):
        read_footer(with_footer(head, nested))
    path = root / "nested.drl"
    path.write_bytes(with_footer(head, nested))
    code, err = verify(path)
    assert code == 2 and "nested too deeply" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("version", "2; rm -rf /", "version"),
        ("base_version", -1, "base_version"),
        ("version", 1 << 63, "version"),
        ("body_xxh3", "0", "body_xxh3"),
        ("tensors.0.dtype", "object", "dtype"),
        ("tensors.0.shape", [1 << 40], "more than"),
        ("tensors.0.changed", -5, "changed"),
        ("tensors.0.chunks", [[0, 1, 2]], "chunks"),
        ("tensors.0.name", "", "name"),
        ("tensors.0.result_digest", "../../etc", "result_digest"),
        ("tensors", "all", "tensors"),
    ],
)
def test_retyped_footer_fields_are_refused(
    delta_file: tuple[Path, bytes], field: str, value: Any, message: str
) -> None:
    root, data = delta_file
    head, footer = split(data)
    *path, leaf = field.split(".")
    target: Any = footer
    for part in path:
        target = target[int(part)] if part.isdigit() else target[part]
    target[leaf] = value
    hostile = with_footer(head, footer)
    with pytest.raises(CorruptDeltaError, match=message):
        read_footer(hostile)
    if field == "version":  # and through the CLI, with and without a base
        file = root / "retyped.drl"
        file.write_bytes(hostile)
        for args in ((), ("--base", str(root / "base.safetensors"))):
            code, err = verify(file, *args)
            assert code == 2 and "version" in err and "Traceback" not in err, err


def test_a_duplicated_tensor_is_refused(delta_file: tuple[Path, bytes]) -> None:
    _, data = delta_file
    head, footer = split(data)
    footer["tensors"].append(dict(footer["tensors"][0]))
    with pytest.raises(CorruptDeltaError, match="listed twice"):
        read_footer(with_footer(head, footer))


def test_the_untouched_file_still_verifies(delta_file: tuple[Path, bytes]) -> None:
    _, data = delta_file
    head, footer = split(data)
    assert check_integrity(with_footer(head, footer))["version"] == 2  # re-packed, same fields


def test_a_delta_joined_to_itself_is_refused(delta_file: tuple[Path, bytes]) -> None:
    """Reading from the end, a file followed by another copy of itself has a valid trailer,
    footer, index and bodies: the bytes between the index and the footer give it away."""
    root, data = delta_file
    doubled = data + data
    with pytest.raises(CorruptDeltaError, match=f"{len(data)} bytes between its index and"):
        check_integrity(doubled)
    path = root / "doubled.drl"
    path.write_bytes(doubled)
    base = str(root / "base.safetensors")
    for args in ((), ("--base", base)):
        code, err = verify(path, *args)
        assert code == 2 and "between its index and its footer" in err, err
        assert len(err.strip().splitlines()) == 1
    out = root / "doubled-result.safetensors"
    r = deltarl("delta", "apply", base, str(path), "-o", str(out))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "between its index and its footer" in r.stderr and not out.exists()
    head, footer = split(data)  # bytes spliced in before the footer: the same refusal
    with pytest.raises(CorruptDeltaError, match="3 bytes between its index and"):
        check_integrity(with_footer(head + b"abc", footer))


def test_trl_deltas_and_anchors_joined_to_themselves_are_refused() -> None:
    old = make_state(seed=3)
    new = perturb(old, 0.02)
    delta = compute_delta(old, new, 1, 2)
    for fmt in ("trl-raw", "trl-gap"):
        blob = encode_delta(delta, old, fmt)
        with pytest.raises(CorruptDeltaError, match="trailing bytes"):
            describe(blob + blob)
    for compress in (False, True):
        blob = encode_anchor(new, 2, compress)
        with pytest.raises(CorruptDeltaError, match="trailing bytes"):
            decode_anchor(blob + blob)
