"""MLflow bookkeeping on the flow-process side: one parent run per pipeline run, one nested
run per stage.

The trainer logs step metrics into its stage run (``trainer_core.tracking.MetricLogger``); this
module creates the runs (tagged with the Prefect flow run's URL), logs the stage's flattened
config as params, at the end logs the stage manifest as an artifact, and puts the pipeline's
headline metrics on the parent run. A SQLite store copied with its storage root (a run directory
resumed elsewhere) first has its artifact locations moved under that root
(:func:`rehome_copied_store`). Models and the registry: ``tasks/report/mlflow_models.py``. Only
``mlflow.MlflowClient`` is used: no fluent API, no process-global active run or tracking URI, so
stage tasks may call it from several threads of one process at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import sqlite3
import time
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.tracking._tracking_service import utils as tracking_service_utils
from pydantic import BaseModel, SecretStr

from trainer_core.config import PipelineConfig, config_hash
from trainer_core.registry import get_stage
from trainer_core.tracking import sanitize_metric_name

log = logging.getLogger(__name__)

MAX_PARAM_VALUE_CHARS = 6000
"""MLflow's limit on a param value (built-in stores)."""

_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_STATUS = {"completed": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}

TAG_RUN_ID = "posttrain.run_id"
TAG_STAGE = "posttrain.stage"
TAG_OUTPUT_URI = "posttrain.output_uri"
TAG_PARENT = "mlflow.parentRunId"
TAG_FLOW_RUN_URL = "prefect.flow_run_url"
TAG_NOTE = "mlflow.note.content"
"""The run description MLflow's UI shows (markdown): a link back to the Prefect flow run."""


def flow_run_note(flow_run_url: str | None) -> str | None:
    """A run description (markdown) linking the Prefect flow run; None without a URL."""
    return f"Prefect flow run: [{flow_run_url}]({flow_run_url})" if flow_run_url else None


def _flow_run_tags(flow_run_url: str | None) -> dict[str, str]:
    """The URL tag and a description linking the Prefect flow run (none without a URL)."""
    if not flow_run_url:
        return {}
    return {TAG_FLOW_RUN_URL: flow_run_url, TAG_NOTE: flow_run_note(flow_run_url)}


TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
"""The experiment kind MLflow 3's UI opens as "Machine learning" (runs, metrics, models) rather
than as a GenAI app (traces); the UI's own kind selector writes the same tag."""


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


def _sqlite_path(tracking_uri: str) -> str | None:
    """The database file of a ``sqlite:///<path>`` tracking URI, else None."""
    prefix = "sqlite:///"
    return tracking_uri[len(prefix) :] if tracking_uri.startswith(prefix) else None


@contextlib.contextmanager
def _store_lock(path: str | None):
    """Hold an exclusive lock on ``<path>.lock`` beside the SQLite database ``path`` (its folder
    created); no lock for None (a store that is not a SQLite file)."""
    if path is None:
        yield
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def open_store(tracking_uri: str) -> MlflowClient:
    """A client of ``tracking_uri`` whose store exists: a SQLite store is created (tables, then
    MLflow's schema migrations) under an exclusive lock on ``<database>.lock``.

    MLflow creates a new SQLite store from every process that opens it first; two pipeline runs
    starting together on a fresh storage root both did, and one failed with a raw SQL error
    (``duplicate column name: step``, ``table experiments already exists``, ...). Under the lock
    the second waits and then finds the store made; later openings (stage processes, the model
    logger) only read its schema version.

    Raises:
        RuntimeError: the store cannot be opened or created; the message names the URI.
    """
    with _store_lock(_sqlite_path(tracking_uri)):
        try:
            client = MlflowClient(tracking_uri)
            client.search_experiments(max_results=1)
            client.search_registered_models(max_results=1)
        except Exception as e:  # noqa: BLE001 - any store failure, named by its URI
            raise RuntimeError(
                f"the MLflow store {tracking_uri} (tracking.tracking_uri) could not be opened: {type(e).__name__}: {e}"
            ) from e
    return client


def _mlflow_status(status: str) -> str:
    status = _STATUS.get(status.lower(), status.upper())
    if status not in {RunStatus.to_string(s) for s in RunStatus.all_status()}:
        raise ValueError(f"unknown MLflow run status {status!r}")
    return status


