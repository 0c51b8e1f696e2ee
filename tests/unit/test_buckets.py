"""Bucket backends against real storage: a directory, a local S3 server (moto), and the HF code
path through a recording fake of ``HfApi`` whose calls are bound to the real method signatures
(the Hub itself is unreachable here)."""

from __future__ import annotations

import inspect
import logging
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from support import free_port

from deltarl.buckets import (
    Bucket,
    BucketSettings,
    ObjectExistsError,
    ObjectNotFoundError,
    open_bucket,
    validate_key,
)
from deltarl.buckets.hf import DryRunHfApi, HfBucket, parse_hf_uri
from deltarl.buckets.local import LocalBucket
from deltarl.buckets.s3 import S3Bucket, make_s3_client
from deltarl.weightsync.errors import CorruptDeltaError
from deltarl.weightsync.manifest import xxh3_hex
from deltarl.weightsync.reader import BucketReader
from deltarl.weightsync.writer import BucketWriter, NewObject

S3_BUCKET = "deltarl-test"
S3_CREDS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}

BAD_KEYS = [
    "",
    "../escape",
    "a/../../escape",
    "a/..",
    "/etc/passwd",
    "a\\b",
    "..\\windows",
    "a//b",
    "a/",
    "./a",
    "a/./b",
    ".hidden",
    "a/.tmp",
    "with space",
    "caf\u00e9",
    "nul\x00byte",
    "x" * 1025,
]


# --- servers and fakes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    make_s3_client(endpoint_url=endpoint, **S3_CREDS).create_bucket(Bucket=S3_BUCKET)
    yield endpoint
    server.stop()


def _s3_settings(endpoint: str) -> BucketSettings:
    return BucketSettings(
        s3_endpoint_url=endpoint,
        s3_access_key_id=S3_CREDS["access_key_id"],
        s3_secret_access_key=SecretStr(S3_CREDS["secret_access_key"]),
        s3_region=S3_CREDS["region"],
    )


