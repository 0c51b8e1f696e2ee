"""``open_bucket(uri)``: the one place that maps a URI to a :class:`Bucket` backend.

=====================================  ==========================================================
``/abs/dir``, ``rel/dir``              :class:`LocalBucket` (the embedded default)
``file:///abs/dir``                    :class:`LocalBucket`
``hf://buckets/<ns>/<name>/<prefix>``  :class:`HfBucket` (huggingface_hub bucket API)
``s3://<bucket>/<prefix>``             :class:`S3Bucket` (boto3, any S3-compatible endpoint)
=====================================  ==========================================================
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import unquote, urlparse

from deltarl.buckets.base import Bucket
from deltarl.buckets.settings import BucketSettings

logger = logging.getLogger(__name__)


def open_bucket(
    uri: str | None = None,
    *,
    settings: BucketSettings | None = None,
    hf_api: Any = None,
    s3_client: Any = None,
    create: bool | None = None,
) -> Bucket:
    """Open the bucket at ``uri`` (default: ``settings.bucket_uri``, i.e. ``DELTARL_BUCKET_URI``).

    ``hf_api``/``s3_client`` inject a ready client (tests, custom sessions); otherwise one is built
    from ``settings`` (read from the environment when not given). ``create``: make the directory /
    HF bucket if missing (default: True for directories, ``settings.hf_create_bucket`` for hf://;
    S3 buckets are never created here). Raises ``ValueError`` for an unknown or malformed URI.
    """
    settings = settings if settings is not None else BucketSettings()
    uri = uri if uri is not None else settings.bucket_uri
    if not uri:
        raise ValueError("empty bucket URI: set DELTARL_BUCKET_URI or pass a path")

    if uri.startswith("hf://"):
        from deltarl.buckets.hf import DryRunHfApi, HfBucket, parse_hf_uri

        bucket_id, prefix = parse_hf_uri(uri)
        dry_run = settings.hf_dry_run
        if hf_api is None:
            if dry_run:
                hf_api = DryRunHfApi()
            else:
                from huggingface_hub import HfApi

                token = settings.hf_token.get_secret_value() if settings.hf_token else None
                hf_api = HfApi(endpoint=settings.hf_endpoint, token=token)
        hf_bucket = HfBucket(bucket_id, prefix, hf_api, dry_run=dry_run)
        want_create = settings.hf_create_bucket if create is None else create
        if want_create or dry_run:
            hf_bucket.ensure_exists(create=True)
        bucket: Bucket = hf_bucket
    elif uri.startswith("s3://"):
        from deltarl.buckets.s3 import S3Bucket, make_s3_client

        parsed = urlparse(uri)
        if parsed.query or parsed.fragment:
            raise ValueError(f"s3 URI {uri!r} must not have a query or fragment")
        if s3_client is None:
            secret = settings.s3_secret_access_key
            if (secret is None) != (settings.s3_access_key_id is None):
                raise ValueError(
                    "set both DELTARL_S3_ACCESS_KEY_ID and DELTARL_S3_SECRET_ACCESS_KEY, or "
                    "neither (then boto3's credential chain is used)"
                )
            s3_client = make_s3_client(
                endpoint_url=settings.s3_endpoint_url,
                region=settings.s3_region,
                access_key_id=settings.s3_access_key_id,
                secret_access_key=secret.get_secret_value() if secret else None,
                addressing_style=settings.s3_addressing_style,
            )
        bucket = S3Bucket(
            parsed.netloc,
            parsed.path.strip("/"),
            s3_client,
            endpoint_url=settings.s3_endpoint_url,
        )
    elif uri.startswith("file:"):
        from deltarl.buckets.local import LocalBucket

        parsed = urlparse(uri)
        if not uri.startswith("file://"):
            raise ValueError(f"file URI {uri!r} must be absolute: file:///absolute/path")
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URI {uri!r} names a host: use file:///absolute/path")
        path = unquote(parsed.path)
        if not path.startswith("/"):
            raise ValueError(f"file URI {uri!r} must be absolute: file:///absolute/path")
        bucket = LocalBucket(path, create=True if create is None else create)
    elif "://" in uri:
        scheme = uri.split("://", 1)[0]
        raise ValueError(
            f"unknown bucket scheme {scheme!r} in {uri!r}: use a path, file://, hf://buckets/ or s3://"
        )
    else:
        from deltarl.buckets.local import LocalBucket

        bucket = LocalBucket(uri, create=True if create is None else create)
    logger.debug("opened bucket %s", bucket.uri)
    return bucket
