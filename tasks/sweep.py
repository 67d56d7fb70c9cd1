"""Sweeps: a grid of recipes over one pipeline, one pipeline run per point, shared stages run once.

A sweep's points are the combinations of its grid's values (:func:`expand_grid`); each point is
a pipeline run of its own, with its own run id (:func:`point_run_id`: the sweep id and a hash
of the point's values, so that adding a value to the grid leaves the other points' ids, and
their committed stages, as they were).

Which stages the points share is decided before anything runs, by the fingerprints the pipeline
reuses stages by (``trainer_core/fingerprint.py``): :func:`stage_keys` computes every stage's
fingerprint of a point from its config alone, each upstream stage's output identified by the
fingerprint it will record. Two points whose stage has the same key would train the same
model; the first point (in grid order) that has it owns it (:func:`owners`), and the others
adopt its committed output: the stage task waits for the owner's result on the sweep's
:class:`SweepBoard` (the points run as subflows of one process) and copies its ``final/``
into its own run (:func:`adopt`: hard links on a local disk, a server-side copy on object
storage), so each point's run is whole, resumable and released on its own. A stage the owner
failed is failed here too, naming the owner; a stage whose adopted output turns out to carry
another fingerprint is run here instead.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
from typing import Any

from tasks.launch.aborts import abort_event
from tasks.launch.failures import LaunchAborted
from tasks.plan import plan_run
from tasks.results import PipelineRun, StageResult
from tasks.runs import completed_result
from trainer_core import storage
from trainer_core.checkpoint.manifest import MANIFEST_NAME
from trainer_core.config import PipelineConfig, check_grid, load_config
from trainer_core.errors import EXIT_FAILED, ConfigError, PosttrainError
from trainer_core.fingerprint import stage_fingerprint
from trainer_core.storage import RunLayout

log = logging.getLogger(__name__)


def expand_grid(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, the first key varying slowest.

    Example: ``{"dpo.beta": [0.1, 0.5], "grpo.learning_rate": [1e-5, 3e-5]}`` gives 4 points,
    ``{"dpo.beta": 0.1, "grpo.learning_rate": 1e-5}`` first. An empty grid gives one point, ``{}``.
    """
    keys = list(grid)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(grid[k] for k in keys))]


def sweep_grid(config: PipelineConfig, extra: dict[str, Any] | None, where: str = "--grid ") -> dict[str, list[Any]]:
    """The grid a sweep runs: ``config.sweep.grid`` with the ``extra`` axes (``posttrain sweep
    --grid``, the flow's ``grid``) added, a key in both taking ``extra``'s values. ``extra`` is held
    to the rule ``sweep.grid`` is validated by (:func:`~trainer_core.config.check_grid`).

    Raises:
        ConfigError: an ``extra`` axis that ``sweep.grid`` would refuse (no values, a repeated
            value, a key one for every point), named as ``<where><key>``; or no grid at all.
    """
    try:
        check_grid(extra or {}, where)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    grid = {**config.sweep.grid, **(extra or {})}
    if not grid:
        raise ConfigError("sweep: no grid: set sweep.grid in the config or pass --grid key=v1,v2")
    return grid


def point_run_id(sweep_id: str, values: dict[str, Any]) -> str:
    """The run id of the point ``values`` of sweep ``sweep_id``: ``<sweep_id>-<8 hex>``, a hash of
    the values alone (their order in the grid does not matter)."""
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()
    return f"{sweep_id}-{digest[:8]}"


def point_config(base: PipelineConfig, values: dict[str, Any]) -> PipelineConfig:
    """``base`` with a point's values set (and no sweep of its own).

    Raises:
        ConfigError: a grid key that is not a config field, or a value it refuses (naming it).
    """
    data = base.model_dump(mode="json", exclude={"sweep"})
    data["storage"] = base.storage.model_dump()  # the keys travel as they are (model_dump(json) masks them)
    return load_config(base=data, overrides={**values})


def stage_keys(config: PipelineConfig, layout: RunLayout) -> dict[str, str]:
    """Each stage's fingerprint in the run of ``config`` at ``layout``, before any stage runs:
    the run's plan (:func:`~tasks.plan.plan_run`), an upstream stage of the run identified by the
    key computed for it here (the fingerprint its output will carry), a committed or outside
    input as the pipeline identifies it.

    Raises:
        ConfigError: a stage input nothing provides.
    """
    keys: dict[str, str] = {}
    for stage, planned in plan_run(config, layout).items():
        identities = {layout.final(upstream): keys[upstream] for upstream in planned.depends_on}
        keys[stage] = stage_fingerprint(config, stage, planned.inputs, identities)
    return keys


