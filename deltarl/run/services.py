"""One run config for services started one at a time: ``deltarl <service> --run-config exp.toml``.

``deltarl run`` starts every service of a run on one machine from one TOML. Across machines each
service is started on its own, and ``--run-config`` gives it what ``deltarl run`` would have:
its section's experiment settings and the ``[run]`` values it shares (a worker's
``temperature``, ``group_size``, ``model`` ...): the servers as the same ``DELTARL_*``
variables, the trainer and the workers as their experiment files. Deployment (URLs, tokens, ports, the bucket) still comes from the
environment and the command line: a run config refuses it.

A ``DELTARL_*`` variable already set to another value than the file's is an error naming both
(one value, one place); set to the same value, it is fine.

A worker's engine seed is ``[run] seed`` mixed with its worker id (SHA-256), so workers started
from one file sample differently, and a worker restarted with its id samples as before.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from deltarl.run.config import RunConfig, RunConfigError, load_run_config
from deltarl.run.derive import (
    check_services,
    experiment_env,
    worker_env,
    write_experiment,
    write_worker_experiment,
)

SEED_SPAN = 2**31  # engine seeds stay below it (every engine's generators take 32 bits)


def worker_seed(run_seed: int, worker_id: str) -> int:
    """The engine seed of ``worker_id`` in a run seeded ``run_seed``."""
    digest = hashlib.sha256(f"{run_seed}:{worker_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % SEED_SPAN


def service_env(config: RunConfig, service: str) -> dict[str, str]:
    """The ``DELTARL_*`` variables ``config`` gives a server (not ``train`` nor ``rollout``:
    see :func:`trainer_config` and :func:`worker_config`)."""
    try:
        return experiment_env(config, service, model=config.run.model)
    except ValueError as err:
        raise RunConfigError(str(err)) from None


def worker_config(config: RunConfig, out: Path, worker_id: str) -> dict[str, str]:
    """Write the experiment of worker ``worker_id`` to ``out`` (``deltarl rollout --config``;
    its engine seed is :func:`worker_seed`'s) and return the deployment variables ``[rollout]``
    gives it."""
    seed = worker_seed(config.run.seed, worker_id)
    try:
        write_worker_experiment(config, out, model=config.run.model, engine_seed=seed)
    except ValueError as err:
        raise RunConfigError(str(err)) from None
    return worker_env(config)


def trainer_config(config: RunConfig, out: Path, run_dir: Path) -> dict[str, str]:
    """Write the trainer's experiment settings to ``out`` (``deltarl train --config``) and
    return the deployment variables the file gives it (``[trainer] device``)."""
    write_experiment(config, out, model=config.run.model, run_dir=run_dir)
    device = config.trainer.get("device")
    return {} if device is None else {"DELTARL_TRAINER_DEVICE": str(device)}


def conflicts(values: Mapping[str, str], environ: Mapping[str, str]) -> list[str]:
    """``NAME=env value`` of each variable the environment sets to another value."""
    return [
        f"{k}={environ[k]!r} (the file: {v!r})" for k, v in values.items() if environ.get(k, v) != v
    ]


def apply(
    path: Path,
    values_of: Any,
    environ: MutableMapping[str, str] | None = None,
) -> dict[str, str]:
    """Read and check the run config at ``path``, compute its variables with
    ``values_of(config)`` and set them in ``environ`` (default: this process's); a
    :class:`~deltarl.run.config.RunConfigError` when the file is invalid or the environment
    already says otherwise."""
    environ = os.environ if environ is None else environ
    config = load_run_config(path)
    try:
        check_services(config)
    except ValueError as err:
        raise RunConfigError(f"{path}: {err}") from None
    values: dict[str, str] = values_of(config)
    clash = conflicts(values, environ)
    if clash:
        raise RunConfigError(
            f"{path} sets what the environment already sets otherwise: {'; '.join(clash)}; "
            "experiment settings come from the file: unset those variables"
        )
    environ.update(values)
    return values


def start_service(service: str, path: Path, kwargs: dict[str, Any]) -> dict[str, str]:
    """What ``deltarl <service> --run-config path`` does before the command runs: set the
    service's variables and, for ``train`` and ``rollout``, point ``kwargs["config"]`` at the
    experiment file; for ``rollout``, pin the worker id its seed was drawn for. Returns the
    variables set."""
    if service == "train":
        if kwargs.get("config") is not None:
            raise RunConfigError("--config and --run-config: give one or the other")
        from deltarl.trainer.settings import ExperimentSettings

        run_dir = Path(str(ExperimentSettings.model_fields["run_dir"].default))
        out = _experiment_file()
        values = apply(path, lambda c: trainer_config(c, out, run_dir))
        kwargs["config"] = out
        return values
    if service == "rollout":
        from deltarl.rollout.settings import default_worker_id

        if kwargs.get("config") is not None or os.environ.get("DELTARL_ROLLOUT_CONFIG"):
            raise RunConfigError(
                "--config (or DELTARL_ROLLOUT_CONFIG) and --run-config: give one or the other"
            )
        wid = kwargs.get("worker_id") or os.environ.get("DELTARL_ROLLOUT_WORKER_ID")
        wid = wid or default_worker_id()
        kwargs["worker_id"] = wid
        out = _experiment_file()
        values = apply(path, lambda c: worker_config(c, out, wid))
        kwargs["config"] = out
        return values
    return apply(path, lambda c: service_env(c, service))


def _experiment_file() -> Path:
    """A private file for the trainer's or a worker's experiment settings, removed when the
    process ends."""
    import atexit
    import tempfile

    fd, name = tempfile.mkstemp(prefix="deltarl-experiment-", suffix=".json")
    os.close(fd)
    atexit.register(lambda: Path(name).unlink(missing_ok=True))
    return Path(name)
