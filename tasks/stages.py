"""The one Prefect task that runs any stage: write its spec, launch its trainer, report it.

``run_stage`` is thin: the trainer process (``python -m trainer_core.run <spec-uri>``) does
the work; this task creates the stage's nested MLflow run, writes the
:class:`~trainer_core.spec.StageSpec`, streams the trainer's output into the Prefect log, reads
the committed ``final/manifest.json`` and reports it to MLflow and the Prefect UI. Retries come
from the config, so the flow builds the task with :func:`stage_task`. A retry resumes from the
stage's latest checkpoint (the trainer's job) and logs into the same MLflow run.

Secrets never reach storage: the spec's copy of the config has no S3 keys; they travel to the
trainer in its environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), which botocore reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mlflow import MlflowClient
from prefect import Task, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency
from prefect.logging import get_run_logger
from prefect.runtime import task_run as prefect_task_run

from tasks import tracking
from tasks.commands import trainer_command
from tasks.failures import raise_for_result
from tasks.launch import launch_stage_process, retry_condition
from trainer_core.checkpoint import storage
from trainer_core.checkpoint.manifest import MANIFEST_NAME, Manifest, read_manifest
from trainer_core.config import PipelineConfig
from trainer_core.fingerprint import stage_fingerprint
from trainer_core.spec import StageSpec, final_uri, join_uri, run_uri, stage_uri

TAG_FINGERPRINT = "posttrain.fingerprint"
"""MLflow tag of a stage run: the stage fingerprint it trained under (``trainer_core/fingerprint.py``)."""

MODEL_STAGES: frozenset[str] = frozenset({"sft", "reward_model", "dpo", "ppo", "grpo"})
"""Stages whose final directory is an HF model, logged to MLflow as artifacts."""

GPU_CONCURRENCY_ENV = "POSTTRAIN_GPU_CONCURRENCY_LIMIT"
"""Env var naming a Prefect global concurrency limit (slots = GPUs of one node or pool). When set,
every stage but prepare_data, unless ``backend.device`` is cpu, holds ``backend.nproc_per_node``
slots of it while its trainer runs, so pipelines sharing a node queue instead of oversubscribing it."""


def spec_uri_for(config: PipelineConfig, run_id: str, stage: str) -> str:
    """``<root>/runs/<run_id>/specs/<stage>.json``."""
    return join_uri(run_uri(config.storage.root, run_id), "specs", f"{stage}.json")


def artifact_key(stage: str, suffix: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes): ``reward_model`` -> ``reward-model-<suffix>``."""
    raw = f"{stage}-{suffix}".lower()
    return "".join(c if c.isalnum() and c.isascii() else "-" for c in raw)


def _stage_run_id(
    config: PipelineConfig, spec_uri: str, parent_mlflow_run_id: str, stage: str, fingerprint: str
) -> str:
    """The stage's MLflow run: an earlier attempt's, when it has the same parent and fingerprint.

    A retry or a resumed run continues the same nested run (the trainer resumes its steps);
    a stage whose config or inputs changed starts over, so it gets a new run.
    """
    tracking_uri = tracking.resolve_tracking_uri(config)
    client = MlflowClient(tracking_uri)
    if storage.exists(spec_uri):
        previous = storage.read_json(spec_uri).get("mlflow_run_id")
        if previous:
            try:
                run = client.get_run(previous)
            except Exception:  # noqa: BLE001 - gone or from another store: start a fresh run
                run = None
            tags = run.data.tags if run is not None else {}
            if tags.get(tracking.TAG_PARENT) == parent_mlflow_run_id and tags.get(TAG_FINGERPRINT) == fingerprint:
                client.update_run(previous, status="RUNNING")
                return previous
    run_id = tracking.start_stage_run(config, parent_mlflow_run_id, stage)
    client.set_tag(run_id, TAG_FINGERPRINT, fingerprint)
    return run_id


def _spec_config_and_env(config: PipelineConfig) -> tuple[PipelineConfig, dict[str, str]]:
    """The config without S3 secrets (it is written to storage) and the trainer's environment."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    safe = config.model_copy(deep=True)
    if config.storage.access_key_id is not None:
        env["AWS_ACCESS_KEY_ID"] = config.storage.access_key_id.get_secret_value()
        safe.storage.access_key_id = None
    if config.storage.secret_access_key is not None:
        env["AWS_SECRET_ACCESS_KEY"] = config.storage.secret_access_key.get_secret_value()
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
    if not name or stage == "prepare_data" or config.backend.device == "cpu":
        yield
        return
    slots = config.backend.nproc_per_node
    log.info("stage %s: waiting for %d slot(s) of concurrency limit %r", stage, slots, name)
    with concurrency(name, occupy=slots, strict=True, raise_on_lease_renewal_failure=False):
        log.info("stage %s: holding %d slot(s) of concurrency limit %r", stage, slots, name)
        try:
            yield
        finally:
            log.info("stage %s: releasing %d slot(s) of concurrency limit %r", stage, slots, name)


def mlflow_run_markdown(tracking_uri: str, mlflow_run_id: str) -> str:
    """The MLflow run id, as a link to its page in the MLflow UI when the tracking URI is http(s)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return f"`{mlflow_run_id}`"
    experiment_id = MlflowClient(tracking_uri).get_run(mlflow_run_id).info.experiment_id
    return f"[`{mlflow_run_id}`]({tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{mlflow_run_id})"


