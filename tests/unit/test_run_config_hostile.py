"""Hostile run configs (`deltarl run exp.toml --check`): whatever the file holds, the answer is
a run config or one line of error (a :class:`RunConfigError` naming the key), never a
traceback, a long parse or a large allocation. Regression tests of each attack, then
hypothesis over generated and mutated documents and ``--set`` overrides."""

from __future__ import annotations

import datetime
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import GENEROUS_S
from typer.testing import CliRunner

from deltarl.cli import app
from deltarl.run.config import (
    MAX_DEPTH,
    MAX_KEY_PARTS,
    MAX_MESSAGE_CHARS,
    RunConfig,
    RunConfigError,
    load_run_config,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))


def write(tmp_path: Path, text: str | bytes, name: str = "exp.toml") -> Path:
    p = tmp_path / name
    if isinstance(text, str):
        p.write_text(text)
    else:
        p.write_bytes(text)
    return p


def refused(path: Path, *overrides: str) -> str:
    """The one-line error of ``path`` (with ``overrides``), checked to be one clean line."""
    with pytest.raises(RunConfigError) as err:
        load_run_config(path).with_overrides(list(overrides))
    return one_line(str(err.value))


def one_line(message: str) -> str:
    assert message and "\n" not in message and "\r" not in message, repr(message)
    assert len(message) <= MAX_MESSAGE_CHARS and message.isprintable(), repr(message)
    return message


def check_command(path: Path, *args: str) -> str:
    """``deltarl run PATH --check``'s output for a refused config: exit 2, one line."""
    result = CliRunner().invoke(app, ["run", str(path), "--check", *args], env={"COLUMNS": "300"})
    assert result.exit_code == 2, (result.exit_code, result.output[-2000:], result.exception)
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("invalid run config:"), result.output[-2000:]
    return lines[0]


