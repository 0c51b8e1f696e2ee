"""``deltarl spaces``: run the coordinator, the env server and a GPU rollout worker as Hugging
Face Docker Spaces; the trainer runs where the user is and connects to them (docs/spaces.md).

* ``deltarl spaces deploy``: create or update the three Spaces (``--dry-run``: write them and
  the plan of API calls locally, send nothing);
* ``deltarl spaces pause`` / ``deltarl spaces delete``: stop billing / remove them;
* ``deltarl spaces worker``: the rollout Space's entry point (the worker behind a health port
  that reports the worker's own ``/health``).

Only typer and light modules are imported here; huggingface_hub is imported inside the commands.
"""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path
from typing import Any

import typer

from deltarl.spaces.names import check_namespace, check_repo_name, parse_bucket
from deltarl.spaces.templates import APP_PORT, TEMPLATES

logger = logging.getLogger(__name__)

app = typer.Typer(
    help="Deploy deltarl's services as Hugging Face Docker Spaces (docs/spaces.md).",
    no_args_is_help=True,
)

DEFAULT_PREFIX = "deltarl"
DEFAULT_HARDWARE = "l4x1"
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the trainer's default, from the Hub
MAX_DESCRIPTION = 200
SECRETS_NAME = "secrets.env"
PLAN_NAME = "plan.json"
DRY_RUN_HUB_TOKEN = "<your Hub token>"
TRAIN_SCRIPT = "train.sh"


def make_hub_api(token: str) -> Any:
    """The ``HfApi`` that a real deployment talks to (tests replace this function)."""
    from huggingface_hub import HfApi

    return HfApi(token=token)


def _hub_token(token: str | None) -> str:
    """``--token``, else ``$HF_TOKEN``, else the locally saved login; an error if none."""
    from huggingface_hub import get_token

    found = token or get_token()
    if not found:
        raise typer.BadParameter(
            "no Hugging Face token: pass --token, set HF_TOKEN, or log in with `hf auth login` "
            "(the token needs write access to the namespace)",
            param_hint="--token",
        )
    return found


def _check_hardware(value: str) -> str:
    from huggingface_hub import SpaceHardware

    known = sorted(h.value for h in SpaceHardware)
    if value not in known or value.startswith("zero-"):
        raise typer.BadParameter(
            f"{value!r} is not a Docker Space hardware flavor; choose one of "
            f"{', '.join(h for h in known if not h.startswith('zero-'))} (ZeroGPU is for Gradio "
            "Spaces only)",
            param_hint="--rollout-hardware",
        )
    if value.startswith("t4"):
        logger.warning(
            "%s: T4 GPUs have no native bf16 (vLLM, the GPU image's engine, refuses bf16 "
            "there); prefer l4x1 for bf16 weights",
            value,
        )
    return value


def _extra_vars(items: list[str]) -> dict[str, dict[str, str]]:
    """``--set-var SERVICE:NAME=VALUE`` items, each checked against SERVICE's settings."""
    from deltarl.spaces.variables import service_vars

    out: dict[str, dict[str, str]] = {}
    for item in items:
        service, _, rest = item.partition(":")
        name, sep, value = rest.partition("=")
        if service not in TEMPLATES or not sep:
            raise typer.BadParameter(
                f"{item!r}: expected SERVICE:NAME=VALUE with SERVICE one of "
                f"{', '.join(TEMPLATES)}, e.g. coordinator:DELTARL_COORDINATOR_MAX_STALENESS=2",
                param_hint="--set-var",
            )
        known = service_vars(service)
        if name not in known:
            raise typer.BadParameter(
                f"{name} is not read by the {service} service; `deltarl {service} --help` "
                "lists its settings",
                param_hint="--set-var",
            )
        if any(w in name for w in ("TOKEN", "SECRET", "PASSWORD", "KEY")):
            raise typer.BadParameter(
                f"{name} is a secret: Space variables are public; tokens are set as secrets "
                "by the deploy itself",
                param_hint="--set-var",
            )
        out.setdefault(service, {})[name] = value
    return out


