"""One stage's checkpoint bookkeeping, shared by every loop: resume, save, purge, commit, and
the metrics that reach the tracker exactly once.

:class:`CheckpointSession` is what the supervised loop (``training/loop.py``) and the RL trainer
(``training/rl/trainer.py``) call; neither touches checkpoint files itself. A save puts every state
component through :func:`~trainer_core.checkpoint.train_state.put_train_state` (the one
writer, in the backend's format) into a :class:`~trainer_core.checkpoint.components.RankWriter`,
which commits the manifest last. On the single-device backend the state is serialised in step
and uploaded by a background thread (one save in flight); every other save is a collective,
written in step by all ranks.

:class:`MetricsBuffer` carries step metrics to the tracker: printed at once, logged to MLflow
only once a committed checkpoint covers their step (the checkpoint stores them as
``metrics.json``), re-logged on resume where the tracker lacks them. A run killed anywhere
thus ends with each step's metrics logged exactly once.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from trainer_core.checkpoint.components import RankWriter, StagedWriter
from trainer_core.checkpoint.lease import LeaseLostError, check_fence
from trainer_core.checkpoint.manifest import Manifest, purge_checkpoints, step_dirname
from trainer_core.checkpoint.train_state import (
    METRICS_FILE,
    TrainProgress,
    checkpoint_metrics,
    find_resumable,
    load_checkpoint_state,
    put_train_state,
)
from trainer_core.storage import join_uri

log = logging.getLogger(__name__)

MetricBatch = list[tuple[dict[str, float], int]]
"""``[(metrics, global_step), ...]`` in logging order."""


class MetricSink(Protocol):
    """Where committed metrics go (``trainer_core.tracking.MetricLogger``)."""

    def log(self, metrics: dict[str, float], step: int) -> Any: ...

    def log_missing(self, batch: MetricBatch) -> int: ...


class MetricsBuffer:
    """Step metrics printed at once and logged to the tracker once a checkpoint covers them.

    Args:
        sink: the tracker (rank 0's MLflow logger; a no-op logger elsewhere); None: not tracked.
        printer: ``(metrics, step)`` -> None, called on every :meth:`emit` (console / task log);
            None: not printed.
    """

    def __init__(
        self, sink: MetricSink | None = None, printer: Callable[[dict[str, float], int], None] | None = None
    ) -> None:
        self.sink = sink
        self.printer = printer
        self._pending: MetricBatch = []

    def emit(self, metrics: dict[str, float], step: int) -> None:
        """Print ``metrics`` now; keep them until a checkpoint covering ``step`` is committed."""
        if self.printer is not None:
            self.printer(metrics, step)
        self._pending.append((metrics, step))

    def take(self) -> MetricBatch:
        """The metrics not yet handed to a checkpoint (the buffer forgets them)."""
        batch, self._pending = self._pending, []
        return batch

    def commit(self, batch: MetricBatch) -> None:
        """Log ``batch`` (its checkpoint is committed, or the stage ended)."""
        if self.sink is None:
            return
        for metrics, step in batch:
            self.sink.log(metrics, step)

    def recommit(self, batch: MetricBatch) -> int:
        """On resume: log the values of ``batch`` the tracker does not hold yet; returns how many."""
        return self.sink.log_missing(batch) if self.sink is not None else 0

    def flush(self) -> None:
        """Log everything still pending (at the end of a stage that succeeded)."""
        self.commit(self.take())


class CheckpointSaver:
    """Runs save jobs, optionally in a background thread, with at most one in flight.

    A failed background save is raised by the next ``submit`` or ``wait`` (the stage then
    fails and is retried).

    Args:
        asynchronous: False runs each job in the caller's thread.
    """

    def __init__(self, asynchronous: bool = True) -> None:
        self.asynchronous = asynchronous
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt") if asynchronous else None
        self._pending: Future | None = None

    def submit(self, job: Callable[[], Any]) -> None:
        """Run ``job`` (write + commit + follow-ups) after the previous one has finished."""
        self.wait()
        if self._pool is None:
            job()
        else:
            self._pending = self._pool.submit(job)

    def wait(self) -> None:
        """Block until the job in flight (if any) is done; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the last job, then stop the thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a session resumed from.

    Attributes:
        uri: its ``step-XXXXXXXX`` directory.
        manifest: its manifest.
        progress: the counters it restored.
    """

    uri: str
    manifest: Manifest
    progress: TrainProgress


class CheckpointSession:
    """Resume, save, purge and commit of one stage's step checkpoints; collective under a
    distributed backend (every rank makes the same calls).

    Args:
        uri: the stage's checkpoints directory (``StageLayout.checkpoints``).
        backend: the running backend (its format, rank, world size, collectives).
        fingerprint: the stage fingerprint, recorded as every manifest's ``config_hash``; a
            checkpoint with another one is not resumed.
        metrics: the stage's metrics buffer (default: neither printed nor tracked).
        stage: the stage name recorded in every manifest.
        run_id: the pipeline run id recorded in every manifest.
        extra: more ``extra`` manifest fields (the MLflow run id, a loop's layout version).
        keep_last: newest checkpoints kept (plus the best, see :meth:`save`).
        asynchronous: upload in the background where a save is not a collective (the
            single-device backend); False always writes in step.
        validate_replicas: compare replicated components' checksums across ranks before writing.
        attempt: this stage attempt's id: checkpoints go to ``step-XXXXXXXX-<attempt>/``, never
            into a directory another attempt writes; None: ``step-XXXXXXXX/``.
        fence: checked on every rank before a checkpoint is written, committed or purged (the
            stage's lease still held by this attempt); None: no check.
    """

    def __init__(
        self,
        uri: str,
        backend: Any,
        *,
        fingerprint: str = "",
        metrics: MetricsBuffer | None = None,
        stage: str = "train",
        run_id: str = "local",
        extra: dict[str, Any] | None = None,
        keep_last: int = 2,
        asynchronous: bool = True,
        validate_replicas: bool = True,
        attempt: str | None = None,
        fence: Any = None,
    ) -> None:
        self.uri = uri
        self.attempt = attempt
        self.fence = fence
        self.backend = backend
        self.stage = stage
        self.fingerprint = fingerprint
        self.metrics = metrics if metrics is not None else MetricsBuffer()
        self.keep_last = keep_last
        self.validate_replicas = validate_replicas
        self._fields = {
            "stage": stage,
            "run_id": run_id,
            "config_hash": fingerprint,
            "backend": backend.name,
            "world_size": backend.world_size,
            "extra": {**(extra or {}), "checkpoint_format": backend.checkpoint_format},
        }
        # Only a backend without a process group saves in the background: any other (DDP at world
        # size 1 too) runs collectives in a save, which must not race the training thread's.
        self.deferred = asynchronous and not backend.process_group
        self._saver = CheckpointSaver(asynchronous=self.deferred)

    def resume(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        *,
        accept: Callable[[Manifest], str | None] | None = None,
    ) -> Resumed | None:
        """Collective: load the latest complete checkpoint this session can resume, if any.

        Args:
            model: the live model to restore into.
            optimizer: the live optimizer to restore into.
            scheduler: the live learning-rate scheduler to restore into.
            accept: ``manifest -> None`` when the caller can resume it, else why not (a loop's
                own layout check); called on every rank with the same manifest.

        Returns:
            What was loaded, or None (no checkpoint, or none with this fingerprint, format or
            layout: a warning says why). Rank 0 re-logs the metrics the
            checkpoint covers that the tracker lacks.
        """
        found = find_resumable(self.uri, self.backend, self.fingerprint)
        if found is None:
            return None
        uri, manifest = found
        problem = accept(manifest) if accept is not None else None
        if problem is not None:
            log.warning("checkpoint %s not resumed: %s; starting fresh", uri, problem)
            return None
        progress = load_checkpoint_state(
            uri, manifest, backend=self.backend, model=model, optimizer=optimizer, scheduler=scheduler
        )
        if self.backend.rank == 0:
            self.metrics.recommit(checkpoint_metrics(uri, manifest))
        return Resumed(uri, manifest, progress)

    def save(
        self,
        progress: TrainProgress,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        files: dict[str, bytes] | None = None,
    ) -> None:
        """Checkpoint the state at ``progress.global_step``; collective unless deferred.

        The state is serialised now. Writing, the manifest commit (its ``metrics`` are the
        latest ``eval/*`` values of ``progress.history``), the tracker flush of the steps the
        checkpoint covers and the purge of old checkpoints (keeping the newest ``keep_last``
        and ``progress.best_checkpoint``) follow in order, in the background when deferred.

        Args:
            progress: counters, data position and history (copied here).
            model: the live model.
            optimizer: the live optimizer.
            scheduler: the live learning-rate scheduler.
            files: the loop's own GLOBAL files (name -> bytes), computed now on every rank.

        Raises:
            ReplicaMismatchError: a replicated component differs across ranks (nothing committed).
        """
        uri = join_uri(self.uri, self.dirname(progress.global_step))
        snapshot = copy.deepcopy(progress)
        batch = self.metrics.take()
        all_files = {**(files or {}), METRICS_FILE: json.dumps(batch).encode()}
        state = {"backend": self.backend, "model": model, "optimizer": optimizer, "scheduler": scheduler}
        t0 = time.perf_counter()
        if not self.deferred:
            self._commit(
                uri, lambda out: put_train_state(out, **state, progress=snapshot, files=all_files), snapshot, batch
            )
            log.info(
                "checkpoint %s committed by %d rank(s) in %.3fs", uri, self.backend.world_size, time.perf_counter() - t0
            )
            return
        staged = StagedWriter()
        put_train_state(staged, **state, progress=snapshot, files=all_files)
        stall_s = time.perf_counter() - t0

        def job() -> None:
            self._commit(uri, staged.replay, snapshot, batch)
            log.info("checkpoint %s committed (step stalled %.3fs)", uri, stall_s)

        self._saver.submit(job)

    def dirname(self, global_step: int) -> str:
        """The directory name of this session's checkpoint of ``global_step``."""
        return step_dirname(global_step, attempt=self.attempt)

    def _check_fence(self, what: str, collective: bool = True) -> None:
        check_fence(self.fence, self.backend, what, collective)

    def _may_purge(self) -> bool:
        """Rank 0 alone, after a commit: whether the lease is still this attempt's. A purge is
        skipped, not raised, when it is not: the other ranks are already past the save, and the
        next save's collective check stops every rank alike."""
        try:
            self._check_fence(f"the purge of old checkpoints under {self.uri}", collective=False)
        except LeaseLostError as e:
            log.error("%s", e)
            return False
        return True

    def _commit(self, uri: str, put: Callable[[RankWriter], None], progress: TrainProgress, batch: MetricBatch) -> None:
        self._check_fence(f"checkpoint {uri}")
        out = RankWriter(uri, self.backend, validate_replicas=self.validate_replicas)
        put(out)
        self._check_fence(f"the manifest of {uri}")
        evals = {
            k: float(v) for k, v in progress.history.items() if k.startswith("eval/") and isinstance(v, (int, float))
        }
        out.commit(
            kind="checkpoint",
            global_step=progress.global_step,
            consumed_samples=progress.consumed_samples,
            consumed_tokens=progress.consumed_tokens,
            metrics=evals,
            **self._fields,
        )
        if self.backend.rank == 0:
            self.metrics.commit(batch)
            if not self._may_purge():
                return
            keep = {progress.best_checkpoint} if progress.best_checkpoint else set()
            purge_checkpoints(self.uri, keep_last=self.keep_last, keep=keep)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its error."""
        self._saver.wait()

    def close(self) -> None:
        """Wait for the last save and stop the background thread (call it in ``finally``)."""
        self._saver.close()
