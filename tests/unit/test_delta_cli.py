"""``deltarl delta`` on real files, as a user runs it (in this process: tests/support.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from states import make_state, perturb
from support import Completed, deltarl


def run(*args: str) -> Completed:
    return deltarl("delta", *args)


@pytest.fixture
def files(tmp_path):
    old = make_state(seed=4)
    new = perturb(old, 0.02)
    a, b = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    save_file(old, str(a))
    save_file(new, str(b))
    return tmp_path, a, b, new


def test_stats_json(files):
    _, a, b, _new = files
    r = run("stats", str(a), str(b), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["changed"] > 0 and set(out["bytes"]) == {"compact", "trl-raw", "trl-gap"}
    assert out["conditional_floor_bits"] <= out["iid_floor_bits"] + 1e-9


@pytest.mark.parametrize("fmt", ["compact", "trl-raw", "trl-gap"])
def test_encode_apply_verify_round_trip(files, fmt):
    tmp, a, b, new = files
    d, out = tmp / f"d.{fmt}", tmp / "out.safetensors"
    assert (
        run("encode", str(a), str(b), "-o", str(d), "--format", fmt, "--version", "2").returncode
        == 0
    )
    r = run("apply", str(a), str(d), "-o", str(out))
    assert r.returncode == 0, r.stderr
    got = load_file(str(out))
    assert all(torch.equal(got[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    r = run("verify", str(d), "--base", str(a), "--result", str(out))
    assert r.returncode == 0 and "equals the delta's result" in r.stdout


@pytest.mark.parametrize("positions", ["contexts", "gaps"])
def test_encode_codes_positions_as_asked_and_verify_says_so(files, positions):
    tmp, a, b, new = files
    d, out = tmp / "d.dlt", tmp / "out.safetensors"
    r = run("encode", str(a), str(b), "-o", str(d), "--positions", positions)
    assert r.returncode == 0, r.stderr
    r = run("verify", str(d))
    other = "gaps" if positions == "contexts" else "contexts"
    assert r.returncode == 0 and "chunks' positions by contexts: " in r.stdout, r.stdout
    assert f"{other}: 0" in r.stdout and f"{positions}: 0" not in r.stdout, r.stdout
    assert run("apply", str(a), str(d), "-o", str(out)).returncode == 0
    got = load_file(str(out))
    assert all(torch.equal(got[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    r = run("encode", str(a), str(b), "-o", str(d), "--positions", "ranks")
    assert r.returncode == 2 and "positions must be" in r.stderr


def test_apply_to_the_wrong_base_fails_cleanly(files):
    tmp, a, b, _ = files
    d = tmp / "d"
    run("encode", str(a), str(b), "-o", str(d))
    r = run("apply", str(b), str(d), "-o", str(tmp / "x.safetensors"))
    assert r.returncode == 2 and "applied twice" in r.stderr
    assert not (tmp / "x.safetensors").exists()


def test_verify_detects_a_wrong_result_and_a_damaged_file(files):
    tmp, a, b, _ = files
    d = tmp / "d"
    run("encode", str(a), str(b), "-o", str(d))
    r = run("verify", str(d), "--result", str(a))
    assert r.returncode == 2 and "not the delta's result" in r.stderr
    data = bytearray(d.read_bytes())
    data[12] ^= 0xFF
    d.write_bytes(bytes(data))
    r = run("verify", str(d))
    assert r.returncode == 2 and "error:" in r.stderr


def test_not_a_safetensors_file(tmp_path, files):
    _, a, _, _ = files
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"hello")
    r = run("stats", str(a), str(junk))
    assert r.returncode == 2 and "not a readable safetensors file" in r.stderr


def test_squash_equals_the_chain(tmp_path):
    states = [make_state(seed=6)]
    for i in range(3):
        states.append(perturb(states[-1], 0.03, seed=20 + i))
    paths = []
    for i, s in enumerate(states):
        p = tmp_path / f"s{i}.safetensors"
        save_file(s, str(p))
        paths.append(p)
    deltas = []
    for i in range(3):
        d = tmp_path / f"d{i}"
        r = run(
            "encode",
            str(paths[i]),
            str(paths[i + 1]),
            "-o",
            str(d),
            "--base-version",
            str(i),
            "--version",
            str(i + 1),
        )
        assert r.returncode == 0, r.stderr
        deltas.append(str(d))
    out = tmp_path / "squashed"
    r = run("squash", str(paths[0]), *deltas, "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "version 0 -> 3" in r.stdout
    r = run("verify", str(out), "--base", str(paths[0]), "--result", str(paths[3]))
    assert r.returncode == 0, r.stderr
    r = run("squash", str(paths[0]), deltas[0], deltas[2], "-o", str(out))  # a gap in the chain
    assert r.returncode == 2 and "not the base" in r.stderr


def test_chained_encode_apply_verify(tmp_path):
    s0 = make_state(seed=8)
    s1 = perturb(s0, 0.05, seed=30)
    s2 = perturb(s1, 0.05, seed=31)
    p = []
    for i, s in enumerate((s0, s1, s2)):
        p.append(tmp_path / f"s{i}.safetensors")
        save_file(s, str(p[-1]))
    d, out = tmp_path / "d12", tmp_path / "out.safetensors"
    r = run("encode", str(p[1]), str(p[2]), "-o", str(d), "--previous", str(p[0]))
    assert r.returncode == 0, r.stderr
    assert "chained on" in r.stdout
    r = run("apply", str(p[1]), str(d), "-o", str(out))  # without its context: refused
    assert r.returncode == 2 and "chained on delta" in r.stderr and not out.exists()
    r = run("apply", str(p[1]), str(d), "-o", str(out), "--previous", str(p[2]))  # wrong one
    assert r.returncode == 2 and "chained on delta" in r.stderr and not out.exists()
    r = run("apply", str(p[1]), str(d), "-o", str(out), "--previous", str(p[0]))
    assert r.returncode == 0, r.stderr
    got = load_file(str(out))
    assert all(torch.equal(got[k].view(torch.int16), s2[k].view(torch.int16)) for k in s2)
    r = run("verify", str(d), "--base", str(p[1]), "--previous", str(p[0]), "--result", str(out))
    assert r.returncode == 0 and "chained on delta" in r.stdout, r.stderr
    r = run("stats", str(p[1]), str(p[2]), "--previous", str(p[0]), "--json")
    assert r.returncode == 0 and "compact-chained" in json.loads(r.stdout)["bytes"], r.stderr
    r = run(
        "encode", str(p[1]), str(p[2]), "-o", str(d), "--previous", str(p[0]), "--format", "trl-gap"
    )
    assert r.returncode == 2 and "--format compact" in r.stderr


def test_unchecked_apply_does_not_claim_verification(files):
    tmp, a, b, _new = files
    d, out = tmp / "d.trl", tmp / "out.safetensors"
    assert run("encode", str(a), str(b), "-o", str(d), "--format", "trl-raw").returncode == 0
    r = run("apply", str(a), str(d), "-o", str(out), "--unchecked")
    assert r.returncode == 0, r.stderr
    assert "not verified (--unchecked)" in r.stdout and ", verified" not in r.stdout
    r = run("apply", str(a), str(d), "-o", str(out))
    assert r.returncode == 0 and r.stdout.rstrip().endswith(", verified")


def test_a_trl_anchor_is_read_applied_and_verified_against_a_result(files):
    tmp, a, _b, new = files
    anchor = tmp / "step_000010.safetensors"  # as TRL writes it: full tensors, sparse="False"
    meta = {
        "format": "sparse_weight_patch",
        "version": "1",
        "sparse": "False",
        "model_version": "10",
    }
    save_file(new, str(anchor), metadata=meta)
    out = tmp / "out.safetensors"
    r = run("apply", str(a), str(anchor), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "TRL anchor of version 10" in r.stdout and "not verified" in r.stdout
    got = load_file(str(out))
    assert all(torch.equal(got[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    r = run("verify", str(anchor), "--result", str(out))
    assert r.returncode == 0 and "equals the anchor's tensors" in r.stdout, r.stderr
    r = run("verify", str(anchor), "--result", str(a))
    assert r.returncode == 2 and "is not the anchor's state" in r.stderr
    other = {k: v for k, v in list(new.items())[1:]}
    save_file(other, str(anchor), metadata=meta)
    r = run("apply", str(a), str(anchor), "-o", str(out))
    assert r.returncode == 2 and "does not match the base's" in r.stderr
