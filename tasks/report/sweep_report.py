"""A sweep's comparison: every point's headline metrics against its grid values, the best point,
and how sure the choice is.

:func:`compare` ranks the completed points by the sweep's metric (higher is better) and pairs the
best with the runner-up on the same held-out problems when the metric has a per-problem value
(exact match, pass@k, avg@n, a harness metric: the two points' evaluate sample tables,
:func:`~trainer_core.objectives.paired.paired_verdicts`), as a gate with ``min_gain_se`` does;
a gain within about twice its standard error is a choice these problems cannot make.
:func:`comparison_markdown` and :func:`comparison_figure` show it in the Prefect UI and MLflow.
"""

from __future__ import annotations

import math
from typing import Any

from matplotlib.figure import Figure

from tasks.report.release import read_sample_tables
from trainer_core.objectives.paired import SAMPLES_FILE, paired_gain, paired_verdicts, sample_column
from trainer_core.storage import join_uri


def _sample_rows(summary: dict[str, Any]) -> list[dict]:
    """A point's evaluate sample tables' rows (:func:`~tasks.report.release.read_sample_tables`); [] without."""
    output = ((summary.get("stages") or {}).get("evaluate") or {}).get("output_uri")
    return (read_sample_tables(join_uri(output, SAMPLES_FILE)) if output else None) or []


def _paired(best: dict[str, Any], runner_up: dict[str, Any], metric: str) -> tuple[float, float] | None:
    """The best point's paired gain over the runner-up on ``metric`` and its standard error, or
    None when the metric has no per-problem value or the tables share no problem."""
    policy, _, name = metric.partition("/")
    try:
        column = f"{policy}_{sample_column(name)}"
    except ValueError:
        return None
    baseline, other = paired_verdicts(_sample_rows(runner_up), column, _sample_rows(best), column)
    return paired_gain(baseline, other) if baseline else None


def compare(points: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Rank a sweep's points by ``metric``.

    Args:
        points: one entry per point: ``{"run_id", "values": {key: value}, "summary": the point's
            summary or None, "error": why it has none}``.
        metric: a headline metric, e.g. ``grpo/exact_match`` (higher is better).

    Returns:
        ``{"metric", "rows": [{"run_id", "values", "status", "value", "se"}...] (grid order),
        "best": run id or None, "runner_up": run id or None, "gain": best - runner-up,
        "gain_se": its paired standard error or None}``; a point without the metric (failed, or
        not evaluated) is not ranked.
    """
    rows = []
    for point in points:
        headline = (point.get("summary") or {}).get("headline") or {}
        value, se = headline.get(metric), headline.get(f"{metric}_se")
        status = (point.get("summary") or {}).get("status") or "failed"
        rows.append(
            {
                "run_id": point["run_id"],
                "values": point["values"],
                "status": status,
                "value": value if value is not None and math.isfinite(value) else None,
                "se": se,
                "error": point.get("error"),
            }
        )
    ranked = sorted((r for r in rows if r["value"] is not None), key=lambda r: -r["value"])
    out: dict[str, Any] = {
        "metric": metric,
        "rows": rows,
        "best": None,
        "runner_up": None,
        "gain": None,
        "gain_se": None,
    }
    if ranked:
        out["best"] = ranked[0]["run_id"]
    if len(ranked) > 1:
        by_id = {p["run_id"]: p.get("summary") or {} for p in points}
        best, second = ranked[0], ranked[1]
        out["runner_up"], out["gain"] = second["run_id"], best["value"] - second["value"]
        paired = _paired(by_id[best["run_id"]], by_id[second["run_id"]], metric)
        if paired is not None:
            out["gain"], out["gain_se"] = paired
    return out


def _values_cell(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items()) or "(base config)"


def comparison_markdown(sweep_id: str, comparison: dict[str, Any]) -> str:
    """The comparison as Markdown: a line naming the best point and its gain over the runner-up
    (with its standard error), then one table row per point."""
    metric, best = comparison["metric"], comparison["best"]
    if best is None:
        lead = f"Sweep `{sweep_id}`: no point has `{metric}`."
    else:
        values = next(r["values"] for r in comparison["rows"] if r["run_id"] == best)
        lead = f"Sweep `{sweep_id}`: best `{metric}` at {_values_cell(values)} (run `{best}`)"
        if comparison["runner_up"] is not None:
            se = comparison["gain_se"]
            noise = (
                f" ± {se:.3g} (paired SE; {'beyond' if comparison['gain'] > 2 * se else 'within'} 2 SE)"
                if se is not None
                else " (no per-problem values to pair)"
            )
            lead += f", {comparison['gain']:+.4g}{noise} over run `{comparison['runner_up']}`"
        lead += "."
    keys = list(comparison["rows"][0]["values"]) if comparison["rows"] else []
    lines = [
        lead,
        "",
        "| " + " | ".join([*keys, "run", "status", metric]) + " |",
        "| " + " | ".join(["---:"] * len(keys) + ["---", "---", "---:"]) + " |",
    ]
    for row in comparison["rows"]:
        value = "-" if row["value"] is None else f"{row['value']:.4g}" + (" **best**" if row["run_id"] == best else "")
        lines.append(
            "| "
            + " | ".join([*(str(row["values"][k]) for k in keys), f"`{row['run_id']}`", row["status"], value])
            + " |"
        )
    return "\n".join(lines)


def comparison_figure(comparison: dict[str, Any]) -> Figure | None:
    """The metric against the first grid key's values, one line per combination of the others
    (error bars where the metric has a standard error); None when no point has the metric."""
    rows = [r for r in comparison["rows"] if r["value"] is not None]
    if not rows:
        return None
    keys = list(rows[0]["values"])
    fig = Figure(figsize=(6, 3.5), dpi=100, layout="constrained")
    ax = fig.subplots()
    first = keys[0] if keys else None
    groups: dict[str, list[dict]] = {}
    for row in rows:
        label = (
            _values_cell({k: v for k, v in row["values"].items() if k != first})
            if len(keys) > 1
            else comparison["metric"]
        )
        groups.setdefault(label, []).append(row)
    for label, members in groups.items():
        xs = [str(r["values"][first]) if first else r["run_id"] for r in members]
        ax.errorbar(
            xs,
            [r["value"] for r in members],
            yerr=[r["se"] or 0.0 for r in members],
            marker="o",
            capsize=3,
            label=label,
        )
    ax.set_xlabel(first or "point")
    ax.set_ylabel(comparison["metric"])
    if len(groups) > 1:
        ax.legend(fontsize="small")
    return fig
