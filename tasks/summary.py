"""The pipeline run's summary: ``<root>/runs/<run_id>/summary.json`` and a Prefect table artifact."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_table_artifact

from tasks.results import PipelineRun, StageResult
from trainer_core import storage
from trainer_core.config import config_hash

_TABLE_METRICS = 6
"""Metrics shown per stage in the Prefect table (all of them are in summary.json and MLflow)."""


def build_summary(run: PipelineRun, results: dict[str, StageResult], interrupted: str | None = None) -> dict[str, Any]:
    """The summary document; ``status`` is ``completed`` only when every stage completed,
    ``interrupted`` when the flow was stopped (``interrupted`` says how), else ``failed``.

    Args:
        run: The pipeline run.
        results: Stage name -> result, for the stages of ``run.config.stages``.
        interrupted: what stopped the flow (e.g. ``KeyboardInterrupt: signal SIGTERM``), if anything.

    Returns:
        ``{"run_id", "status", "stages": {stage: StageResult.summary_entry()}, "mlflow":
        {"tracking_uri", "parent_run_id"}, "config_hash"}``, stages in pipeline order.
    """
    stages = {name: results[name].summary_entry() for name in run.config.stages if name in results}
    done = len(stages) == len(run.config.stages) and all(s["status"] == "completed" for s in stages.values())
    status = "interrupted" if interrupted else "completed" if done else "failed"
    summary: dict[str, Any] = {
        "run_id": run.run_id,
        "status": status,
        "stages": stages,
        "mlflow": {"tracking_uri": run.tracking_uri, "parent_run_id": run.parent_mlflow_run_id},
        "config_hash": config_hash(run.config),
    }
    if interrupted:
        summary["interrupted"] = interrupted
    return summary


def _metrics_cell(metrics: dict[str, float]) -> str:
    shown = sorted(metrics.items())[:_TABLE_METRICS]
    more = len(metrics) - len(shown)
    text = ", ".join(f"{k}={v:.4g}" for k, v in shown)
    return f"{text}, +{more} more" if more > 0 else text


def _status_cell(entry: dict[str, Any]) -> str:
    if entry["status"] == "skipped":
        because = entry["skipped_because"]
        return "skipped (interrupted)" if because == "interrupted" else f"skipped ({because} failed)"
    return "completed (reused)" if entry.get("reused") else entry["status"]


def write_summary(run: PipelineRun, summary: dict[str, Any]) -> str:
    """Write ``summary.json``, publish a Prefect table artifact of the stages; return the URI."""
    uri = run.layout.summary
    storage.write_json(uri, summary)
    rows = [
        {
            "stage": name,
            "status": _status_cell(entry),
            "wall_s": round(entry["wall_s"], 1) if entry.get("wall_s") is not None else None,
            "metrics": _metrics_cell(entry["metrics"]),
            "output_uri": entry["output_uri"],
        }
        for name, entry in summary["stages"].items()
    ]
    create_table_artifact(rows, key="pipeline-summary", description=f"{summary['run_id']}: {summary['status']}")
    return uri
