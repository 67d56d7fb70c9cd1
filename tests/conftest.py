"""Shared fixtures: a real S3 endpoint (moto's server on loopback) and storage roots on it; the
``integration`` and ``e2e`` markers, set by folder (``-m 'not e2e'``, ``-m integration``); the
groups ``make test``'s pytest-xdist workers take whole (``-n 2 --dist loadscope``)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from trainer_core.config import StorageConfig

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under ``pytest -n N`` the workers share the machine's cores: one compute thread a process (the
    # stage processes inherit it), so N workers' trainers do not oversubscribe them.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

FOLDER_MARKERS = ("integration", "e2e")
"""Test folders whose name is also a marker every test in them carries."""


SHARED_GROUPS = {
    # the session's finished demo run (tests/e2e/conftest.py: demo_run): its readers and the test
    # that resumes it after them
    "tests/e2e/test_demo_cli.py::test_demo_config_through_the_cli": "demo_run",
    "tests/e2e/test_demo_cli.py::test_the_task_log_is_stage_output": "demo_run",
    "tests/e2e/test_model_lifecycle.py": "demo_run",
    # the session's Prefect and MLflow servers (tests/e2e/conftest.py: stack)
    "tests/e2e/test_deployment.py": "stack",
    "tests/e2e/test_k8s_stage.py": "stack",
    "tests/e2e/test_ui_form.py": "stack",
}
"""Tests that share a session fixture, by node id or module: under xdist each group runs on one
worker, so the fixture is built once."""

SPLIT_MODULES = ("tests/e2e/test_demo_cli.py",)
"""Modules without module-scoped fixtures whose tests are long (whole pipelines): under xdist each
test is a group of its own, so they run side by side."""


def xdist_group(nodeid: str) -> str:
    """The group a test runs in under ``pytest -n N --dist loadscope``: its shared fixture's
    (:data:`SHARED_GROUPS`), its own node id (:data:`SPLIT_MODULES`), else its module, so
    module-scoped fixtures are built once."""
    module = nodeid.split("::", 1)[0]
    for key in (nodeid, module):
        if key in SHARED_GROUPS:
            return SHARED_GROUPS[key]
    return nodeid if module in SPLIT_MODULES else module


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist (the dev extra) not installed: the suite runs in one process
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class GroupScheduling(LoadScopeScheduling):
        """xdist's ``--dist loadscope`` with :func:`xdist_group` as the scope: a group's tests run on
        one worker, in order; groups are handed out in collection order (the long e2e runs first)."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadScopeScheduling | None:
        """``--dist loadscope`` schedules :class:`GroupScheduling`; other modes are xdist's own."""
        if config.getvalue("dist") != "loadscope":
            return None
        config.option.loadscopereorder = False  # collection order, not the most tests first
        return GroupScheduling(config, log)


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