# -- deep nesting: a RecursionError (3,000 lines of traceback) before -----------------------------
@pytest.mark.parametrize(
    "text",
    [
        "a = " + "[" * 100_000 + "]" * 100_000,  # arrays
        "a = " + "{b = " * 10_000 + "1" + "}" * 10_000,  # inline tables
        "[trainer]\na = " + "[" * 300 + "]" * 300,  # shallower than the parser's limit
        "[trainer]\na = " + "{b = " * 40 + "1" + "}" * 40,
    ],
    ids=["arrays-100000", "inline-tables-10000", "arrays-300", "inline-tables-40"],
)
def test_deep_nesting_is_one_line(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    message = refused(path)
    assert "nested" in message and f"{MAX_DEPTH} levels" in message, message
    check_command(path)


@pytest.mark.parametrize(
    "text",
    [
        "[trainer]\n" + "a." * 100_000 + "b = 1\n",  # key/value: quadratic memory (~40 GB)
        "[" + "a." * 100_000 + "b]\n",  # table header: quadratic time
        "[[" + "a." * 100_000 + "b]]\n",
        "[trainer]\nx = {" + "a." * 100_000 + "b = 1}\n",  # inside an inline table
        "[trainer]\n" + '"a" . ' * 20_000 + "b = 1\n",  # quoted parts, spaces
        "[trainer]\nx = {s = '''\n''''', " + "a." * 100_000 + "b = 1}\n",  # after '''''
    ],
    ids=["key-value", "header", "array-of-tables", "inline", "quoted", "after-multiline"],
)
def test_long_dotted_keys_are_refused_before_parsing(tmp_path: Path, text: str) -> None:
    """tomllib's time (and, for a key/value pair, memory) is quadratic in a dotted key's parts:
    100,000 parts ran out of memory after minutes; now refused at once."""
    path = write(tmp_path, text)
    start = time.monotonic()
    message = refused(path)
    assert time.monotonic() - start < GENEROUS_S  # parsing them took minutes
    assert f"more than {MAX_KEY_PARTS} parts" in message, message


def test_dotted_keys_within_the_bound_and_dots_in_strings_are_fine(tmp_path: Path) -> None:
    text = (
        '[run]\nmodel = "a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r.s.t.u.v"  # x.y.z.a.b.c.d.e.f.g.h\n'
        "[trainer]\noptimizer.lr = 1.5e-6\n"
        '[rollout]\nepisodes.system_prompt = """\n' + "a." * 40 + '\n"""\n'
    )
    config = load_run_config(write(tmp_path, text))
    assert config.run.model.startswith("a.b.c") and config.trainer["optimizer"]["lr"] == 1.5e-6


# -- numbers: floats where integers are meant, huge values ---------------------------------------
@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[run]\ngroup_size = 1e23\n", "run.group_size: Input should be a valid integer"),
        ("[run]\ngroup_size = 8.0\n", "run.group_size: Input should be a valid integer"),
        ("[run]\ngroup_size = 100000\n", "run.group_size: Input should be less than or equal"),
        ("[run]\nmax_staleness = 2.5\n", "run.max_staleness: Input should be a valid integer"),
        ("[run]\nmax_staleness = 10000000\n", "run.max_staleness: Input should be less than"),
        ("[run]\nseed = true\n", "run.seed: Input should be a valid integer"),
        ("[run]\nseed = 4294967296\n", "run.seed: Input should be less than or equal"),
        ("[run]\ntemperature = inf\n", "[run] temperature: inf is not a finite number"),
        ("[run]\ntemperature = nan\n", "[run] temperature: nan is not a finite number"),
        ("[run]\ntemperature = 1e9\n", "run.temperature: Input should be less than or equal"),
        ('[run]\ntemperature = "1.0"\n', "run.temperature: Input should be a valid number"),
        ("[run]\nmodel = 1\n", "run.model: Input should be a valid string"),
        ("[rollout]\nworkers = 2.0\n", "[rollout] workers: an integer from 1 to 64"),
        ("[rollout]\nworkers = 1000\n", "[rollout] workers: an integer from 1 to 64"),
        ("[rollout]\nin_flight_groups = 1e23\n", "[rollout] in_flight_groups: "),
        ("[rollout]\nin_flight_groups = 16.0\n", "[rollout] in_flight_groups: Input should be a"),
        (
            "[rollout]\nepisodes.sampling.max_new_tokens = 16.0\n",
            "[rollout] episodes.sampling.max_new_tokens: Input should be a",
        ),
        ("[rollout]\nsubmit_timeout_s = true\n", "[rollout] submit_timeout_s: Input should be"),
        ("[coordinator]\nmax_body_bytes = 1.5\n", "[coordinator] max_body_bytes: Input should"),
        ("[env]\nmax_guesses = true\n", "[env] max_guesses: Input should be a valid integer"),
        ('[env]\nmax_guesses = "6"\n', "[env] max_guesses: Input should be a valid integer"),
        ("[trainer]\nmax_steps = 1e23\n", "[trainer] max_steps: "),
        ("[teacher]\ntop_k = 8.0\n", "[teacher] top_k: Input should be a valid integer"),
        ("[trainer]\nmax_steps = " + "9" * 30 + "\n", "[trainer] max_steps: an integer of"),
        ("[trainer]\nmax_steps = " + "9" * 5000 + "\n", "not valid TOML"),
        ("[trainer]\noptimizer.lr = -inf\n", "[trainer] optimizer.lr: -inf is not a finite"),
    ],
)
def test_numbers_must_have_the_settings_type_and_bounds(
    tmp_path: Path, text: str, words: str
) -> None:
    message = refused(write(tmp_path, text))
    assert words in message, message
    assert any(w in message for w in ("integer", "number", "string", "less than")), message


def test_integers_given_as_integers_and_floats_as_either_pass(tmp_path: Path) -> None:
    text = "[run]\ntemperature = 1\ngroup_size = 4\nseed = 10000000\n[trainer]\noptimizer.lr = 1\n"
    config = load_run_config(write(tmp_path, text))
    assert (config.run.temperature, config.run.group_size, config.run.seed) == (1.0, 4, 10**7)


