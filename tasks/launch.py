"""Launch a stage's trainer as a child process, stream its output, and never leak it.

The child runs in its own session (``start_new_session=True``), so its process group id is its
pid and ``os.killpg`` reaches it and every process it spawned (data-loader workers,
``torchrun`` ranks). A reader thread moves output lines into a queue; the calling thread polls
that queue with a short timeout, so a deadline, a ``KeyboardInterrupt`` or Prefect's
``TerminationSignal`` (raised from its SIGTERM handler when a flow run is cancelled) is
acted on within ``poll_interval_s`` even while the child prints nothing. On any exception in
the calling thread the whole group is killed before the exception propagates.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from trainer_core.config import PipelineConfig
from trainer_core.errors import EXIT_BAD_INPUT

_EOF = object()
"""Queue sentinel: the child's output pipe closed."""

_EXIT_DRAIN_S = 2.0
"""After the child exits, wait this long for EOF (a grandchild may still hold the pipe)."""


class LineLogger(Protocol):
    """Anything with ``info(msg, *args)``: a ``logging.Logger`` or a Prefect run logger."""

    def info(self, msg: str, *args: Any) -> Any: ...


@dataclass(frozen=True)
class LaunchResult:
    """What a finished (or killed) child process left behind.

    Attributes:
        returncode: The exit status; negative ``-N`` when killed by signal ``N``.
        tail: The last output lines (stdout and stderr merged), oldest first.
        wall_s: Seconds from start to reaping.
        timed_out: True when the deadline passed and the group was killed.
    """

    returncode: int
    tail: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    timed_out: bool = False


class StageFailed(RuntimeError):
    """A trainer process exited non-zero (or was killed on timeout); a retry may fix it.

    Attributes:
        returncode: The child's exit status.
        tail: Its last output lines.
    """

    def __init__(self, message: str, returncode: int, tail: list[str] | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.tail = list(tail or [])


class BadStageInput(StageFailed):
    """The trainer exited with ``EXIT_BAD_INPUT``: bad config or data; never retried."""


def trainer_command(spec_uri: str, config: PipelineConfig) -> list[str]:
    """The command line that runs one stage described by the spec at ``spec_uri``.

    Args:
        spec_uri: URI of the stage's ``StageSpec`` JSON.
        config: The pipeline config (its ``backend`` picks the launcher).

    Returns:
        ``[python, "-m", "trainer_core.run", spec_uri]`` for the single backend (one process).

    Raises:
        ValueError: for a backend this launcher does not know.
    """
    if config.backend.name == "single" and config.backend.nproc_per_node == 1:
        return [sys.executable, "-m", "trainer_core.run", spec_uri]
    raise ValueError(f"no launcher for backend {config.backend.name!r} x {config.backend.nproc_per_node}")


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


def _terminate_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the group, give the leader ``grace_s`` to exit, then SIGKILL whatever is left."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)


def _forward(
    proc: subprocess.Popen,
    lines: queue.Queue,
    tail: deque,
    log: LineLogger,
    deadline: float | None,
    poll_interval_s: float,
) -> bool:
    """Forward lines until EOF (or the child exited and EOF did not follow); True on timeout."""
    exited_at: float | None = None
    while True:
        try:
            item = lines.get(timeout=poll_interval_s)
        except queue.Empty:
            item = None
        if item is _EOF:
            return False
        if item is not None:
            tail.append(item)
            log.info("%s", item)
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return True
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and item is None and now - exited_at > _EXIT_DRAIN_S:
            return False


def _drain(lines: queue.Queue, tail: deque, log: LineLogger) -> None:
    while True:
        try:
            item = lines.get_nowait()
        except queue.Empty:
            return
        if item is not _EOF:
            tail.append(item)
            log.info("%s", item)


def launch_stage_process(
    cmd: list[str],
    *,
    env: dict[str, str] | None,
    log: LineLogger,
    timeout_s: float | None,
    poll_interval_s: float = 0.2,
    tail_lines: int = 50,
    kill_grace_s: float = 10.0,
) -> LaunchResult:
    """Run ``cmd`` in its own process group, stream its output to ``log``, and reap it.

    Args:
        cmd: The command line.
        env: The child's environment (None: inherit).
        log: Receives every output line through ``log.info``.
        timeout_s: Wall-clock limit; past it the group gets SIGTERM, then SIGKILL after
            ``kill_grace_s``. None: no limit.
        poll_interval_s: Longest time the calling thread blocks before checking the deadline.
        tail_lines: How many last lines to keep in the result.
        kill_grace_s: Seconds between SIGTERM and SIGKILL on timeout.

    Returns:
        The exit status, output tail, wall time and whether the deadline killed it.

    Raises:
        BaseException: whatever interrupted the calling thread (``KeyboardInterrupt``,
            Prefect's ``TerminationSignal``, an exception from ``log``) after the whole
            process group was killed with SIGKILL and reaped.
    """
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
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
    tail: deque[str] = deque(maxlen=tail_lines)
    timed_out = False
    try:
        timed_out = _forward(proc, lines, tail, log, deadline, poll_interval_s)
        if timed_out:
            _terminate_group(proc, kill_grace_s)
    except BaseException:
        _signal_group(proc.pid, signal.SIGKILL)  # reaped in `finally`, then re-raised
        raise
    finally:
        returncode = proc.wait()
        # Stray members of the group (a grandchild holding the pipe) must not outlive the stage.
        _signal_group(proc.pid, signal.SIGKILL)
        reader.join(timeout=1.0)
    _drain(lines, tail, log)
    return LaunchResult(returncode=returncode, tail=list(tail), wall_s=time.monotonic() - start, timed_out=timed_out)


def raise_for_result(result: LaunchResult, stage: str) -> None:
    """Raise unless ``result`` is a clean exit.

    Args:
        result: A finished launch.
        stage: The stage name, for the message.

    Raises:
        BadStageInput: the trainer exited with ``EXIT_BAD_INPUT`` (bad config or data).
        StageFailed: any other non-zero exit, or a timeout.
    """
    if result.returncode == 0 and not result.timed_out:
        return
    tail = "\n".join(result.tail[-20:])
    if result.timed_out:
        what = f"timed out after {result.wall_s:.0f} s and was killed"
    else:
        what = f"exited with code {result.returncode}"
    message = f"stage {stage!r} trainer {what}; last output:\n{tail}"
    if result.returncode == EXIT_BAD_INPUT and not result.timed_out:
        raise BadStageInput(message, result.returncode, result.tail)
    raise StageFailed(message, result.returncode, result.tail)


def _failure_exception(state: Any) -> BaseException | None:
    try:
        value = state.result(raise_on_failure=False)
    except BaseException:  # noqa: BLE001 - unreadable result: treat as unknown
        value = None
    if isinstance(value, BaseException):
        return value
    data = getattr(state, "data", None)
    return data if isinstance(data, BaseException) else None


def retry_condition(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry any failure except :class:`BadStageInput`.

    Prefect 3.8 calls it as ``retry_condition(task, task_run, state)`` with a ``Failed`` state
    whose data is the raised exception; it must be a plain function (``inspect.isfunction``).

    Args:
        task: The Prefect task.
        task_run: The failing task run.
        state: The ``Failed`` state.

    Returns:
        False when the failure was bad input (a retry cannot fix it), else True.
    """
    return not isinstance(_failure_exception(state), BadStageInput)
