"""Shared fixtures: a real S3 endpoint (moto's server on loopback) and storage roots on it; the
``integration`` and ``e2e`` markers, set by folder (``-m 'not e2e'``, ``-m integration``)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from trainer_core.config import StorageConfig

FOLDER_MARKERS = ("integration", "e2e")
"""Test folders whose name is also a marker every test in them carries."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test under ``tests/integration`` or ``tests/e2e`` with its folder's marker."""
    for item in items:
        folder = Path(str(item.path)).parent.name
        if folder in FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, folder))


_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server on 127.0.0.1 (one per test session).

    Sets dummy AWS credentials in ``os.environ`` for the session and restores them after.
    """
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in (*_S3_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(_S3_ENV)
    os.environ.pop("AWS_ENDPOINT_URL", None)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_bucket(endpoint_url: str) -> str:
    """Create a fresh bucket on the moto server and point the process's S3 settings at it."""
    from trainer_core import storage

    storage.configure(StorageConfig(endpoint_url=endpoint_url, region="us-east-1"))
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket


@pytest.fixture(params=["local", "s3"])
def storage_root(request: pytest.FixtureRequest, tmp_path) -> str:
    """A fresh, empty storage root URI: a local tmp dir, or ``s3://<fresh bucket>/root`` on moto."""
    if request.param == "local":
        return str(tmp_path / "root")
    bucket = make_bucket(request.getfixturevalue("s3_server"))
    return f"s3://{bucket}/root"
