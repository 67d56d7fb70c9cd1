"""The pipeline run's summary: ``<root>/runs/<run_id>/summary.json`` and a Prefect table artifact."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_table_artifact

from trainer_core.checkpoint import storage
from trainer_core.config import PipelineConfig, config_hash
from trainer_core.spec import join_uri, run_uri

SUMMARY_NAME = "summary.json"
_STAGE_FIELDS = ("status", "output_uri", "wall_s", "metrics", "mlflow_run_id")
_TABLE_METRICS = 6
"""Metrics shown per stage in the Prefect table (all of them are in summary.json and MLflow)."""


def summary_uri(config: PipelineConfig, run_id: str) -> str:
    """``<root>/runs/<run_id>/summary.json``."""
    return join_uri(run_uri(config.storage.root, run_id), SUMMARY_NAME)


def stage_entry(result: dict[str, Any]) -> dict[str, Any]:
    """One stage's summary entry: its status, output, wall time, metrics, MLflow run (and error)."""
    entry = {k: result.get(k) for k in _STAGE_FIELDS}
    entry["metrics"] = dict(entry["metrics"] or {})
    if result.get("error"):
        entry["error"] = result["error"]
    if result.get("reused"):
        entry["reused"] = True
    return entry


def build_summary(
    config: PipelineConfig,
    run_id: str,
    results: dict[str, dict[str, Any]],
    *,
    tracking_uri: str,
    parent_run_id: str,
) -> dict[str, Any]:
    """The summary document; ``status`` is ``completed`` only when every stage completed.

    Args:
        config: The pipeline config.
        run_id: Pipeline run id.
        results: Stage name -> result (``run_stage``'s return value, or a failed/skipped record).
        tracking_uri: MLflow tracking URI.
        parent_run_id: The pipeline's MLflow run.
    """
    stages = {name: stage_entry(results[name]) for name in config.stages if name in results}
    done = len(stages) == len(config.stages) and all(s["status"] == "completed" for s in stages.values())
    return {
        "run_id": run_id,
        "status": "completed" if done else "failed",
        "stages": stages,
        "mlflow": {"tracking_uri": tracking_uri, "parent_run_id": parent_run_id},
        "config_hash": config_hash(config),
    }


def _metrics_cell(metrics: dict[str, float]) -> str:
    shown = sorted(metrics.items())[:_TABLE_METRICS]
    more = len(metrics) - len(shown)
    text = ", ".join(f"{k}={v:.4g}" for k, v in shown)
    return f"{text}, +{more} more" if more > 0 else text


def write_summary(config: PipelineConfig, summary: dict[str, Any]) -> str:
    """Write ``summary.json``, publish a Prefect table artifact of the stages; return the URI."""
    uri = summary_uri(config, summary["run_id"])
    storage.write_json(uri, summary)
    rows = [
        {
            "stage": name,
            "status": entry["status"],
            "wall_s": round(entry["wall_s"], 1) if entry.get("wall_s") is not None else None,
            "metrics": _metrics_cell(entry["metrics"]),
            "output_uri": entry["output_uri"],
        }
        for name, entry in summary["stages"].items()
    ]
    create_table_artifact(rows, key="pipeline-summary", description=f"{summary['run_id']}: {summary['status']}")
    return uri