def _descriptions() -> dict[str, str]:
    from deltarl.spaces.variables import service_vars

    out: dict[str, str] = {}
    for service in TEMPLATES:
        for name, text in service_vars(service).items():
            out[name] = text if len(text) <= MAX_DESCRIPTION else text[: MAX_DESCRIPTION - 1] + "…"
    return out


def _default_source() -> Path:
    import deltarl

    return Path(deltarl.__file__).resolve().parent.parent


def _train_lines(
    secrets_file: Path, coordinator_url: str, bucket_uri: str, private: bool, model: str
) -> list[str]:
    lines = [
        f"set -a; . {shlex.quote(str(secrets_file))}; set +a   # DELTARL_TRAINER_TOKEN",
        f"export DELTARL_TRAINER_COORDINATOR_URL={shlex.quote(coordinator_url)}",
        f"export DELTARL_BUCKET_URI={shlex.quote(bucket_uri)}   # written with your HF login / HF_TOKEN",
    ]
    if private:
        lines.append(
            "export DELTARL_HF_PROXY_TOKEN=\"$(python -c 'from huggingface_hub import get_token; "
            "print(get_token())')\"   # private Spaces: sent as X-HF-Authorization"
        )
    lines.append(f"deltarl train --set model={shlex.quote(model)}")
    return lines