ARTIFACTS_DIR = "mlflow-artifacts"
"""The folder of a local storage root that holds its experiments' MLflow artifacts."""

_LOCATION_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("logged_models", "artifact_location"),
    ("model_versions", "source"),
    ("model_versions", "storage_location"),
)
"""Where MLflow's SQL store keeps artifact locations (tables and columns of older schemas that
lack one are skipped)."""


def _artifact_root(storage_root: str) -> str | None:
    """``<root>/mlflow-artifacts`` of a local storage root (absolute), else None."""
    root = _local_path(storage_root)
    return os.path.join(os.path.abspath(root), ARTIFACTS_DIR) if root is not None else None


def _moved_artifact_root(location: str | None, artifact_root: str) -> str | None:
    """``location`` (as stored) when it is the artifact folder of another local root, else None."""
    path = _local_path(location or "")
    if not path or not os.path.isabs(path):
        return None
    path = path.rstrip("/")
    if os.path.basename(path) != ARTIFACTS_DIR or path == artifact_root:
        return None
    return location.rstrip("/")


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    """The columns of ``table`` (none when the schema has no such table)."""
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def _forget_artifact_repos(folder: str) -> None:
    """Drop MLflow's cached artifact repositories (one per run or logged model, process-wide,
    made from the location read when first used) that write under ``folder``: a process that
    used a run before its store was moved would else go on writing to the old place."""
    cache = getattr(tracking_service_utils, "_artifact_repos_cache", None)
    if not isinstance(cache, dict):
        return
    for key, repo in list(cache.items()):
        uri = str(getattr(repo, "artifact_uri", ""))
        if uri == folder or uri.startswith(folder + "/"):
            cache.pop(key, None)


def rehome_copied_store(tracking_uri: str, storage_root: str) -> dict[str, str]:
    """Put the artifact locations of a SQLite store copied with its storage root under that root.

    MLflow keeps absolute artifact locations in its database: the experiment's
    (``<root>/mlflow-artifacts``, :func:`_experiment_id`) and, made from it, each run's, logged
    model's and model version's. A run directory copied elsewhere (``cp -r outputs /tmp/copy``)
    and resumed there (``posttrain resume RUN --root /tmp/copy``) opens the copied
    ``mlflow.db``, whose locations still name the original root: the reopened parent run and
    every new stage run would write their artifacts into the original. When the store's
    database lies under the local ``storage_root``, every location under another root's
    ``mlflow-artifacts`` folder is rewritten to the same place under ``storage_root`` (the copy
    holds those artifacts too), under the store's lock. A store elsewhere (a tracking server, a
    SQLite file shared by several roots) is left as it is: its records are not the copy's.

    Args:
        tracking_uri: The MLflow tracking URI (:func:`resolve_tracking_uri`).
        storage_root: The pipeline's storage root (absolute when local).

    Returns:
        ``{old artifact folder: new one}`` for each folder moved (empty: nothing moved).

    Raises:
        sqlite3.Error: the database cannot be read or written.
    """
    path, artifact_root = _sqlite_path(tracking_uri), _artifact_root(storage_root)
    if path is None or artifact_root is None:
        return {}
    path = os.path.abspath(path)
    if os.path.commonpath([path, os.path.dirname(artifact_root)]) != os.path.dirname(artifact_root):
        return {}
    with _store_lock(path), contextlib.closing(sqlite3.connect(path, timeout=60)) as db, db:
        present = [(t, c) for t, c in _LOCATION_COLUMNS if c in _columns(db, t)]
        if ("experiments", "artifact_location") not in present:
            return {}
        stored = db.execute("SELECT artifact_location FROM experiments").fetchall()
        moved = {old: artifact_root for (loc,) in stored if (old := _moved_artifact_root(loc, artifact_root))}
        for old in moved:
            for table, column in present:
                db.execute(
                    f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                    f"WHERE substr({column}, 1, ?) = ? AND (length({column}) = ? OR substr({column}, ?, 1) = '/')",
                    (artifact_root, len(old) + 1, len(old), old, len(old), len(old) + 1),
                )
    for old in moved:
        _forget_artifact_repos(old)
        log.info(
            "MLflow store %s: artifacts of %s are now those under %s (the store was copied with its storage root)",
            tracking_uri,
            old,
            artifact_root,
        )
    return moved


