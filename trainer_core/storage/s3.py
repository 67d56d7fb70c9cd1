"""The process's S3 settings: :func:`configure` sets them from the config (anything shaped like
:class:`S3Settings`, e.g. the pipeline's ``StorageConfig``), falling back to the standard AWS
environment variables that botocore reads itself (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``) and to ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``; :func:`process_env` hands them to another process. Secrets are never logged.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Protocol

import fsspec
import fsspec.config

from trainer_core.storage.retry import quiet_abandoned_requests

logger = logging.getLogger(__name__)


class S3Settings(Protocol):
    """What :func:`configure` reads (``trainer_core.config.StorageConfig`` has these fields).

    The storage floor imports nothing of the config: any object with these attributes works.
    """

    endpoint_url: str | None
    region: str | None
    access_key_id: Any  # a pydantic SecretStr or None
    secret_access_key: Any


def configure(storage: S3Settings) -> None:
    """Set the process-wide S3 defaults used by every ``s3://`` URI (``fsspec.config.conf``).

    Fields left ``None`` fall back to the environment: ``AWS_ENDPOINT_URL`` for the endpoint;
    botocore itself reads ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and
    ``AWS_DEFAULT_REGION``. Cached S3 filesystem instances are dropped so the settings apply
    to the next call. Secrets are passed to s3fs only, never logged. asyncio's report of a request
    abandoned when an endpoint went away becomes one line (:func:`quiet_abandoned_requests`).

    Args:
        storage: the pipeline's storage settings (``StorageConfig``); the two keys are
            ``SecretStr`` values or None.
    """
    s3_conf: dict[str, Any] = {
        k: v for k, v in fsspec.config.conf.get("s3", {}).items() if k not in ("endpoint_url", "key", "secret")
    }
    client_kwargs = dict(s3_conf.pop("client_kwargs", {}) or {})
    client_kwargs.pop("endpoint_url", None)
    client_kwargs.pop("region_name", None)
    endpoint = storage.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        s3_conf["endpoint_url"] = endpoint
    region = storage.region or os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
    if region:
        client_kwargs["region_name"] = region
    if client_kwargs:
        s3_conf["client_kwargs"] = client_kwargs
    if storage.access_key_id is not None:
        s3_conf["key"] = storage.access_key_id.get_secret_value()
    if storage.secret_access_key is not None:
        s3_conf["secret"] = storage.secret_access_key.get_secret_value()
    fsspec.config.conf["s3"] = s3_conf
    quiet_abandoned_requests()
    s3fs = sys.modules.get("s3fs")  # cached instances exist only where s3fs is imported already
    if s3fs is not None:
        s3fs.S3FileSystem.clear_instance_cache()
    logger.debug("S3 configured: endpoint=%s region=%s", endpoint or "<aws default>", region or "<default>")


def process_env(storage: S3Settings) -> dict[str, str]:
    """The environment variables that give another process these S3 settings before it has read
    any config: ``AWS_ENDPOINT_URL_S3``, ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` and
    ``AWS_SECRET_ACCESS_KEY``, for the fields that are set (botocore reads them; :func:`configure`
    reads the first two).

    A trainer reads its stage spec from the storage root before it knows the config in it, so an
    ``s3://`` root on a custom endpoint (MinIO, Ceph) needs the endpoint in the trainer's
    environment, not only in the config. ``AWS_ENDPOINT_URL_S3`` applies to S3 alone (not to
    other AWS clients of the process, as ``AWS_ENDPOINT_URL`` would).

    Args:
        storage: the pipeline's storage settings (``StorageConfig``).

    Returns:
        ``{variable: value}``; secrets in clear: for a child process's environment or a
        Kubernetes Secret, never for a log or a file on storage.
    """
    env = {}
    if storage.endpoint_url:
        env["AWS_ENDPOINT_URL_S3"] = storage.endpoint_url
    if storage.region:
        env["AWS_DEFAULT_REGION"] = storage.region
    if storage.access_key_id is not None:
        env["AWS_ACCESS_KEY_ID"] = storage.access_key_id.get_secret_value()
    if storage.secret_access_key is not None:
        env["AWS_SECRET_ACCESS_KEY"] = storage.secret_access_key.get_secret_value()
    return env
