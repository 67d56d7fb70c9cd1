"""Why a launched stage failed: the errors it raises, and torchrun's failure summary.

:func:`raise_for_result` turns a finished launch (:class:`LaunchResult`, what ``tasks/launch/process.py``
returns) into :class:`StageFailed`
(a retry may fix it) or :class:`BadStageInput` (never retried); :func:`retry_condition` is the
Prefect retry rule that tells them apart. For a torchrun launch it reads
torchrun's error summary (:func:`parse_torchrun_failures`), picks the rank to blame
(:func:`blamed_failure`, which uses each rank's last lines to tell a cause from a consequence)
and shows that rank's own last lines rather than the interleaved tail.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainer_core.errors import EXIT_BAD_INPUT, EXIT_RESOURCE

if TYPE_CHECKING:
    from datetime import datetime


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
        started_at: When the failed trainer started, UTC (set by the stage task that launched
            it, for the run's summary; None until then).
        ended_at: When it ended, UTC (likewise).
    """

    def __init__(self, message: str, returncode: int, tail: list[str] | None = None, rank: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.tail = list(tail or [])
        self.rank = rank
        self.started_at: datetime | None = None
        self.ended_at: datetime | None = None


class BadStageInput(StageFailed):
    """The trainer exited with ``EXIT_BAD_INPUT``: bad config, data, model source, credentials,
    permissions, or a diverged run; never retried."""


class StageResourceError(StageFailed):
    """The trainer exited with ``EXIT_RESOURCE``: disk full or out of memory. Not retried: the
    same attempt would fail the same way; the message says what to change."""


_ERROR_LINE = re.compile(r"^(?:\[\w+\]:)?error: (.*)$")
"""The line ``python -m trainer_core.run`` prints for a taxonomy error (after torchrun's rank prefix)."""


def trainer_error(lines: list[str]) -> str | None:
    """The trainer's own error message in ``lines`` (from its last ``error: ...`` line to the end), or None."""
    for i in range(len(lines) - 1, -1, -1):
        if m := _ERROR_LINE.match(lines[i]):
            rest = [re.sub(r"^\[\w+\]:", "", line) for line in lines[i + 1 :]]
            return "\n".join([m[1], *rest]).strip()
    return None


def _lead(stage: str, headline: str | None, message: str) -> str:
    """``message`` led by the trainer's own error (prefixed with the stage unless it names it)."""
    if not headline:
        return message
    named = headline if headline.startswith(f"stage {stage}") else f"stage {stage!r}: {headline}"
    return f"{named}\n\n{message}"


def _stage_error(code: int) -> type[StageFailed]:
    return {EXIT_BAD_INPUT: BadStageInput, EXIT_RESOURCE: StageResourceError}.get(code, StageFailed)


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

    The trainer's own message (its ``error: ...`` line, see :func:`trainer_error`) leads the
    exception's message when there is one; the launch details and last lines follow.

    Raises:
        BadStageInput: the trainer (or, under torchrun, one of its ranks) exited with
            ``EXIT_BAD_INPUT`` (bad input).
        StageResourceError: it exited with ``EXIT_RESOURCE`` (disk full, out of memory).
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
        message = _lead(stage, trainer_error(rank_tail), message)
        raise _stage_error(failure.exitcode)(message, failure.exitcode, result.tail, rank=failure.rank)
    tail = "\n".join(result.tail[-20:])
    if result.timed_out:
        what = f"timed out after {result.wall_s:.0f} s and was killed"
    else:
        what = _exit_words(result.returncode)
    message = f"stage {stage!r} trainer {what}; last output:\n{tail}"
    message = _lead(stage, None if result.timed_out else trainer_error(result.tail), message)
    error = StageFailed if result.timed_out else _stage_error(result.returncode)
    raise error(message, result.returncode, result.tail)


class LaunchAborted(Exception):
    """The launch's group was aborted (:func:`abort_launches`): its flow was interrupted."""


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
    """Prefect ``retry_condition_fn``: retry any failure except :class:`BadStageInput`,
    :class:`StageResourceError` and :class:`LaunchAborted` (the flow run itself was interrupted).

    Prefect 3.8 calls it as ``retry_condition(task, task_run, state)`` with a ``Failed`` state
    whose data is the raised exception; it must be a plain function (``inspect.isfunction``).

    Args:
        task: The Prefect task.
        task_run: The failing task run.
        state: The ``Failed`` state.

    Returns:
        False when the failure was bad input or an exhausted resource (a retry cannot fix them)
        or an abort, else True.
    """
    return not isinstance(_failure_exception(state), (BadStageInput, StageResourceError, LaunchAborted))