@app.command()
def deploy(
    namespace: str = typer.Option(
        ..., "--namespace", help="Your Hugging Face user or organization."
    ),
    bucket: str = typer.Option(
        ...,
        "--bucket",
        help="Hugging Face Bucket for the weights: NS/NAME or NS/NAME/path (created if missing).",
    ),
    prefix: str = typer.Option(
        DEFAULT_PREFIX, "--prefix", help="Space names: <prefix>-coordinator, -env, -rollout."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Write the Spaces and the plan of API calls locally; send nothing."
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Local folder of the Spaces, plan and tokens (default ./spaces-dry-run, or ./spaces-deploy).",
    ),
    private: bool = typer.Option(False, "--private", help="Make the Spaces private."),
    token: str | None = typer.Option(
        None,
        "--token",
        envvar="HF_TOKEN",
        help="Hub token with write access (default: your login).",
    ),
    worker_hf_token: str | None = typer.Option(
        None,
        "--worker-hf-token",
        help="Hub token stored in the rollout Space (reads the bucket; private Spaces: the proxy). "
        "Default: --token. A fine-grained read-only token is safer.",
    ),
    rollout_hardware: str = typer.Option(
        DEFAULT_HARDWARE,
        "--rollout-hardware",
        help="Hardware of the rollout Space (l4x1, a10g-small, ..., cpu-basic).",
    ),
    sleep_time: int | None = typer.Option(
        None,
        "--rollout-sleep-time",
        help="Seconds without HTTP traffic before the rollout Space sleeps (default: the Hub's).",
    ),
    model: str = typer.Option(
        DEFAULT_MODEL, "--model", help="Model of the run (the trainer's `model`)."
    ),
    trainer_token: str | None = typer.Option(
        None,
        "--trainer-token",
        envvar="DELTARL_COORDINATOR_TRAINER_TOKEN",
        help="Coordinator trainer token (default: the secrets file's, else generated).",
    ),
    worker_token: str | None = typer.Option(
        None,
        "--worker-token",
        envvar="DELTARL_COORDINATOR_WORKER_TOKEN",
        help="Coordinator worker token (default: the secrets file's, else generated).",
    ),
    env_token: str | None = typer.Option(
        None,
        "--env-token",
        envvar="DELTARL_ENV_TOKEN",
        help="Env server token (default: the secrets file's, else generated).",
    ),
    secrets_file: Path | None = typer.Option(
        None,
        "--secrets-file",
        help="Where the tokens are kept, mode 0600 (default <out>/secrets.env).",
    ),
    set_var: list[str] = typer.Option(
        [],
        "--set-var",
        help="Extra Space variable SERVICE:NAME=VALUE, e.g. rollout:DELTARL_ROLLOUT_SUBMIT_TIMEOUT_S=300.",
    ),
    source: Path | None = typer.Option(
        None,
        "--source",
        help="deltarl checkout to upload (default: the one this command runs from).",
    ),
) -> None:
    """Create or update one Docker Space per service: coordinator, env server, rollout worker."""
    from deltarl.spaces.deploy import DeployOptions, DryRunApi, RecordingApi
    from deltarl.spaces.deploy import deploy as run_deploy
    from deltarl.spaces.tokens import resolve_tokens, write_secrets_file

    try:
        check_namespace(namespace)
        check_repo_name(f"{prefix}-coordinator", "Space name", "--prefix")
        ref = parse_bucket(bucket, default_prefix=prefix)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    hardware = _check_hardware(rollout_hardware)
    if sleep_time is not None and sleep_time != -1 and sleep_time <= 0:
        raise typer.BadParameter(
            "give seconds > 0, or -1 to never sleep", param_hint="--rollout-sleep-time"
        )
    extra = _extra_vars(set_var)
    out_dir = out or Path("spaces-dry-run" if dry_run else "spaces-deploy")
    secrets_path = secrets_file or out_dir / SECRETS_NAME
    try:
        tokens = resolve_tokens(
            {"trainer": trainer_token, "worker": worker_token, "env": env_token}, secrets_path
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    hub_token = None if dry_run else _hub_token(token)
    if hub_token and not worker_hf_token:
        logger.warning(
            "the rollout Space gets your deploy token as HF_TOKEN; a fine-grained read-only "
            "token (--worker-hf-token) limits what a leak of that Space could do"
        )
    # A dry run needs no token: the plan shows where it would go (its value is redacted anyway).
    worker_hub = worker_hf_token or hub_token or token or DRY_RUN_HUB_TOKEN

    options = DeployOptions(
        namespace=namespace,
        prefix=prefix,
        bucket=ref,
        model=model,
        rollout_hardware=hardware,
        private=private,
        sleep_time=sleep_time,
        extra_vars=extra,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ".gitignore").write_text("# written by deltarl spaces deploy: holds tokens\n*\n")
    write_secrets_file(secrets_path, tokens, f"deltarl Spaces {namespace}/{prefix}-*")

    from huggingface_hub import HfApi

    backend = DryRunApi(private) if dry_run else make_hub_api(hub_token or "")
    secrets = tokens.values() | {t for t in (hub_token, worker_hub, token) if t}
    api = RecordingApi(backend, HfApi, secrets)
    plan_path = out_dir / PLAN_NAME
    result = None
    try:
        result = run_deploy(
            api, options, tokens, worker_hub, out_dir, source or _default_source(), _descriptions()
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    except Exception as exc:
        from huggingface_hub.errors import HfHubHTTPError

        if not isinstance(exc, HfHubHTTPError):
            raise
        last = api.calls[-1]["method"] if api.calls else "the first call"
        status = getattr(exc.response, "status_code", None)
        hint = (
            f"Check that the token can write to {namespace} (create buckets and Spaces, set "
            "their secrets and hardware; paid hardware needs a payment method on the account)."
            if status in (401, 402, 403)
            else "Check the message above; the Hub may also be busy (retry)."
        )
        typer.echo(
            f"Error: the Hub refused {last}: {exc}\n{hint} The calls made so far are in "
            f"{plan_path}; re-running is safe (every call creates or updates).",
            err=True,
        )
        raise typer.Exit(1) from exc
    finally:
        _write_plan(plan_path, dry_run, api.calls, result, secrets_path)

    coordinator = result.spaces["coordinator"]
    train = _train_lines(
        secrets_path.resolve(), coordinator.app_url, result.bucket_uri, result.any_private, model
    )
    script = out_dir / TRAIN_SCRIPT
    script.write_text(
        "#!/bin/sh\n# Train locally against the Spaces (written by deltarl spaces deploy).\nset -e\n"
        + "\n".join(train)
        + "\n"
    )
    _report(result, dry_run, plan_path, secrets_path, tokens.sources, train)


def _write_plan(
    path: Path, dry_run: bool, calls: list[dict[str, Any]], result: Any, secrets_path: Path
) -> None:
    from dataclasses import asdict

    body: dict[str, Any] = {"dry_run": dry_run, "secrets_file": str(secrets_path), "calls": calls}
    if result is not None:
        body["bucket_uri"] = result.bucket_uri
        body["spaces"] = {k: asdict(v) for k, v in result.spaces.items()}
    path.write_text(json.dumps(body, indent=2, default=str) + "\n")


def _report(
    result: Any,
    dry_run: bool,
    plan: Path,
    secrets_path: Path,
    sources: dict[str, str],
    train: list[str],
) -> None:
    head = "Dry run: nothing was sent." if dry_run else "Deployed."
    typer.echo(f"{head} Plan of every Hub call (secrets redacted): {plan}")
    for s in result.spaces.values():
        extra = f", hardware {s.hardware}" if s.hardware else ""
        typer.echo(f"  {s.service:<12} {s.page_url}{' (private)' if s.private else ''}{extra}")
        typer.echo(f"  {'':<12} app: {s.app_url}   folder: {s.folder}")
    typer.echo(f"Bucket: {result.bucket_uri}")
    generated = sum(1 for v in sources.values() if v == "generated")
    names = sorted({n for s in result.spaces.values() for n in s.secret_names})
    typer.echo(
        f"Tokens ({generated} generated now): Space secrets {', '.join(names)}; copies in "
        f"{secrets_path} (mode 0600, keep it private)."
    )
    rollout = result.spaces["rollout"]
    if rollout.hardware and rollout.hardware != "cpu-basic":
        namespace, name = rollout.repo_id.split("/", 1)
        typer.echo(
            f"Cost: {rollout.repo_id} runs on paid hardware ({rollout.hardware}), billed while "
            f"it runs, until paused: `deltarl spaces pause --namespace {namespace} --prefix "
            f"{name.removesuffix('-rollout')}` when done."
        )
    typer.echo("Train from this machine (also in train.sh next to the plan):")
    for line in train:
        typer.echo(f"  {line}")


@app.command()
def worker(
    port: int = typer.Option(APP_PORT, "--port", help="Port of the health endpoint (app_port)."),
) -> None:
    """Run `deltarl rollout` behind a health endpoint on --port (the rollout Space's entry
    point): / and /health say whether the worker process runs and carry the worker's own
    /health (on 127.0.0.1:$DELTARL_ROLLOUT_PORT, default 8702); /ready passes it through."""
    from deltarl.spaces.worker_space import run_worker

    try:
        code = run_worker(port)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    raise typer.Exit(code)


def _space_ids(namespace: str, prefix: str) -> list[str]:
    try:
        check_namespace(namespace)
        check_repo_name(f"{prefix}-coordinator", "Space name", "--prefix")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    # the GPU Space first: it is the one that costs
    return [
        f"{namespace}/{prefix}-{TEMPLATES[s].suffix}" for s in ("rollout", "coordinator", "env")
    ]


@app.command()
def pause(
    namespace: str = typer.Option(..., "--namespace"),
    prefix: str = typer.Option(DEFAULT_PREFIX, "--prefix"),
    token: str | None = typer.Option(None, "--token", envvar="HF_TOKEN"),
) -> None:
    """Pause the deployment's Spaces (billing stops; restart them from their settings page)."""
    ids = _space_ids(namespace, prefix)
    api = make_hub_api(_hub_token(token))
    for repo_id in ids:
        api.pause_space(repo_id)
        typer.echo(f"paused {repo_id}")


@app.command()
def delete(
    namespace: str = typer.Option(..., "--namespace"),
    prefix: str = typer.Option(DEFAULT_PREFIX, "--prefix"),
    yes: bool = typer.Option(False, "--yes", help="Confirm: the Spaces are deleted for good."),
    token: str | None = typer.Option(None, "--token", envvar="HF_TOKEN"),
) -> None:
    """Delete the deployment's Spaces (not the bucket: its weights stay)."""
    ids = _space_ids(namespace, prefix)
    if not yes:
        raise typer.BadParameter(
            f"this deletes {', '.join(ids)} for good: add --yes", param_hint="--yes"
        )
    api = make_hub_api(_hub_token(token))
    for repo_id in ids:
        api.delete_repo(repo_id, repo_type="space", missing_ok=True)
        typer.echo(f"deleted {repo_id}")
