"""compose.yaml's CPU profile is checked against the run-config derivation (deltarl/run): the
profile is the run config ``examples/compose-cpu.toml``, and every value the derivation hands a
service (shared ones included: group size, temperature, staleness bound, seed) is what compose
sets for it, and nothing else of the experiment is set there. Values that only the deployment
knows (tokens, URLs, ports, worker ids, file paths, the model's path inside the image) are
compose's own."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from deltarl.run.config import load_run_config
from deltarl.run.derive import Endpoints, RunLayout, Tokens, experiment, worker_experiment

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
CONFIG = ROOT / "examples" / "compose-cpu.toml"
# derived variables whose value is the deployment's (compose writes its own)
DEPLOYMENT_VARS = {
    "DELTARL_BUCKET_URI",
    "DELTARL_COORDINATOR_SQLITE_PATH",
    "DELTARL_COORDINATOR_TRAINER_TOKEN",
    "DELTARL_COORDINATOR_WORKER_TOKEN",
    "DELTARL_ENV_TOKEN",
    "DELTARL_ROLLOUT_COORDINATOR_URL",
    "DELTARL_ROLLOUT_WORKER_TOKEN",
    "DELTARL_ROLLOUT_ENV_URL",
    "DELTARL_ROLLOUT_ENV_TOKEN",
    "DELTARL_ROLLOUT_WORKER_ID",
    "DELTARL_TRAINER_COORDINATOR_URL",
    "DELTARL_TRAINER_TOKEN",
    "DELTARL_TRAINER_DEVICE",
}
# variables compose sets that are not run settings (logging, deployment)
NOT_SETTINGS = re.compile(
    r"^DELTARL_(LOG_LEVEL|HF_|S3_|CA_BUNDLE|.*_TLS_|.*_HOST$|.*_PORT$|ROLLOUT_SHUTDOWN_GRACE_S$"
    r"|.*_TOKEN$|.*_URL$|BUCKET_URI$|COORDINATOR_(STORE|REDIS_.*|SQLITE_PATH)$|ROLLOUT_MODEL$"
    r"|ROLLOUT_WORKER_ID$)"
)
SERVICES = {"coordinator": "coordinator", "env": "env-cpu", "rollout": "rollout-cpu"}


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _value(raw: Any) -> str:
    """A compose value with ``${VAR:-default}`` read as its default."""
    text = str(raw)
    m = re.fullmatch(r"\$\{\w+:?-(.*)\}", text)
    return m.group(1) if m else text


def _env(service: str) -> dict[str, str]:
    env = _compose()["services"][service].get("environment") or {}
    return {k: _value(v) for k, v in env.items() if k.startswith("DELTARL_")}


def _layout() -> RunLayout:
    config = load_run_config(CONFIG)
    tokens = Tokens(trainer="t" * 32, worker="w" * 32, env="e" * 32)
    return RunLayout(config, Path("/data"), "image", Endpoints("0.0.0.0", 8700, 8001), tokens, "b")


def _derived(section: str) -> dict[str, str]:
    layout = _layout()
    launch = {
        "coordinator": layout.coordinator,
        "env": layout.env,
        "rollout": lambda: layout.worker(0),
    }[section]()
    return {k: v for k, v in launch.env.items() if k not in DEPLOYMENT_VARS}


@pytest.mark.parametrize("section", sorted(SERVICES))
def test_compose_sets_what_the_run_config_derives(section: str) -> None:
    compose = _env(SERVICES[section])
    derived = _derived(section)
    for name, value in derived.items():
        assert compose.get(name) == value, (
            f"{SERVICES[section]}: {name} is {compose.get(name)!r} in compose.yaml, "
            f"{value!r} from {CONFIG.name}"
        )
    extra = {k for k in compose if k not in derived and not NOT_SETTINGS.match(k)}
    assert not extra, f"{SERVICES[section]} sets {sorted(extra)}: declare them in {CONFIG.name}"


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def _sets(service: str) -> dict[str, Any]:
    """A compose service's ``--set key=value`` arguments, as ``deltarl train|rollout --set``
    reads them (JSON, else a string; ``${VAR:-default}`` read as its default)."""
    command = _compose()["services"][service]["command"]
    sets = dict(
        item.split("=", 1)
        for flag, item in zip(command[::2], command[1::2], strict=True)
        if flag == "--set"
    )
    out: dict[str, Any] = {}
    for key, raw in sets.items():
        raw = _value(raw)
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def test_compose_worker_gets_the_derived_experiment() -> None:
    compose = _sets("rollout-cpu")
    derived = _flat(worker_experiment(_layout().config, model="image", engine_seed=0))
    # the image's packaged GGUF (the default model), the engine's default type and seed (one
    # compose service scales to N workers)
    for key in ("engine.model", "engine.seed"):
        derived.pop(key)
    assert derived.pop("engine.type") == "transformers"
    assert compose == derived


def test_compose_trainer_gets_the_derived_experiment() -> None:
    compose = _sets("trainer-cpu")
    derived = _flat(experiment(_layout().config, model="image", run_dir=Path("run")))
    derived.pop("run_dir")
    assert compose.pop("model", None) is not None  # the image's converted model directory
    derived.pop("model")
    assert compose == derived


def test_the_shared_values_agree_inside_compose() -> None:
    """The values [run] declares once, as compose spells them for each service."""
    config = load_run_config(CONFIG).run
    worker, coordinator = _sets("rollout-cpu"), _env("coordinator")
    assert worker["episodes.group_size"] == config.group_size
    assert worker["episodes.sampling.temperature"] == config.temperature
    assert coordinator["DELTARL_COORDINATOR_MAX_STALENESS"] == str(config.max_staleness)
