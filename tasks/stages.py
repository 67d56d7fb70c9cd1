"""The one Prefect task that runs any stage: write its spec, launch its trainer, report it.

``run_stage`` is thin: the trainer process (``python -m trainer_core.run <spec-uri>``) does
the work. This task builds the :class:`~trainer_core.spec.StageSpec` (computing the stage
fingerprint, once), returns at once when the stage's committed output already carries that
fingerprint, else creates (or reopens) the stage's nested MLflow run, writes the spec, streams
the trainer's output into the Prefect log (a training stage's step lines also move its progress
artifact), reads the committed ``final/manifest.json`` and reports it to MLflow (curves image
included) and the Prefect UI (``tasks/report/views.py``). Retries come from the config, so the flow builds the
task with :func:`stage_task`. A retry resumes from the stage's latest checkpoint (the
trainer's job) and logs into the same MLflow run.

Secrets never reach storage: the spec's copy of the config has no S3 keys; they travel to the
trainer in its environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), which botocore reads,
with the S3 endpoint and region the trainer needs to read its spec (``storage.process_env``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime
from typing import Any

from mlflow import MlflowClient
from prefect import Task, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency
from prefect.logging import get_run_logger
from prefect.runtime import task_run as prefect_task_run

from tasks.k8s.job import run_trainer_job
from tasks.k8s.manifest import pin_rendezvous, trainer_job
from tasks.launch.commands import trainer_command
from tasks.launch.failures import StageFailed, raise_for_result
from tasks.launch.process import LaunchResult, launch_stage_process, retry_condition
from tasks.report import mlflow_models, tracking
from tasks.report.views import StageProgress, artifact_key, log_curves, mlflow_ui_url, png_markdown, run_link_markdown
from tasks.results import PipelineRun, StageResult, utc_now
from tasks.runs import completed_result
from tasks.sweep import adopt
from trainer_core import storage
from trainer_core.checkpoint.manifest import MANIFEST_NAME, Manifest, read_manifest
from trainer_core.config import PipelineConfig
from trainer_core.errors import StorageUnavailable, classify
from trainer_core.registry import get_stage
from trainer_core.spec import StageSpec, build_spec
from trainer_core.storage import join_uri

TAG_FINGERPRINT = "posttrain.fingerprint"
"""MLflow tag of a stage run: the stage fingerprint it trained under (``trainer_core/fingerprint.py``)."""

GPU_CONCURRENCY_ENV = "POSTTRAIN_GPU_CONCURRENCY_LIMIT"
"""Env var naming a Prefect global concurrency limit (slots = GPUs of one node or pool). When set,
every stage but prepare_data, unless its backend's ``device`` is cpu, holds its backend's
``nproc_per_node`` slots of it while its trainer runs, so pipelines sharing a node queue instead of oversubscribing it."""


def _stage_run_id(run: PipelineRun, stage: str, fingerprint: str) -> str:
    """The stage's MLflow run: an earlier attempt's, when it has the same parent and fingerprint.

    A retry or a resumed run continues the same nested run (the trainer resumes its steps);
    a stage whose config or inputs changed starts over, so it gets a new run.
    """
    client = MlflowClient(run.tracking_uri)
    spec_uri = run.layout.spec(stage)
    if storage.exists(spec_uri):
        previous = storage.read_json(spec_uri).get("mlflow_run_id")
        if previous:
            try:
                found = client.get_run(previous)
            except Exception:  # noqa: BLE001 - gone or from another store: start a fresh run
                found = None
            tags = found.data.tags if found is not None else {}
            if tags.get(tracking.TAG_PARENT) == run.parent_mlflow_run_id and tags.get(TAG_FINGERPRINT) == fingerprint:
                client.update_run(previous, status="RUNNING")
                return previous
    run_id = tracking.start_stage_run(
        run.config, run.parent_mlflow_run_id, stage, tracking_uri=run.tracking_uri, flow_run_url=run.flow_run_url
    )
    client.set_tag(run_id, TAG_FINGERPRINT, fingerprint)
    return run_id


QUIET_PROGRESS_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
"""Defaults of a trainer's environment (the flow's own values win): no progress bars from
transformers, huggingface_hub or tqdm in the task log (a bar's every redraw became a log line;
a stage's progress is its ``<stage>-progress`` artifact and its step lines)."""


SHARED_CPU_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Defaults of a trainer's environment (the flow's own values win): OpenMP threads that wait for
work sleep instead of spinning. With the default policy, libgomp's threads spin before they sleep,
so on a CPU shared with other busy processes each of torch's parallel regions waits for a thread
that the kernel has descheduled, and a small model's many short parallel regions each wait a
scheduler time slice. Sleeping costs a little on an idle CPU (the wake-up) and gains several
times on a busy one; a GPU worker's threads mostly wait on the device either way. What each costs:
``bench/bench_cpu_threads.py``, docs/benchmarks ("Shared CPUs")."""


def _spec_config_and_env(config: PipelineConfig) -> tuple[PipelineConfig, dict[str, str]]:
    """The config without S3 secrets (it is written to storage) and the trainer's environment: the
    flow's, with :data:`QUIET_PROGRESS_ENV` and :data:`SHARED_CPU_ENV` as defaults and the config's
    S3 endpoint, region and keys (``storage.process_env``; the trainer reads its spec from the
    storage root before it reads the config in it)."""
    env = {
        **QUIET_PROGRESS_ENV,
        **SHARED_CPU_ENV,
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        **storage.process_env(config.storage),
    }
    safe = config.model_copy(deep=True)
    safe.storage.access_key_id = None
    safe.storage.secret_access_key = None
    return safe, env


@contextmanager
def gpu_slots(stage: str, config: PipelineConfig, log: Any) -> Iterator[None]:
    """Hold slots of the concurrency limit ``launch.gpu_concurrency_limit`` (default
    ``$POSTTRAIN_GPU_CONCURRENCY_LIMIT``, see :data:`GPU_CONCURRENCY_ENV`); waits as long as the
    slots are taken.

    Raises:
        ConcurrencySlotAcquisitionError: the named limit does not exist.
    """
    name = (config.launch.gpu_concurrency_limit or os.environ.get(GPU_CONCURRENCY_ENV, "")).strip()
    backend = config.backend_for(stage)
    if not name or stage == "prepare_data" or backend.device == "cpu":
        yield
        return
    slots = backend.nproc_per_node
    log.info("stage %s: waiting for %d slot(s) of concurrency limit %r", stage, slots, name)
    with concurrency(name, occupy=slots, strict=True, raise_on_lease_renewal_failure=False):
        log.info("stage %s: holding %d slot(s) of concurrency limit %r", stage, slots, name)
        try:
            yield
        finally:
            log.info("stage %s: releasing %d slot(s) of concurrency limit %r", stage, slots, name)


def mlflow_run_markdown(config: PipelineConfig, tracking_uri: str, mlflow_run_id: str) -> str:
    """The MLflow run id, as a link to its page in the MLflow UI when a UI URL is known
    (``tracking.ui_url``, else an http(s) tracking URI: see :func:`tasks.report.views.mlflow_ui_url`)."""
    ui_url = mlflow_ui_url(config, tracking_uri)
    experiment_id = MlflowClient(tracking_uri).get_run(mlflow_run_id).info.experiment_id if ui_url else None
    return run_link_markdown(ui_url, experiment_id, mlflow_run_id)


def _metrics_markdown(
    stage: str, run_id: str, manifest: Manifest, output_uri: str, mlflow_run: str, curves_png: bytes | None = None
) -> str:
    rows = "\n".join(f"| `{k}` | {v:.6g} |" for k, v in sorted(manifest.metrics.items()))
    curves = f"{png_markdown(curves_png, f'{stage} curves')}\n\n" if curves_png else ""
    return (
        f"# {stage} ({run_id})\n\n"
        f"- output: `{output_uri}`\n- global_step: {manifest.global_step}\n"
        f"- MLflow run: {mlflow_run}\n\n"
        f"{curves}"
        f"| metric | value |\n|---|---|\n{rows}\n"
    )


def _curves(stage: str, mlflow_run_id: str, tracking_uri: str, log: Any) -> bytes | None:
    """Log the stage's curves image into its MLflow run (training stages); None when there is
    none or it failed (logged as a warning: a picture never fails a committed stage)."""
    if not get_stage(stage).trains:
        return None
    try:
        return log_curves(tracking_uri, mlflow_run_id, stage)
    except Exception as e:  # noqa: BLE001
        log.warning("stage %s: curves not logged to MLflow run %s: %s: %s", stage, mlflow_run_id, type(e).__name__, e)
        return None


def _model_logger(
    stage: str, spec_uri: str, env: dict[str, str], config: PipelineConfig, log: Any, group: str
) -> Callable[[], None]:
    """What logs a committed stage's final model into its MLflow run when its trainer did not:
    ``python -m trainer_core.mlflow_model <spec-uri>`` (loading a model needs torch, which the
    flow process never imports), launched like a trainer (own process group, killed on abort).

    Raises (when called):
        StageFailed: the process failed (its last lines in the message).
    """

    def log_missing() -> None:
        log.info("stage %s: final model not in MLflow yet; logging it from %s", stage, spec_uri)
        cmd = [sys.executable, "-m", "trainer_core.mlflow_model", spec_uri]
        result = launch_stage_process(cmd, env=env, log=log, timeout_s=config.launch.timeout_s, group=group)
        raise_for_result(result, f"{stage} (MLflow model)")

    return log_missing


def _report(
    stage: str, run: PipelineRun, output: str, mlflow_run_id: str, log: Any, log_missing: Callable[[], None]
) -> tuple[Manifest, str | None]:
    """Read the committed manifest and report it to MLflow (curves, manifest; the final model
    is the trainer's to log, else ``log_missing``'s) and the Prefect UI (a markdown artifact with
    the curves image and a link to the MLflow run); returns the manifest and the stage's MLflow
    model URI (None when it logs no model)."""
    tracking_uri = run.tracking_uri
    manifest = read_manifest(output)
    model_uri = mlflow_models.stage_model_uri(
        stage, run.config, mlflow_run_id, tracking_uri=tracking_uri, log_missing=log_missing
    )
    curves_png = _curves(stage, mlflow_run_id, tracking_uri, log)
    tracking.finish_stage_run(mlflow_run_id, manifest, output, "FINISHED", tracking_uri=tracking_uri)
    mlflow_run = mlflow_run_markdown(run.config, tracking_uri, mlflow_run_id)
    create_markdown_artifact(
        _metrics_markdown(stage, run.run_id, manifest, output, mlflow_run, curves_png),
        key=artifact_key(stage, "metrics"),
        description=f"{stage} final metrics",
    )
    return manifest, model_uri


def _mark_failed(mlflow_run_id: str, tracking_uri: str, log: Any) -> None:
    """Terminate the stage's MLflow run as FAILED without masking the stage's own error."""
    try:
        tracking.finish_stage_run(mlflow_run_id, None, None, "FAILED", tracking_uri=tracking_uri)
    except Exception as e:  # noqa: BLE001
        log.warning("could not mark MLflow run %s as FAILED: %s", mlflow_run_id, e)


@task(name="run_stage", cache_policy=NO_CACHE, persist_result=False)
def run_stage(stage: str, run: PipelineRun, inputs: dict[str, str]) -> StageResult:
    """Run one stage's trainer process and report its committed result. A stage whose backend has
    ``nnodes > 1`` runs as a Kubernetes Indexed Job (``tasks/k8s/job.py``), read the same way.

    Args:
        stage: Stage name (``trainer_core.registry.STAGE_ORDER``).
        run: The pipeline run (config, run id, MLflow tracking URI and parent run).
        inputs: Input role -> URI (see ``trainer_core.registry``); upstream outputs are committed.

    Returns:
        A completed :class:`StageResult`, ``reused`` without a launch when its committed output
        carries its fingerprint, or another point of its sweep trains it (``tasks/sweep.py``).

    Raises:
        BadStageInput: the trainer exited with code 2 (bad config or data; not retried), or a
            multi-node stage whose storage root or tracking URI the pods cannot reach.
        StageFailed: any other trainer failure or timeout (retried per ``config.launch``).
        SharedStageFailed: the point of the run's sweep that trains the stage did not.
        StorageUnavailable: this task's own reads and writes (the spec, the committed manifest)
            found storage down through its retries (naming the endpoint and URI; retried).
    """
    try:
        return _run_stage(stage, run, inputs)
    except Exception as e:
        error = classify(e)
        if isinstance(error, StorageUnavailable):  # one line naming the service, not botocore's frames
            raise error from e
        raise


def _run_stage(stage: str, run: PipelineRun, inputs: dict[str, str]) -> StageResult:
    """The body of :func:`run_stage` (same arguments, result and errors)."""
    log = get_run_logger()
    config, layout = run.config, run.layout
    writer_id = f"prefect-task-run:{prefect_task_run.id}" if prefect_task_run.id else None
    spec = build_spec(config, stage, run.run_id, inputs, tracking_uri=run.tracking_uri, writer_id=writer_id)
    spec_uri = layout.spec(stage)
    spec_config, env = _spec_config_and_env(config)
    reused = completed_result(layout, stage, spec.fingerprint) or adopt(run, stage, spec.fingerprint, log)
    if reused is not None:
        return _reuse(reused, run, spec_uri, env, log)
    spec, job = _write_spec(spec, run, spec_uri, spec_config)
    log.info("stage %s: spec %s, inputs %s", stage, spec_uri, inputs)
    try:
        progress = StageProgress(stage, config.section(stage).max_steps, log=log) if get_stage(stage).trains else None
        result, started_at, ended_at = _launch_trainer(stage, run, spec_uri, env, job, progress, log)
        try:
            raise_for_result(result, stage)
        except StageFailed as e:  # the failed attempt's times, for the run's summary
            e.started_at, e.ended_at = started_at, ended_at
            raise
        if progress is not None:
            progress.complete()
        output = layout.final(stage)
        manifest, model_uri = _report(
            stage,
            run,
            output,
            spec.mlflow_run_id,
            log,
            _model_logger(stage, spec_uri, env, config, log, run.launch_group),
        )
    except BaseException:
        _mark_failed(spec.mlflow_run_id, run.tracking_uri, log)
        raise
    return StageResult(
        stage=stage,
        status="completed",
        output_uri=output,
        manifest_uri=join_uri(output, MANIFEST_NAME),
        fingerprint=spec.fingerprint,
        wall_s=result.wall_s,
        started_at=started_at,
        ended_at=ended_at,
        metrics=dict(manifest.metrics),
        mlflow_run_id=spec.mlflow_run_id,
        model_uri=model_uri,
    )


def _write_spec(spec: StageSpec, run: PipelineRun, spec_uri: str, spec_config: PipelineConfig) -> tuple[StageSpec, Any]:
    """Write the stage's spec to ``spec_uri`` with the MLflow run it reports to and the config its
    trainer reads (``spec_config``; with several nodes, pinned to the Kubernetes Job's rendezvous).

    Returns:
        The spec (with its ``mlflow_run_id``) and the Job whose pods meet at its pod 0
        (tasks/k8s/job.py; it holds no slots here), or None on one node.
    """
    config, stage = run.config, spec.stage
    job = (
        trainer_job(config, stage, run.run_id, spec_uri, run.tracking_uri)
        if config.backend_for(stage).nnodes > 1
        else None
    )
    if job is not None:
        spec_config = pin_rendezvous(spec_config, stage, job.rdzv_endpoint)
    spec = spec.model_copy(update={"mlflow_run_id": _stage_run_id(run, stage, spec.fingerprint)})
    storage.write_json(spec_uri, spec.model_copy(update={"config": spec_config}).model_dump(mode="json"))
    return spec, job


def _reuse(reused: StageResult, run: PipelineRun, spec_uri: str, env: dict[str, str], log: Any) -> StageResult:
    """The result of a stage whose committed output already carries the fingerprint it would
    produce now, with its MLflow model (logged now if it was not: its output may predate model
    logging, or its trainer died before it)."""
    stage, config = reused.stage, run.config
    log.info("stage %s: committed output %s matches its config and inputs; not re-run", stage, reused.output_uri)
    if not reused.mlflow_run_id:
        return reused
    model_uri = mlflow_models.stage_model_uri(
        stage,
        config,
        reused.mlflow_run_id,
        tracking_uri=run.tracking_uri,
        log_missing=_model_logger(stage, spec_uri, env, config, log, run.launch_group),
    )
    return reused.model_copy(update={"model_uri": model_uri})


def _launch_trainer(
    stage: str, run: PipelineRun, spec_uri: str, env: dict[str, str], job: Any, progress: StageProgress | None, log: Any
) -> tuple[LaunchResult, datetime, datetime]:
    """Run the stage's trainer to its end: as the Kubernetes Job ``job`` when there is one, else as
    a local process holding the stage's GPU slots; its output lines feed ``progress``.

    Returns:
        The launch's result, and when the trainer started and ended (UTC).
    """
    config = run.config
    with gpu_slots(stage, config, log) if job is None else nullcontext():
        if progress is not None:
            progress.start()
        started_at = utc_now()
        on_line = progress.on_line if progress is not None else None
        if job is not None:
            result = run_trainer_job(
                job, log=log, timeout_s=config.launch.timeout_s, group=run.launch_group, on_line=on_line
            )
        else:
            cmd = trainer_command(spec_uri, config.backend_for(stage), rdzv_id=f"{run.run_id}-{stage}")
            result = launch_stage_process(
                cmd, env=env, log=log, timeout_s=config.launch.timeout_s, group=run.launch_group, on_line=on_line
            )
        return result, started_at, utc_now()


def stage_task(stage: str, config: PipelineConfig) -> Task:
    """``run_stage`` with the config's retries, delay and the bad-input retry condition."""
    return run_stage.with_options(
        name=f"run_stage[{stage}]",
        task_run_name=stage,
        retries=config.launch.retries,
        retry_delay_seconds=config.launch.retry_delay_s,
        retry_condition_fn=retry_condition,
    )
