"""MLflow bookkeeping on the flow-process side: one parent run per pipeline run, one nested
run per stage, the stages' models, and the model registry.

The trainer logs step metrics into its stage run (``trainer_core.tracking.MetricLogger``); this
module creates the runs, logs the stage's flattened config as params, at the end logs the stage
manifest as an artifact and the final model as an MLflow ``transformers`` model (a LoggedModel
of MLflow 3, linked to its stage run), puts the pipeline's headline metrics on the parent run,
and registers model versions with aliases. Only ``mlflow.MlflowClient`` is used: no fluent API,
no process-global active run or tracking URI, so stage tasks may call it from several threads of
one process at once.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric, Param, RunStatus
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS
from pydantic import BaseModel, SecretStr

from trainer_core import storage
from trainer_core.config import PipelineConfig, config_hash
from trainer_core.registry import get_stage
from trainer_core.tracking import sanitize_metric_name

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
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
"""The experiment kind MLflow 3's UI opens as "Machine learning" (runs, metrics, models) rather
than as a GenAI app (traces); the UI's own kind selector writes the same tag."""

_TASK_BY_OUTPUT = {"policy": "text-generation", "reward_model": "text-classification"}
"""The transformers pipeline task of each model-producing stage output (``StageDef.output``)."""
_AUTO_CLASS_BY_TASK = {
    "text-generation": "AutoModelForCausalLM",
    "text-classification": "AutoModelForSequenceClassification",
}
_MODEL_REQUIREMENTS = ("torch", "transformers", "tokenizers", "safetensors")
"""The pip requirements of a logged model, pinned to the installed versions. Given explicitly:
MLflow's default list names torchvision (not installed here) and its inference loads the model
again in a subprocess."""


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
    """The id of the pipeline's experiment, created when missing; tagged as a model-training
    experiment (:data:`TAG_EXPERIMENT_KIND`) unless it already has a kind."""
    name = config.tracking.experiment_name
    found = client.get_experiment_by_name(name)
    if found is None:
        root = _local_path(config.storage.root)
        location = os.path.join(os.path.abspath(root), "mlflow-artifacts") if root is not None else None
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
    config: PipelineConfig, run_id: str, *, tracking_uri: str, flow_run_url: str | None = None
) -> str:
    """Create the parent MLflow run of one pipeline run, or reopen it when the run id is resumed.

    Args:
        config: The validated pipeline config (local root already absolute).
        run_id: The pipeline run id (also the MLflow run name).
        tracking_uri: The MLflow tracking URI (:func:`resolve_tracking_uri`).
        flow_run_url: The Prefect UI page of the flow run, set as tag :data:`TAG_FLOW_RUN_URL`
            (on a reopened run it replaces the earlier flow run's). None: no tag.

    Returns:
        The MLflow run id.

    Raises:
        MlflowException: when the store rejects a read or write.
    """
    client = MlflowClient(tracking_uri)
    experiment_id = _experiment_id(client, config)
    tagged = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_RUN_ID}` = '{run_id}'", max_results=1000)
    existing = [r for r in tagged if TAG_PARENT not in r.data.tags]  # stage runs carry the run id too
    if existing:
        parent = existing[0].info.run_id
        client.update_run(parent, status="RUNNING")
        if flow_run_url:
            client.set_tag(parent, TAG_FLOW_RUN_URL, flow_run_url)
        client.log_dict(parent, config.model_dump(mode="json"), "config.json")
        return parent
    tags = {TAG_RUN_ID: run_id, "posttrain.config_hash": config_hash(config), "posttrain.name": config.name}
    if flow_run_url:
        tags[TAG_FLOW_RUN_URL] = flow_run_url
    run = client.create_run(experiment_id, tags=tags, run_name=run_id)
    params = {"stages": ",".join(config.stages), "seed": str(config.seed)}
    params.update(flatten_params(config.model, "model"))
    params.update(flatten_params(config.backend, "backend"))
    _log_params(client, run.info.run_id, params)
    client.log_dict(run.info.run_id, config.model_dump(mode="json"), "config.json")
    return run.info.run_id


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
    if flow_run_url:
        tags[TAG_FLOW_RUN_URL] = flow_run_url
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

    The manifest becomes the artifact ``manifests/<kind>.json``; its metrics are not copied into
    run metrics (the trainer logged their per-step history into this run already).

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
    if output_uri:
        client.set_tag(run_id, TAG_OUTPUT_URI, output_uri)
    client.set_terminated(run_id, status=status)


def log_pipeline_metrics(
    parent_run_id: str, metrics: dict[str, float], *, tracking_uri: str, step: int = 0
) -> None:
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


def model_task(stage: str) -> str:
    """The transformers pipeline task of ``stage``'s final model, from the stage registry.

    Returns:
        ``"text-generation"`` for a policy (causal LM), ``"text-classification"`` for the reward
        model (sequence classification, one label).

    Raises:
        ConfigError: unknown stage.
        ValueError: the stage's final directory is not a model (``StageDef.produces_model``).
    """
    output = get_stage(stage).output
    if output not in _TASK_BY_OUTPUT:
        raise ValueError(f"stage {stage!r} produces no model (its final directory holds {output!r})")
    return _TASK_BY_OUTPUT[output]


def _pinned_requirements() -> list[str]:
    """``name==version`` for each installed package of :data:`_MODEL_REQUIREMENTS` (local
    version labels such as ``+cpu`` dropped: pip could not install them from PyPI)."""
    pinned = []
    for name in _MODEL_REQUIREMENTS:
        try:
            pinned.append(f"{name}=={importlib.metadata.version(name).split('+')[0]}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return pinned


@contextmanager
def _local_model_dir(model_dir_uri: str) -> Iterator[str]:
    """The HF model directory as a local path: a remote one is downloaded to a temporary
    directory, removed on exit.

    Raises:
        FileNotFoundError: the directory holds no ``config.json`` (or, remote, no files).
    """
    local = _local_path(model_dir_uri)
    with tempfile.TemporaryDirectory(prefix="posttrain-model-") as tmp:
        path = os.path.abspath(local) if local is not None else storage.download_dir(model_dir_uri, tmp)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"not a Hugging Face model directory (no config.json): {model_dir_uri}")
        yield path


def _link_step_metrics(client: MlflowClient, run_id: str, model_id: str, step: int) -> None:
    """Link the run's metrics logged at ``step`` to the LoggedModel ``model_id`` (its metric
    columns in the experiment's Models tab), as ``Model.log`` does."""
    linked = [
        Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id, run_id=run_id)
        for key in client.get_run(run_id).data.metrics
        for m in client.get_metric_history(run_id, key)
        if m.step == step and m.model_id is None
    ]
    for start in range(0, len(linked), _MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=linked[start : start + _MAX_METRICS_PER_BATCH])


def log_transformers_model(
    run_id: str,
    model_dir_uri: str,
    *,
    task: str,
    tracking_uri: str,
    artifact_path: str = "model",
    step: int | None = None,
) -> str:
    """Log a final HF model directory into the existing run ``run_id`` as an MLflow
    ``transformers`` model (weights, tokenizer, task, pip requirements).

    The model and tokenizer are loaded (``dtype="auto"``: the stored dtype) and saved with
    ``mlflow.transformers.save_model`` into a LoggedModel created with the client (as
    ``mlflow.transformers.log_model`` does, but without the fluent API's process-global run and
    tracking URI): the model appears in the experiment's Models tab and as an output of the run,
    with the run's params and ``posttrain.*`` tags. A failure after the LoggedModel was created
    leaves it in status FAILED.

    Args:
        run_id: The (stage) MLflow run the model belongs to; it must be active (not deleted).
        model_dir_uri: The model directory (``config.json``, safetensors, tokenizer files): a
            local path or any fsspec URI (downloaded to a temporary directory first).
        task: ``"text-generation"`` (causal LM) or ``"text-classification"`` (sequence
            classification, e.g. the reward model); see :func:`model_task`.
        tracking_uri: The MLflow tracking URI.
        artifact_path: The LoggedModel's name.
        step: The run's global step of this model: the run's metrics logged at this step are
            linked to the model (shown in the Models tab). None: no metrics linked.

    Returns:
        ``models:/<model_id>``: what ``mlflow.transformers.load_model`` (with the tracking URI
        set) and :func:`register_model_version` take.

    Raises:
        ValueError: an unsupported ``task``.
        FileNotFoundError: the directory does not exist or holds no ``config.json``.
        OSError: transformers cannot load the model or tokenizer from it.
        MlflowException: the run does not exist or the store rejects a write.
    """
    if task not in _AUTO_CLASS_BY_TASK:
        raise ValueError(f"unsupported model task {task!r}; expected one of {sorted(_AUTO_CLASS_BY_TASK)}")
    import mlflow.transformers
    import transformers
    from mlflow.models import Model

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    with _local_model_dir(model_dir_uri) as local, tempfile.TemporaryDirectory(prefix="posttrain-mlmodel-") as tmp:
        auto_class = getattr(transformers, _AUTO_CLASS_BY_TASK[task])
        components = {
            "model": auto_class.from_pretrained(local, dtype="auto"),
            "tokenizer": transformers.AutoTokenizer.from_pretrained(local),
        }
        tags = {k: v for k, v in run.data.tags.items() if k.startswith("posttrain.")}
        tags[TAG_OUTPUT_URI] = model_dir_uri
        logged = client.create_logged_model(
            run.info.experiment_id, name=artifact_path, source_run_id=run_id,
            tags=tags, params=dict(run.data.params), model_type=task,
        )
        try:
            client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=step or 0)])
            mlflow_model = Model(
                artifact_path=logged.artifact_location, model_uuid=logged.model_id,
                run_id=run_id, model_id=logged.model_id,
            )
            path = os.path.join(tmp, "model")
            mlflow.transformers.save_model(
                components, path, task=task, mlflow_model=mlflow_model, pip_requirements=_pinned_requirements()
            )
            client.log_model_artifacts(logged.model_id, path)
            if step is not None:
                _link_step_metrics(client, run_id, logged.model_id, step)
        except BaseException:
            with suppress(Exception):  # the original error matters more
                client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
            raise
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    return f"models:/{logged.model_id}"


def _model_id(model_uri: str) -> str | None:
    """The LoggedModel id of a ``models:/<model_id>`` URI; None for any other URI (a run's
    ``runs:/`` URI, a registered ``models:/<name>/<version>`` or ``models:/<name>@<alias>``)."""
    rest = model_uri.removeprefix("models:/")
    if rest == model_uri or not rest or "/" in rest or "@" in rest:
        return None
    return rest


def run_model_uri(run_id: str, artifact_path: str = "model") -> str:
    """``runs:/<run_id>/<artifact_path>``: the model logged in a run under that name.

    :func:`register_model_version` resolves it to the run's newest LoggedModel of that name
    (:func:`log_transformers_model`); ``mlflow.transformers.load_model`` does the same.
    """
    return f"runs:/{run_id}/{artifact_path}"


def _run_logged_model_id(client: MlflowClient, model_uri: str) -> str | None:
    """The newest LoggedModel named ``<path>`` of run ``<run_id>`` for ``runs:/<run_id>/<path>``;
    None for another URI or a run without one."""
    if not model_uri.startswith("runs:/"):
        return None
    run_id, _, name = model_uri.removeprefix("runs:/").partition("/")
    experiment_id = client.get_run(run_id).info.experiment_id
    found = client.search_logged_models(
        [experiment_id],
        filter_string=f"source_run_id = '{run_id}' AND name = '{name.rstrip('/')}'",
        order_by=[{"field_name": "creation_timestamp", "ascending": False}],
        max_results=1,
    )
    return found[0].model_id if found else None


def _is_rest_store(uri: str) -> bool:
    """True when ``uri`` names a tracking server (the store runs there, not in this process)."""
    return uri.split(":", 1)[0] in ("http", "https", "databricks", "databricks-uc", "uc")


def _link_model_version(client: MlflowClient, model_id: str, name: str, version: int | str) -> None:
    """Tag the LoggedModel with its registered version (``mlflow.modelVersions``, which the UI
    reads) as MLflow's tracking server does when it registers one (``version`` as the store
    returned it)."""
    entry = {"name": name, "version": version}
    found = client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS)
    versions = json.loads(found) if found else []
    if entry not in versions:
        client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps([*versions, entry])})


def register_model_version(
    name: str, model_uri: str, *, run_id: str, tags: dict[str, str], tracking_uri: str
) -> str:
    """Register ``model_uri`` as a new version of the registered model ``name``.

    The registered model is created when missing (another pipeline creating it at the same
    moment is fine). A LoggedModel (``models:/<model_id>``, or ``runs:/<run_id>/<name>`` of a
    run that logged one) is registered with ``models:/<model_id>`` as the version's source when
    the registry is a tracking server (its UI then links the version to the model); with a
    registry store in this process (sqlite, a database) the source is the model's artifact
    location instead, because MLflow's SQL store resolves a ``models:/`` source through the
    process-global tracking URI. Either way the LoggedModel is tagged with the version.

    Args:
        name: The registered model's name.
        model_uri: What :func:`log_transformers_model` returned (``models:/<model_id>``), or
            :func:`run_model_uri` of the run that logged it, or any model URI the registry takes
            as a source (a ``runs:/`` URI of plain run artifacts is passed on as it is).
        run_id: The MLflow run that produced the model (the stage run); :func:`champion_metrics`
            reads the metrics of its parent.
        tags: Tags of the new version.
        tracking_uri: The MLflow tracking URI (the registry is its store, unless
            ``MLFLOW_REGISTRY_URI`` names another).

    Returns:
        The new version number, as a string (``"1"``, ``"2"``...).

    Raises:
        MlflowException: the store rejects the registration (e.g. an invalid name, or a model
            id that does not exist).
    """
    client = MlflowClient(tracking_uri)
    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    model_id = _model_id(model_uri) or _run_logged_model_id(client, model_uri)
    rest = _is_rest_store(getattr(client, "_registry_uri", None) or tracking_uri)
    source = model_uri
    if model_id is not None:
        source = f"models:/{model_id}" if rest else client.get_logged_model(model_id).artifact_location
    version = client.create_model_version(name, source, run_id=run_id, tags=tags, model_id=model_id).version
    if model_id is not None and not rest:  # a tracking server tags the LoggedModel itself
        _link_model_version(client, model_id, name, version)
    return str(version)


def set_model_alias(name: str, alias: str, version: str, *, tracking_uri: str) -> None:
    """Point ``alias`` (e.g. ``"champion"``) of the registered model ``name`` at ``version``,
    moving it from the version that held it.

    Raises:
        MlflowException: no such registered model or version, or an invalid alias (a version
            string like ``v1`` is reserved by MLflow).
    """
    MlflowClient(tracking_uri).set_registered_model_alias(name, alias, str(version))


def model_version_by_alias(name: str, alias: str, *, tracking_uri: str) -> ModelVersion | None:
    """The version of registered model ``name`` that ``alias`` points at.

    Returns:
        The ``ModelVersion`` (its ``version`` is an int from a SQL store, a str from a server:
        compare ``str(v.version)``), or None when the registered model or the alias does not exist.

    Raises:
        MlflowException: when the store fails otherwise.
    """
    client = MlflowClient(tracking_uri)
    try:
        registered = client.get_registered_model(name)
    except MlflowException as e:
        if e.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            return None
        raise
    version = registered.aliases.get(alias)
    return client.get_model_version(name, version) if version is not None else None


def champion_metrics(
    name: str, *, tracking_uri: str, alias: str = "champion"
) -> tuple[str, dict[str, float]] | None:
    """The version ``alias`` points at and the metrics of the pipeline run that produced it.

    The version's run is a stage run; its tag ``mlflow.parentRunId`` names the pipeline's parent
    run, which holds the headline metrics (:func:`log_pipeline_metrics`). A version registered
    from a run without a parent reads that run's own metrics.

    Args:
        name: The registered model's name.
        tracking_uri: The MLflow tracking URI.
        alias: The alias to read.

    Returns:
        ``(version, {metric: latest value})``; the metrics are empty when the version names no
        run. None when the registered model or the alias does not exist.

    Raises:
        MlflowException: the version's run (or its parent) no longer exists, or the store fails.
    """
    version = model_version_by_alias(name, alias, tracking_uri=tracking_uri)
    if version is None:
        return None
    if not version.run_id:
        return str(version.version), {}
    client = MlflowClient(tracking_uri)
    run = client.get_run(version.run_id)
    parent_id = run.data.tags.get(TAG_PARENT)
    metrics = client.get_run(parent_id).data.metrics if parent_id else run.data.metrics
    return str(version.version), dict(metrics)


def finish_pipeline_run(run_id: str, status: str, *, tracking_uri: str) -> None:
    """Terminate the pipeline's parent MLflow run with ``status`` (see :func:`finish_stage_run`)."""
    MlflowClient(tracking_uri).set_terminated(run_id, status=_mlflow_status(status))
