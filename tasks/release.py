"""Release of a completed run: its headline metrics on the parent MLflow run, its quality gates,
and its final policy as a new version of the registered model.

A run whose stages all completed is judged against ``evaluate.gates`` (``tasks/gates.py``); with
``tracking.registered_model_name`` set, its final policy (``tracking.registered_stage``, default
the last policy stage it trained) becomes a new model version tagged with the run id and the
config and data fingerprints, and gets the alias ``champion`` only when every gate passed, else
``candidate``. So a nightly deployment never silently replaces a better model: the champion alias
moves only forward.
"""

from __future__ import annotations

from typing import Any

from tasks import mlflow_models, tracking
from tasks.gates import GateResult, check_gates, gate_failure_message
from tasks.results import PipelineRun, StageResult
from trainer_core.config import config_hash
from trainer_core.registry import get_stage, policy_stages

CHAMPION = "champion"
CANDIDATE = "candidate"


def registered_stage(run: PipelineRun) -> str | None:
    """The stage whose final model is registered: ``tracking.registered_stage``, else the last
    policy stage of the run in pipeline order; None when the run trains no policy."""
    config = run.config
    if config.tracking.registered_stage:
        return config.tracking.registered_stage
    trained = [s for s in policy_stages() if s in config.stages and get_stage(s).trains]
    return trained[-1] if trained else None


def _version_tags(run: PipelineRun, stage: str, results: dict[str, StageResult]) -> dict[str, str]:
    data = results.get("prepare_data")
    tags = {
        "posttrain.run_id": run.run_id,
        "posttrain.stage": stage,
        "posttrain.config_hash": config_hash(run.config),
        "posttrain.fingerprint": results[stage].fingerprint or "",
        "posttrain.output_uri": results[stage].output_uri or "",
    }
    if data is not None and data.fingerprint:
        tags["posttrain.data_fingerprint"] = data.fingerprint
    if run.flow_run_url:
        tags[tracking.TAG_FLOW_RUN_URL] = run.flow_run_url
    return tags


def release(run: PipelineRun, results: dict[str, StageResult], headline: dict[str, float]) -> dict[str, Any]:
    """Judge the gates of a completed run and register its final policy.

    Args:
        run: The pipeline run (its headline metrics are already on the parent MLflow run).
        results: Every stage's result, all completed.
        headline: The run's headline metrics (``tasks.summary.headline_metrics``).

    A run with a gate it could not judge (its stage not in the run) is registered as a candidate:
    the champion moves only on a run every gate judged and passed.

    Returns:
        ``{"gates": [GateResult.as_dict()...], "passed": bool, "judged": bool, "failure": message or None,
        "registered_model": {"name", "version", "alias", "stage", "model_uri"} or None}``.

    Raises:
        MlflowException: the registry refused a write.
    """
    config = run.config
    name = config.tracking.registered_model_name
    champion = mlflow_models.champion_metrics(name, tracking_uri=run.tracking_uri) if name else None
    gates: list[GateResult] = check_gates(config.evaluate.gates, headline, champion, list(config.stages))
    failure = gate_failure_message(gates)
    judged = all(g.judged for g in gates)
    outcome: dict[str, Any] = {
        "gates": [g.as_dict() for g in gates], "passed": failure is None, "judged": judged, "failure": failure,
        "registered_model": None,
    }
    stage = registered_stage(run)
    if not name or stage is None:
        return outcome
    result = results[stage]
    model_uri = result.model_uri or mlflow_models.run_model_uri(result.mlflow_run_id)
    version = mlflow_models.register_model_version(
        name, model_uri, run_id=result.mlflow_run_id, tags=_version_tags(run, stage, results),
        tracking_uri=run.tracking_uri,
    )
    alias = CHAMPION if failure is None and judged else CANDIDATE
    mlflow_models.set_model_alias(name, alias, version, tracking_uri=run.tracking_uri)
    outcome["registered_model"] = {
        "name": name, "version": version, "alias": alias, "stage": stage, "model_uri": model_uri,
        "previous_champion": champion[0] if champion else None,
    }
    return outcome
