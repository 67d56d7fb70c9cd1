"""The pipeline run's summary: ``<root>/runs/<run_id>/summary.json`` and a Prefect table artifact.

The table has one row per stage and one column per headline metric (:data:`COLUMNS`), so
stages compare at a glance; evaluate's metrics go into the row of the model they measure
(``dpo/exact_match`` -> row ``dpo``, column ``exact_match``). Every metric stays in
summary.json and MLflow. :func:`headline_metrics` flattens the same numbers into
``{"<stage>/<metric>": value}`` for the MLflow parent run and quality gates.
"""

from __future__ import annotations

import re
from typing import Any

from mlflow import MlflowClient
from prefect.artifacts import create_markdown_artifact

from tasks.report.views import mlflow_run_url, mlflow_ui_url
from tasks.results import PipelineRun, StageResult
from trainer_core import storage
from trainer_core.config import config_hash
from trainer_core.registry import EVALUATED_METRICS

COLUMNS: dict[str, dict[str, str]] = {
    "pretrain": {"train_loss": "train/loss", "eval_loss": "eval/loss"},
    "sft": {"train_loss": "train/loss", "eval_loss": "eval/loss"},
    "reward_model": {"train_loss": "train/loss", "eval_loss": "eval/loss", "accuracy": "eval/accuracy"},
    "dpo": {"train_loss": "train/loss", "eval_loss": "eval/loss", "accuracy": "eval/rewards/accuracies"},
    "kto": {"train_loss": "train/loss", "eval_loss": "eval/loss", "kl": "eval/kl"},
    "ppo": {"train_loss": "train/loss", "reward": "reward_mean", "kl": "objective/kl", "accuracy": "verifier_accuracy"},
    "grpo": {
        "train_loss": "train/loss",
        "reward": "reward_mean",
        "kl": "objective/kl",
        "accuracy": "verifier_accuracy",
    },
    "score": {"reward": "reward_mean", "accuracy": "verifier_accuracy"},
}
"""Stage -> table column -> the key of its final metric (its manifest's ``metrics``: the last
value the trainer logged; see ``training/loop.py`` and ``training/rl/trainer.py``)."""

EVALUATE_STAGE = "evaluate"

_EVALUATE_CELLS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^(?P<row>[a-z0-9_]+)/exact_match$"), "exact_match"),
    (re.compile(r"^(?P<row>[a-z0-9_]+)_vs_sft/win_rate$"), "win_rate_vs_sft"),
    (re.compile(r"^(?P<row>sft)/eval_loss$"), "eval_loss"),
    (re.compile(r"^(?P<row>reward_model)/eval_accuracy$"), "accuracy"),
    (re.compile(r"^(?P<row>dpo)/eval_reward_accuracy$"), "accuracy"),
)
"""Evaluate metric name -> (row, column) of the table (``trainer_core/stages/evaluate.py``). Its
held-out numbers replace the training stage's own ``eval_loss`` / ``accuracy`` in that row:
evaluate measures the final model on more held-out data."""

TABLE_COLUMNS: tuple[str, ...] = (
    "stage",
    "status",
    "wall_s",
    "train_loss",
    "eval_loss",
    "accuracy",
    "reward",
    "kl",
    "exact_match",
    "win_rate_vs_sft",
    "mlflow_run",
    "output_uri",
)
"""The table's columns, in order (a stage without a metric has an empty cell)."""


def _evaluate_cell(key: str) -> tuple[str, str] | None:
    """The table's (row, column) for evaluate's metric ``key`` (:data:`_EVALUATE_CELLS`), or None."""
    for pattern, column in _EVALUATE_CELLS:
        if m := pattern.match(key):
            return m.group("row"), column
    return None


def headline_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """A run's headline numbers, flat: ``{"<stage>/<metric>": value}``, one name per quantity.

    Args:
        summary: A summary from :func:`build_summary` (its ``stages`` entries' ``metrics``).

    Returns:
        Every evaluate metric under its own name (``dpo/exact_match``, ``dpo_vs_sft/win_rate``,
        ``sft/eval_loss``), as quality gates name them; for each training (or scoring) stage, its
        final :data:`COLUMNS` metrics under ``<stage>/<manifest key>`` (``sft/train/loss``,
        ``ppo/reward_mean``), except one evaluate measured again on the final model
        (:data:`~trainer_core.registry.EVALUATED_METRICS`): with evaluate in the run the parent
        MLflow run has ``sft/eval_loss``, not also SFT's last ``sft/eval/loss`` (one quantity under
        two names in MLflow's charts), as the summary table shows evaluate's number in that cell.
    """
    evaluated = (summary["stages"].get(EVALUATE_STAGE) or {}).get("metrics") or {}
    out: dict[str, float] = {k: float(v) for k, v in evaluated.items()}
    for stage, entry in summary["stages"].items():
        if stage == EVALUATE_STAGE:
            continue
        metrics = entry.get("metrics") or {}
        for key in COLUMNS.get(stage, {}).values():
            name = f"{stage}/{key}"
            if key in metrics and EVALUATED_METRICS.get(name) not in evaluated:
                out[name] = float(metrics[key])
    return out


