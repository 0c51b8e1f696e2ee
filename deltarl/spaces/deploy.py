"""Create or update the three Spaces of a deployment through an ``HfApi``-like object.

:func:`deploy` is the one code path of both modes: a real deployment passes
``huggingface_hub.HfApi``, ``--dry-run`` passes :class:`DryRunApi` (answers locally, sends
nothing). Either way the object is wrapped in :class:`RecordingApi`, which binds every call to
the signature of the installed ``HfApi`` method (a wrong argument fails before anything is sent)
and records it, secrets redacted, for the plan file.

Order of calls (each step completes before the next starts):

1. ``create_bucket(private=True, exist_ok=True)``: the bucket the trainer publishes to;
2. per Space, coordinator, env, rollout: ``create_repo(repo_type="space", space_sdk="docker",
   exist_ok=True)``; ``space_info`` (the host the Hub assigned, and whether the Space is
   private); ``update_repo_settings(private=True)`` when ``--private`` and an existing Space is
   public;
3. per Space, in the same order: ``add_space_secret`` and ``add_space_variable`` for each entry
   (before any code arrives, so the first start has them), ``request_space_hardware`` for the
   rollout Space, then ``upload_folder(delete_patterns="*")``, which starts the build. The GPU
   Space comes last, so that it is billed as little as possible while the others build.

Guarantee: every Space gets its whole configuration before its code; the URLs a Space is given
are the hosts the Hub reported (the predicted ``NS-NAME.hf.space`` only in a dry run, or when the
Hub reports none); no token value reaches a log line or the plan.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltarl.services.common.client_headers import HF_PROXY_TOKEN_ENV
from deltarl.spaces.names import (
    MAX_DNS_LABEL,
    SPACES_APP_DOMAIN,
    BucketRef,
    space_app_url,
    space_page_url,
    space_subdomain,
)
from deltarl.spaces.templates import (
    TEMPLATES,
    check_source,
    copy_source,
    dockerfile,
    front_matter,
)
from deltarl.spaces.tokens import Tokens

logger = logging.getLogger(__name__)

REDACTED = "<redacted>"
ORDER = ("coordinator", "env", "rollout")
PROXY_TOKEN_VAR = HF_PROXY_TOKEN_ENV  # read by every client (services/common/client_headers.py)
BUCKET_TOKEN_VAR = "HF_TOKEN"
CPU_FLAVORS = ("cpu-basic", "cpu-upgrade")
WORKER_EXPERIMENT = "worker.toml"  # the rollout Space's experiment file (DELTARL_ROLLOUT_CONFIG)


@dataclass(frozen=True, slots=True)
class DeployOptions:
    """What the user asked for (validated by the CLI)."""

    namespace: str
    prefix: str
    bucket: BucketRef
    model: str
    rollout_hardware: str
    private: bool = False
    sleep_time: int | None = None  # seconds; None: the Hub's default for the hardware
    extra_vars: dict[str, dict[str, str]] = field(default_factory=dict)  # service -> vars

    def repo_id(self, service: str) -> str:
        return f"{self.namespace}/{self.prefix}-{TEMPLATES[service].suffix}"


@dataclass(slots=True)
class SpaceResult:
    """One deployed Space: where it is and what it was given (secret names only)."""

    service: str
    repo_id: str
    page_url: str
    app_url: str
    private: bool
    hardware: str | None
    folder: str
    variables: dict[str, str]
    secret_names: list[str]


@dataclass(slots=True)
class Deployment:
    """The outcome: each Space by service, the bucket URI, every call made (redacted)."""

    spaces: dict[str, SpaceResult]
    bucket_uri: str
    calls: list[dict[str, Any]]

    @property
    def any_private(self) -> bool:
        return any(s.private for s in self.spaces.values())


class RecordingApi:
    """Wraps an ``HfApi``-like object: checks each call against ``reference`` (``HfApi``'s
    signatures), records it with secrets redacted, then forwards it."""

    def __init__(self, api: Any, reference: type, secrets: set[str]) -> None:
        self._api = api
        self._reference = reference
        self._secrets = {s for s in secrets if s}
        self.calls: list[dict[str, Any]] = []

    def _redact(self, method: str, name: str, value: Any) -> Any:
        if (method == "add_space_secret" and name == "value") or name == "token":
            return REDACTED if value else value
        if isinstance(value, str):
            for secret in self._secrets:
                value = value.replace(secret, REDACTED)
        elif isinstance(value, Path):
            value = str(value)
        return value

    def __getattr__(self, method: str) -> Callable[..., Any]:
        target = getattr(self._api, method)
        signature = inspect.signature(getattr(self._reference, method))

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(None, *args, **kwargs)  # None: self; TypeError if wrong
            arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
            self.calls.append(
                {
                    "method": method,
                    "arguments": {k: self._redact(method, k, v) for k, v in arguments.items()},
                }
            )
            return target(*args, **kwargs)

        return call


@dataclass
class _Info:
    host: str | None
    private: bool | None


class DryRunApi:
    """Answers the calls :func:`deploy` makes without sending anything: Spaces report the
    predicted host and the requested visibility."""

    def __init__(self, private: bool) -> None:
        self.private = private

    def space_info(self, repo_id: str, **_: Any) -> _Info:
        return _Info(host=f"{space_subdomain(repo_id)}.{SPACES_APP_DOMAIN}", private=self.private)

    def __getattr__(self, method: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def _service_config(
    service: str,
    options: DeployOptions,
    tokens: Tokens,
    worker_hf_token: str | None,
    urls: dict[str, str],
    private: bool,
) -> tuple[dict[str, str], dict[str, str]]:
    """(variables, secrets) of one Space: ``DELTARL_*`` names its settings class reads."""
    if service == "coordinator":
        variables = {
            "DELTARL_COORDINATOR_STORE": "sqlite",
            "DELTARL_COORDINATOR_SQLITE_PATH": "/data/coordinator.sqlite3",
        }
        secrets = {
            "DELTARL_COORDINATOR_TRAINER_TOKEN": tokens.trainer,
            "DELTARL_COORDINATOR_WORKER_TOKEN": tokens.worker,
        }
    elif service == "env":
        variables = {}
        secrets = {"DELTARL_ENV_TOKEN": tokens.env}
    else:
        variables = {
            "DELTARL_ROLLOUT_COORDINATOR_URL": urls["coordinator"],
            "DELTARL_ROLLOUT_ENV_URL": urls["env"],
            "DELTARL_ROLLOUT_BUCKET_URI": options.bucket.uri,
            # path-safe (no '/': the id is a segment of the coordinator's /v1/workers/{id})
            "DELTARL_ROLLOUT_WORKER_ID": f"space:{options.repo_id('rollout').replace('/', ':')}",
        }
        secrets = {
            "DELTARL_ROLLOUT_WORKER_TOKEN": tokens.worker,
            "DELTARL_ROLLOUT_ENV_TOKEN": tokens.env,
        }
        if worker_hf_token:
            secrets[BUCKET_TOKEN_VAR] = worker_hf_token
            if private:
                secrets[PROXY_TOKEN_VAR] = worker_hf_token
    variables.update(options.extra_vars.get(service, {}))
    return variables, secrets


def worker_experiment(model: str, *, gpu: bool) -> str:
    """The rollout Space's experiment file (``deltarl rollout``'s ``DELTARL_ROLLOUT_CONFIG``):
    the engine of its hardware on ``model``; edit it in the Space (docs/rollout.md,
    Settings) for episodes, hints or a teacher."""
    engine = "vllm" if gpu else "transformers"
    return (
        "# The rollout worker's experiment (docs/rollout.md, Settings), written by `deltarl "
        "spaces deploy`.\n"
        f'[engine]\ntype = "{engine}"\nmodel = {json.dumps(model)}\n'
    )


def _readme(
    service: str, repo_id: str, hardware: str | None, variables: dict[str, str], secrets: list[str]
) -> str:
    template = TEMPLATES[service]
    gpu = hardware is not None and hardware not in CPU_FLAVORS
    text = front_matter(template, suggested_hardware=hardware if gpu else None)
    text += f"\n# {template.title}\n\n"
    text += (
        f"Part of a deltarl deployment (`{repo_id}`), created by `deltarl spaces deploy`. Its "
        "configuration is the Space's variables and secrets:\n\n"
    )
    text += "| variable | value |\n|---|---|\n"
    text += "".join(f"| `{k}` | `{v}` |\n" for k, v in variables.items()) or "| (none) | |\n"
    text += "\nSecrets (values are set in the Space's settings, never in this repository): "
    text += ", ".join(f"`{s}`" for s in secrets) + ".\n\n"
    text += (
        "deltarl's source is in `src/`; the Dockerfile builds and installs it. Update this Space "
        "with `deltarl spaces deploy` rather than by hand: it replaces every file.\n"
    )
    return text


def write_folder(
    folder: Path,
    source_root: Path,
    service: str,
    repo_id: str,
    hardware: str | None,
    variables: dict[str, str],
    secrets: list[str],
    model: str | None = None,
) -> None:
    """Write one Space's repository (README.md, Dockerfile, src/; the rollout Space's
    experiment, ``worker.toml``, on ``model``) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    gpu = hardware not in CPU_FLAVORS
    (folder / "README.md").write_text(_readme(service, repo_id, hardware, variables, secrets))
    (folder / "Dockerfile").write_text(dockerfile(TEMPLATES[service], gpu=gpu))
    if service == "rollout":
        if model is None:
            raise ValueError("the rollout Space's experiment needs its model")
        (folder / WORKER_EXPERIMENT).write_text(worker_experiment(model, gpu=gpu))
    copy_source(source_root, folder / "src")