# -- files and values that are not settings --------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"\xff\xfe[run]\n", "not UTF-8 text"),
        (b"# " + b"x" * (300 << 10) + b"\n", "larger than 256 KiB"),
        (b'[run]\nmodel = "a\\u0000b"\n', "a string with a NUL character"),
        (b'[run]\nmodel = "' + b"x" * 5000 + b'"\n', "a string of 5000 characters"),
        (b"[run]\nmodel = 1979-05-27T07:32:00Z\n", "a date or time (1979-05-27T07:32:00+00:00)"),
        (b"[trainer]\nstart = 07:32:00\n", "[trainer] start: a date or time"),
        (b'[run]\n"a\\nb\\u001b[31m" = 1\n', "run.a\\nb\\x1b[31m: Extra inputs"),
        (b'["se\\nction"]\n', "se\\nction: Extra inputs"),
        (b'[trainer]\n"optimizer" = 1\n"optimizer.lr" = 2\n', "optimizer is a value, not a table"),
        (b"[run\n", "not valid TOML"),
    ],
)
def test_what_is_not_a_setting_is_one_line(tmp_path: Path, content: bytes, words: str) -> None:
    path = write(tmp_path, content)
    message = refused(path)
    assert words in message, message
    check_command(path)


def test_unreadable_paths(tmp_path: Path) -> None:
    assert "cannot read" in refused(tmp_path)  # a directory
    assert "cannot read" in refused(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("trainer.device.x=1", "trainer.device is a value, not a table"),
        ("run.group_size=1e23", "run.group_size: Input should be a valid integer"),
        ("trainer.a=" + "[" * 100_000, "[trainer] a: a string of 100000"),  # a bare string
        ("trainer." + "a." * 100 + "b=1", "nested more than"),
        ("rollout.x=1979-05-27", "[rollout] x: a date or time"),
        ('run.model="a\\u0000"', "a string with a NUL character"),
    ],
)
def test_overrides_are_checked_the_same(override: str, words: str) -> None:
    message = refused(EXAMPLES[0], override)
    assert words in message, message
    assert check_command(EXAMPLES[0], "--set", override)


