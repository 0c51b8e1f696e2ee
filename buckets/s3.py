"""S3 and S3-compatible stores (AWS, MinIO, R2, Ceph, the HF S3 gateway) through boto3.

``s3://<bucket>/<prefix>``: every key is stored as ``<prefix>/<key>``. The endpoint URL is
configurable for S3-compatible stores; credentials come from boto3's standard chain
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_PROFILE``/instance roles) unless given
explicitly. ``overwrite=False`` sends ``If-None-Match: *`` (a conditional PUT, atomic on stores
that support it: AWS S3 since 2024, MinIO, R2, moto). boto3 is imported only when an S3 bucket is
opened (``pip install 'deltarl[s3]'``).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from deltarl.buckets.base import (
    Bucket,
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    join_key,
    validate_key,
    validate_prefix,
)

logger = logging.getLogger(__name__)

_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_EXISTS = {"412", "PreconditionFailed", "ConditionalRequestConflict"}


def _code(err: Exception) -> str:
    return str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))


def make_s3_client(
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
    addressing_style: str | None = None,
) -> Any:
    """A boto3 S3 client; path-style addressing by default when a custom endpoint is set."""
    import boto3
    from botocore.config import Config

    style = addressing_style or ("path" if endpoint_url else "auto")
    config = Config(s3={"addressing_style": style}, retries={"max_attempts": 5, "mode": "standard"})
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region,
        aws_access_key_id=access_key_id,
        aws_secret_access_key=secret_access_key,
        config=config,
    )


class S3Bucket(Bucket):
    """Objects under ``s3://bucket/prefix`` accessed through a boto3 S3 ``client``."""

    def __init__(self, bucket: str, prefix: str, client: Any, *, endpoint_url: str | None = None):
        if not bucket:
            raise ValueError("s3:// URI needs a bucket name: s3://<bucket>/<prefix>")
        self.bucket = bucket
        self.prefix = validate_key(prefix) if prefix else ""
        self.client = client
        where = f" at {endpoint_url}" if endpoint_url else ""
        self.uri = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "") + where

    def _full(self, key: str) -> str:
        return join_key(self.prefix, validate_key(key))

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def put_bytes(self, key: str, data: bytes, *, overwrite: bool = True) -> ObjectInfo:
        extra = {} if overwrite else {"IfNoneMatch": "*"}
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data, **extra)
        except Exception as err:
            if _code(err) in _EXISTS:
                raise ObjectExistsError(f"{key!r} already exists in {self.uri}") from None
            raise
        return ObjectInfo(key, len(data), None)

    def put_file(self, key: str, path: str | Path, *, overwrite: bool = True) -> ObjectInfo:
        size = os.path.getsize(path)
        if overwrite:
            # upload_file switches to multipart for large files.
            self.client.upload_file(str(path), self.bucket, self._full(key))
            return ObjectInfo(key, size, None)
        try:
            with open(path, "rb") as f:
                self.client.put_object(
                    Bucket=self.bucket, Key=self._full(key), Body=f, IfNoneMatch="*"
                )
        except Exception as err:
            if _code(err) in _EXISTS:
                raise ObjectExistsError(f"{key!r} already exists in {self.uri}") from None
            raise
        return ObjectInfo(key, size, None)

    def get_bytes(self, key: str) -> bytes:
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._full(key))
        except Exception as err:
            if _code(err) in _NOT_FOUND:
                raise ObjectNotFoundError(f"{key!r} does not exist in {self.uri}") from None
            raise
        data: bytes = resp["Body"].read()
        return data

    def download_file(self, key: str, path: str | Path) -> Path:
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex}")
        try:
            self.client.download_file(self.bucket, self._full(key), str(tmp))
            os.replace(tmp, dest)
        except Exception as err:
            if _code(err) in _NOT_FOUND:
                raise ObjectNotFoundError(f"{key!r} does not exist in {self.uri}") from None
            raise
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    def head(self, key: str) -> ObjectInfo | None:
        try:
            resp = self.client.head_object(Bucket=self.bucket, Key=self._full(key))
        except Exception as err:
            if _code(err) in _NOT_FOUND:
                return None
            raise
        return ObjectInfo(key, int(resp["ContentLength"]), resp.get("LastModified"))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        full_prefix = join_key(self.prefix, prefix)  # "<prefix>/" lists the whole bucket prefix
        out: list[ObjectInfo] = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
            for item in page.get("Contents", []):
                rel = self._rel(item["Key"])
                try:
                    validate_key(rel)
                except ValueError:
                    logger.warning("skipping object with an unsafe key %r in %s", rel, self.uri)
                    continue
                out.append(ObjectInfo(rel, int(item["Size"]), item.get("LastModified")))
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._full(key))

    def delete_many(self, keys: Iterable[str]) -> None:
        full = [self._full(k) for k in keys]
        for i in range(0, len(full), 1000):  # the DeleteObjects limit
            chunk = [{"Key": k} for k in full[i : i + 1000]]
            resp = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True}
            )
            errors = resp.get("Errors", [])
            if errors:
                raise BucketDeleteError(f"{len(errors)} deletes failed in {self.uri}: {errors[:3]}")


class BucketDeleteError(RuntimeError):
    """The store refused to delete some keys."""
