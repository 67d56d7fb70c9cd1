"""Launch a stage's trainer as a child process, stream its output, and never leak it.

The command lines come from ``tasks/launch/commands.py`` (:func:`trainer_command`); the errors a
failed launch raises, the reading of torchrun's error summary and the retry rule, from
``tasks/launch/failures.py`` (:func:`raise_for_result`, :class:`StageFailed`, :class:`BadStageInput`,
:class:`LaunchAborted`, :func:`retry_condition`). Those are re-exported here (``__all__``), so
``from tasks.launch.process import ...`` keeps working for them.

Threads: signals reach only a process's main thread, and the flow runs stage tasks in worker
threads, so an interrupted flow stops their launches through :func:`abort_launches` (each
launch polls its group's abort flag).

Process tree: the child runs in its own session (``start_new_session=True``), so ``os.killpg``
reaches it and what it spawned in its group. ``torchrun`` starts each rank in a session of
its own, out of that group's reach, so the child's environment also carries a launch id
(``POSTTRAIN_LAUNCH_ID``) that every descendant inherits: when the stage ends, however it
ends, every process still carrying it is SIGKILLed (found through ``/proc/<pid>/environ``),
including ranks orphaned by a killed ``torchrun``.

Output: a reader thread moves output lines into a queue; the calling thread polls that queue
with a short timeout, so a deadline, a ``KeyboardInterrupt`` or Prefect's
``TerminationSignal`` (raised from its SIGTERM handler when a flow run is cancelled) is acted
on within ``poll_interval_s`` even while the child prints nothing. On any exception in the
calling thread the whole tree is killed before the exception propagates. ``torchrun --tee 3``
prefixes each rank's line with ``[default<local_rank>]:``; the launcher keeps each rank's last
lines apart, and on failure :func:`raise_for_result` reads torchrun's error summary to name the
failing rank and show its own last lines.

Node entry point: ``python -m tasks.launch.process SPEC_URI --node-rank N`` (:func:`main`) runs one
node's share of a multi-node stage, e.g. in each pod of ``infra/k8s/multinode-trainer.yaml``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import IO, Any, Protocol

from tasks.launch.aborts import abort_event, abort_launches, forget_launch_group
from tasks.launch.commands import trainer_command
from tasks.launch.failures import (
    BadStageInput,
    LaunchAborted,
    LaunchResult,
    StageFailed,
    raise_for_result,
    retry_condition,
)
from trainer_core.config import BackendConfig
from trainer_core.errors import EXIT_BAD_INPUT, ConfigError
from trainer_core.processes import LAUNCH_ID_ENV, kill_marked, marked_pids

__all__ = [
    "LAUNCH_ID_ENV",
    "BadStageInput",
    "LaunchAborted",
    "LaunchResult",
    "LineLogger",
    "Output",
    "StageFailed",
    "abort_launches",
    "forget_launch_group",
    "launch_stage_process",
    "main",
    "marked_pids",
    "node_backend",
    "raise_for_result",
    "retry_condition",
    "trainer_command",
]

_EOF = object()
"""Queue sentinel: the child's output pipe closed."""

_EXIT_DRAIN_S = 2.0
"""After the child exits, wait this long for EOF (a grandchild may still hold the pipe)."""

WATCH_PID_ENV = "POSTTRAIN_WATCH_PID"
"""Environment variable naming the launching process: trainers (ranks under torchrun included,
whose own parent is the launcher agent) exit when it is gone (``trainer_core/run.py``)."""

_KILL_SWEEP_S = 3.0
"""How long the final sweep keeps SIGKILLing marked processes before giving up on them."""

_LAUNCHER_LINES = 400
"""Lines kept that no rank printed: the launcher's own output, where its error summary is."""

_RANK_LINE = re.compile(r"^\[default(\d+)\]:(.*)$")
"""A line torchrun ``--tee`` copied from a worker (role ``default``): local rank, text."""


class LineLogger(Protocol):
    """Anything with ``info(msg, *args)``: a ``logging.Logger`` or a Prefect run logger."""

    def info(self, msg: str, *args: Any) -> Any: ...


# --------------------------------------------------------------------------- process tree


def _pump(stream: IO[str], lines: queue.Queue) -> None:
    try:
        for line in stream:
            lines.put(line.rstrip("\r\n"))
    except (OSError, ValueError):  # pipe broken while the group was killed
        pass
    finally:
        # Closed here, not by the caller: closing a pipe another thread is blocked reading
        # waits for that read, i.e. for whatever process still holds the write end.
        stream.close()
        lines.put(_EOF)


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _kill_tree(proc: subprocess.Popen, launch_id: str) -> list[int]:
    """SIGKILL the child's group, then every process carrying ``launch_id``, and wait until they
    are dead (:func:`trainer_core.processes.kill_marked`).

    Returns:
        The pids still running after ``_KILL_SWEEP_S`` (e.g. stuck in uninterruptible sleep).
    """
    _signal_group(proc.pid, signal.SIGKILL)
    return kill_marked(launch_id, _KILL_SWEEP_S)