class RecordingHfApi(DryRunHfApi):
    """Records every call and checks it binds to the real ``HfApi`` method's signature."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, dict[str, Any]]] = []
        self.known_buckets: set[str] = set()

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name.startswith("_") or not callable(attr):
            return attr
        from huggingface_hub import HfApi

        real = getattr(HfApi, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(real).bind(None, *args, **kwargs)  # TypeError if invalid
            self.log.append((name, dict(list(bound.arguments.items())[1:])))
            return attr(*args, **kwargs)

        return call

    def bucket_info(self, bucket_id: str, **kw: Any) -> dict[str, Any]:
        if bucket_id not in self.known_buckets:
            from huggingface_hub.errors import BucketNotFoundError

            request = httpx.Request("GET", f"https://huggingface.co/api/buckets/{bucket_id}")
            response = httpx.Response(404, request=request)
            raise BucketNotFoundError("not found", response=response)  # type: ignore[arg-type]
        return super().bucket_info(bucket_id, **kw)

    def create_bucket(self, bucket_id: str, **kw: Any) -> None:
        self.known_buckets.add(bucket_id)
        super().create_bucket(bucket_id, **kw)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.network), "hf"])
def bucket(request: pytest.FixtureRequest, tmp_path: Path) -> Bucket:
    if request.param == "local":
        return open_bucket(str(tmp_path / "bucket"))
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        uri = f"s3://{S3_BUCKET}/run-{uuid.uuid4().hex[:8]}/weights"
        return open_bucket(uri, settings=_s3_settings(endpoint))
    return open_bucket("hf://buckets/alice/rl/run1", hf_api=RecordingHfApi(), create=True)


# --- the contract, on every backend -----------------------------------------------------------


def test_put_get_head_list_delete(bucket: Bucket, tmp_path: Path) -> None:
    assert bucket.head("a/b.bin") is None and not bucket.exists("a/b.bin")
    info = bucket.put_bytes("a/b.bin", b"hello")
    assert info.key == "a/b.bin" and info.size == 5
    assert bucket.get_bytes("a/b.bin") == b"hello"
    assert bucket.size("a/b.bin") == 5 and bucket.exists("a/b.bin")
    head = bucket.head("a/b.bin")
    assert head is not None and head.size == 5 and head.modified is not None

    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 10_000)
    assert bucket.put_file("ab/c.bin", src).size == 10_000
    out = bucket.download_file("ab/c.bin", tmp_path / "dl" / "c.bin")
    assert out.read_bytes() == src.read_bytes()
    bucket.put_bytes("latest.json", b"{}")

    assert [o.key for o in bucket.list()] == ["a/b.bin", "ab/c.bin", "latest.json"]
    assert [o.key for o in bucket.list("a/")] == ["a/b.bin"]
    assert [o.key for o in bucket.list("a")] == ["a/b.bin", "ab/c.bin"]  # string prefix
    assert [o.key for o in bucket.list("ab/c")] == ["ab/c.bin"]
    assert bucket.list("zzz/") == []

    bucket.put_bytes("a/b.bin", b"replaced")
    assert bucket.get_bytes("a/b.bin") == b"replaced"
    bucket.delete("a/b.bin")
    bucket.delete("a/b.bin")  # missing is fine
    bucket.delete_many(["ab/c.bin", "never/was.bin"])
    assert [o.key for o in bucket.list()] == ["latest.json"]


def test_missing_objects(bucket: Bucket, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFoundError):
        bucket.get_bytes("nope.bin")
    with pytest.raises(ObjectNotFoundError):
        bucket.download_file("nope.bin", tmp_path / "nope.bin")
    assert not (tmp_path / "nope.bin").exists()
    with pytest.raises(ObjectNotFoundError):
        bucket.size("nope.bin")


def test_no_overwrite_keeps_the_original(bucket: Bucket, tmp_path: Path) -> None:
    bucket.put_bytes("m/v1.json", b"first", overwrite=False)
    with pytest.raises(ObjectExistsError):
        bucket.put_bytes("m/v1.json", b"second", overwrite=False)
    src = tmp_path / "f"
    src.write_bytes(b"third")
    with pytest.raises(ObjectExistsError):
        bucket.put_file("m/v1.json", src, overwrite=False)
    assert bucket.get_bytes("m/v1.json") == b"first"


@pytest.mark.parametrize("key", BAD_KEYS)
def test_path_traversal_and_bad_keys_refused(bucket: Bucket, key: str, tmp_path: Path) -> None:
    for call in (
        lambda: bucket.put_bytes(key, b"x"),
        lambda: bucket.get_bytes(key),
        lambda: bucket.head(key),
        lambda: bucket.delete(key),
        lambda: bucket.download_file(key, tmp_path / "out"),
    ):
        with pytest.raises(ValueError):
            call()
    assert bucket.list() == []


@pytest.mark.parametrize("prefix", ["../", "/abs", "a/../", "a\\", "a//"])
def test_bad_list_prefix_refused(bucket: Bucket, prefix: str) -> None:
    with pytest.raises(ValueError):
        bucket.list(prefix)


def test_publication_round_trip(bucket: Bucket) -> None:
    """The whole protocol works unchanged on every backend."""
    pub, reader = BucketWriter(bucket, anchor_every=2), BucketReader(bucket)
    d0, d1 = xxh3_hex(b"state0"), xxh3_hex(b"state1")
    pub.publish(
        0,
        [NewObject("anchor", "safetensors", b"A" * 100)],
        state_digest=d0,
        numel=50,
        full_bytes=100,
    )
    m1 = pub.publish(
        1,
        [
            NewObject(
                "delta", "deltarl-compact-v1", b"D" * 7, base_version=0, base_digest=d0, changed=3
            )
        ],
        state_digest=d1,
        numel=50,
        full_bytes=100,
    )
    assert reader.latest_version() == 1
    plan = reader.plan(0)
    assert plan.keys == [m1.deltas[0].key] and reader.fetch(plan.steps[0]) == b"D" * 7
    bucket.put_bytes(m1.deltas[0].key, b"D" * 6)  # truncated in place
    with pytest.raises(CorruptDeltaError, match="6 bytes"):
        reader.fetch(plan.steps[0])


# --- backend specifics ------------------------------------------------------------------------


def test_local_writes_are_atomic_and_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = LocalBucket(tmp_path / "b")
    bucket.put_bytes("k/v.bin", b"old")

    def crash(*_: Any) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr("os.replace", crash)
    with pytest.raises(OSError):
        bucket.put_bytes("k/v.bin", b"new")
    monkeypatch.undo()
    assert bucket.get_bytes("k/v.bin") == b"old"
    assert [o.key for o in bucket.list()] == ["k/v.bin"]
    (tmp_path / "b" / "k" / ".v.bin.tmp-left-by-a-crash").write_bytes(b"partial")
    assert [o.key for o in bucket.list()] == ["k/v.bin"]
    bucket.delete("k/v.bin")
    assert bucket.list() == []


def test_local_symlink_escape_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    bucket = LocalBucket(tmp_path / "b")
    (tmp_path / "b" / "link").symlink_to(outside)
    with pytest.raises(ValueError, match="outside"):
        bucket.put_bytes("link/x.bin", b"x")
    assert list(outside.iterdir()) == []


def test_local_delete_prunes_empty_dirs(tmp_path: Path) -> None:
    bucket = LocalBucket(tmp_path / "b")
    bucket.put_bytes("objects/v1/a.bin", b"a")
    bucket.delete("objects/v1/a.bin")
    assert list((tmp_path / "b").iterdir()) == []


@pytest.mark.network
def test_s3_layout_and_conditional_put(s3_endpoint: str) -> None:
    client = make_s3_client(endpoint_url=s3_endpoint, **S3_CREDS)
    bucket = S3Bucket(S3_BUCKET, "exp/run7", client)
    bucket.put_bytes("manifests/v1.json", b"{}", overwrite=False)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=S3_BUCKET, Prefix="exp/")["Contents"]]
    assert keys == ["exp/run7/manifests/v1.json"]
    # Another prefix that merely starts with the same characters is not listed.
    S3Bucket(S3_BUCKET, "exp/run77", client).put_bytes("x.bin", b"x")
    assert [o.key for o in bucket.list()] == ["manifests/v1.json"]
    with pytest.raises(ObjectExistsError):
        bucket.put_bytes("manifests/v1.json", b"{}", overwrite=False)


def test_hf_calls_use_the_real_api(tmp_path: Path) -> None:
    api = RecordingHfApi()
    bucket = open_bucket("hf://buckets/alice/rl/exp/run1", hf_api=api, create=True)
    assert isinstance(bucket, HfBucket) and bucket.prefix == "exp/run1"
    assert [c[0] for c in api.log] == ["bucket_info", "create_bucket"]
    assert api.log[1][1] == {"bucket_id": "alice/rl", "private": True, "exist_ok": True}
    api.log.clear()

    bucket.put_bytes("objects/v1/a.bin", b"abc")
    src = tmp_path / "f.bin"
    src.write_bytes(b"defg")
    bucket.put_file("objects/v1/b.bin", src)
    assert api.log[0] == (
        "batch_bucket_files",
        {"bucket_id": "alice/rl", "add": [(b"abc", "exp/run1/objects/v1/a.bin")]},
    )
    assert api.log[1][1]["add"] == [(str(src), "exp/run1/objects/v1/b.bin")]
    assert set(api.files["alice/rl"]) == {"exp/run1/objects/v1/a.bin", "exp/run1/objects/v1/b.bin"}

    assert bucket.get_bytes("objects/v1/b.bin") == b"defg"
    name, kwargs = api.log[-1]
    assert name == "download_bucket_files" and kwargs["raise_on_missing_files"] is True
    assert kwargs["files"][0][0] == "exp/run1/objects/v1/b.bin"

    api.log.clear()
    assert [o.key for o in bucket.list("objects/v1/a")] == ["objects/v1/a.bin"]
    assert api.log == [
        (
            "list_bucket_tree",
            {"bucket_id": "alice/rl", "prefix": "exp/run1/objects/v1", "recursive": True},
        )
    ]
    bucket.delete_many(["objects/v1/a.bin", "objects/v1/b.bin"])
    assert api.log[-1] == (
        "batch_bucket_files",
        {
            "bucket_id": "alice/rl",
            "delete": ["exp/run1/objects/v1/a.bin", "exp/run1/objects/v1/b.bin"],
        },
    )
    assert bucket.list() == []


def test_hf_missing_bucket_without_create_is_a_clear_error() -> None:
    bucket = open_bucket("hf://buckets/alice/none", hf_api=RecordingHfApi())
    with pytest.raises(ValueError, match="does not exist"):
        bucket.ensure_exists()  # type: ignore[attr-defined]


def test_hf_dry_run_needs_no_network_or_token(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    bucket = open_bucket("hf://buckets/alice/rl", settings=BucketSettings(hf_dry_run=True))
    bucket.put_bytes("latest.json", b"{}")
    assert bucket.get_bytes("latest.json") == b"{}" and "dry run" in bucket.uri
    assert "[dry run] HfApi.batch_bucket_files(alice/rl: add latest.json (2 B))" in caplog.text


@pytest.mark.parametrize(
    "uri",
    ["hf://buckets/", "hf://buckets/alice", "hf://buckets/alice/../x", "hf://models/alice/m"],
)
def test_hf_bad_uris(uri: str) -> None:
    with pytest.raises(ValueError):
        parse_hf_uri(uri)


# --- factory and settings ---------------------------------------------------------------------


def test_open_bucket_dispatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(open_bucket(str(tmp_path / "plain")), LocalBucket)
    b = open_bucket((tmp_path / "uri").as_uri())
    assert isinstance(b, LocalBucket) and b.root == tmp_path / "uri"
    monkeypatch.setenv("DELTARL_BUCKET_URI", str(tmp_path / "env"))
    assert isinstance(open_bucket(), LocalBucket) and (tmp_path / "env").is_dir()
    for bad, msg in [
        ("file://host/x", "host"),
        ("file:relative", "absolute"),
        ("gs://b/p", "unknown bucket scheme"),
        ("", "empty"),
    ]:
        with pytest.raises(ValueError, match=msg):
            open_bucket(bad)
    with pytest.raises(ValueError, match="does not exist"):
        open_bucket(str(tmp_path / "missing"), create=False)


@pytest.mark.network
def test_open_s3_from_environment(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTARL_S3_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("DELTARL_BUCKET_URI", f"s3://{S3_BUCKET}/env-{uuid.uuid4().hex[:6]}")
    bucket = open_bucket()
    assert isinstance(bucket, S3Bucket)
    bucket.put_bytes("a.bin", b"a")
    assert bucket.get_bytes("a.bin") == b"a"


def test_secrets_never_printed_or_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("HF_TOKEN", "hf_supersecret")
    monkeypatch.setenv("DELTARL_S3_SECRET_ACCESS_KEY", "s3supersecret")
    monkeypatch.setenv("DELTARL_S3_ACCESS_KEY_ID", "AKIDEXAMPLE")
    settings = BucketSettings()
    assert (
        settings.hf_token is not None and settings.hf_token.get_secret_value() == "hf_supersecret"
    )
    bucket = open_bucket("hf://buckets/alice/rl", settings=settings)  # builds a real HfApi, no I/O
    s3 = open_bucket("s3://b/p", settings=settings)
    text = " ".join(
        [repr(settings), str(settings.model_dump()), repr(bucket), repr(s3), caplog.text]
    )
    assert "supersecret" not in text
    monkeypatch.delenv("DELTARL_S3_ACCESS_KEY_ID")
    with pytest.raises(ValueError, match="both"):
        open_bucket("s3://b/p")


def test_keys_and_buckets_are_torch_free() -> None:
    assert validate_key("objects/v000000000001/ab_c-1.safetensors.zst")
    code = (
        "import sys; import deltarl.buckets, deltarl.weightsync.writer, "
        "deltarl.weightsync.retention; assert 'torch' not in sys.modules"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)


def test_local_create_if_absent_without_hard_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*_: Any) -> None:
        raise PermissionError("operation not permitted")

    monkeypatch.setattr("os.link", no_links)
    bucket = LocalBucket(tmp_path / "b")
    bucket.put_bytes("m.json", b"1", overwrite=False)
    with pytest.raises(ObjectExistsError):
        bucket.put_bytes("m.json", b"2", overwrite=False)
    assert bucket.get_bytes("m.json") == b"1" and [o.key for o in bucket.list()] == ["m.json"]
