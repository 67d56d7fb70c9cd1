"""Launch a stage's trainer as a child process, stream its output, and never leak it.

Command: :func:`trainer_command` runs one plain process for the ``single`` backend and every
other backend under ``torchrun`` (one process per rank, c10d rendezvous) or the ``deepspeed``
launcher; :func:`launcher_command` builds the same for any Python entry point.

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

Node entry point: ``python -m tasks.launch SPEC_URI --node-rank N`` (:func:`main`) runs one
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
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from trainer_core.config import BackendConfig
from trainer_core.errors import EXIT_BAD_INPUT, ConfigError

_EOF = object()
"""Queue sentinel: the child's output pipe closed."""

_EXIT_DRAIN_S = 2.0
"""After the child exits, wait this long for EOF (a grandchild may still hold the pipe)."""

LAUNCH_ID_ENV = "POSTTRAIN_LAUNCH_ID"
"""Environment variable marking every process of one launch (see the module docstring)."""

_KILL_SWEEP_S = 3.0
"""How long the final sweep keeps SIGKILLing marked processes before giving up on them."""

_LAUNCHER_LINES = 400
"""Lines kept that no rank printed: the launcher's own output, where its error summary is."""

_RANK_LINE = re.compile(r"^\[default(\d+)\]:(.*)$")
"""A line torchrun ``--tee`` copied from a worker (role ``default``): local rank, text."""


class LineLogger(Protocol):
    """Anything with ``info(msg, *args)``: a ``logging.Logger`` or a Prefect run logger."""

    def info(self, msg: str, *args: Any) -> Any: ...


# --------------------------------------------------------------------------- commands


def torchrun_args(backend: BackendConfig, rdzv_id: str) -> list[str]:
    """The ``torchrun`` options (between ``torch.distributed.run`` and the entry point).

    c10d rendezvous at ``backend.rdzv_endpoint``; on one node without one, ``127.0.0.1:0``:
    the rendezvous store binds a free loopback port itself (what ``--standalone`` does), so
    no port is picked here and then raced for. ``torchrun`` ignores ``--node-rank`` for c10d
    (ranks are assigned at the rendezvous), so ``node_rank`` decides which node hosts the
    rendezvous store instead: node 0 (``--rdzv-conf is_host=true``), as the endpoint says.
    ``--max-restarts 0`` leaves retries to the Prefect task; ``--tee 3`` copies both streams
    of every rank to the console prefixed ``[default<local_rank>]:``.

    Args:
        backend: The stage's backend (``nnodes``, ``nproc_per_node``, ``node_rank``,
            ``rdzv_endpoint``).
        rdzv_id: Rendezvous id, the same on every node of the job.

    Returns:
        The options, as strings.
    """
    endpoint = backend.rdzv_endpoint or "127.0.0.1:0"
    is_host = "true" if backend.node_rank == 0 else "false"
    return [
        "--nnodes", str(backend.nnodes),
        "--nproc-per-node", str(backend.nproc_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", rdzv_id,
        "--rdzv-conf", f"is_host={is_host}",
        "--max-restarts", "0",
        "--tee", "3",
    ]  # fmt: skip


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_args(backend: BackendConfig) -> list[str]:
    """The ``deepspeed`` launcher's options for one node (DeepSpeed 0.19 ``launcher/runner.py``).

    ``--hostfile /dev/null`` keeps a stray ``/job/hostfile`` from turning the launch into a
    pdsh/ssh multi-node one; ``--no_local_rank`` keeps ``--local_rank=N`` out of the entry
    point's arguments (ranks read ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` from the environment).

    Args:
        backend: The stage's backend; ``rdzv_endpoint`` (if set) is the master address.

    Returns:
        The options, as strings.

    Raises:
        ValueError: ``backend.nnodes > 1``: the deepspeed launcher reaches other nodes over
            ssh with a hostfile; use ``launcher=torchrun`` (one worker per node) instead.
    """
    if backend.nnodes > 1:
        raise ValueError(
            f"backend.launcher=deepspeed runs on one node (got nnodes={backend.nnodes}); "
            "use backend.launcher=torchrun for multi-node stages"
        )
    if backend.rdzv_endpoint:
        host, _, port = backend.rdzv_endpoint.rpartition(":")
    else:
        host, port = "127.0.0.1", str(free_loopback_port())
    return [
        "--hostfile", "/dev/null",
        "--num_nodes", "1",
        "--num_gpus", str(backend.nproc_per_node),
        "--master_addr", host,
        "--master_port", port,
        "--no_local_rank",
    ]  # fmt: skip


def launcher_command(backend: BackendConfig, rdzv_id: str, entry: list[str]) -> list[str]:
    """The command that runs the Python entry point ``entry`` on ``backend``'s ranks.

    Args:
        backend: The stage's backend: ``single`` runs one plain process; any other runs under
            ``backend.launcher`` (even at world size 1, so the ranks see the same environment).
        rdzv_id: Rendezvous id (torchrun only).
        entry: ``["-m", module, *args]`` or ``[script.py, *args]``.

    Returns:
        The command line.

    Raises:
        ValueError: an empty ``entry``, or a launcher that cannot run ``backend`` (see
            :func:`deepspeed_args`).
    """
    if not entry:
        raise ValueError("empty entry point")
    if backend.name == "single":
        return [sys.executable, *entry]
    if backend.launcher == "deepspeed":
        target = ["--module", *entry[1:]] if entry[0] == "-m" else entry
        return [sys.executable, "-m", "deepspeed.launcher.runner", *deepspeed_args(backend), *target]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(backend, rdzv_id), *entry]


