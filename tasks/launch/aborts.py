"""Abort groups: how an interrupted flow stops the trainers its task threads launched.

Signals reach only a process's main thread, where the flow runs; the stage tasks run in worker
threads, each polling its launch. A launch belongs to a group (the flow run's id); aborting the
group makes each of its launches kill its process tree (``tasks/launch/process.py``), and refuses the
launches that would start afterwards.
"""

from __future__ import annotations

import threading

_ABORTS: dict[str, threading.Event] = {}
_ABORTS_LOCK = threading.Lock()


def abort_event(group: str) -> threading.Event:
    """The abort flag of ``group`` (created unset on first use)."""
    with _ABORTS_LOCK:
        return _ABORTS.setdefault(group, threading.Event())


def abort_launches(group: str) -> None:
    """Stop every launch of ``group`` (e.g. one flow run's stages, running in task threads).

    Each ``tasks.launch.process.launch_stage_process`` of the group notices within its poll interval, kills its whole
    process tree and raises :class:`~tasks.launch.failures.LaunchAborted`. Signals reach only a process's main thread:
    this is how an interrupted flow (Ctrl-C, Prefect's ``TerminationSignal`` on cancel) stops
    the trainers that task threads launched. Launches started in the group afterwards are
    aborted at once, until :func:`forget_launch_group`.
    """
    abort_event(group).set()


def forget_launch_group(group: str) -> None:
    """Drop ``group``'s abort state (when its flow run ends)."""
    with _ABORTS_LOCK:
        _ABORTS.pop(group, None)
