"""The post-training pipeline flow: the stage graph of one run, as Prefect task futures.

prepare_data -> sft -> {reward_model, dpo, grpo}; reward_model -> {score, ppo}; all -> evaluate
(the edges come from the stage registry: ``tasks/plan.py``). The flow submits each stage
(``tasks/graph.py``) as soon as the stages it reads from have completed, up to ``launch.max_parallel_stages`` at once (and
each GPU stage holds slots of the GPU concurrency limit, when one is set), so independent stages
run side by side. A failed stage skips only the stages that depend on it; the others finish.

Re-running a run id reuses every stage whose committed final output carries the fingerprint the
stage would produce now (its config and its inputs' hashes: ``trainer_core/fingerprint.py``) and
resumes an unfinished one from its latest checkpoint; a stage whose config changed runs again,
and so does every stage that consumes its output.

Before anything is written the flow checks the storage root, the data and the model sources
(``tasks/preflight.py``) and takes the run's lease (``<run>/lease.json``): a second live run or
resume of the same run id is refused at once, naming the holder. The run's config is recorded
in ``config.json``; a resume with another config is a re-plan, logged with the changed fields
(the replaced config kept under ``config-history/``).

At the end the flow logs the run's headline metrics on its parent MLflow run; when every stage
completed it judges ``evaluate.gates`` and registers the final policy as a new model version
(alias ``champion`` only when every gate passed: ``tasks/report/release.py``). It writes
``<root>/runs/<run_id>/summary.json``, also when a stage failed (each stage's status, times,
metrics, and for a skipped stage the failure that caused it; each gate's result), and then
re-raises the first failure, or ends in Prefect's ``Failed`` state naming the failed gates
(tagged ``gate-failed``). The release outcome is shown in both UIs (``publish_release``).
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run as prefect_flow_run
from prefect.states import Failed

from flows.settings import RunSettings, resolve_config
from tasks.console import use_plain_console
from tasks.graph import StageGraphRun, max_parallel_stages
from tasks.launch.process import forget_launch_group
from tasks.model_import import import_base_model
from tasks.plan import PlannedStage, plan_run
from tasks.preflight import preflight
from tasks.report.gates import QualityGateFailed
from tasks.report.release import publish_release, release
from tasks.report.summary import build_summary, write_summary
from tasks.report.tracking import finish_pipeline_run, log_pipeline_metrics, resolve_tracking_uri, start_pipeline_run
from tasks.results import PipelineRun, SweepPoint, describe_interrupt
from tasks.runs import check_run_id, new_run_id, run_lease, save_run_config
from trainer_core import storage
from trainer_core.config import PipelineConfig
from trainer_core.errors import classify
from trainer_core.storage import RunLayout


def flow_run_name() -> str:
    """The Prefect flow run's name: the ``run_id`` parameter; the flow renames a run started
    without one to the run id it picks (one id in Prefect, MLflow and storage)."""
    from prefect.runtime import flow_run

    return str(flow_run.parameters.get("run_id") or f"posttrain-{time.strftime('%Y%m%d-%H%M%S')}")


def _name_flow_run(run_id: str) -> None:
    """Rename the current flow run to ``run_id`` (best effort: the run goes on without it)."""
    flow_run_id = prefect_flow_run.id
    if not flow_run_id or prefect_flow_run.name == run_id:
        return
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run_id, name=run_id)
    except Exception as e:  # noqa: BLE001
        get_run_logger().warning("could not rename the flow run to %s: %s", run_id, e)


def _checked(cfg: PipelineConfig, run_id: str, layout: RunLayout, log: Any) -> PipelineConfig:
    """``cfg`` after the pre-flight checks, with a GGUF base model imported (``tasks.model_import``)."""
    preflight(cfg, {layout.final(s) for s in cfg.stages})
    return import_base_model(cfg, run_id, log)


@flow(name="post-training-pipeline", flow_run_name=flow_run_name)
def post_training_pipeline(
    config_uri: str | None = None,
    settings: RunSettings | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    run_id: str | None = None,
    config: PipelineConfig | None = None,
    sweep: SweepPoint | None = None,
) -> dict[str, Any]:
    """Run the configured stages as a graph, then write and return the run summary.

    Args:
        config_uri: The YAML config file of the run: a path relative to the run's working
            directory (for example configs/demo.yaml), or any fsspec URI.
        settings: The commonly changed settings, applied on top of the config file. A
            deployment's form opens on the file's values.
        overrides: Any other config keys, applied last: one key.path=value item each, the value
            read as YAML (as posttrain run --set), for example
            evaluate.generation.max_new_tokens=64 or launch.retries=1. Python callers may pass a
            mapping of dotted keys instead. An item that sets a field the settings changed, to
            another value, is refused.
        run_id: Reuse the id of an earlier run to resume it (its finished stages are reused).
            Empty: a new id made of the config name, the time and 6 hex digits; the flow run is
            renamed to it.
        config: A whole config object instead of config_uri (Python callers; deployments do
            not show it).
        sweep: Set by a sweep (the post-training-sweep flow) for each of its points: the stages
            another point trains are adopted from it, the MLflow run is nested under the
            sweep's, and the release is left to the sweep. Empty for a pipeline run of its own.

    Returns:
        The summary (tasks.report.summary.build_summary) plus summary_uri.

    Raises:
        ConfigError: invalid config or run id, a failed pre-flight check or import (storage
            root, data, model sources), or a stage input nothing provides (nothing written).
        LeaseHeldError: another live run or resume of this run id holds its lease (refused at
            once, before anything is written).
        StageFailed: a stage failed (after the summary is written, or a warning that storage
            could not take it; the first failure).
        StorageUnavailable: no stage failed but storage could not take the summary (naming
            the S3 endpoint and the URI).
        QualityGateFailed: every stage completed but the final policy failed a quality gate;
            the flow run ends in Prefect's standard Failed state with the gate's message (and
            the tag ``gate-failed``, the event ``posttrain.release.gate-failed``).
    """
    use_plain_console()
    log = get_run_logger()
    cfg = resolve_config(config, config_uri, overrides, settings)
    run_id = check_run_id(run_id or new_run_id(cfg))
    _name_flow_run(run_id)
    storage.configure(cfg.storage)
    layout = RunLayout(cfg.storage.root, run_id)
    cfg = _checked(cfg, run_id, layout, log)
    plan = plan_run(cfg, layout)
    lease = run_lease(cfg, layout)
    lease.acquire(wait_s=0)
    try:
        return _run(cfg, run_id, layout, plan, log, sweep)
    finally:
        lease.release()


def _record_interruption(run: PipelineRun, graph: StageGraphRun, interrupt: BaseException, log: Any) -> None:
    """Write the summary of an interrupted run (best effort: the interrupt must propagate)."""
    try:
        summary = build_summary(run, graph.results, interrupted=describe_interrupt(interrupt))
        write_summary(run, summary)
        finish_pipeline_run(run.parent_mlflow_run_id, "KILLED", tracking_uri=run.tracking_uri)
    except Exception as e:  # noqa: BLE001
        log.warning("run %s: could not record the interruption: %s", run.run_id, e)


def _write_summary(run: PipelineRun, summary: dict[str, Any], log: Any, failed: bool) -> str | None:
    """Write the run's summary; returns its URI, or None when a stage had failed and the summary
    could not be written either (logged as one warning: the stage's failure, raised next, is the
    run's error, not the summary's).

    Raises:
        StorageUnavailable: no stage failed, but storage did not answer (naming the endpoint and URI).
        Exception: no stage failed, and the summary could not be written for another reason.
    """
    try:
        return write_summary(run, summary)
    except Exception as e:
        error = classify(e)
        if not failed:
            if error is None:
                raise
            raise error from e
        log.warning(
            "run %s: summary %s not written: %s",
            run.run_id,
            run.layout.summary,
            error if error is not None else f"{type(e).__name__}: {e}",
        )
        return None


def _start(
    cfg: PipelineConfig, run_id: str, layout: RunLayout, log: Any, sweep: SweepPoint | None
) -> tuple[PipelineRun, dict[str, Any]]:
    """Record the run's config (the fields changed since its last start, logged) and open its
    MLflow parent run: the run's record and those changes."""
    changes = save_run_config(cfg, layout)
    if changes:
        log.info(
            "run %s re-planned: %d config field(s) changed since its last start: %s",
            run_id,
            len(changes),
            "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()),
        )
    tracking_uri = resolve_tracking_uri(cfg)
    flow_run_url = prefect_flow_run.ui_url
    parent = start_pipeline_run(
        cfg,
        run_id,
        tracking_uri=tracking_uri,
        flow_run_url=flow_run_url,
        parent_run_id=sweep.mlflow_run_id if sweep else None,
    )
    run = PipelineRun(
        run_id=run_id,
        config=cfg,
        tracking_uri=tracking_uri,
        flow_run_url=flow_run_url,
        parent_mlflow_run_id=parent,
        sweep=sweep,
    )
    return run, changes


