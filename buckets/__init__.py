"""Object-store buckets behind one interface (torch-free).

``open_bucket(uri)`` picks the backend by URI (a directory, ``file://``, ``hf://buckets/...``,
``s3://...``); every backend implements :class:`Bucket` and validates keys with
:func:`validate_key`, so no key can escape the bucket. See docs/buckets.md.
"""

from deltarl.buckets.base import (
    Bucket,
    BucketError,
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    validate_key,
    validate_prefix,
)
from deltarl.buckets.factory import open_bucket
from deltarl.buckets.settings import BucketSettings

__all__ = [
    "Bucket",
    "BucketError",
    "BucketSettings",
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectNotFoundError",
    "open_bucket",
    "validate_key",
    "validate_prefix",
]