def _metrics_markdown(stage: str, run_id: str, manifest: Manifest, output_uri: str, mlflow_run: str) -> str:
    rows = "\n".join(f"| `{k}` | {v:.6g} |" for k, v in sorted(manifest.metrics.items()))
    return (
        f"# {stage} ({run_id})\n\n"
        f"- output: `{output_uri}`\n- global_step: {manifest.global_step}\n"
        f"- MLflow run: {mlflow_run}\n\n"
        f"| metric | value |\n|---|---|\n{rows}\n"
    )


def _report(stage: str, run_id: str, output: str, mlflow_run_id: str, tracking_uri: str) -> Manifest:
    """Read the committed manifest and report it to MLflow and the Prefect UI."""
    manifest = read_manifest(output)
    if stage in MODEL_STAGES:
        tracking.log_model_dir(mlflow_run_id, output, tracking_uri=tracking_uri)
    tracking.finish_stage_run(mlflow_run_id, manifest, output, "FINISHED", tracking_uri=tracking_uri)
    create_markdown_artifact(
        _metrics_markdown(stage, run_id, manifest, output, mlflow_run_markdown(tracking_uri, mlflow_run_id)),
        key=artifact_key(stage, "metrics"),
        description=f"{stage} final metrics",
    )
    return manifest


def _mark_failed(mlflow_run_id: str, tracking_uri: str, log: Any) -> None:
    """Terminate the stage's MLflow run as FAILED without masking the stage's own error."""
    try:
        tracking.finish_stage_run(mlflow_run_id, None, None, "FAILED", tracking_uri=tracking_uri)
    except Exception as e:  # noqa: BLE001
        log.warning("could not mark MLflow run %s as FAILED: %s", mlflow_run_id, e)


@task(name="run_stage", cache_policy=NO_CACHE, persist_result=False)
def run_stage(
    stage: str,
    config: PipelineConfig,
    run_id: str,
    inputs: dict[str, str],
    parent_mlflow_run_id: str,
) -> dict[str, Any]:
    """Run one stage's trainer process and report its committed result.

    Args:
        stage: Stage name (``config.STAGE_ORDER``).
        config: The validated pipeline config with an absolute local root.
        run_id: Pipeline run id.
        inputs: Input role -> URI (see ``StageSpec``).
        parent_mlflow_run_id: The pipeline's MLflow run.

    Returns:
        ``{"stage", "status": "completed", "output_uri", "manifest_uri", "wall_s", "metrics",
        "mlflow_run_id"}``; ``output_uri`` is the stage's ``final/`` directory.

    Raises:
        BadStageInput: the trainer exited with code 2 (bad config or data; not retried).
        StageFailed: any other trainer failure or timeout (retried per ``config.launch``).
    """
    log = get_run_logger()
    tracking_uri = tracking.resolve_tracking_uri(config)
    spec_uri = spec_uri_for(config, run_id, stage)
    fingerprint = stage_fingerprint(config, stage, inputs)
    mlflow_run_id = _stage_run_id(config, spec_uri, parent_mlflow_run_id, stage, fingerprint)
    spec_config, env = _spec_config_and_env(config)
    spec = StageSpec(
        stage=stage,
        run_id=run_id,
        config=spec_config,
        inputs=inputs,
        output_uri=stage_uri(config.storage.root, run_id, stage),
        tracking_uri=tracking_uri,
        mlflow_run_id=mlflow_run_id,
        writer_id=f"prefect-task-run:{prefect_task_run.id}" if prefect_task_run.id else None,
    )
    storage.write_json(spec_uri, spec.model_dump(mode="json"))
    log.info("stage %s: spec %s, inputs %s", stage, spec_uri, inputs)
    try:
        cmd = trainer_command(spec_uri, config.backend_for(stage), rdzv_id=f"{run_id}-{stage}")
        with gpu_slots(stage, config, log):
            result = launch_stage_process(cmd, env=env, log=log, timeout_s=config.launch.timeout_s)
        raise_for_result(result, stage)
        output = final_uri(spec.output_uri)
        manifest = _report(stage, run_id, output, mlflow_run_id, tracking_uri)
    except BaseException:
        _mark_failed(mlflow_run_id, tracking_uri, log)
        raise
    return {
        "stage": stage,
        "status": "completed",
        "output_uri": output,
        "manifest_uri": join_uri(output, MANIFEST_NAME),
        "wall_s": result.wall_s,
        "metrics": dict(manifest.metrics),
        "mlflow_run_id": mlflow_run_id,
    }


def stage_task(stage: str, config: PipelineConfig) -> Task:
    """``run_stage`` with the config's retries, delay and the bad-input retry condition."""
    return run_stage.with_options(
        name=f"run_stage[{stage}]",
        task_run_name=stage,
        retries=config.launch.retries,
        retry_delay_seconds=config.launch.retry_delay_s,
        retry_condition_fn=retry_condition,
    )
