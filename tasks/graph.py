"""The stage graph of one run, run: each stage a Prefect task future, submitted once the stages
it reads from completed (:class:`StageGraphRun`), at most :func:`max_parallel_stages` at once.
The graph itself (each stage's inputs and the stages it waits for) is :mod:`tasks.plan`'s.
"""

from __future__ import annotations

import os
from typing import Any

from prefect.futures import PrefectFuture, as_completed, wait

from tasks.launch.process import LaunchAborted, abort_launches
from tasks.plan import PlannedStage
from tasks.results import PipelineRun, StageResult
from tasks.stages import GPU_CONCURRENCY_ENV, stage_task
from tasks.sweep import sweep_board
from trainer_core.config import PipelineConfig

ABORT_WAIT_S = 60.0
"""After an interrupt, how long the flow waits for its running stages to kill their trainers."""


def max_parallel_stages(config: PipelineConfig) -> int | None:
    """How many stages of one run may run at once (``launch.max_parallel_stages``).

    None (no bound of the flow's own) when the config leaves it unset and a GPU concurrency limit
    is named (its slots bound the GPU stages); 1 when neither is set, and always 1 when a stage's
    backend names its rendezvous (``rdzv_endpoint`` / ``rdzv_id``: multi-node jobs), which two
    stages at once would share.
    """
    if any(config.backend_for(s).rdzv_endpoint or config.backend_for(s).rdzv_id for s in config.stages):
        return 1  # a configured rendezvous is one per job: stages side by side would collide on it
    if config.launch.max_parallel_stages is not None:
        return config.launch.max_parallel_stages
    named = (config.launch.gpu_concurrency_limit or os.environ.get(GPU_CONCURRENCY_ENV, "")).strip()
    return None if named else 1


def _ready(stage: PlannedStage, results: dict[str, StageResult]) -> bool:
    return all(d in results for d in stage.depends_on)


def _failed_dependency(stage: PlannedStage, results: dict[str, StageResult]) -> str | None:
    """The failed stage that keeps ``stage`` from running (followed back through skipped ones)."""
    for d in stage.depends_on:
        result = results.get(d)
        if result is not None and result.status != "completed":
            return result.skipped_because or d
    return None


class StageGraphRun:
    """The stages of one run's plan as task futures, each submitted once the stages it reads
    from completed.

    Stages are submitted in pipeline order among those ready, at most ``max_parallel`` running
    at once (None: no bound). A stage whose dependency failed (or was skipped) is skipped, naming
    the failure. If the flow itself is interrupted, every running stage's trainer is killed before
    the interrupt propagates; the stages it cut short are recorded as interrupted, the others
    skipped.

    Attributes:
        results: stage -> result, filled as stages end.
        failures: the stages' exceptions, in the order they happened.
    """

    def __init__(self, plan: dict[str, PlannedStage], run: PipelineRun, max_parallel: int | None, log: Any) -> None:
        self.plan, self.run_info, self.max_parallel, self.log = plan, run, max_parallel, log
        self.results: dict[str, StageResult] = {}
        self.failures: list[BaseException] = []

    def _submit_ready(self, waiting: list[str], running: dict[PrefectFuture, str]) -> None:
        for name in list(waiting):
            planned, cause = self.plan[name], _failed_dependency(self.plan[name], self.results)
            if cause is not None:
                self.log.info("stage %s: skipped, because %s failed", name, cause)
                self._set(name, StageResult.skipped(name, cause))
                waiting.remove(name)
            elif _ready(planned, self.results) and (self.max_parallel is None or len(running) < self.max_parallel):
                task = stage_task(name, self.run_info.config)
                running[task.submit(name, self.run_info, planned.inputs)] = name
                waiting.remove(name)

    def run(self) -> None:
        """Run every stage of the plan (see the class docstring)."""
        running: dict[PrefectFuture, str] = {}
        waiting = list(self.plan)
        try:
            while waiting or running:
                self._submit_ready(waiting, running)
                if not running:
                    continue
                done = next(as_completed(list(running)))
                self._record(running.pop(done), done)
        except BaseException as interrupt:
            # Ctrl-C, SIGTERM, a cancelled flow run (or an error of the scheduling itself): kill
            # every trainer the task threads launched, give them time to end, record what ended.
            abort_launches(self.run_info.launch_group)
            wait(list(running), timeout=ABORT_WAIT_S)
            for future, name in running.items():
                if future.state.is_final():
                    self._record(name, future, interrupt)
                else:
                    self._set(name, StageResult.interrupted(name, interrupt))
            for name in waiting:
                self._set(name, StageResult.skipped(name, "interrupted"))
            raise

    def _set(self, name: str, result: StageResult) -> None:
        """Record ``result``; in a sweep's point, also for the points that share the stage."""
        self.results[name] = result
        if self.run_info.sweep is not None:
            sweep_board(self.run_info.sweep.sweep_id).record(self.run_info.run_id, name, result)

    def _record(self, name: str, future: PrefectFuture, interrupt: BaseException | None = None) -> None:
        """Record a finished stage; one whose launch the interrupt aborted (``LaunchAborted``)
        as interrupted."""
        try:
            self._set(name, future.result())
        except Exception as e:  # noqa: BLE001 - recorded, summarised, re-raised by the flow
            if interrupt is not None and isinstance(e, LaunchAborted):
                self._set(name, StageResult.interrupted(name, interrupt))
                return
            self.failures.append(e)
            times = {"started_at": getattr(e, "started_at", None), "ended_at": getattr(e, "ended_at", None)}
            self._set(name, StageResult.failed(name, e, **times))
