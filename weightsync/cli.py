"""``deltarl delta``: compute, inspect, encode, apply and verify deltas between safetensors files.

Heavy imports (torch, safetensors, numba) happen inside the commands, after argument parsing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import typer

app = typer.Typer(
    help="Compute, inspect, encode, apply and verify lossless weight deltas.",
    no_args_is_help=True,
)

OLD = typer.Argument(..., exists=True, dir_okay=False, help="Old state (.safetensors).")
NEW = typer.Argument(..., exists=True, dir_okay=False, help="New state (.safetensors).")
PREVIOUS = typer.Option(
    None,
    "--previous",
    exists=True,
    dir_okay=False,
    help="The state before OLD/BASE (.safetensors): chain the compact delta on the delta "
    "PREVIOUS -> OLD (values predicted from that delta's moves; decoding needs --previous too).",
)


def _load(path: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return dict(load_file(str(path)))
    except (SafetensorError, OSError) as e:
        raise typer.BadParameter(f"{path}: not a readable safetensors file ({e})") from None


def _trl_anchor(data: bytes) -> tuple[dict[str, Any], str] | None:
    """(tensors, model_version) of a TRL anchor (``sparse="False"``), None for anything else."""
    from deltarl.weightsync import DeltaError
    from deltarl.weightsync.anchor import decode_anchor
    from deltarl.weightsync.codec.formats import detect_format
    from deltarl.weightsync.codec.trl_format import TRL_FORMAT, read_metadata

    try:
        if detect_format(data) != "trl":
            return None
        meta = read_metadata(data)
        if meta.get("format") != TRL_FORMAT or meta.get("sparse") != "False":
            return None
        tensors, _, _ = decode_anchor(data, require_digests=False)
    except DeltaError as e:
        _fail(str(e))
    return tensors, meta.get("model_version", "?")


def _same_tensors(state: dict[str, Any], tensors: dict[str, Any]) -> None:
    """Refuse an anchor whose tensors are not the base's (names, dtypes, shapes)."""
    for name in sorted(set(state) | set(tensors)):
        a, b = state.get(name), tensors.get(name)
        if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape:
            _fail(f"the anchor's tensor {name!r} does not match the base's")


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _sizes(delta: Any, old: dict[str, Any], context: Any = None) -> dict[str, int]:
    from deltarl.weightsync.codec.formats import DELTA_FORMATS, encode_delta

    sizes = {f: len(encode_delta(delta, old, f)) for f in DELTA_FORMATS}
    if context is not None:
        sizes["compact-chained"] = len(encode_delta(delta, old, "compact", context=context))
    return sizes


def _context(previous: Path | None, old: dict[str, Any], base_version: int | None = None) -> Any:
    """The context of the delta PREVIOUS -> OLD (None without --previous)."""
    if previous is None:
        return None
    from deltarl.weightsync import DeltaContext, compute_delta

    prev = _load(previous)
    before = None if base_version is None or base_version < 1 else base_version - 1
    return DeltaContext.of(compute_delta(prev, old, before, base_version), prev)


