"""The suite's xdist groups (``tests/conftest.py``): every test that reads a session fixture built
by a whole pipeline or by servers runs in that fixture's one group, so ``make test``'s workers
build it once (a reader left in a group of its own made the second worker run the demo again,
126 s)."""

from __future__ import annotations

import pytest

from tests.conftest import xdist_group

SHARED_FIXTURES = ("demo_run", "stack")
"""Session fixtures too costly to build twice (``tests/e2e/conftest.py``)."""


@pytest.mark.parametrize("fixture", SHARED_FIXTURES)
def test_readers_of_a_shared_fixture_share_one_group(request, fixture):
    readers = [item.nodeid for item in request.session.items if fixture in getattr(item, "fixturenames", ())]
    groups = {xdist_group(nodeid) for nodeid in readers}
    assert len(groups) <= 1, {nodeid: xdist_group(nodeid) for nodeid in readers}
