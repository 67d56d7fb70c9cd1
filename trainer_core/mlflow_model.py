"""A stage's final model as an MLflow ``transformers`` model, logged from the trainer side.

Loading a model needs torch and transformers, which the flow process never imports
(``.importlinter``), so the logging runs in a trainer-side process: rank 0 of the stage's
trainer right after it committed its final directory (``trainer_core.stages.runner``), or, when
that never happened (the trainer died between its commit and the logging, or the stage was
committed before models were logged), ``python -m trainer_core.mlflow_model <spec-uri>``, which
the stage task runs (``tasks/report/mlflow_models.py``). Either way the model becomes a LoggedModel of
MLflow 3 linked to the stage run, loadable with ``mlflow.transformers.load_model``.

Only ``mlflow.MlflowClient`` is used: no fluent API, no process-global active run or tracking
URI. (``mlflow.transformers.load_model("models:/...")`` itself reads the global tracking URI:
set ``MLFLOW_TRACKING_URI`` where models are loaded.)
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric

from trainer_core import storage
from trainer_core.processes import skip_exit_collection
from trainer_core.registry import get_stage
from trainer_core.spec import StageSpec, read_spec
from trainer_core.tracking import MODEL_NAME, stage_logged_model_uri, stage_model_name

TAG_OUTPUT_URI = "posttrain.output_uri"
_MAX_METRICS_PER_BATCH = 1000
_LOAD_LOCK = threading.Lock()
"""Serialises ``from_pretrained`` in this process: transformers' loader disables weight tying by
swapping ``PreTrainedModel.tie_weights`` on the class for the duration of a load
(``transformers.initialization.no_tie_weights``), so two loads in two threads can leave it swapped
for good, and every later load of a tied model then reports ``lm_head.weight`` missing."""


def _local_path(uri: str) -> str | None:
    """The filesystem path of a local URI (plain path or ``file://``), else None."""
    if uri.startswith("file://"):
        return uri[len("file://") :]
    return None if "://" in uri else uri


_TASK_BY_OUTPUT = {"policy": "text-generation", "reward_model": "text-classification"}
"""The transformers pipeline task of each model-producing stage output (``StageDef.output``)."""
_AUTO_CLASS_BY_TASK = {
    "text-generation": "AutoModelForCausalLM",
    "text-classification": "AutoModelForSequenceClassification",
}
_TASK_KWARGS = {"text-classification": {"num_labels": 1}}
"""``from_pretrained`` arguments of a task: a reward model has one output, also when an adapter's
base is the causal LM it started from."""
_MODEL_REQUIREMENTS = ("torch", "transformers", "tokenizers", "safetensors")
"""The pip requirements of a logged model, pinned to the installed versions. Given explicitly:
MLflow's default list names torchvision (not installed here) and its inference loads the model
again in a subprocess."""


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


def _directory_task(local: str, task: str) -> str:
    """``task``, except for an implicit reward model (a causal LM whose ``config.json`` carries
    :data:`~trainer_core.modeling.forwards.rewards.IMPLICIT_REWARD_KEY`): ``"text-generation"``."""
    from trainer_core.modeling.forwards.rewards import IMPLICIT_REWARD_KEY

    config = os.path.join(local, "config.json")
    if task == "text-classification" and os.path.exists(config):
        with open(config) as f:
            if IMPLICIT_REWARD_KEY in json.load(f):
                return "text-generation"
    return task


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
        FileNotFoundError: the directory holds neither ``config.json`` nor ``adapter_config.json``
            (or, remote, no files).
    """
    local = _local_path(model_dir_uri)
    with tempfile.TemporaryDirectory(prefix="posttrain-model-") as tmp:
        path = os.path.abspath(local) if local is not None else storage.download_dir(model_dir_uri, tmp)
        if not any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
            raise FileNotFoundError(
                f"not a Hugging Face model directory (no config.json) nor a PEFT adapter "
                f"(no adapter_config.json): {model_dir_uri}"
            )
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


class _HubLookupFilter(logging.Filter):
    """Drops MLflow's warnings that a local model has no Hugging Face Hub model card or license
    (it is not on the hub: a stage's own output); every other record passes."""

    DROPPED = ("The model card could not be retrieved", "Unable to find license information")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.DROPPED)


@contextmanager
def _no_hub_lookup_warnings() -> Iterator[None]:
    logger, quiet = logging.getLogger("mlflow.transformers"), _HubLookupFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def log_transformers_model(
    run_id: str,
    model_dir_uri: str,
    *,
    task: str,
    tracking_uri: str,
    artifact_path: str = MODEL_NAME,
    step: int | None = None,
) -> str:
    """Log a final HF model directory into the run ``run_id`` as an MLflow ``transformers`` model.

    The model and tokenizer are loaded (``dtype="auto"``: the stored dtype) and saved (weights,
    tokenizer, task, pinned pip requirements) with ``mlflow.transformers.save_model`` into a LoggedModel created with the client (as
    ``mlflow.transformers.log_model`` does, but without the fluent API's process-global run and
    tracking URI): the model appears in the experiment's Models tab and as an output of the run,
    with the run's params and ``posttrain.*`` tags. A failure after the LoggedModel was created
    leaves it in status FAILED.

    Args:
        run_id: The (stage) MLflow run the model belongs to; it must be active (not deleted).
        model_dir_uri: The model directory (``config.json``, safetensors, tokenizer files): a
            local path or any fsspec URI (downloaded to a temporary directory first); or a PEFT
            adapter directory, logged merged into its base model (``base_model_name_or_path``).
        task: ``"text-generation"`` (causal LM) or ``"text-classification"`` (sequence
            classification, e.g. the reward model; an implicit one is a causal LM, logged as text generation).
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
    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    with _local_model_dir(model_dir_uri) as local, tempfile.TemporaryDirectory(prefix="posttrain-mlmodel-") as tmp:
        task = _directory_task(local, task)
        components = _load_components(local, task)
        tags = {**{k: v for k, v in run.data.tags.items() if k.startswith("posttrain.")}, TAG_OUTPUT_URI: model_dir_uri}
        logged = client.create_logged_model(
            run.info.experiment_id,
            name=artifact_path,
            source_run_id=run_id,
            tags=tags,
            params=dict(run.data.params),
            model_type=task,
        )
        try:
            _save_logged_model(client, logged, run_id, components, task=task, tmp=tmp, step=step)
        except BaseException:
            with suppress(Exception):  # the original error matters more
                client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
            raise
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    return f"models:/{logged.model_id}"


def _load_components(local: str, task: str) -> dict[str, Any]:
    """The model (``dtype="auto"``; an adapter, as ``lora.merge_on_commit: false`` commits it,
    merged into its base) and the tokenizer of the directory ``local``, as
    ``mlflow.transformers.save_model`` takes them."""
    import transformers

    from trainer_core.modeling.models import from_pretrained_merged

    auto_class = getattr(transformers, _AUTO_CLASS_BY_TASK[task])
    with _LOAD_LOCK:
        return {
            "model": from_pretrained_merged(auto_class, local, dtype="auto", **_TASK_KWARGS.get(task, {})),
            "tokenizer": transformers.AutoTokenizer.from_pretrained(local),
        }


def _save_logged_model(
    client: MlflowClient, logged: Any, run_id: str, components: dict[str, Any], *, task: str, tmp: str, step: int | None
) -> None:
    """Make the LoggedModel ``logged`` an output of ``run_id`` and save ``components`` as its
    artifacts (through ``tmp``); with ``step``, link the run's metrics at that step to it."""
    import mlflow.transformers
    from mlflow.models import Model

    from trainer_core.modeling.models import without_absent_integrations

    client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=step or 0)])
    mlflow_model = Model(
        artifact_path=logged.artifact_location, model_uuid=logged.model_id, run_id=run_id, model_id=logged.model_id
    )
    path = os.path.join(tmp, "model")
    with without_absent_integrations(), _no_hub_lookup_warnings():  # a plain local model
        mlflow.transformers.save_model(
            components, path, task=task, mlflow_model=mlflow_model, pip_requirements=_pinned_requirements()
        )
    client.log_model_artifacts(logged.model_id, path)
    if step is not None:
        _link_step_metrics(client, run_id, logged.model_id, step)


