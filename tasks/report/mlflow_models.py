"""The stages' models in MLflow, from the flow process: each training stage's final model as
a LoggedModel of its stage run (logged trainer-side: ``trainer_core/mlflow_model.py``), and the
model registry (versions, aliases, the champion's metrics).

Only ``mlflow.MlflowClient`` is used, as in ``tasks/report/tracking.py``: no fluent API, no
process-global active run or tracking URI, so stage tasks may call it from several threads of
one process at once. (``mlflow.transformers.load_model("models:/...")`` itself reads the global
tracking URI: set ``MLFLOW_TRACKING_URI`` where models are loaded.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

from tasks.report.tracking import TAG_PARENT
from trainer_core.config import PipelineConfig
from trainer_core.registry import get_stage
from trainer_core.tracking import MODEL_NAME, logged_model_uri, stage_logged_model_uri


def _model_id(model_uri: str) -> str | None:
    """The LoggedModel id of a ``models:/<model_id>`` URI; None for any other URI (a run's
    ``runs:/`` URI, a registered ``models:/<name>/<version>`` or ``models:/<name>@<alias>``)."""
    rest = model_uri.removeprefix("models:/")
    if rest == model_uri or not rest or "/" in rest or "@" in rest:
        return None
    return rest


def run_model_uri(run_id: str, artifact_path: str = MODEL_NAME) -> str:
    """``runs:/<run_id>/<artifact_path>``: the model logged in a run under that name.

    :func:`register_model_version` resolves it to the run's newest LoggedModel of that name
    (:func:`log_transformers_model`); ``mlflow.transformers.load_model`` does the same.
    """
    return f"runs:/{run_id}/{artifact_path}"


def _run_logged_model_id(client: MlflowClient, model_uri: str) -> str | None:
    """The newest READY LoggedModel named ``<path>`` of run ``<run_id>`` for
    ``runs:/<run_id>/<path>``; None for another URI or a run without one."""
    if not model_uri.startswith("runs:/"):
        return None
    run_id, _, name = model_uri.removeprefix("runs:/").partition("/")
    return _model_id(logged_model_uri(client, run_id, name.rstrip("/")) or "")


def stage_model_uri(
    stage: str, config: PipelineConfig, mlflow_run_id: str, *, tracking_uri: str, log_missing: Callable[[], None]
) -> str | None:
    """The stage's final model as an MLflow model URI: the LoggedModel of its stage run.

    The trainer logs it right after committing (``trainer_core.mlflow_model``); when it did not
    (it died in between, or the stage was committed before models were logged), ``log_missing``
    is called to log it (the stage task runs ``python -m trainer_core.mlflow_model <spec-uri>``:
    loading a model needs torch, which this process never imports) and the run is read again.

    Returns:
        ``models:/<model_id>``, or None when the stage produces no model or
        ``tracking.log_models`` is off.

    Raises:
        RuntimeError: the model is still missing after ``log_missing``.
        MlflowException: the store fails.
    """
    if not (get_stage(stage).produces_model and config.tracking.log_models):
        return None
    client = MlflowClient(tracking_uri)
    found = stage_logged_model_uri(client, stage, mlflow_run_id)
    if found is None:
        log_missing()
        found = stage_logged_model_uri(client, stage, mlflow_run_id)
    if found is None:
        raise RuntimeError(f"stage {stage}: no MLflow model in run {mlflow_run_id} after logging it")
    return found


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


def register_model_version(name: str, model_uri: str, *, run_id: str, tags: dict[str, str], tracking_uri: str) -> str:
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
        run_id: The MLflow run that produced the model (the stage run); :func:`read_champion`
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


@dataclass(frozen=True)
class Champion:
    """The version an alias points at, read once.

    Attributes:
        version: The version number, as MLflow writes it (``"3"``).
        metrics: The metrics of the pipeline run that produced it (``{metric: latest value}``);
            empty when the version names no run.
        tags: The version's tags (``posttrain.eval_samples_uri``: its evaluate sample table).
    """

    version: str
    metrics: dict[str, float]
    tags: dict[str, str]


def read_champion(name: str, *, tracking_uri: str, alias: str = "champion") -> Champion | None:
    """The version ``alias`` points at, its tags and the metrics of the pipeline run that produced it.

    The version's run is a stage run; its tag ``mlflow.parentRunId`` names the pipeline's parent
    run, which holds the headline metrics (:func:`log_pipeline_metrics`). A version registered
    from a run without a parent reads that run's own metrics. The alias is read once, so the
    metrics and the tags are those of one version.

    Args:
        name: The registered model's name.
        tracking_uri: The MLflow tracking URI.
        alias: The alias to read.

    Returns:
        The :class:`Champion`; None when the registered model or the alias does not exist.

    Raises:
        MlflowException: the version's run (or its parent) no longer exists, or the store fails.
    """
    version = model_version_by_alias(name, alias, tracking_uri=tracking_uri)
    if version is None:
        return None
    tags = dict(version.tags or {})
    if not version.run_id:
        return Champion(str(version.version), {}, tags)
    client = MlflowClient(tracking_uri)
    run = client.get_run(version.run_id)
    parent_id = run.data.tags.get(TAG_PARENT)
    metrics = client.get_run(parent_id).data.metrics if parent_id else run.data.metrics
    return Champion(str(version.version), dict(metrics), tags)