def _release(
    run: PipelineRun, graph: StageGraphRun, summary: dict[str, Any], log: Any
) -> tuple[str | None, Exception | None]:
    """Log the headline metrics to MLflow and, for a run outside a sweep whose stages all
    succeeded, judge the gates and release (``summary["release"]``): the gate failure's message
    and the error met, each None if none (the summary is written before either is raised)."""
    gate_failure, release_error = None, None
    try:
        log_pipeline_metrics(run.parent_mlflow_run_id, summary["headline"], tracking_uri=run.tracking_uri)
        if not graph.failures and run.sweep is None:  # a sweep releases its best point itself
            summary["release"] = release(run, graph.results, summary["headline"])
            gate_failure = summary["release"]["failure"]
            publish_release(run, summary["release"], log)
    except Exception as e:  # noqa: BLE001 - the summary is written first, then it is raised
        release_error = e
        summary["release"] = {"error": f"{type(e).__name__}: {e}"}
    return gate_failure, release_error


def _run(
    cfg: PipelineConfig,
    run_id: str,
    layout: RunLayout,
    plan: dict[str, PlannedStage],
    log: Any,
    sweep: SweepPoint | None = None,
) -> dict[str, Any]:
    """The flow's body once it holds the run's lease: record the config, run the graph, summarise."""
    run, changes = _start(cfg, run_id, layout, log, sweep)
    bound = max_parallel_stages(cfg)
    log.info(
        "run %s: stages %s (at most %s at once), MLflow %s (run %s)",
        run_id,
        cfg.stages,
        bound or "unbounded",
        run.tracking_uri,
        run.parent_mlflow_run_id,
    )
    graph = StageGraphRun(plan, run, bound, log)
    try:
        graph.run()
    except BaseException as interrupt:
        # The launch group stays aborted: a task thread still on its way to a launch (waiting for
        # GPU slots, retrying) must not start a trainer once the flow has gone.
        _record_interruption(run, graph, interrupt, log)
        raise
    if sweep is None:  # a sweep's group is the sweep's to forget
        forget_launch_group(run.launch_group)
    summary = build_summary(run, graph.results)
    if changes:
        summary["config_changes"] = changes
    gate_failure, release_error = _release(run, graph, summary, log)
    if gate_failure or release_error:
        summary["status"] = "gate_failed" if gate_failure else "failed"
    summary["summary_uri"] = _write_summary(run, summary, log, failed=bool(graph.failures))
    finish_pipeline_run(
        run.parent_mlflow_run_id, "FAILED" if gate_failure else summary["status"], tracking_uri=run.tracking_uri
    )
    log.info("run %s %s; summary %s", run_id, summary["status"], summary["summary_uri"] or "not written")
    if graph.failures:
        raise graph.failures[0]
    if release_error is not None:
        raise release_error
    if gate_failure:
        log.error("run %s: %s; the new version is not the champion", run_id, gate_failure)
        return Failed(message=gate_failure, data=QualityGateFailed(gate_failure))
    return summary
