"""The deployment's shared secrets and the local file that keeps them.

Three deltarl tokens protect a deployment: the coordinator's trainer token and worker token and
the env server's token. Each is taken from its option (or environment variable), else from the
secrets file of an earlier deployment (so a re-deploy keeps the tokens a running trainer holds),
else generated with :func:`secrets.token_urlsafe` (256 bits).

Space secrets can't be read back from the Hub, so the tokens are also written to a local file
(mode 0600, written atomically) that a shell can load before ``deltarl train``. Token values are
never logged: callers print the file's path and the Space secret names only.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from deltarl.services.common.settings import MIN_TOKEN_CHARS

_TOKEN = re.compile(r"^[A-Za-z0-9._~+/=-]+$")  # header-safe, shell-safe once quoted

# Field of Tokens -> the server-side variable that holds it (the key in the secrets file).
TOKEN_VARS: dict[str, str] = {
    "trainer": "DELTARL_COORDINATOR_TRAINER_TOKEN",
    "worker": "DELTARL_COORDINATOR_WORKER_TOKEN",
    "env": "DELTARL_ENV_TOKEN",
}
TRAINER_TOKEN_VAR = "DELTARL_TRAINER_TOKEN"  # what the local `deltarl train` reads


@dataclass(frozen=True, slots=True)
class Tokens:
    """The three tokens of a deployment, and where each came from."""

    trainer: str
    worker: str
    env: str
    sources: dict[str, str]  # field -> "option" | "secrets file" | "generated"

    def values(self) -> set[str]:
        return {self.trainer, self.worker, self.env}


def check_token(value: str, option: str) -> str:
    """``value`` if it can serve as a deltarl token, else ValueError (never echoing it)."""
    if len(value) < MIN_TOKEN_CHARS or not _TOKEN.fullmatch(value):
        raise ValueError(
            f"{option}: a token needs at least {MIN_TOKEN_CHARS} characters among letters, "
            "digits and ._~+/=-; leave it out to have one generated"
        )
    return value


def read_secrets_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of a secrets file (comments and blank lines skipped); {} if absent."""
    if not path.is_file():
        return {}
    out: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, raw = line.removeprefix("export ").partition("=")
        words = shlex.split(raw) if sep else []
        if len(words) != 1:
            raise ValueError(f"{path}:{number}: expected KEY=VALUE (one shell word)")
        out[key.strip()] = words[0]
    return out


def resolve_tokens(given: dict[str, str | None], secrets_file: Path) -> Tokens:
    """Tokens from ``given`` (field -> option value or None), else ``secrets_file``, else new."""
    stored = read_secrets_file(secrets_file)
    values: dict[str, str] = {}
    sources: dict[str, str] = {}
    for name, var in TOKEN_VARS.items():
        if given.get(name):
            values[name] = check_token(given[name] or "", f"--{name}-token")
            sources[name] = "option"
        elif stored.get(var):
            values[name] = check_token(stored[var], f"{var} in {secrets_file}")
            sources[name] = "secrets file"
        else:
            values[name] = secrets.token_urlsafe(32)
            sources[name] = "generated"
    if values["trainer"] == values["worker"]:
        raise ValueError("the trainer and worker tokens must differ (they grant different roles)")
    return Tokens(values["trainer"], values["worker"], values["env"], sources)


def write_secrets_file(path: Path, tokens: Tokens, title: str) -> None:
    """Write ``tokens`` to ``path`` with mode 0600 (atomically: no reader sees a partial file,
    and the file is never readable by others, not even briefly)."""
    lines = [
        f"# {title}",
        "# Tokens of this deployment: keep this file private (mode 0600). Load it with",
        f"#   set -a; . {shlex.quote(str(path))}; set +a",
        *(f"{var}={shlex.quote(getattr(tokens, name))}" for name, var in TOKEN_VARS.items()),
        "# what the local `deltarl train` reads (the coordinator's trainer token):",
        f"{TRAINER_TOKEN_VAR}={shlex.quote(tokens.trainer)}",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # created 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