def build_summary(run: PipelineRun, results: dict[str, StageResult], interrupted: str | None = None) -> dict[str, Any]:
    """The summary document; ``status`` is ``completed`` only when every stage completed,
    ``interrupted`` when the flow was stopped (``interrupted`` says how), else ``failed``.

    Args:
        run: The pipeline run.
        results: Stage name -> result, for the stages of ``run.config.stages``.
        interrupted: what stopped the flow (e.g. ``KeyboardInterrupt: signal SIGTERM``), if anything.

    Returns:
        ``{"run_id", "status", "stages": {stage: StageResult.summary_entry()}, "headline":
        headline_metrics(...), "mlflow": {"tracking_uri", "parent_run_id"}, "config_hash"}``,
        stages in pipeline order.
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
    summary["headline"] = headline_metrics(summary)
    if interrupted:
        summary["interrupted"] = interrupted
    return summary


def _status_cell(entry: dict[str, Any]) -> str:
    if entry["status"] == "skipped":
        because = entry["skipped_because"]
        return "skipped (interrupted)" if because == "interrupted" else f"skipped ({because} failed)"
    return "completed (reused)" if entry.get("reused") else entry["status"]


def _number(value: float) -> float:
    """Four significant digits: a table to read, not to compute with (summary.json has them all)."""
    return float(f"{value:.4g}")


def _run_cell(run_id: str | None, ui_url: str | None, experiment_id: str | None) -> str | None:
    if run_id is None:
        return None
    if ui_url is None or experiment_id is None:
        return run_id
    return f"[{run_id}]({mlflow_run_url(ui_url, experiment_id, run_id)})"


def _experiment_id(run: PipelineRun, ui_url: str | None) -> str | None:
    """The experiment of the run's MLflow runs (one read of the parent run), when links are made."""
    if ui_url is None:
        return None
    try:
        return MlflowClient(run.tracking_uri).get_run(run.parent_mlflow_run_id).info.experiment_id
    except Exception:  # noqa: BLE001 - no links rather than no summary
        return None


def summary_rows(summary: dict[str, Any], ui_url: str | None = None, experiment_id: str | None = None) -> list[dict]:
    """The table artifact's rows: one per stage (a ``base`` row first when evaluate measured the
    base model), columns :data:`TABLE_COLUMNS`.

    Args:
        summary: A summary from :func:`build_summary`.
        ui_url: The MLflow UI base URL; None: the ``mlflow_run`` column holds bare run ids.
        experiment_id: The experiment of the stage runs (needed for links).

    Returns:
        Rows as dicts, every column present (None where a stage has no value).
    """
    rows: dict[str, dict[str, Any]] = {}
    for name, entry in summary["stages"].items():
        metrics = entry.get("metrics") or {}
        row = dict.fromkeys(TABLE_COLUMNS)
        wall_s = entry.get("wall_s")
        row.update(
            stage=name,
            status=_status_cell(entry),
            wall_s=round(wall_s, 1) if wall_s is not None else None,
            mlflow_run=_run_cell(entry.get("mlflow_run_id"), ui_url, experiment_id),
            output_uri=entry.get("output_uri"),
        )
        row.update({col: _number(metrics[key]) for col, key in COLUMNS.get(name, {}).items() if key in metrics})
        rows[name] = row
    for key, value in (summary["stages"].get(EVALUATE_STAGE, {}).get("metrics") or {}).items():
        if (cell := _evaluate_cell(key)) is not None:
            target, column = cell
            if target not in rows:  # the base model, or a stage reused from another run
                rows[target] = {**dict.fromkeys(TABLE_COLUMNS), "stage": target, "status": "evaluated only"}
            rows[target][column] = _number(value)
    order = {name: i for i, name in enumerate(["base", *summary["stages"]])}
    return sorted(rows.values(), key=lambda r: order.get(r["stage"], len(order)))


def _cell(column: str, value: Any) -> str:
    if value is None:
        return ""
    if column == "output_uri":
        return f"`{value}`"
    return str(value).replace("|", "\\|")


def summary_markdown(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The ``pipeline-summary`` artifact: the run's status, what its release did (the first line
    of :func:`~tasks.report.release.release_markdown`), and :func:`summary_rows` as a Markdown table (a
    Markdown artifact, so the MLflow links render as links in both Prefect UIs; a table artifact
    shows them as raw ``[id](url)`` text)."""
    from tasks.report.release import release_markdown

    lines = [f"**Run `{summary['run_id']}`: {summary['status']}**", ""]
    release = summary.get("release") or {}
    if "gates" in release:
        lines += [release_markdown(summary["run_id"], release).split("\n", 1)[0], ""]
    elif release.get("error"):
        lines += [f"Release failed: {release['error']}", ""]
    lines += [
        "| " + " | ".join(c.replace("_", " ") for c in TABLE_COLUMNS) + " |",
        "| " + " | ".join("---" for _ in TABLE_COLUMNS) + " |",
    ]
    lines += ["| " + " | ".join(_cell(c, row.get(c)) for c in TABLE_COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def write_summary(run: PipelineRun, summary: dict[str, Any]) -> str:
    """Write ``summary.json``, publish the Prefect Markdown artifact ``pipeline-summary``
    (:func:`summary_markdown`); return the URI."""
    uri = run.layout.summary
    storage.write_json(uri, summary)
    ui_url = mlflow_ui_url(run.config, run.tracking_uri)
    rows = summary_rows(summary, ui_url, _experiment_id(run, ui_url))
    create_markdown_artifact(
        summary_markdown(summary, rows), key="pipeline-summary", description=f"{summary['run_id']}: {summary['status']}"
    )
    return uri