def _terminate_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the group (launchers forward it to their ranks), give the leader ``grace_s`` to
    exit, then SIGKILL the group (the rest of the tree is swept by :func:`_kill_tree`)."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)


class Output:
    """Where each output line goes: the merged tail, its rank's tail, or the launcher's lines;
    then the log and the ``on_line`` callback (whose errors are logged once and never raised)."""

    def __init__(self, log: LineLogger, tail_lines: int, on_line: Callable[[str], None] | None = None) -> None:
        self.log = log
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.rank_tails: dict[int, deque[str]] = {}
        self.launcher_lines: deque[str] = deque(maxlen=max(tail_lines, _LAUNCHER_LINES))
        self._tail_lines = tail_lines
        self._on_line = on_line
        self._on_line_failed = False

    def add(self, line: str) -> None:
        self.tail.append(line)
        if m := _RANK_LINE.match(line):
            rank = int(m.group(1))
            self.rank_tails.setdefault(rank, deque(maxlen=self._tail_lines)).append(m.group(2))
        else:
            self.launcher_lines.append(line)
        self.log.info("%s", line)
        try:
            if self._on_line is not None:
                self._on_line(line)
        except Exception as e:  # noqa: BLE001 - a line consumer never stops the stage
            if not self._on_line_failed:
                self._on_line_failed = True
                warn = getattr(self.log, "warning", self.log.info)
                warn("on_line callback failed (later failures not logged): %s: %s", type(e).__name__, e)


def _forward(
    proc: subprocess.Popen,
    lines: queue.Queue,
    out: Output,
    deadline: float | None,
    poll_interval_s: float,
    abort: threading.Event | None = None,
) -> bool:
    """Forward lines until EOF (or the child exited and EOF did not follow); True on timeout.

    Raises:
        LaunchAborted: ``abort`` was set.
    """
    exited_at: float | None = None
    while True:
        if abort is not None and abort.is_set():
            raise LaunchAborted("the stage's flow run was interrupted; its processes are killed")
        try:
            item = lines.get(timeout=poll_interval_s)
        except queue.Empty:
            item = None
        if item is _EOF:
            return False
        if item is not None:
            out.add(item)
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return True
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and item is None and now - exited_at > _EXIT_DRAIN_S:
            return False


def _drain(lines: queue.Queue, out: Output) -> None:
    while True:
        try:
            item = lines.get_nowait()
        except queue.Empty:
            return
        if item is not _EOF:
            out.add(item)


def _spawn(
    cmd: list[str], env: dict[str, str] | None, launch_id: str
) -> tuple[subprocess.Popen, queue.Queue, threading.Thread]:
    """Start ``cmd`` in a session of its own, tagged with ``launch_id``; a thread pumps its output lines."""
    env = dict(os.environ if env is None else env)
    env[LAUNCH_ID_ENV] = ":".join(filter(None, [env.get(LAUNCH_ID_ENV), launch_id]))
    env[WATCH_PID_ENV] = str(os.getpid())  # every rank exits when this process is gone
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
        text=True,
        errors="replace",
        bufsize=1,
    )
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_pump, args=(proc.stdout, lines), name=f"pump-{proc.pid}", daemon=True)
    reader.start()
    return proc, lines, reader


def launch_stage_process(
    cmd: list[str],
    *,
    env: dict[str, str] | None,
    log: LineLogger,
    timeout_s: float | None,
    poll_interval_s: float = 0.2,
    tail_lines: int = 50,
    kill_grace_s: float = 10.0,
    group: str | None = None,
    on_line: Callable[[str], None] | None = None,
) -> LaunchResult:
    """Run ``cmd`` in its own process group, stream its output to ``log``, and reap it.

    Whatever way it ends, no process it started (ranks in their own sessions included)
    outlives this call: see the module docstring.

    Args:
        cmd: The command line.
        env: The child's environment (None: inherit); this launch's id is added to
            ``POSTTRAIN_LAUNCH_ID``.
        log: Receives every output line through ``log.info``.
        timeout_s: Wall-clock limit; past it the group gets SIGTERM, then everything left
            SIGKILL after ``kill_grace_s``. None: no limit.
        poll_interval_s: Longest time the calling thread blocks before checking the deadline.
        tail_lines: How many last lines to keep in the result (merged, and per rank).
        kill_grace_s: Seconds between SIGTERM and SIGKILL on timeout.
        group: Abort group (see :func:`abort_launches`); None: none.
        on_line: Called with every output line after ``log`` (e.g. a progress tracker); an
            exception from it is logged once and otherwise ignored.

    Returns:
        The exit status, output tails, wall time and whether the deadline killed it.

    Raises:
        BaseException: whatever interrupted the calling thread (``KeyboardInterrupt``,
            Prefect's ``TerminationSignal``, an exception from ``log``, :class:`LaunchAborted`)
            after the whole process tree was killed with SIGKILL and the child reaped.
    """
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    abort = abort_event(group) if group is not None else None
    if abort is not None and abort.is_set():
        raise LaunchAborted("the stage's flow run was interrupted before its trainer started; nothing launched")
    launch_id = uuid.uuid4().hex
    proc, lines, reader = _spawn(cmd, env, launch_id)
    out = Output(log, tail_lines, on_line)
    timed_out = False
    try:
        timed_out = _forward(proc, lines, out, deadline, poll_interval_s, abort)
        if timed_out:
            _terminate_group(proc, kill_grace_s)
    except BaseException:
        _signal_group(proc.pid, signal.SIGKILL)  # the rest is swept in `finally`, then re-raised
        raise
    finally:
        returncode = proc.wait()
        # Stray processes (a grandchild holding the pipe, ranks in their own sessions) must not
        # outlive the stage.
        survivors = _kill_tree(proc, launch_id)
        reader.join(timeout=1.0)
    _drain(lines, out)
    if survivors:
        log.info("processes %s of the stage survived SIGKILL (uninterruptible?)", survivors)
    return LaunchResult(
        returncode=returncode,
        tail=list(out.tail),
        wall_s=time.monotonic() - start,
        timed_out=timed_out,
        rank_tails={rank: list(t) for rank, t in sorted(out.rank_tails.items())},
        launcher_lines=list(out.launcher_lines),
    )


