"""E2E fixtures: one Prefect test server (``prefect_test_harness``) for the whole session.

Starting the harness takes ~15 s on a small machine, so it is session-scoped and opt-in:
tests that run flows request ``prefect_api``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """A real Prefect API (temporary database) for the session; yields its URL."""
    from prefect.settings import PREFECT_API_URL

    with prefect_test_harness(server_startup_timeout=60):
        yield PREFECT_API_URL.value()
