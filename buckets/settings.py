"""Deployment settings of the bucket backends (environment variables, never a config file).

Secrets (``hf_token``, ``s3_secret_access_key``) are ``SecretStr``: they print as ``**********``
and are never logged. S3 credentials may also come from boto3's standard chain
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, instance
roles); the ``DELTARL_S3_*`` variables only override it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import SettingsConfigDict

from deltarl.services.common.settings import ServiceSettings


class BucketSettings(ServiceSettings):
    """Where weights are published and how to reach it.

    Fields with several environment names (``hf_token``: ``DELTARL_HF_TOKEN`` then ``HF_TOKEN``)
    take the first one set; keyword arguments by field name override the environment.
    """

    model_config = SettingsConfigDict(**ServiceSettings.model_config, validate_by_name=True)

    bucket_uri: str = Field(
        default=".deltarl/bucket",
        description="Where versions are published: a directory (plain path or file:///abs/dir, "
        "the default), hf://buckets/<ns>/<name>/<prefix> or s3://<bucket>/<prefix>.",
    )
    hf_token: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("DELTARL_HF_TOKEN", "HF_TOKEN"),
        description="Hugging Face token for hf:// buckets (also read from HF_TOKEN); unset: the "
        "locally saved login.",
    )
    hf_endpoint: str | None = Field(
        default=None,
        validation_alias=AliasChoices("DELTARL_HF_ENDPOINT", "HF_ENDPOINT"),
        description="Hub endpoint URL for hf:// buckets; unset: https://huggingface.co.",
    )
    hf_dry_run: bool = Field(
        default=False,
        description="hf:// only: send nothing, keep objects in memory and log every call that "
        "would have been made.",
    )
    hf_create_bucket: bool = Field(
        default=False, description="hf:// only: create the bucket (private) if it does not exist."
    )
    s3_endpoint_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices(
            "DELTARL_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"
        ),
        description="s3:// only: endpoint of an S3-compatible store (MinIO, R2, ...); unset: AWS.",
    )
    s3_region: str | None = Field(
        default=None,
        validation_alias=AliasChoices("DELTARL_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION"),
        description="s3:// only: region name; unset: boto3's default.",
    )
    s3_access_key_id: str | None = Field(
        default=None, description="s3:// only: access key id; unset: boto3's credential chain."
    )
    s3_secret_access_key: SecretStr | None = Field(
        default=None, description="s3:// only: secret access key; unset: boto3's credential chain."
    )
    s3_addressing_style: Literal["auto", "path", "virtual"] | None = Field(
        default=None,
        description="s3:// only: URL style; unset: 'path' with a custom endpoint, else 'auto'.",
    )