@app.command()
def stats(
    old: Path = OLD,
    new: Path = NEW,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    previous: Path | None = PREVIOUS,
) -> None:
    """Density, bytes per format, bits per changed element and the entropy floors.

    With --previous, also the size of the chained compact delta ("compact-chained")."""
    from deltarl.weightsync import DeltaError, compute_delta
    from deltarl.weightsync.stats import delta_stats

    o, n = _load(old), _load(new)
    try:
        delta = compute_delta(o, n)
        context = _context(previous, o)
    except DeltaError as e:
        _fail(str(e))
    s = delta_stats(delta, o)
    sizes = _sizes(delta, o, context)
    out: dict[str, Any] = s.as_dict()
    out["bytes"] = sizes
    out["bits_per_changed"] = {
        f: (b * 8 / s.changed if s.changed else None) for f, b in sizes.items()
    }
    if as_json:
        typer.echo(json.dumps(out, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"{s.changed:,} of {s.numel:,} elements changed (density {s.density:.4%}); "
        f"full state {s.dense_bytes:,} bytes"
    )
    table = Table("format", "bytes", "bits/changed", "vs full")
    for f, b in sizes.items():
        bpc = out["bits_per_changed"][f]
        table.add_row(f, f"{b:,}", f"{bpc:.2f}" if bpc else "-", f"{b / max(s.dense_bytes, 1):.3%}")
    console.print(table)
    console.print(
        f"entropy floors (bits/changed): i.i.d. {s.iid_floor_bits:.2f}; given tensor and old "
        f"exponent {s.conditional_floor_bits:.2f} (mask {s.mask_conditional_bits:.2f} + values "
        f"{s.value_conditional_bits:.2f})"
    )


@app.command()
def encode(
    old: Path = OLD,
    new: Path = NEW,
    output: Path = typer.Option(..., "-o", "--output", help="Delta file to write."),
    fmt: str = typer.Option("compact", "--format", help="compact | trl-raw | trl-gap"),
    base_version: int | None = typer.Option(
        None, help="Version number of OLD, recorded in the delta."
    ),
    version: int | None = typer.Option(None, help="Version number of NEW, recorded in the delta."),
    previous: Path | None = PREVIOUS,
    positions: str = typer.Option(
        "auto",
        help="compact: how changed positions are coded: contexts (fewest bytes), gaps (a decode "
        "that reads only the changed elements), auto (gaps from 16 G elements on)",
    ),
) -> None:
    """Write the delta that turns OLD into NEW."""
    from deltarl.weightsync import DeltaError, compute_delta
    from deltarl.weightsync.codec.formats import DELTA_FORMATS, encode_delta, resolve_positions

    if fmt not in DELTA_FORMATS:
        raise typer.BadParameter(f"--format must be one of {', '.join(DELTA_FORMATS)}")
    if previous is not None and fmt != "compact":
        raise typer.BadParameter("--previous (a chained delta) needs --format compact")
    o, n = _load(old), _load(new)
    try:
        coding = resolve_positions(positions, sum(t.numel() for t in o.values()))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    try:
        delta = compute_delta(o, n, base_version, version)
        blob = encode_delta(
            delta, o, fmt, context=_context(previous, o, base_version), positions=coding
        )
    except DeltaError as e:
        _fail(str(e))
    output.write_bytes(blob)
    kind = f"{fmt}, chained on {previous}" if previous is not None else fmt
    typer.echo(f"wrote {output} ({len(blob):,} bytes, {delta.changed:,} changed elements, {kind})")


@app.command()
def apply(
    base: Path = typer.Argument(
        ..., exists=True, dir_okay=False, help="Base state (.safetensors)."
    ),
    delta_path: Path = typer.Argument(..., exists=True, dir_okay=False, help="Delta file."),
    output: Path = typer.Option(
        ..., "-o", "--output", help="Result state (.safetensors) to write."
    ),
    unchecked: bool = typer.Option(
        False, help="Apply a delta that carries no digests (plain TRL)."
    ),
    previous: Path | None = PREVIOUS,
) -> None:
    """Apply a delta to BASE and write the verified result."""
    from safetensors.torch import save_file

    from deltarl.weightsync import DeltaError, apply_delta
    from deltarl.weightsync.codec.formats import decode_delta

    state = _load(base)
    data = delta_path.read_bytes()
    anchor = _trl_anchor(data)
    if anchor is not None:  # full tensors: the result, whatever the base held
        tensors, version = anchor
        _same_tensors(state, tensors)
        save_file(tensors, str(output))
        typer.echo(
            f"wrote {output}: TRL anchor of version {version} (full tensors); not verified: a TRL "
            "anchor carries no digests"
        )
        return
    try:
        context = _context(previous, state)
        delta = decode_delta(data, state, context=context)
        apply_delta(state, delta, check_base=not unchecked, verify=not unchecked)
    except DeltaError as e:
        _fail(str(e))
    save_file(state, str(output))
    checked = "not verified (--unchecked)" if unchecked else "verified"
    typer.echo(
        f"wrote {output}: version {delta.version}, {delta.changed:,} elements changed, {checked}"
    )


@app.command()
def squash(
    base: Path = typer.Argument(
        ..., exists=True, dir_okay=False, help="State at the first delta's base (.safetensors)."
    ),
    deltas: list[Path] = typer.Argument(
        ..., exists=True, dir_okay=False, help="Consecutive delta files, oldest first."
    ),
    output: Path = typer.Option(..., "-o", "--output", help="Squashed delta file to write."),
    fmt: str = typer.Option("compact", "--format", help="compact | trl-raw | trl-gap"),
    previous: Path | None = PREVIOUS,
) -> None:
    """Squash consecutive deltas into one (what a replica lagging several versions fetches)."""
    from deltarl.weightsync import DeltaError
    from deltarl.weightsync.codec.formats import DELTA_FORMATS, squash_chain

    if fmt not in DELTA_FORMATS:
        raise typer.BadParameter(f"--format must be one of {', '.join(DELTA_FORMATS)}")
    try:
        state = _load(base)
        squashed, blob = squash_chain(
            state, [p.read_bytes() for p in deltas], fmt, context=_context(previous, state)
        )
    except DeltaError as e:
        _fail(str(e))
    output.write_bytes(blob)
    size = sum(p.stat().st_size for p in deltas)
    typer.echo(
        f"wrote {output}: version {squashed.base_version} -> {squashed.version}, {len(blob):,} bytes "
        f"(the {len(deltas)} deltas: {size:,} bytes)"
    )


@app.command()
def verify(
    delta_path: Path = typer.Argument(..., exists=True, dir_okay=False, help="Delta file."),
    base: Path = typer.Option(
        None, "--base", exists=True, dir_okay=False, help="Check this is the delta's base."
    ),
    result: Path = typer.Option(
        None,
        "--result",
        exists=True,
        dir_okay=False,
        help="Check this state equals the delta's result.",
    ),
    previous: Path | None = PREVIOUS,
) -> None:
    """Check a delta's integrity, and optionally that BASE is its base and RESULT its result.

    With --base the delta is fully decoded and applied in memory, and the result digest checked.
    """
    from deltarl.weightsync import DeltaError, apply_delta, state_digest
    from deltarl.weightsync.codec.formats import decode_delta, describe

    data = delta_path.read_bytes()
    anchor = _trl_anchor(data)
    if anchor is not None:
        tensors, version = anchor
        typer.echo(
            f"{delta_path}: TRL anchor of version {version}, {len(tensors)} full tensors; it "
            "carries no digests (only its safetensors structure was checked)"
        )
        if result is not None:
            got = _load(result)
            if set(got) != set(tensors) or state_digest(got) != state_digest(tensors):
                _fail(f"{result} is not the anchor's state")
            typer.echo(f"{result} equals the anchor's tensors")
        return
    try:
        info = describe(data)
        chained = info.get("context")
        on = (
            f", chained on delta {chained['base_version']} -> {chained['version']}"
            if isinstance(chained, dict)
            else ""
        )
        pos = info.get("positions")
        chunks = (
            ", chunks' positions by " + " / ".join(f"{k}: {n}" for k, n in pos.items())
            if isinstance(pos, dict)
            else ""
        )
        typer.echo(
            f"{delta_path}: {info['format']}, version {info['base_version']} -> {info['version']}"
            f"{on}{chunks}, integrity ok"
        )
        want = info["result_digest"]
        if base is not None:
            state = _load(base)
            delta = decode_delta(data, state, context=_context(previous, state))
            apply_delta(state, delta)
            want = delta.result_digest
            typer.echo(f"base matches; applied in memory, result digest {want} verified")
        if result is not None:
            if want is None:
                _fail("this delta records no result digest; pass --base to verify against a base")
            if state_digest(_load(result)) != want:
                _fail(f"{result} is not the delta's result state")
            typer.echo(f"{result} equals the delta's result")
    except DeltaError as e:
        _fail(str(e))


@app.command()
def keygen(
    path: Path = typer.Argument(..., dir_okay=False, help="Private key file to write (mode 0600)."),
) -> None:
    """Write a new Ed25519 signing key for the trainer (publish.signing_key_file) and print its
    public key (the workers' DELTARL_ROLLOUT_TRUSTED_KEYS)."""
    from deltarl.weightsync.signing import generate_key

    try:
        signer = generate_key(path)
    except FileExistsError:
        _fail(f"{path} exists: refusing to overwrite a key")
    typer.echo(signer.public_hex)