def trainer_command(spec_uri: str, backend: BackendConfig, rdzv_id: str) -> list[str]:
    """The command line that runs one stage described by the spec at ``spec_uri``.

    Args:
        spec_uri: URI of the stage's ``StageSpec`` JSON.
        backend: The stage's effective backend (``PipelineConfig.backend_for(stage)``).
        rdzv_id: Default rendezvous id (e.g. run id and stage); ``backend.rdzv_id`` wins when set.

    Returns:
        ``[python, "-m", "trainer_core.run", spec_uri]`` for the single backend; that entry
        point under ``torch.distributed.run`` or ``deepspeed.launcher.runner`` otherwise.

    Raises:
        ValueError: a launcher that cannot run ``backend`` (deepspeed launcher on several nodes).
    """
    return launcher_command(backend, backend.rdzv_id or rdzv_id, ["-m", "trainer_core.run", spec_uri])


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class LaunchResult:
    """What a finished (or killed) child process left behind.

    Attributes:
        returncode: The exit status; negative ``-N`` when killed by signal ``N``.
        tail: The last output lines (stdout and stderr merged, ranks interleaved), oldest first.
        wall_s: Seconds from start to reaping.
        timed_out: True when the deadline passed and the group was killed.
        rank_tails: Local rank -> its last lines, ``[default<N>]:`` prefix removed (torchrun only).
        launcher_lines: The last lines no rank printed (torchrun's own, with its error summary).
    """

    returncode: int
    tail: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    timed_out: bool = False
    rank_tails: dict[int, list[str]] = field(default_factory=dict)
    launcher_lines: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RankFailure:
    """One failed rank in torchrun's error summary.

    Attributes:
        rank: Global rank.
        local_rank: Rank on its node (the ``[default<local_rank>]:`` prefix).
        exitcode: Its exit status; ``-N`` when killed by signal ``N``.
        host: The node's host name.
        root_cause: True for the failure torchrun observed first.
        traceback: torchrun's ``traceback`` field (the rank's Python traceback when the entry
            point is wrapped in ``torch.distributed.elastic.multiprocessing.errors.record``).
        error_file: The rank's error file, ``<N/A>`` when it wrote none.
    """

    rank: int
    local_rank: int
    exitcode: int
    host: str = ""
    root_cause: bool = False
    traceback: str = ""
    error_file: str = "<N/A>"


class StageFailed(RuntimeError):
    """A trainer process exited non-zero (or was killed on timeout); a retry may fix it.

    Attributes:
        returncode: The child's exit status; for a multi-rank launch whose failing rank is
            known, that rank's exit status (the launcher itself exits 1).
        tail: Its last output lines (ranks interleaved).
        rank: The failing global rank, when known.
    """

    def __init__(
        self, message: str, returncode: int, tail: list[str] | None = None, rank: int | None = None
    ) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.tail = list(tail or [])
        self.rank = rank


class BadStageInput(StageFailed):
    """The trainer exited with ``EXIT_BAD_INPUT``: bad config or data; never retried."""


_FAILURE_FIELD = re.compile(r"^  (time|host|rank|exitcode|error_file|traceback)\s*: ?(.*)$")


