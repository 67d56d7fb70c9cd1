"""E2E fixtures, session-scoped and opt-in (each takes ~15 s to start on a small machine):

* ``prefect_api``: an in-process Prefect test server (``prefect_test_harness``), for tests that
  run flows in the test process;
* ``stack``: a real ``prefect server start`` (with its UIs) and ``mlflow server`` on loopback, in
  their own processes (``tests/e2e/stack.py``), for tests of deployments, workers and the UI.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prefect.testing.utilities import prefect_test_harness

from tests.e2e.stack import server_stack


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """A real Prefect API (temporary database) for the session; yields its URL."""
    from prefect.settings import PREFECT_API_URL

    with prefect_test_harness(server_startup_timeout=60):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Iterator[dict]:
    """One Prefect server and one MLflow server for the session (see ``server_stack``)."""
    with server_stack(tmp_path_factory.mktemp("stack")) as servers:
        yield servers
