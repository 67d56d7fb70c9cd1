"""The sweep flow: a grid of recipes over one pipeline, compared, and the best point released.

One parent flow run; each grid point a pipeline run of its own (``flows/pipeline.py``, as a
subflow of the task ``sweep_point``), run id ``<sweep_id>-<hash of its values>``
(``tasks/sweep.py``). Before anything runs, every point's stage fingerprints are computed from
its config; a stage two points would train alike (the same fingerprint: prepare_data and SFT when
only DPO's beta and GRPO's learning rate are swept, GRPO when only DPO's beta differs) is trained
by the first point that has it and adopted by the others. Points run side by side,
``sweep.max_parallel_points`` at once; their GPU stages hold the GPU concurrency limit's slots
as any stage does.

The sweep's MLflow run is the parent of every point's pipeline run. At the end the flow compares
the points by ``sweep.metric`` (``tasks/report/sweep_report.py``: a table, a picture, the best
point and its paired gain over the runner-up with its standard error) as a Prefect artifact
``sweep-comparison`` and on the sweep's MLflow run, and, when every point completed, releases the
best point through the gates and the registry as a single run is released (the others as
candidates with ``sweep.register_others``). It writes ``<root>/sweeps/<sweep_id>/summary.json``.

Run the same sweep id again to resume: each point resumes as a pipeline run does (its committed
stages reused), so only what is missing runs; a value added to the grid adds points whose
stages the old points already trained are adopted from them.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed, wait
from prefect.runtime import flow_run as prefect_flow_run

from flows.pipeline import post_training_pipeline
from flows.settings import RunSettings, resolve_config
from tasks.graph import ABORT_WAIT_S, max_parallel_stages
from tasks.launch.aborts import abort_launches, forget_launch_group
from tasks.report import tracking
from tasks.report.release import publish_release, registered_stage_of, release
from tasks.report.sweep_report import compare, comparison_figure, comparison_markdown
from tasks.report.views import figure_png, png_markdown
from tasks.results import PipelineRun, StageResult, SweepPoint
from tasks.runs import check_run_id, new_run_id
from tasks.sweep import (
    SweepFailed,
    expand_grid,
    forget_board,
    owners,
    point_config,
    point_run_id,
    stage_keys,
    sweep_board,
    sweep_grid,
)
from trainer_core import storage
from trainer_core.config import PipelineConfig, config_value
from trainer_core.storage import RunLayout, join_uri


def sweep_run_name() -> str:
    """The Prefect flow run's name: the ``sweep_id`` parameter, or ``sweep-<time>``."""
    return str(prefect_flow_run.parameters.get("sweep_id") or f"sweep-{time.strftime('%Y%m%d-%H%M%S')}")


@task(name="sweep_point", cache_policy=NO_CACHE, persist_result=False)
def sweep_point(config: PipelineConfig, run_id: str, point: SweepPoint) -> dict[str, Any]:
    """One point's pipeline run (a subflow). Should it end before its stages did (refused, or a
    crash of the flow itself), its stages are failed on the sweep's board, so that no other point
    waits for them."""
    try:
        return post_training_pipeline(config=config, run_id=run_id, sweep=point)
    except BaseException as e:
        sweep_board(point.sweep_id).abandon(run_id, config.stages, e)
        raise


def _points_at_once(config: PipelineConfig, points: int) -> int:
    """``sweep.max_parallel_points``; else every point when GPU stages are bounded by a GPU
    concurrency limit (``max_parallel_stages`` is None then), else 2."""
    if config.sweep.max_parallel_points is not None:
        return config.sweep.max_parallel_points
    return points if max_parallel_stages(config) is None else min(points, 2)