# -- fuzz ------------------------------------------------------------------------------------------
def _settings() -> dict[str, Any]:
    """Every section's settings (the trainer's nested ones dotted) and their defaults, so that
    generated documents reach each settings class's validation with hostile values."""
    from pydantic import BaseModel

    from deltarl.env_server.settings import EnvSettings
    from deltarl.rollout.settings import RolloutSettings
    from deltarl.run.config import SharedSettings
    from deltarl.services.coordinator.settings import CoordinatorSettings
    from deltarl.teacher.settings import TeacherSettings
    from deltarl.trainer.settings import ExperimentSettings

    def fields(cls: type[BaseModel], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, field in cls.model_fields.items():
            nested = field.annotation
            if isinstance(nested, type) and issubclass(nested, BaseModel):
                out |= fields(nested, f"{prefix}{name}.")
            else:
                out[prefix + name] = field.default
        return out

    classes: list[tuple[str, type[BaseModel]]] = [
        ("run", SharedSettings),
        ("coordinator", CoordinatorSettings),
        ("env", EnvSettings),
        ("rollout", RolloutSettings),
        ("teacher", TeacherSettings),
        ("trainer", ExperimentSettings),
    ]
    out = {"rollout.workers": 2}
    for section, cls in classes:
        out |= fields(cls, f"{section}.")
    return out


SETTINGS = _settings()
SECTIONS = ["run", "coordinator", "env", "rollout", "trainer", "teacher"]


def toml_string(text: str) -> str:
    """A TOML basic string (every control character escaped)."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


nasty_text = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12
) | st.sampled_from(["", " ", "a\nb", "\x00", "\x1b[2J", "..", "a.b", "${HOME}", "'", '"', "é"])
scalars = (
    st.integers(min_value=-(10**30), max_value=10**30)
    | st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**23])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([1e23, 8.0, 0.5, -0.0, 1e-300])
    | st.booleans()
    | nasty_text
    | st.dates()
    | st.times()
    | st.datetimes()
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(nasty_text, inner, max_size=3),
    max_leaves=12,
)
keys = st.sampled_from(sorted(SETTINGS)) | st.tuples(
    st.sampled_from(SECTIONS) | nasty_text, nasty_text
).map(lambda t: f"{t[0]}.{t[1]}")


def near(default: Any) -> st.SearchStrategy[Any]:
    """A setting's default, as is or turned into what a hurried or hostile user may write."""
    if isinstance(default, bool):
        return st.sampled_from([default, not default, int(default), str(default).lower()])
    if isinstance(default, int):
        return st.sampled_from(
            [default, float(default), default + 1, -default - 1, default * 10**18, str(default)]
        )
    if isinstance(default, float):
        return st.sampled_from([default, default * 2, -default, math.inf, int(default), 1e300])
    if isinstance(default, str):
        return st.sampled_from([default, default + "\n", default.upper(), "", default * 3])
    if isinstance(default, list | tuple | dict):
        return st.sampled_from([default, [default], {"x": default}])
    return values


@st.composite
def documents(draw: st.DrawFn) -> str:
    """A TOML document: sections of settings (known or not) with near-default or hostile values,
    as dotted keys, sometimes deeply nested."""
    sections: dict[str, dict[str, Any]] = {}
    for _ in range(draw(st.integers(0, 8))):
        dotted = draw(keys)
        section, _, name = dotted.partition(".")
        value = draw(near(SETTINGS[dotted]) if dotted in SETTINGS else values)
        if draw(st.integers(0, 9)) == 0:  # deeply nested
            for _ in range(draw(st.integers(MAX_DEPTH - 2, 400))):
                value = [value] if draw(st.booleans()) else {"k": value}
        sections.setdefault(section, {})[name] = value
    lines = []
    for section, entries in sections.items():
        lines.append(f"[{toml_string(section)}]")
        for name, value in entries.items():
            key = ".".join(toml_string(p) for p in name.split("."))
            lines.append(f"{key} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


TMP = Path(tempfile.mkdtemp(prefix="deltarl-run-config-fuzz-"))
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def accepted_or_one_line(text: str | bytes, overrides: list[str] | None = None) -> None:
    """The property: a run config whose dump and derivation work, or one clean line."""
    path = write(TMP, text)
    try:
        config = load_run_config(path).with_overrides(overrides or [])
    except RunConfigError as err:
        one_line(str(err))
        return
    assert isinstance(config, RunConfig)
    config.model_dump_json()


@FUZZ
@given(documents())
def test_generated_documents_are_accepted_or_one_line(text: str) -> None:
    accepted_or_one_line(text)


MUTATIONS = [
    "[",
    "]",
    "{",
    "}",
    '"',
    "'",
    "'''",
    '"""',
    "=",
    ".",
    ",",
    "\n",
    "#",
    "\\",
    "1e23",
    "inf",
    "nan",
    "true",
    "-0x7fffffffffffffff",
    "9" * 40,
    "1979-05-27",
    "a.b.c",
    "[trainer]\n",
    "[[run]]\n",
    "\x00",
    "\udcff",
]


@FUZZ
@given(st.sampled_from(EXAMPLES), st.data())
def test_mutated_examples_are_accepted_or_one_line(example: Path, data: st.DataObject) -> None:
    text = example.read_text()
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(text)))
        kind = data.draw(st.integers(0, 2))
        if kind == 0:  # insert a token, or a run of it
            token = data.draw(st.sampled_from(MUTATIONS)) * data.draw(st.sampled_from([1, 2, 500]))
            text = text[:at] + token + text[at:]
        elif kind == 1:  # delete a range
            text = text[:at] + text[at + data.draw(st.integers(1, 40)) :]
        else:  # duplicate a range
            end = at + data.draw(st.integers(1, 80))
            text = text[:end] + text[at:end] + text[end:]
    accepted_or_one_line(text.encode("utf-8", "surrogateescape"))


@st.composite
def overrides(draw: st.DrawFn) -> str:
    key = draw(st.sampled_from(sorted(SETTINGS)) | keys)
    value = draw(near(SETTINGS[key]) if key in SETTINGS else values)
    raw = toml_value(value) if draw(st.integers(0, 4)) else draw(nasty_text)  # or not TOML
    return f"{key}={raw}"


@FUZZ
@given(st.lists(overrides(), max_size=3))
def test_overrides_are_accepted_or_one_line(sets: list[str]) -> None:
    accepted_or_one_line(EXAMPLES[0].read_text(), sets)
