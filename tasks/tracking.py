"""MLflow bookkeeping on the flow-process side: one parent run per pipeline run, one nested
run per stage.

The trainer logs step metrics into its stage run (``trainer_core.tracking.MetricLogger``); this
module creates the runs, logs the stage's flattened config as params, and at the end logs the
stage manifest, final metrics and model directory as artifacts. Only ``mlflow.MlflowClient`` is
used: no fluent API, no process-global active run.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from pydantic import BaseModel, SecretStr

from trainer_core import storage
from trainer_core.config import PipelineConfig, config_hash
from trainer_core.registry import get_stage
from trainer_core.tracking import sanitize_metric_name

MAX_PARAM_VALUE_CHARS = 6000
"""MLflow's limit on a param value (built-in stores)."""

_MAX_PARAMS_PER_BATCH = 100
_STATUS = {"completed": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}

TAG_RUN_ID = "posttrain.run_id"
TAG_STAGE = "posttrain.stage"
TAG_OUTPUT_URI = "posttrain.output_uri"
TAG_PARENT = "mlflow.parentRunId"


def _local_path(uri: str) -> str | None:
    """The filesystem path of a local URI (plain path or ``file://``), else None."""
    if uri.startswith("file://"):
        return uri[len("file://") :]
    return None if "://" in uri else uri


def resolve_tracking_uri(config: PipelineConfig) -> str:
    """The MLflow tracking URI for ``config``.

    Order: ``tracking.tracking_uri``; env ``MLFLOW_TRACKING_URI``; ``sqlite:///<root>/mlflow.db``
    for a local storage root; else ``sqlite:///<cwd>/mlruns.db``.
    """
    if config.tracking.tracking_uri:
        return config.tracking.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    root = _local_path(config.storage.root)
    if root is not None:
        root = os.path.abspath(root)
        os.makedirs(root, exist_ok=True)
        return f"sqlite:///{os.path.join(root, 'mlflow.db')}"
    return f"sqlite:///{os.path.join(os.getcwd(), 'mlruns.db')}"


def _mlflow_status(status: str) -> str:
    status = _STATUS.get(status.lower(), status.upper())
    if status not in {RunStatus.to_string(s) for s in RunStatus.all_status()}:
        raise ValueError(f"unknown MLflow run status {status!r}")
    return status


def _experiment_id(client: MlflowClient, config: PipelineConfig) -> str:
    name = config.tracking.experiment_name
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    root = _local_path(config.storage.root)
    location = os.path.join(os.path.abspath(root), "mlflow-artifacts") if root is not None else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException:  # created concurrently by another pipeline run
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def flatten_params(obj: BaseModel | dict | None, prefix: str) -> dict[str, str]:
    """Flatten a (nested) config into ``{"prefix.field.sub": "value"}`` MLflow params.

    Secret fields are dropped, lists become JSON, values are cut to 6000 characters.

    Args:
        obj: A pydantic model, a dict, or None (no params).
        prefix: The leading key, e.g. ``"sft"``.

    Returns:
        Param name -> string value.
    """
    if obj is None:
        return {}
    data = obj.model_dump() if isinstance(obj, BaseModel) else obj
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, SecretStr):
            continue
        if isinstance(value, dict):
            out.update(flatten_params(value, name))
            continue
        text = json.dumps(list(value)) if isinstance(value, (list, tuple)) else str(value)
        out[name] = text[:MAX_PARAM_VALUE_CHARS]
    return out


def _log_params(client: MlflowClient, run_id: str, params: dict[str, str]) -> None:
    items = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(items), _MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[start : start + _MAX_PARAMS_PER_BATCH])