def _run_points(plan: list[tuple[str, PipelineConfig, SweepPoint]], at_once: int, log: Any) -> list[dict[str, Any]]:
    """Run the points, ``at_once`` at a time in grid order; each one's outcome: ``{"run_id",
    "values", "summary" (None when it wrote none), "error"}``."""
    outcomes: dict[str, dict[str, Any]] = {}
    waiting, running = list(plan), {}
    while waiting or running:
        while waiting and len(running) < at_once:
            run_id, config, point = waiting.pop(0)
            running[sweep_point.with_options(task_run_name=run_id).submit(config, run_id, point)] = (
                run_id,
                config,
                point,
            )
        try:
            done = next(as_completed(list(running)))
        except BaseException:  # interrupted: stop every point's trainers, let the points record it
            abort_launches(plan[0][2].launch_group or "")
            wait(list(running), timeout=ABORT_WAIT_S)
            raise
        run_id, config, point = running.pop(done)
        outcome: dict[str, Any] = {"run_id": run_id, "values": point.values, "summary": None, "error": None}
        try:
            outcome["summary"] = done.result()
        except Exception as e:  # noqa: BLE001 - the point's summary (when written) says what failed
            outcome["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            summary_uri = RunLayout(config.storage.root, run_id).summary
            outcome["summary"] = storage.read_json(summary_uri) if storage.exists(summary_uri) else None
            log.error("sweep point %s failed: %s", run_id, outcome["error"])
        outcomes[run_id] = outcome
    return [outcomes[run_id] for run_id, _, _ in plan]


def _release_points(
    config: PipelineConfig,
    plan: list[tuple[str, PipelineConfig, SweepPoint]],
    outcomes: list[dict[str, Any]],
    best: str,
    tracking_uri: str,
    log: Any,
) -> dict[str, Any]:
    """Release the best point as a single run is released (gates, registry, both UIs), then, with
    ``sweep.register_others``, each other completed point as a candidate."""
    released: dict[str, Any] = {}
    order = [best] + ([o["run_id"] for o in outcomes if o["run_id"] != best] if config.sweep.register_others else [])
    by_id = {o["run_id"]: o for o in outcomes}
    configs = {run_id: cfg for run_id, cfg, _ in plan}
    for run_id in order:
        summary = by_id[run_id]["summary"]
        run = PipelineRun(
            run_id=run_id,
            config=configs[run_id],
            tracking_uri=tracking_uri,
            parent_mlflow_run_id=summary["mlflow"]["parent_run_id"],
            flow_run_url=prefect_flow_run.ui_url,
        )
        results = {s: StageResult.model_validate({**e, "stage": s}) for s, e in summary["stages"].items()}
        outcome = release(run, results, summary["headline"], candidate_only=run_id != best)
        if run_id == best:
            publish_release(run, outcome, log)
        released[run_id] = outcome
    return released


def _publish(sweep_id: str, mlflow_run_id: str, comparison: dict[str, Any], tracking_uri: str) -> None:
    """The comparison in the Prefect UI (artifact ``sweep-comparison``: the table and the picture)
    and on the sweep's MLflow run (``sweep/comparison.json``, ``sweep/comparison.png``, the metrics
    ``best/<metric>`` and ``best/gain`` (``_se``), the tag ``posttrain.sweep.best``)."""
    from mlflow import MlflowClient

    markdown = comparison_markdown(sweep_id, comparison)
    fig = comparison_figure(comparison)
    png = figure_png(fig) if fig is not None else None
    create_markdown_artifact(
        markdown + (f"\n\n{png_markdown(png, 'sweep comparison')}" if png else ""),
        key="sweep-comparison",
        description=f"sweep {sweep_id}: points compared",
    )
    client = MlflowClient(tracking_uri)
    client.log_dict(mlflow_run_id, comparison, "sweep/comparison.json")
    if fig is not None:
        client.log_figure(mlflow_run_id, fig, "sweep/comparison.png")
    client.set_tag(mlflow_run_id, tracking.TAG_NOTE, markdown)
    if comparison["best"] is not None:
        client.set_tag(mlflow_run_id, "posttrain.sweep.best", comparison["best"])
        best = next(r for r in comparison["rows"] if r["run_id"] == comparison["best"])
        metrics = {
            f"best/{comparison['metric']}": best["value"],
            "best/gain": comparison["gain"],
            "best/gain_se": comparison["gain_se"],
        }
        tracking.log_pipeline_metrics(
            mlflow_run_id, {k: v for k, v in metrics.items() if v is not None}, tracking_uri=tracking_uri
        )


def _plan(
    cfg: PipelineConfig, sweep_id: str, grid: dict[str, list[Any]], mlflow_run_id: str | None
) -> list[tuple[str, PipelineConfig, SweepPoint]]:
    """Each point's run id, config and :class:`SweepPoint` (the stages other points train for it)."""
    configs = [point_config(cfg, values) for values in expand_grid(grid)]
    points = [{key: config_value(c, key) for key in grid} for c in configs]  # as the config reads them: 3e-5 -> 3e-05
    run_ids = [point_run_id(sweep_id, values) for values in points]
    keys = [stage_keys(c, RunLayout(c.storage.root, r)) for c, r in zip(configs, run_ids, strict=True)]
    shared = owners(run_ids, keys)
    return [
        (
            r,
            c,
            SweepPoint(
                sweep_id=sweep_id,
                values=v,
                shared_from=s,
                mlflow_run_id=mlflow_run_id,
                launch_group=prefect_flow_run.id,
            ),
        )
        for r, c, v, s in zip(run_ids, configs, points, shared, strict=True)
    ]


@flow(name="post-training-sweep", flow_run_name=sweep_run_name)
def post_training_sweep(
    config_uri: str | None = None,
    grid: dict[str, list[Any]] | None = None,
    settings: RunSettings | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    sweep_id: str | None = None,
    config: PipelineConfig | None = None,
) -> dict[str, Any]:
    """Run one pipeline per grid point, the shared stages once; compare the points; release the best.

    Args:
        config_uri: The YAML config file (a path relative to the working directory, or any
            fsspec URI); its sweep section's grid is swept.
        grid: More grid keys and their values, for example {"dpo.beta": [0.1, 0.5]}, added to
            the config's sweep.grid (a key in both takes these values).
        settings: The commonly changed settings of every point, applied on top of the config
            file (as the pipeline's run form).
        overrides: Other config keys for every point, key.path=value items (as posttrain run --set).
        sweep_id: Reuse the id of an earlier sweep to resume it or to add points to it. Empty: a
            new id made of the config name, the time and 6 hex digits.
        config: A whole config object instead of config_uri (Python callers).

    Returns:
        The sweep's summary: ``{"sweep_id", "grid", "status", "points": [...], "comparison",
        "release", "mlflow_run_id", "summary_uri"}``.

    Raises:
        ConfigError: no grid, an empty or repeated axis, a grid key that is not a config field or a value
            it refuses (before anything is written).
        SweepFailed: a point did not complete (after the summary and the comparison are
            written; nothing is released).
    """
    log = get_run_logger()
    cfg = resolve_config(config, config_uri, overrides, settings)
    grid = sweep_grid(cfg, grid, where="grid ")
    sweep_id = check_run_id(sweep_id or new_run_id(cfg))
    storage.configure(cfg.storage)
    tracking_uri = tracking.resolve_tracking_uri(cfg)
    plan = _plan(cfg, sweep_id, grid, None)  # refuses a bad grid before anything is written
    mlflow_run_id = tracking.start_sweep_run(
        cfg, sweep_id, grid, tracking_uri=tracking_uri, flow_run_url=prefect_flow_run.ui_url
    )
    plan = [(r, c, p.model_copy(update={"mlflow_run_id": mlflow_run_id})) for r, c, p in plan]
    shared = sum(len(p.shared_from) for _, _, p in plan)
    log.info(
        "sweep %s: %d points; %d stages to train, %d adopted from another point",
        sweep_id,
        len(plan),
        sum(len(c.stages) for _, c, _ in plan) - shared,
        shared,
    )
    try:
        outcomes = _run_points(plan, _points_at_once(cfg, len(plan)), log)
    finally:
        forget_board(sweep_id)
        forget_launch_group(prefect_flow_run.id or "")
    return _conclude(cfg, sweep_id, grid, plan, outcomes, mlflow_run_id, tracking_uri, log)


def _conclude(
    cfg: PipelineConfig,
    sweep_id: str,
    grid: dict[str, list[Any]],
    plan: list[tuple[str, PipelineConfig, SweepPoint]],
    outcomes: list[dict[str, Any]],
    mlflow_run_id: str,
    tracking_uri: str,
    log: Any,
) -> dict[str, Any]:
    """Compare the points, show it, release the best when every point completed, write and
    return the sweep's summary (see :func:`post_training_sweep`)."""
    metric = cfg.sweep.metric or f"{registered_stage_of(cfg) or 'sft'}/exact_match"
    comparison = compare(outcomes, metric)
    _publish(sweep_id, mlflow_run_id, comparison, tracking_uri)
    failed = [o for o in outcomes if o["error"] or (o["summary"] or {}).get("status") != "completed"]
    released = None
    if not failed and comparison["best"] is not None:
        released = _release_points(cfg, plan, outcomes, comparison["best"], tracking_uri, log)
    summary = {
        "sweep_id": sweep_id,
        "grid": grid,
        "status": "failed" if failed else "completed",
        "points": [
            {
                "run_id": o["run_id"],
                "values": o["values"],
                "error": o["error"],
                "status": (o["summary"] or {}).get("status", "failed"),
            }
            for o in outcomes
        ],
        "comparison": comparison,
        "release": released,
        "mlflow_run_id": mlflow_run_id,
    }
    summary["summary_uri"] = join_uri(cfg.storage.root, "sweeps", sweep_id, "summary.json")
    storage.write_json(summary["summary_uri"], summary)
    tracking.finish_pipeline_run(mlflow_run_id, "FAILED" if failed else "completed", tracking_uri=tracking_uri)
    log.info("sweep %s %s; summary %s", sweep_id, summary["status"], summary["summary_uri"])
    if failed:
        raise SweepFailed(
            f"sweep {sweep_id}: {len(failed)} of {len(outcomes)} points did not complete (nothing "
            "released; run the same sweep id again to resume them): "
            + "; ".join(f"{o['run_id']}: {o['error'] or o['summary'].get('status')}" for o in failed)
        )
    return summary
