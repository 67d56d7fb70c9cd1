"""What travels between the flow and the stage tasks: one run's identity, and each stage's result.

:class:`PipelineRun` is resolved once by the flow (config validated, run id checked, MLflow
tracking URI and parent run opened) and handed to every stage task. :class:`StageResult` is what
a stage task returns, what the flow records for a failed or skipped stage, and what
``summary.json`` lists per stage.
"""

from __future__ import annotations

import signal
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trainer_core.config import PipelineConfig
from trainer_core.storage import RunLayout


class SweepPoint(BaseModel):
    """What a pipeline run that is one point of a sweep knows of the sweep (``flows/sweep.py``).

    Attributes:
        sweep_id: the sweep.
        values: the point's grid values, ``{"dpo.beta": 0.1}``.
        shared_from: stage -> the run id of the point that trains it for this one (``tasks/sweep.py``).
        mlflow_run_id: the sweep's MLflow run, the parent of the point's.
        launch_group: the sweep's flow run id: every point's trainers launch in its group, so
            that an interrupted sweep stops them all (``tasks/launch/aborts.py``).
    """

    model_config = ConfigDict(frozen=True)

    sweep_id: str
    values: dict[str, Any] = Field(default_factory=dict)
    shared_from: dict[str, str] = Field(default_factory=dict)
    mlflow_run_id: str | None = None
    launch_group: str | None = None


class PipelineRun(BaseModel):
    """One pipeline run, as the flow resolved it.

    Attributes:
        run_id: the pipeline run id (storage, MLflow run name, Prefect flow run name).
        config: the validated config, local storage root absolute.
        tracking_uri: the MLflow tracking URI (resolved once).
        parent_mlflow_run_id: the pipeline's MLflow run.
        flow_run_url: the Prefect UI page of the flow run (tagged on every MLflow run), if known.
        sweep: the sweep the run is a point of (its stages shared with other points, its release
            left to the sweep), or None.
    """

    model_config = ConfigDict(frozen=True)

    run_id: str
    config: PipelineConfig
    tracking_uri: str
    parent_mlflow_run_id: str
    flow_run_url: str | None = None
    sweep: SweepPoint | None = None

    @property
    def layout(self) -> RunLayout:
        """Where the run's files are."""
        return RunLayout(self.config.storage.root, self.run_id)

    @property
    def launch_group(self) -> str:
        """The group its trainers launch in (``tasks/launch/aborts.py``): its sweep's, when it is
        a point of one, else its own flow run's id."""
        from prefect.runtime import flow_run

        return (self.sweep.launch_group if self.sweep else None) or flow_run.id or ""


def utc_now() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(timezone.utc)


class StageResult(BaseModel):
    """The outcome of one stage of one pipeline run.

    Attributes:
        stage: the stage name.
        status: ``completed`` (trained now, or reused), ``failed``, ``interrupted`` (running when
            the flow was stopped: a signal, a cancelled flow run; its trainer was killed, and a
            resume goes on from its last checkpoint), or ``skipped`` (a stage it depends on
            failed or was skipped, or the flow was stopped before it started).
        reused: completed without running: its committed output already had the fingerprint it
            would produce now.
        output_uri: its committed ``final/`` directory (completed only).
        manifest_uri: that directory's ``manifest.json``.
        fingerprint: the stage fingerprint it ran (or was reused) under.
        wall_s: seconds its trainer ran (0 when reused; None when it never started).
        started_at: when its trainer started (after any GPU slots were acquired), UTC; for a
            failed stage, its last attempt's trainer (None when no trainer ran).
        ended_at: when its trainer ended, UTC (likewise).
        metrics: the final metrics of its manifest.
        mlflow_run_id: its nested MLflow run.
        model_uri: its final model as an MLflow model (``mlflow.transformers.load_model`` reads
            it), when one was logged.
        error: ``<ExceptionType>: <message>`` of a failure.
        skipped_because: for a skipped stage, the failed stage that caused it (followed back
            through skipped ones).
    """

    model_config = ConfigDict(frozen=True)

    stage: str
    status: Literal["completed", "failed", "interrupted", "skipped"]
    reused: bool = False
    output_uri: str | None = None
    manifest_uri: str | None = None
    fingerprint: str | None = None
    wall_s: float | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    mlflow_run_id: str | None = None
    model_uri: str | None = None
    error: str | None = None
    skipped_because: str | None = None

    @classmethod
    def failed(cls, stage: str, error: BaseException, **fields: Any) -> StageResult:
        """The record of ``stage`` failing with ``error`` (message cut at 2000 characters)."""
        return cls(stage=stage, status="failed", error=f"{type(error).__name__}: {error}"[:2000], **fields)

    @classmethod
    def interrupted(cls, stage: str, interrupt: BaseException) -> StageResult:
        """The record of ``stage`` cut short by ``interrupt`` (what stopped the flow)."""
        return cls(stage=stage, status="interrupted", error=describe_interrupt(interrupt)[:2000])

    @classmethod
    def skipped(cls, stage: str, because: str) -> StageResult:
        """The record of ``stage`` not run because the stage ``because`` failed."""
        return cls(stage=stage, status="skipped", skipped_because=because)

    def summary_entry(self) -> dict[str, Any]:
        """This result as ``summary.json`` lists it (JSON types; the stage name is the key)."""
        return self.model_dump(mode="json", exclude={"stage"})


def describe_interrupt(interrupt: BaseException) -> str:
    """What stopped a flow, for the summary: ``KeyboardInterrupt: signal SIGTERM`` (the CLI's
    handlers), ``TerminationSignal: signal SIGTERM`` (Prefect's, which carries only the number),
    else ``<type>: <message>``."""
    signum = getattr(interrupt, "signal", None)
    if isinstance(signum, int) and not str(interrupt):
        try:
            return f"{type(interrupt).__name__}: signal {signal.Signals(signum).name}"
        except ValueError:
            return f"{type(interrupt).__name__}: signal {signum}"
    return f"{type(interrupt).__name__}: {interrupt}"
