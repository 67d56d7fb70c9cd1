"""Processes of one launch, found and stopped by the launch id they carry (Linux ``/proc``).

Every process a stage task launches carries ``POSTTRAIN_LAUNCH_ID`` in its environment, and its
descendants inherit it: torchrun's ranks too, which run in sessions of their own, out of reach
of a process-group kill. The launcher (``tasks/launch/process.py``) sweeps a launch's processes when the
launch ends; a stage's writer lease (``trainer_core/checkpoint/lease.py``) stops a previous
attempt's processes before a retry takes the stage over. The variable holds the ids of nested
launches joined by ``:``, innermost last.

Every entry point (a stage's trainer, the CLI) also tunes its own interpreter's cyclic garbage
collector: paused while it imports its libraries (:func:`gc_paused`), and skipped over what is
still alive when it exits (:func:`skip_exit_collection`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import time
from collections.abc import Iterator

LAUNCH_ID_ENV = "POSTTRAIN_LAUNCH_ID"
"""Environment variable marking every process of one launch (see the module docstring)."""


def current_launch_id() -> str | None:
    """The innermost launch id of this process (the last of ``POSTTRAIN_LAUNCH_ID``), or None
    when it was not started by a launcher."""
    ids = [i for i in os.environ.get(LAUNCH_ID_ENV, "").split(":") if i]
    return ids[-1] if ids else None


def marked_pids(launch_id: str) -> list[int]:
    """Live processes whose environment holds ``POSTTRAIN_LAUNCH_ID=<launch_id>`` (Linux ``/proc``).

    Args:
        launch_id: The id given to one launch.

    The variable holds the ids of nested launches joined by ``:`` (a launch inside a launched
    process keeps its parent's ids), so an outer launch's sweep reaches inner ones too.

    Returns:
        Their pids, this process excluded; empty where ``/proc`` is missing. Zombies (empty
        environment) and other users' processes (unreadable) are not listed.
    """
    prefix, wanted = f"{LAUNCH_ID_ENV}=".encode(), launch_id.encode()
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    pids = []
    for name in names:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone, or not ours
            continue
        for entry in environ.split(b"\0"):
            if entry.startswith(prefix) and wanted in entry[len(prefix) :].split(b":"):
                pids.append(int(name))
                break
    return pids


def process_running(pid: int) -> bool:
    """False once ``pid`` is gone or a zombie (dead, waiting for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field 22):
    with the pid, the identity of a process (a pid is reused, a pid and start time are not).
    None when it is gone or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_alive(pid: int, started: int | None = None) -> bool:
    """Whether process ``pid`` runs: it exists (signal 0; another user's counts), is not a zombie
    (killed and not yet reaped by its parent: signal 0 still reaches it) and, when ``started`` is
    given, is the process that started then (:func:`process_start`), not a later one given the pid.

    Args:
        pid: The process.
        started: Its start time as :func:`process_start` read it earlier; None: not checked.

    Returns:
        False once it is gone or a zombie; where there is no ``/proc``, signal 0 alone decides.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    if not os.path.isdir("/proc"):
        return True
    return process_running(pid) and (started is None or process_start(pid) == started)


def kill_marked(launch_id: str, timeout_s: float = 3.0, also: set[int] | None = None) -> list[int]:
    """SIGKILL every process carrying ``launch_id`` (and the pids in ``also``) until none runs.

    Sweeps again each round (a process may fork while being swept) and waits until each one
    killed is gone or a zombie (a killed process drops its environment before it is a zombie).

    Args:
        launch_id: the launch whose processes are stopped.
        timeout_s: how long to keep sweeping.
        also: pids killed and waited for as well (e.g. a launch's own child, already signalled).

    Returns:
        The pids still running after ``timeout_s`` (e.g. stuck in uninterruptible sleep).
    """
    deadline = time.monotonic() + timeout_s
    killed: set[int] = set(also or ())
    while True:
        pids = marked_pids(launch_id)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        killed = {pid for pid in killed | set(pids) if process_running(pid)}
        if not killed or time.monotonic() > deadline:
            return sorted(killed)
        time.sleep(0.02)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (on again after it, if it was on).

    For an entry point's imports: torch and transformers allocate hundreds of thousands of
    long-lived objects while they import, and every allocation threshold crossed starts a
    collection that traverses them and frees next to nothing. The collector runs as before once
    the block ends.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def skip_exit_collection() -> None:
    """Make the interpreter's shutdown skip the cyclic collection of everything alive at exit.

    Registers :func:`gc.freeze` with :mod:`atexit`: the handlers run before the interpreter
    finalises its modules, and frozen objects are left out of the collection it runs then (with
    torch and transformers imported, that collection traverses millions of objects). What exit
    does otherwise is unchanged: every other exit handler runs (registered before this one or
    after), standard streams are flushed, reference counts free what is not in a cycle. What is
    given up: finalizers of objects in reference cycles at exit, which Python does not promise
    to run either; nothing of a stage's is committed by one (a manifest is written and closed
    before the stage returns).
    """
    atexit.register(gc.freeze)