def start_pipeline_run(config: PipelineConfig, run_id: str, *, tracking_uri: str) -> str:
    """Create the parent MLflow run of one pipeline run, or reopen it when the run id is resumed.

    Args:
        config: The validated pipeline config (local root already absolute).
        run_id: The pipeline run id (also the MLflow run name).
        tracking_uri: The MLflow tracking URI (:func:`resolve_tracking_uri`).

    Returns:
        The MLflow run id.
    """
    client = MlflowClient(tracking_uri)
    experiment_id = _experiment_id(client, config)
    tagged = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_RUN_ID}` = '{run_id}'", max_results=1000)
    existing = [r for r in tagged if TAG_PARENT not in r.data.tags]  # stage runs carry the run id too
    if existing:
        parent = existing[0].info.run_id
        client.update_run(parent, status="RUNNING")
        client.log_dict(parent, config.model_dump(mode="json"), "config.json")
        return parent
    tags = {TAG_RUN_ID: run_id, "posttrain.config_hash": config_hash(config), "posttrain.name": config.name}
    run = client.create_run(experiment_id, tags=tags, run_name=run_id)
    params = {"stages": ",".join(config.stages), "seed": str(config.seed)}
    params.update(flatten_params(config.model, "model"))
    params.update(flatten_params(config.backend, "backend"))
    _log_params(client, run.info.run_id, params)
    client.log_dict(run.info.run_id, config.model_dump(mode="json"), "config.json")
    return run.info.run_id


def start_stage_run(config: PipelineConfig, parent_run_id: str, stage: str, *, tracking_uri: str) -> str:
    """Create a stage's MLflow run, nested under ``parent_run_id``, with its config as params.

    Args:
        config: The pipeline config.
        parent_run_id: The pipeline's MLflow run.
        stage: The stage name; its section (``data`` for ``prepare_data``) becomes params.
        tracking_uri: The MLflow tracking URI.

    Returns:
        The nested MLflow run id.
    """
    client = MlflowClient(tracking_uri)
    parent = client.get_run(parent_run_id)
    tags = {TAG_PARENT: parent_run_id, TAG_STAGE: stage, TAG_RUN_ID: parent.data.tags.get(TAG_RUN_ID, "")}
    run = client.create_run(parent.info.experiment_id, tags=tags, run_name=stage)
    section = get_stage(stage).section
    params = flatten_params(config.section(stage), section)
    params["seed"] = str(config.seed)
    _log_params(client, run.info.run_id, params)
    return run.info.run_id


def finish_stage_run(
    run_id: str, manifest: Any, output_uri: str | None, status: str, *, tracking_uri: str
) -> None:
    """Log a stage's outcome and terminate its MLflow run.

    Args:
        run_id: The stage's MLflow run.
        manifest: The stage's final ``Manifest`` (None when the stage failed before writing one).
        output_uri: The stage's final directory (tag ``posttrain.output_uri``), or None.
        status: ``FINISHED``/``FAILED``/``KILLED`` (or ``completed``/``failed``/``cancelled``).
        tracking_uri: The MLflow tracking URI.

    Raises:
        ValueError: for an unknown status.
        MlflowException: when the store rejects a write.
    """
    client = MlflowClient(tracking_uri)
    status = _mlflow_status(status)
    tags = [RunTag(TAG_OUTPUT_URI, output_uri)] if output_uri else []
    metrics: list[Metric] = []
    if manifest is not None:
        client.log_dict(run_id, manifest.model_dump(mode="json"), f"manifests/{manifest.kind}.json")
        now_ms = int(time.time() * 1000)
        for key, value in (manifest.metrics or {}).items():
            name = sanitize_metric_name(f"final/{key}")  # per-step history stays the trainer's alone
            metric = Metric(name, float(value), now_ms, int(manifest.global_step or 0))
            if metric.value == metric.value and abs(metric.value) != float("inf"):
                metrics.append(metric)
    if tags or metrics:
        client.log_batch(run_id, metrics=metrics, tags=tags)
    client.set_terminated(run_id, status=status)


def log_model_dir(run_id: str, local_or_uri_dir: str, artifact_path: str = "model", *, tracking_uri: str) -> None:
    """Log every file of a model directory (HF format) as run artifacts under ``artifact_path``.

    A remote directory (``s3://``, ``memory://``) is copied to a temporary directory first.

    Args:
        run_id: The MLflow run.
        local_or_uri_dir: The model directory: a local path or any fsspec URI.
        artifact_path: Artifact sub-directory.
        tracking_uri: The MLflow tracking URI.

    Raises:
        FileNotFoundError: when the directory does not exist (or, remote, holds no files).
    """
    client = MlflowClient(tracking_uri)
    local = _local_path(local_or_uri_dir)
    if local is not None:
        if not os.path.isdir(local):
            raise FileNotFoundError(f"model directory not found: {local_or_uri_dir}")
        client.log_artifacts(run_id, local, artifact_path)
        return
    with tempfile.TemporaryDirectory(prefix="posttrain-model-") as tmp:
        client.log_artifacts(run_id, storage.download_dir(local_or_uri_dir, tmp), artifact_path)


def finish_pipeline_run(run_id: str, status: str, *, tracking_uri: str) -> None:
    """Terminate the pipeline's parent MLflow run with ``status`` (see :func:`finish_stage_run`)."""
    MlflowClient(tracking_uri).set_terminated(run_id, status=_mlflow_status(status))
