"""The entry points' garbage-collector settings (``trainer_core/processes.py``): paused while they
import, skipped over what is alive at exit."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from tests.tiny import REPO
from trainer_core.processes import gc_paused

PROBE = "import atexit, gc; atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0)); "
"""Registered first, so it runs last of the exit handlers: what the final collection would see."""


def test_gc_paused_restores_the_collector_even_on_an_error():
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("an import failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()


@pytest.mark.parametrize("skip", [True, False])
def test_skip_exit_collection_freezes_what_is_alive_after_the_other_exit_handlers(skip):
    call = "from trainer_core.processes import skip_exit_collection; skip_exit_collection(); " if skip else ""
    code = PROBE + call + "atexit.register(print, 'a later handler ran'); print('done')"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.splitlines() == ["done", "a later handler ran", f"frozen at exit: {skip}"]