def parse_torchrun_failures(lines: list[str]) -> list[RankFailure]:
    """Read the failed ranks from torchrun's error summary (the last one in ``lines``).

    The summary is ``ChildFailedError``'s message (torch 2.13,
    ``torch/distributed/elastic/multiprocessing/errors/__init__.py``): a ``Failures:`` section,
    then ``Root Cause (first observed failure):``, each failure a ``[i]:`` block of
    ``  key : value`` fields whose ``traceback`` may continue on indented lines.

    Args:
        lines: Launcher output lines (e.g. ``LaunchResult.launcher_lines``).

    Returns:
        The failures in summary order (root cause last); empty when there is no summary.
    """
    start = max((i for i, line in enumerate(lines) if line == "Failures:"), default=None)
    if start is None:
        return []
    failures: list[RankFailure] = []
    block: dict[str, str] | None = None
    root = False
    last_key = ""

    def close() -> None:
        if block is not None and "rank" in block and "exitcode" in block:
            failures.append(_failure_from(block, root))

    for line in lines[start + 1 :]:
        if re.fullmatch(r"=+", line):
            break
        if re.fullmatch(r"-+", line) or line.startswith("Root Cause"):
            close()
            block, root = None, root or line.startswith("Root Cause")
        elif re.fullmatch(r"\[\d+\]:", line):
            close()
            block, last_key = {}, ""
        elif block is not None and (m := _FAILURE_FIELD.match(line)):
            last_key = m.group(1)
            block[last_key] = m.group(2)
        elif block is not None and last_key == "traceback":
            block["traceback"] += "\n" + line.removeprefix("  ")
    close()
    return failures


def _failure_from(block: dict[str, str], root: bool) -> RankFailure:
    rank = re.match(r"(-?\d+) \(local_rank: (\d+)\)", block["rank"])
    exitcode = re.match(r"(-?\d+)", block["exitcode"])
    return RankFailure(
        rank=int(rank.group(1)) if rank else -1,
        local_rank=int(rank.group(2)) if rank else -1,
        exitcode=int(exitcode.group(1)) if exitcode else -1,
        host=block.get("host", "").strip(),
        root_cause=root,
        traceback=block.get("traceback", "").rstrip(),
        error_file=block.get("error_file", "<N/A>").strip(),
    )


_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "remote worker", "communicator was aborted")
"""Text of a collective failing because a peer died (gloo's TCP pair errors, NCCL's abort)."""


def _consequence(failure: RankFailure, rank_tail: list[str]) -> bool:
    """A failure caused by another's: stopped by torchrun (SIGTERM) or a peer gone mid-collective."""
    if failure.exitcode == -signal.SIGTERM:
        return True
    last = "\n".join([*rank_tail[-5:], failure.traceback.rsplit("\n", 3)[-1]])
    return any(marker in last for marker in _PEER_LOSS)


def blamed_failure(failures: list[RankFailure], rank_tails: dict[int, list[str]] | None = None) -> RankFailure | None:
    """The failure a stage is failed for.

    In order: a rank that exited ``EXIT_BAD_INPUT``; torchrun's root cause unless it is a
    consequence of another rank's failure (see below); the first failure that is not one;
    torchrun's root cause. torchrun picks the root cause by timestamp in whole seconds, the
    time it noticed an exit or the time in the rank's error file, lowest rank first on a tie:
    a rank that raised "connection reset by peer" after its peer was SIGKILLed can come out
    first (captured in ``tests/integration/fixtures/torchrun_output/rank1_sigkill_misattributed.log``).
    A consequence is a rank torchrun stopped itself (SIGTERM) or whose last lines say a peer
    closed the connection (gloo) or the communicator was aborted (NCCL): a heuristic on text.

    Args:
        failures: From :func:`parse_torchrun_failures`.
        rank_tails: Local rank -> last lines (``LaunchResult.rank_tails``).

    Returns:
        The failure, or None when ``failures`` is empty.
    """
    if not failures:
        return None
    tails = rank_tails or {}
    bad = [f for f in failures if f.exitcode == EXIT_BAD_INPUT]
    causes = [f for f in failures if not _consequence(f, tails.get(f.local_rank, []))]
    roots = [f for f in failures if f.root_cause]
    return (bad or [f for f in causes if f.root_cause] or causes or roots or failures)[0]


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def raise_for_result(result: LaunchResult, stage: str) -> None:
    """Raise unless ``result`` is a clean exit.

    For a torchrun launch that failed, the message names the failing rank (see
    :func:`blamed_failure`) and shows that rank's own last lines, not the interleaved tail.

    Args:
        result: A finished launch.
        stage: The stage name, for the message.

    Raises:
        BadStageInput: the trainer (or, under torchrun, one of its ranks) exited with
            ``EXIT_BAD_INPUT`` (bad config or data).
        StageFailed: any other non-zero exit, or a timeout.
    """
    if result.returncode == 0 and not result.timed_out:
        return
    failures = [] if result.timed_out else parse_torchrun_failures(result.launcher_lines)
    failure = blamed_failure(failures, result.rank_tails)
    if failure is not None:
        rank_tail = result.rank_tails.get(failure.local_rank) or result.tail
        where = f"rank {failure.rank} (local rank {failure.local_rank} on {failure.host or 'this node'})"
        message = (
            f"stage {stage!r} trainer {where} {_exit_words(failure.exitcode)} "
            f"(launcher exit code {result.returncode}); rank {failure.rank}'s last output:\n"
            + "\n".join(rank_tail[-20:])
        )
        if failure.error_file != "<N/A>" and failure.traceback:
            message += f"\nrank {failure.rank}'s traceback:\n{failure.traceback}"
        if others := [f"rank {f.rank} {_exit_words(f.exitcode)}" for f in failures if f is not failure]:
            message += "\nalso failed: " + "; ".join(others)
        error = BadStageInput if failure.exitcode == EXIT_BAD_INPUT else StageFailed
        raise error(message, failure.exitcode, result.tail, rank=failure.rank)
    tail = "\n".join(result.tail[-20:])
    if result.timed_out:
        what = f"timed out after {result.wall_s:.0f} s and was killed"
    else:
        what = _exit_words(result.returncode)
    message = f"stage {stage!r} trainer {what}; last output:\n{tail}"
    if result.returncode == EXIT_BAD_INPUT and not result.timed_out:
        raise BadStageInput(message, result.returncode, result.tail)
    raise StageFailed(message, result.returncode, result.tail)


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