def deploy(
    api: RecordingApi,
    options: DeployOptions,
    tokens: Tokens,
    worker_hf_token: str | None,
    out: Path,
    source_root: Path,
    descriptions: dict[str, str] | None = None,
) -> Deployment:
    """Create or update the coordinator, env and rollout Spaces (see the module's docstring).

    ``worker_hf_token``: the Hub token stored in the rollout Space (bucket reads; the Spaces
    proxy when private); None only in a dry run without one. ``descriptions``: variable name ->
    description shown in the Space's settings (the settings classes' field descriptions).
    """
    descriptions = descriptions or {}
    check_source(source_root)  # before anything is sent
    api.create_bucket(options.bucket.bucket_id, private=True, exist_ok=True)
    hosts: dict[str, str | None] = {}
    private: dict[str, bool] = {}
    for service in ORDER:
        repo_id = options.repo_id(service)
        api.create_repo(
            repo_id, repo_type="space", space_sdk="docker", exist_ok=True, private=options.private
        )
        info = api.space_info(repo_id)
        hosts[service] = getattr(info, "host", None) or None
        if hosts[service] is None and len(space_subdomain(repo_id)) > MAX_DNS_LABEL:
            logger.warning(
                "%s: the predicted subdomain %s is longer than a DNS label (%d characters); "
                "the Hub assigns another: check the Space page's 'Embed this Space' URL, or "
                "choose a shorter --prefix",
                repo_id,
                space_subdomain(repo_id),
                MAX_DNS_LABEL,
            )
        is_private = bool(getattr(info, "private", options.private))
        if options.private and not is_private:
            logger.warning("%s exists and is public: making it private (--private)", repo_id)
            api.update_repo_settings(repo_id, repo_type="space", private=True)
            is_private = True
        private[service] = is_private
    urls = {s: space_app_url(options.repo_id(s), hosts[s]) for s in ORDER}
    any_private = any(private.values())
    spaces: dict[str, SpaceResult] = {}
    for service in ORDER:
        repo_id = options.repo_id(service)
        variables, secrets = _service_config(
            service, options, tokens, worker_hf_token, urls, any_private
        )
        hardware = options.rollout_hardware if service == "rollout" else None
        folder = out / repo_id.split("/", 1)[1]
        write_folder(
            folder, source_root, service, repo_id, hardware, variables, list(secrets), options.model
        )
        for key, value in secrets.items():
            api.add_space_secret(repo_id, key, value, description=descriptions.get(key))
        for key, value in variables.items():
            api.add_space_variable(repo_id, key, value, description=descriptions.get(key))
        if hardware is not None:
            sleep = options.sleep_time if hardware != "cpu-basic" else None
            api.request_space_hardware(repo_id, hardware, sleep_time=sleep)
        api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            repo_type="space",
            commit_message=f"deltarl spaces deploy: {service}",
            delete_patterns="*",
        )
        spaces[service] = SpaceResult(
            service,
            repo_id,
            space_page_url(repo_id),
            urls[service],
            private[service],
            hardware,
            str(folder),
            variables,
            sorted(secrets),
        )
    return Deployment(spaces, options.bucket.uri, api.calls)