def _experiment_id(client: MlflowClient, config: PipelineConfig, tracking_uri: str) -> str:
    """The id of the pipeline's experiment, created when missing; tagged as a model-training
    experiment (:data:`TAG_EXPERIMENT_KIND`) unless it already has a kind. A store copied with
    the storage root first gets its artifact locations moved under it (:func:`rehome_copied_store`)."""
    name = config.tracking.experiment_name
    rehome_copied_store(tracking_uri, config.storage.root)
    found = client.get_experiment_by_name(name)
    if found is None:
        location = _artifact_root(config.storage.root)
        try:
            return client.create_experiment(
                name, artifact_location=location, tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND}
            )
        except MlflowException:  # created concurrently by another pipeline run
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if TAG_EXPERIMENT_KIND not in found.tags:
        client.set_experiment_tag(found.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
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


def start_pipeline_run(
    config: PipelineConfig,
    run_id: str,
    *,
    tracking_uri: str,
    flow_run_url: str | None = None,
    parent_run_id: str | None = None,
) -> str:
    """Create the parent MLflow run of one pipeline run, or reopen it when the run id is resumed.

    Args:
        config: The validated pipeline config (local root already absolute).
        run_id: The pipeline run id (also the MLflow run name).
        tracking_uri: The MLflow tracking URI (:func:`resolve_tracking_uri`).
        flow_run_url: The Prefect UI page of the flow run, set as tag :data:`TAG_FLOW_RUN_URL`
            (on a reopened run it replaces the earlier flow run's). None: no tag.
        parent_run_id: The sweep's MLflow run when the run is a point of a sweep (the run is
            nested under it); None: a top-level run.

    Returns:
        The MLflow run id.

    Raises:
        MlflowException: when the store rejects a read or write.
        RuntimeError: the store cannot be opened or created (:func:`open_store`).
    """
    client = open_store(tracking_uri)
    experiment_id = _experiment_id(client, config, tracking_uri)
    tagged = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_RUN_ID}` = '{run_id}'", max_results=1000)
    existing = [r for r in tagged if TAG_STAGE not in r.data.tags]  # stage runs carry the run id too
    if existing:
        parent = existing[0].info.run_id
        client.update_run(parent, status="RUNNING")
        for key, value in _flow_run_tags(flow_run_url).items():
            client.set_tag(parent, key, value)
        client.log_dict(parent, config.model_dump(mode="json"), "config.json")
        return parent
    tags = {TAG_RUN_ID: run_id, "posttrain.config_hash": config_hash(config), "posttrain.name": config.name}
    tags.update(_flow_run_tags(flow_run_url))
    if parent_run_id:
        tags[TAG_PARENT] = parent_run_id
    run = client.create_run(experiment_id, tags=tags, run_name=run_id)
    params = {"stages": ",".join(config.stages), "seed": str(config.seed)}
    params.update(flatten_params(config.model, "model"))
    params.update(flatten_params(config.backend, "backend"))
    _log_params(client, run.info.run_id, params)
    client.log_dict(run.info.run_id, config.model_dump(mode="json"), "config.json")
    return run.info.run_id


TAG_SWEEP_ID = "posttrain.sweep_id"
"""Tag of a sweep's MLflow run (``flows/sweep.py``); its points' runs are nested under it."""


def start_sweep_run(
    config: PipelineConfig,
    sweep_id: str,
    grid: dict[str, list[Any]],
    *,
    tracking_uri: str,
    flow_run_url: str | None = None,
) -> str:
    """Create the MLflow run of a sweep (run name and tag :data:`TAG_SWEEP_ID` the sweep id, each
    grid key's values as the tag ``posttrain.grid.<key>``), or reopen it when the sweep id is run
    again (its grid tags replaced: a grid may grow).

    Returns:
        The MLflow run id.

    Raises:
        MlflowException: when the store rejects a read or write.
    """
    client = open_store(tracking_uri)
    experiment_id = _experiment_id(client, config, tracking_uri)
    found = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_SWEEP_ID}` = '{sweep_id}'", max_results=1)
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
    else:
        tags = {TAG_SWEEP_ID: sweep_id, "posttrain.name": config.name}
        run_id = client.create_run(experiment_id, tags=tags, run_name=sweep_id).info.run_id
    tags = {
        **_flow_run_tags(flow_run_url),
        **{f"posttrain.grid.{k}": json.dumps(v, default=str) for k, v in grid.items()},
    }
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    return run_id