def owners(run_ids: list[str], keys: list[dict[str, str]]) -> list[dict[str, str]]:
    """For each point, the stages another point owns: ``{stage: owner run id}``, the owner being
    the first point (in ``run_ids``' order) whose stage has the same key.

    Args:
        run_ids: the points' run ids, in grid order.
        keys: each point's :func:`stage_keys`, in the same order.
    """
    first: dict[tuple[str, str], str] = {}
    out: list[dict[str, str]] = []
    for run_id, point_keys in zip(run_ids, keys, strict=True):
        shared = {}
        for stage, key in point_keys.items():
            owner = first.setdefault((stage, key), run_id)
            if owner != run_id:
                shared[stage] = owner
        out.append(shared)
    return out


class SharedStageFailed(PosttrainError):
    """The point that owns a shared stage did not complete it (failed, skipped or interrupted)."""

    exit_code = EXIT_FAILED


class SweepFailed(PosttrainError):
    """A point of the sweep did not complete; the sweep released nothing (run it again to resume)."""

    exit_code = EXIT_FAILED


class SweepBoard:
    """Where the points of one sweep, running in one process, hand each other their stages'
    results: an owner :meth:`record` s each result, a point that shares the stage :meth:`wait` s
    for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._results: dict[tuple[str, str], StageResult] = {}
        self._events: dict[tuple[str, str], threading.Event] = {}

    def _event(self, key: tuple[str, str]) -> threading.Event:
        with self._lock:
            return self._events.setdefault(key, threading.Event())

    def record(self, run_id: str, stage: str, result: StageResult) -> None:
        """The result of ``stage`` in the point ``run_id`` (the last one recorded counts)."""
        with self._lock:
            self._results[(run_id, stage)] = result
        self._event((run_id, stage)).set()

    def abandon(self, run_id: str, stages: list[str], error: BaseException) -> None:
        """The point ``run_id`` ended (``error``) before recording ``stages``: each is failed."""
        for stage in stages:
            if (run_id, stage) not in self._results:
                self.record(run_id, stage, StageResult.failed(stage, error))

    def wait(self, run_id: str, stage: str, group: str, poll_s: float = 1.0) -> StageResult:
        """The result of ``stage`` in the point ``run_id``, once recorded.

        Raises:
            LaunchAborted: the launch ``group`` (the sweep's) was aborted meanwhile: the sweep
                was interrupted, the owner's trainers killed.
        """
        event = self._event((run_id, stage))
        while not event.wait(poll_s):
            if abort_event(group).is_set():
                raise LaunchAborted(f"sweep interrupted while waiting for stage {stage} of point {run_id}")
        with self._lock:
            return self._results[(run_id, stage)]


_BOARDS: dict[str, SweepBoard] = {}
_BOARDS_LOCK = threading.Lock()


def sweep_board(sweep_id: str) -> SweepBoard:
    """The board of the sweep ``sweep_id`` in this process (made on first use)."""
    with _BOARDS_LOCK:
        return _BOARDS.setdefault(sweep_id, SweepBoard())


def forget_board(sweep_id: str) -> None:
    """Drop the board of a finished sweep (a later run of the same sweep id starts a fresh one)."""
    with _BOARDS_LOCK:
        _BOARDS.pop(sweep_id, None)


def adopt(run: PipelineRun, stage: str, fingerprint: str, log: Any) -> StageResult | None:
    """The committed output of a stage another point of the sweep owns, copied into this run.

    Waits for the owner's result (:class:`SweepBoard`). Returns this run's ``reused`` result
    once the owner's ``final/`` is copied (its ``manifest.json`` last), or None when the stage
    is not shared, or the owner's output carries another fingerprint (then this run trains it).

    Raises:
        SharedStageFailed: the owner did not complete the stage.
        LaunchAborted: the sweep was interrupted while this point waited.
    """
    owner = run.sweep.shared_from.get(stage) if run.sweep else None
    if owner is None:
        return None
    log.info("stage %s: shared with point %s of sweep %s; waiting for it", stage, owner, run.sweep.sweep_id)
    result = sweep_board(run.sweep.sweep_id).wait(owner, stage, run.launch_group)
    if result.status != "completed" or not result.output_uri:
        raise SharedStageFailed(
            f"stage {stage} is shared with point {owner} of sweep {run.sweep.sweep_id}, where it "
            f"ended {result.status}: {result.error or result.skipped_because or ''}".rstrip(": ")
        )
    if result.fingerprint != fingerprint:
        log.warning(
            "stage %s: point %s's output has fingerprint %s, this run needs %s: running it here",
            stage,
            owner,
            result.fingerprint,
            fingerprint,
        )
        return None
    target = run.layout.final(stage)
    if target != result.output_uri:
        storage.remove(target)  # an older output of this run, made under another fingerprint
        copied = storage.copy_dir(result.output_uri, target, last=MANIFEST_NAME)
        log.info("stage %s: adopted %s from point %s (%d files)", stage, result.output_uri, owner, copied)
    return completed_result(run.layout, stage, fingerprint)