# --------------------------------------------------------------------------- one node of a job


def node_backend(
    backend: BackendConfig,
    node_rank: int,
    *,
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    rdzv_endpoint: str | None = None,
) -> BackendConfig:
    """``backend`` on the node ``node_rank``, checked against the job that runs it.

    Args:
        backend: The stage's backend from its spec.
        node_rank: This node's rank (a Kubernetes Indexed Job: the pod's completion index).
        nnodes: The job's node count, if known (must equal ``backend.nnodes``).
        nproc_per_node: The processes (GPUs) per node the job requests, if known.
        rdzv_endpoint: The rendezvous endpoint the job serves, if known.

    Returns:
        The backend with ``node_rank`` set.

    Raises:
        ConfigError: the job and the spec disagree, or ``node_rank`` is out of range.
    """
    job = {"nnodes": nnodes, "nproc_per_node": nproc_per_node, "rdzv_endpoint": rdzv_endpoint}
    for key, value in job.items():
        if value is not None and value != getattr(backend, key):
            raise ConfigError(f"the job has {key}={value} but the stage spec has backend.{key}={getattr(backend, key)}")
    try:
        return BackendConfig.model_validate({**backend.model_dump(), "node_rank": node_rank})
    except ValueError as e:
        raise ConfigError(f"--node-rank {node_rank}: {e}") from None


class _PrintLog:
    def info(self, msg: str, *args: Any) -> None:
        print(msg % args if args else msg, flush=True)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # in launch_stage_process: kill the tree, then exit


def main(argv: list[str] | None = None) -> int:
    """``python -m tasks.launch.process SPEC_URI --node-rank N``: run one node's share of a stage.

    What each pod of ``infra/k8s/multinode-trainer.yaml`` runs: the command
    :func:`trainer_command` builds from the spec's backend for its stage, on this node, under
    :func:`launch_stage_process`. A failure is printed with the failing rank's last lines.

    Args:
        argv: Command-line arguments (default ``sys.argv[1:]``); ``--help`` lists them.

    Returns:
        0 on success; ``EXIT_BAD_INPUT`` (2) for a missing or bad spec, a spec that disagrees
        with the job, or a rank that exited with 2; 1 for any other failure (storage errors
        included).
    """
    parser = argparse.ArgumentParser(
        prog="python -m tasks.launch.process", description="Run one node's share of a stage."
    )
    parser.add_argument("spec_uri", help="URI of the stage's StageSpec JSON.")
    parser.add_argument("--node-rank", type=int, required=True, help="This node's rank in [0, nnodes).")
    parser.add_argument("--nnodes", type=int, help="The job's node count (checked against the spec).")
    parser.add_argument("--nproc-per-node", type=int, help="The job's processes per node (checked).")
    parser.add_argument("--rdzv-endpoint", help="The job's rendezvous host:port (checked).")
    parser.add_argument("--dry-run", action="store_true", help="Print the command instead of running it.")
    args = parser.parse_args(argv)
    try:
        import fsspec

        from trainer_core.spec import StageSpec

        with fsspec.open(args.spec_uri, "r") as f:
            spec = StageSpec.model_validate(json.load(f))
        backend = node_backend(
            spec.config.backend_for(spec.stage),
            args.node_rank,
            nnodes=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            rdzv_endpoint=args.rdzv_endpoint,
        )
        cmd = trainer_command(args.spec_uri, backend, f"{spec.run_id}-{spec.stage}")
    except (FileNotFoundError, ValueError) as e:  # ConfigError and pydantic's ValidationError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # storage unreachable: a retry may fix it
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    result = launch_stage_process(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, log=_PrintLog(), timeout_s=None)
    try:
        raise_for_result(result, spec.stage)
    except StageFailed as e:
        print(e, file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT if isinstance(e, BadStageInput) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