def ensure_stage_model(spec: StageSpec, step: int | None = None) -> str | None:
    """The stage's final model as a LoggedModel of its MLflow run: the one logged already, else
    logged now from ``<spec.output_uri>/final``.

    Args:
        spec: The stage spec (config, tracking URI, MLflow run, output URI).
        step: The final global step (the run's metrics at that step are linked to the model).

    Returns:
        ``models:/<model_id>``, or None when the stage produces no model, the spec names no MLflow
        run, or ``tracking.log_models`` is off.

    Raises:
        FileNotFoundError: the final directory holds no model.
        MlflowException: the store rejects a write.
    """
    if not (get_stage(spec.stage).produces_model and spec.config.tracking.log_models and spec.mlflow_run_id):
        return None
    client = MlflowClient(spec.tracking_uri)
    found = stage_logged_model_uri(client, spec.stage, spec.mlflow_run_id)
    if found is not None:
        return found
    from trainer_core.storage import StageLayout

    return log_transformers_model(
        spec.mlflow_run_id,
        StageLayout(spec.output_uri).final,
        task=model_task(spec.stage),
        tracking_uri=spec.tracking_uri,
        artifact_path=stage_model_name(spec.stage),
        step=step,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer_core.mlflow_model <spec-uri>``: :func:`ensure_stage_model` for a
    committed stage; prints the model URI (or nothing) as the last line. Exit 0, or 1 on error."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m trainer_core.mlflow_model <spec-uri>", file=sys.stderr)
        return 2
    spec = read_spec(args[0])
    storage.configure(spec.config.storage)
    from trainer_core.checkpoint.manifest import read_manifest
    from trainer_core.storage import StageLayout

    manifest = read_manifest(StageLayout(spec.output_uri).final)
    print(ensure_stage_model(spec, manifest.global_step) or "")
    return 0


if __name__ == "__main__":
    skip_exit_collection()
    raise SystemExit(main())