def marked_pids(launch_id: str) -> list[int]:
    """Live processes whose environment holds ``POSTTRAIN_LAUNCH_ID=<launch_id>`` (Linux ``/proc``).

    Args:
        launch_id: The id given to one launch.

    The variable holds the ids of nested launches joined by ``:`` (a launch inside a launched
    process keeps its parent's ids), so an outer launch's sweep reaches inner ones too.

    Returns:
        Their pids; empty where ``/proc`` is missing. Zombies (empty environment) and other
        users' processes (unreadable) are not listed.
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


def _running(pid: int) -> bool:
    """False once ``pid`` is gone or a zombie (dead, waiting for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _kill_tree(proc: subprocess.Popen, launch_id: str) -> list[int]:
    """SIGKILL the child's group, then every process carrying ``launch_id``, and wait until they
    are dead (a killed process drops its environment before it is a zombie).

    Returns:
        The pids still running after ``_KILL_SWEEP_S`` (e.g. stuck in uninterruptible sleep).
    """
    _signal_group(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + _KILL_SWEEP_S
    killed: set[int] = set()
    while True:
        pids = marked_pids(launch_id)  # again each round: a process may fork while being swept
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        killed = {pid for pid in killed | set(pids) if _running(pid)}
        if not killed or time.monotonic() > deadline:
            return sorted(killed)
        time.sleep(0.02)


def _terminate_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the group (launchers forward it to their ranks), give the leader ``grace_s`` to
    exit, then SIGKILL the group (the rest of the tree is swept by :func:`_kill_tree`)."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)


class _Output:
    """Where each output line goes: the merged tail, its rank's tail, or the launcher's lines."""

    def __init__(self, log: LineLogger, tail_lines: int) -> None:
        self.log = log
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.rank_tails: dict[int, deque[str]] = {}
        self.launcher_lines: deque[str] = deque(maxlen=max(tail_lines, _LAUNCHER_LINES))
        self._tail_lines = tail_lines

    def add(self, line: str) -> None:
        self.tail.append(line)
        if m := _RANK_LINE.match(line):
            rank = int(m.group(1))
            self.rank_tails.setdefault(rank, deque(maxlen=self._tail_lines)).append(m.group(2))
        else:
            self.launcher_lines.append(line)
        self.log.info("%s", line)


def _forward(
    proc: subprocess.Popen,
    lines: queue.Queue,
    out: _Output,
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
            out.add(item)
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return True
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and item is None and now - exited_at > _EXIT_DRAIN_S:
            return False


def _drain(lines: queue.Queue, out: _Output) -> None:
    while True:
        try:
            item = lines.get_nowait()
        except queue.Empty:
            return
        if item is not _EOF:
            out.add(item)


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

    Returns:
        The exit status, output tails, wall time and whether the deadline killed it.

    Raises:
        BaseException: whatever interrupted the calling thread (``KeyboardInterrupt``,
            Prefect's ``TerminationSignal``, an exception from ``log``) after the whole
            process tree was killed with SIGKILL and the child reaped.
    """
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    launch_id = uuid.uuid4().hex
    env = dict(os.environ if env is None else env)
    env[LAUNCH_ID_ENV] = ":".join(filter(None, [env.get(LAUNCH_ID_ENV), launch_id]))
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
    out = _Output(log, tail_lines)
    timed_out = False
    try:
        timed_out = _forward(proc, lines, out, deadline, poll_interval_s)
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
    """``python -m tasks.launch SPEC_URI --node-rank N``: run one node's share of a stage.

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
    parser = argparse.ArgumentParser(prog="python -m tasks.launch", description="Run one node's share of a stage.")
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
