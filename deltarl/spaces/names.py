"""Names of a Spaces deployment: validation of the user's input and the URL rules of the Hub.

Everything here is pure string work (no huggingface_hub import, no network), so that the CLI can
refuse a bad ``--namespace``, ``--prefix`` or ``--bucket`` before it touches anything, with a
message that says what to type instead.

URL rules (huggingface.co):

* a Space ``NS/NAME`` lives at ``https://huggingface.co/spaces/NS/NAME``;
* its app is served at ``https://<subdomain>.hf.space`` where the subdomain is ``NS-NAME``
  lowercased with ``_`` and ``.`` replaced by ``-`` (``Alice/my_app.v2`` ->
  ``alice-my-app-v2.hf.space``). The Hub also reports the subdomain it assigned
  (``space_info(...).host``); a real deployment uses that answer, this rule is the prediction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from deltarl.buckets.base import validate_key
from deltarl.services.common.client_headers import SPACES_APP_DOMAIN

HUB_URL = "https://huggingface.co"
HF_BUCKET_PREFIX = "hf://buckets/"
MAX_DNS_LABEL = 63  # a subdomain is one DNS label
MAX_REPO_NAME = 96  # the Hub's limit on the name part of a repo id

# Namespaces (users, organizations): letters, digits and inner '-' (the Hub refuses others).
_NAMESPACE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,40}[A-Za-z0-9])?$")
# Repo names (Space names, bucket names): letters, digits, '-', '_', '.', not at either end.
_REPO_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")


def check_namespace(namespace: str, option: str = "--namespace") -> str:
    """``namespace`` if it can be a Hugging Face user or organization name, else ValueError."""
    if not _NAMESPACE.fullmatch(namespace) or "--" in namespace:
        raise ValueError(
            f"{option} {namespace!r} is not a Hugging Face user or organization name: use "
            "letters, digits and single inner '-' (at most 42 characters), e.g. "
            f"{option} alice (your user name, see `hf auth whoami`) or {option} my-org"
        )
    return namespace


def check_repo_name(name: str, what: str, option: str) -> str:
    """``name`` if the Hub accepts it as a repo name, else ValueError naming ``option``."""
    if (
        not _REPO_NAME.fullmatch(name)
        or len(name) > MAX_REPO_NAME
        or "--" in name
        or ".." in name
        or name.endswith(".git")
    ):
        raise ValueError(
            f"{option}: {what} {name!r} is not a valid Hugging Face repo name: use letters, "
            "digits, '-', '_' and '.', starting and ending with a letter or digit, no '--' or "
            f"'..', at most {MAX_REPO_NAME} characters"
        )
    return name


def space_subdomain(repo_id: str) -> str:
    """The predicted ``*.hf.space`` subdomain of Space ``repo_id`` (``NS/NAME``)."""
    return re.sub(r"[_./]", "-", repo_id.lower())


def space_page_url(repo_id: str) -> str:
    """``https://huggingface.co/spaces/NS/NAME``."""
    return f"{HUB_URL}/spaces/{repo_id}"


def space_app_url(repo_id: str, host: str | None = None) -> str:
    """The app's base URL: ``https://<host>`` when the Hub told the host, else the prediction."""
    return f"https://{host or space_subdomain(repo_id) + '.' + SPACES_APP_DOMAIN}"


@dataclass(frozen=True, slots=True)
class BucketRef:
    """A Hugging Face Bucket and the path prefix a run publishes under."""

    bucket_id: str  # "NS/NAME"
    prefix: str  # "" or "a/b"

    @property
    def uri(self) -> str:
        """``hf://buckets/NS/NAME[/prefix]``: the value of ``DELTARL_BUCKET_URI``."""
        return HF_BUCKET_PREFIX + self.bucket_id + (f"/{self.prefix}" if self.prefix else "")


def parse_bucket(value: str, default_prefix: str) -> BucketRef:
    """``--bucket``: ``NS/NAME``, ``NS/NAME/path`` or ``hf://buckets/NS/NAME[/path]``.

    Without a path the run publishes under ``default_prefix`` (the deployment's prefix), so that
    several deployments can share one bucket.
    """
    raw = value.strip()
    if "://" in raw and not raw.startswith(HF_BUCKET_PREFIX):
        raise ValueError(
            f"--bucket {value!r}: Spaces read weights from a Hugging Face Bucket; give "
            "NS/NAME (e.g. --bucket alice/deltarl-weights) or hf://buckets/NS/NAME/path"
        )
    parts = raw.removeprefix(HF_BUCKET_PREFIX).strip("/").split("/")
    if len(parts) < 2 or not all(parts):
        raise ValueError(
            f"--bucket {value!r} needs a namespace and a bucket name: --bucket NS/NAME "
            "(e.g. --bucket alice/deltarl-weights), optionally followed by /path"
        )
    namespace = check_namespace(parts[0], "--bucket's namespace")
    name = check_repo_name(parts[1], "bucket name", "--bucket")
    prefix = "/".join(parts[2:]) or default_prefix
    try:
        validate_key(prefix)  # the bucket backends' own rule for object keys
    except ValueError as exc:
        raise ValueError(
            f"--bucket {value!r}: the path {prefix!r} is not a valid object key prefix ({exc}); "
            "use '/'-separated parts of letters, digits and ._+=- starting with a letter, digit "
            "or '_'"
        ) from None
    return BucketRef(f"{namespace}/{name}", prefix)