def start_stage_run(
    config: PipelineConfig,
    parent_run_id: str,
    stage: str,
    *,
    tracking_uri: str,
    flow_run_url: str | None = None,
) -> str:
    """Create a stage's MLflow run, nested under ``parent_run_id``, with its config as params.

    Args:
        config: The pipeline config.
        parent_run_id: The pipeline's MLflow run.
        stage: The stage name; its section (``data`` for ``prepare_data``) becomes params.
        tracking_uri: The MLflow tracking URI.
        flow_run_url: The Prefect UI page of the flow run, set as tag :data:`TAG_FLOW_RUN_URL`.
            None: no tag.

    Returns:
        The nested MLflow run id.

    Raises:
        ConfigError: unknown stage.
        MlflowException: the parent run does not exist, or the store rejects a write.
    """
    client = MlflowClient(tracking_uri)
    parent = client.get_run(parent_run_id)
    tags = {TAG_PARENT: parent_run_id, TAG_STAGE: stage, TAG_RUN_ID: parent.data.tags.get(TAG_RUN_ID, "")}
    tags.update(_flow_run_tags(flow_run_url))
    run = client.create_run(parent.info.experiment_id, tags=tags, run_name=stage)
    section = get_stage(stage).section
    params = flatten_params(config.section(stage), section)
    params["seed"] = str(config.seed)
    _log_params(client, run.info.run_id, params)
    return run.info.run_id


def finish_stage_run(run_id: str, manifest: Any, output_uri: str | None, status: str, *, tracking_uri: str) -> None:
    """Log a stage's outcome and terminate its MLflow run.

    The manifest becomes the artifact ``manifests/<kind>.json``. A training stage's manifest
    metrics are not copied into run metrics (the trainer logged their per-step history into this
    run already: no ``final/*`` duplicates); a stage without an optimizer loop (prepare_data,
    score, evaluate) gets the manifest metrics it did not log itself, under their own names.

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
    if manifest is not None:
        client.log_dict(run_id, manifest.model_dump(mode="json"), f"manifests/{manifest.kind}.json")
        if not get_stage(manifest.stage).trains:  # no step history: its numbers are these
            logged = set(client.get_run(run_id).data.metrics)
            missing = {k: v for k, v in manifest.metrics.items() if sanitize_metric_name(k) not in logged}
            log_pipeline_metrics(run_id, missing, tracking_uri=tracking_uri, step=int(manifest.global_step or 0))
    if output_uri:
        client.set_tag(run_id, TAG_OUTPUT_URI, output_uri)
    client.set_terminated(run_id, status=status)


def log_pipeline_metrics(parent_run_id: str, metrics: dict[str, float], *, tracking_uri: str, step: int = 0) -> None:
    """Log the pipeline's headline metrics (e.g. evaluate's) on its parent run.

    Names are sanitised with :func:`trainer_core.tracking.sanitize_metric_name`; NaN and
    infinite values are skipped (MLflow stores them but they break charts and comparisons).

    Args:
        parent_run_id: The pipeline's MLflow run (:func:`start_pipeline_run`).
        metrics: Metric name -> value.
        tracking_uri: The MLflow tracking URI.
        step: The step recorded with every value.

    Raises:
        TypeError, ValueError: a value is not a number.
        MlflowException: the run does not exist or the store rejects the write.
    """
    now_ms = int(time.time() * 1000)
    finite = {sanitize_metric_name(k): float(v) for k, v in metrics.items() if math.isfinite(float(v))}
    batch = [Metric(k, v, now_ms, step) for k, v in finite.items()]
    client = MlflowClient(tracking_uri)
    for start in range(0, len(batch), _MAX_METRICS_PER_BATCH):
        client.log_batch(parent_run_id, metrics=batch[start : start + _MAX_METRICS_PER_BATCH])


def finish_pipeline_run(run_id: str, status: str, *, tracking_uri: str) -> None:
    """Terminate the pipeline's parent MLflow run with ``status`` (see :func:`finish_stage_run`)."""
    MlflowClient(tracking_uri).set_terminated(run_id, status=_mlflow_status(status))
