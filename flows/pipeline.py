"""The post-training pipeline flow: the stage graph of one run, as Prefect task futures.

prepare_data -> sft -> {reward_model, dpo, grpo}; reward_model -> {score, ppo}; all -> evaluate
(the edges come from the stage registry: ``tasks/plan.py``). The flow submits each stage as soon
as the stages it reads from have completed, up to ``launch.max_parallel_stages`` at once (and
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

import json
import os
import re
import secrets
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.futures import PrefectFuture, as_completed, wait
from prefect.runtime import flow_run as prefect_flow_run
from prefect.states import Failed
from pydantic import BaseModel, SecretStr, ValidationError

from flows.settings import RunSettings, settings_overrides
from tasks.console import use_plain_console
from tasks.report.gates import QualityGateFailed
from tasks.launch.process import LaunchAborted, abort_launches, forget_launch_group
from tasks.plan import PlannedStage, plan_run
from tasks.preflight import preflight
from tasks.results import PipelineRun, StageResult, describe_interrupt
from tasks.runs import save_run_config
from tasks.stages import GPU_CONCURRENCY_ENV, stage_task
from tasks.report.summary import build_summary, write_summary
from tasks.report.release import publish_release, release
from tasks.report.tracking import finish_pipeline_run, log_pipeline_metrics, resolve_tracking_uri, start_pipeline_run
from trainer_core import storage
from trainer_core.checkpoint.lease import StageLease
from trainer_core.config import PipelineConfig, load_config, parse_override, resolve_local_root
from trainer_core.errors import ConfigError
from trainer_core.storage import RunLayout

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

_ABORT_WAIT_S = 60.0
"""After an interrupt, how long the flow waits for its running stages to kill their trainers."""


def new_run_id(config: PipelineConfig) -> str:
    """``<name>-<YYYYmmdd-HHMMSS>-<6 hex>``, e.g. ``demo-20250101-120000-a1b2c3``."""
    return f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is usable in URIs and MLflow run names.

    Raises:
        ConfigError: it is empty, too long, or has characters other than letters, digits, ``._-``.
    """
    if not _RUN_ID.match(run_id):
        raise ConfigError(f"run_id {run_id!r} must match {_RUN_ID.pattern}")
    return run_id


def _reveal(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, dict):
        return {k: _reveal(v) for k, v in value.items()}
    return value


def resolve_config(
    config: PipelineConfig | dict | None,
    config_uri: str | None,
    overrides: list[str] | dict[str, Any] | None,
    settings: RunSettings | dict | None = None,
) -> PipelineConfig:
    """``config`` (or the YAML at ``config_uri``, or defaults) with ``settings`` and then
    ``overrides`` applied, validated, with an absolute local storage root.

    A :class:`PipelineConfig` given without settings or overrides is used as it is (it is already
    valid); otherwise they are applied to its data and the result validated once.

    Args:
        config: A whole config (object or data), instead of ``config_uri``.
        config_uri: The YAML config file.
        overrides: ``key.path=value`` items (the value read as YAML, as ``posttrain run --set``)
            or a ``{key.path: value}`` mapping.
        settings: The run form's values (:class:`RunSettings`).

    Raises:
        ConfigError: unreadable YAML, bad settings, a bad override or a failed validation (names
            the field); an override of a key whose value the settings changed from the file's,
            to yet another value (two edits of one field: both are named; an override of a
            field the settings leave at the file's value simply applies).
    """
    overrides = overrides_mapping(overrides)
    if settings is not None:
        try:
            settings = RunSettings.model_validate(settings)
        except ValidationError as e:
            raise ConfigError(f"settings: {e}") from None
        from_settings = settings_overrides(settings)
        if overrides:
            refuse_conflicts(from_settings, overrides, _config_data(config, config_uri))
        overrides = {**from_settings, **overrides}
    if isinstance(config, PipelineConfig) and not overrides:
        return resolve_local_root(config)
    if config is not None:
        return resolve_local_root(load_config(base=_config_data(config, None), overrides=overrides))
    return resolve_local_root(load_config(config_uri, overrides=overrides))


def _config_data(config: PipelineConfig | dict | None, config_uri: str | None) -> dict[str, Any]:
    """The data of ``config``, else of the YAML at ``config_uri`` (defaults filled in when read)."""
    if isinstance(config, BaseModel):
        return _reveal(config.model_dump())
    if config is not None:
        return dict(config)
    return _reveal(load_config(config_uri).model_dump())


def overrides_mapping(overrides: list[str] | dict[str, Any] | None) -> dict[str, Any]:
    """``["key.path=value", ...]`` (values read as YAML) or a mapping, as ``{key.path: value}``.

    Raises:
        ConfigError: an item that is not ``key.path=value`` (named with its index).
    """
    if not overrides:
        return {}
    if isinstance(overrides, dict):
        return dict(overrides)
    out: dict[str, Any] = {}
    for i, item in enumerate(overrides):
        try:
            key, value = parse_override(str(item))
        except ConfigError as e:
            raise ConfigError(f"overrides[{i}]: {e}") from None
        out[key] = value
    return out


def override_items(overrides: dict[str, Any]) -> list[str]:
    """``{key.path: value}`` as the ``key.path=value`` items the run form edits (values as JSON,
    which :func:`overrides_mapping` reads back as YAML unchanged)."""
    return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]


def flat_overrides(overrides: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"sft": {"max_steps": 4}}`` and ``{"sft.max_steps": 4}`` alike as ``{"sft.max_steps": 4}``."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if isinstance(value, dict) and value:
            out.update(flat_overrides(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


_MISSING = object()


def _value_at(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return json.loads(json.dumps(node, default=str))


def refuse_conflicts(from_settings: dict[str, Any], overrides: dict[str, Any], file_data: dict[str, Any]) -> None:
    """Refuse an override of a key whose value the run settings changed from the config file's,
    to another value than the settings' (a field typed in the form, overridden again).

    Args:
        from_settings: :func:`~flows.settings.settings_overrides` of the run settings.
        overrides: The run's overrides, ``{key.path: value}``.
        file_data: The config the settings and overrides apply to, as data.

    Raises:
        ConfigError: naming each such key with both values.
    """
    flat = flat_overrides(overrides)
    clashes = [f"overrides sets {key}={flat[key]!r} but settings set it to {value!r} (the config file has "
               f"{_value_at(file_data, key)!r})"
               for key, value in from_settings.items()
               if key in flat and flat[key] != value and _value_at(file_data, key) != value]
    if clashes:
        raise ConfigError("; ".join(clashes) + ": set each in one place (the form's field, or overrides)")


def max_parallel_stages(config: PipelineConfig) -> int | None:
    """How many stages of one run may run at once (``launch.max_parallel_stages``).

    None (no bound of the flow's own) when the config leaves it unset and a GPU concurrency limit
    is named (its slots bound the GPU stages); 1 when neither is set, and always 1 when a stage's
    backend names its rendezvous (``rdzv_endpoint`` / ``rdzv_id``: multi-node jobs), which two
    stages at once would share.
    """
    if any(config.backend_for(s).rdzv_endpoint or config.backend_for(s).rdzv_id for s in config.stages):
        return 1  # a configured rendezvous is one per job: stages side by side would collide on it
    if config.launch.max_parallel_stages is not None:
        return config.launch.max_parallel_stages
    named = (config.launch.gpu_concurrency_limit or os.environ.get(GPU_CONCURRENCY_ENV, "")).strip()
    return None if named else 1


def _ready(stage: PlannedStage, results: dict[str, StageResult]) -> bool:
    return all(d in results for d in stage.depends_on)


def _failed_dependency(stage: PlannedStage, results: dict[str, StageResult]) -> str | None:
    """The failed stage that keeps ``stage`` from running (followed back through skipped ones)."""
    for d in stage.depends_on:
        result = results.get(d)
        if result is not None and result.status != "completed":
            return result.skipped_because or d
    return None


class StageGraphRun:
    """The stages of one run's plan as task futures, each submitted once the stages it reads
    from completed.

    Stages are submitted in pipeline order among those ready, at most ``max_parallel`` running
    at once (None: no bound). A stage whose dependency failed (or was skipped) is skipped, naming
    the failure. If the flow itself is interrupted, every running stage's trainer is killed before
    the interrupt propagates; the stages it cut short are recorded as interrupted, the others
    skipped.

    Attributes:
        results: stage -> result, filled as stages end.
        failures: the stages' exceptions, in the order they happened.
    """

    def __init__(self, plan: dict[str, PlannedStage], run: PipelineRun, max_parallel: int | None, log: Any) -> None:
        self.plan, self.run_info, self.max_parallel, self.log = plan, run, max_parallel, log
        self.results: dict[str, StageResult] = {}
        self.failures: list[BaseException] = []

    def _submit_ready(self, waiting: list[str], running: dict[PrefectFuture, str]) -> None:
        for name in list(waiting):
            planned, cause = self.plan[name], _failed_dependency(self.plan[name], self.results)
            if cause is not None:
                self.log.info("stage %s: skipped, because %s failed", name, cause)
                self.results[name] = StageResult.skipped(name, cause)
                waiting.remove(name)
            elif _ready(planned, self.results) and (self.max_parallel is None or len(running) < self.max_parallel):
                task = stage_task(name, self.run_info.config)
                running[task.submit(name, self.run_info, planned.inputs)] = name
                waiting.remove(name)

    def run(self) -> None:
        """Run every stage of the plan (see the class docstring)."""
        running: dict[PrefectFuture, str] = {}
        waiting = list(self.plan)
        try:
            while waiting or running:
                self._submit_ready(waiting, running)
                if not running:
                    continue
                done = next(as_completed(list(running)))
                self._record(running.pop(done), done)
        except BaseException as interrupt:
            # Ctrl-C, SIGTERM, a cancelled flow run (or an error of the scheduling itself): kill
            # every trainer the task threads launched, give them time to end, record what ended.
            abort_launches(prefect_flow_run.id or "")
            wait(list(running), timeout=_ABORT_WAIT_S)
            for future, name in running.items():
                if future.state.is_final():
                    self._record(name, future, interrupt)
                else:
                    self.results[name] = StageResult.interrupted(name, interrupt)
            for name in waiting:
                self.results[name] = StageResult.skipped(name, "interrupted")
            raise

    def _record(self, name: str, future: PrefectFuture, interrupt: BaseException | None = None) -> None:
        """Record a finished stage; one whose launch the interrupt aborted (``LaunchAborted``)
        as interrupted."""
        try:
            self.results[name] = future.result()
        except Exception as e:  # noqa: BLE001 - recorded, summarised, re-raised by the flow
            if interrupt is not None and isinstance(e, LaunchAborted):
                self.results[name] = StageResult.interrupted(name, interrupt)
                return
            self.failures.append(e)
            self.results[name] = StageResult.failed(name, e)


def run_lease(config: PipelineConfig, layout: RunLayout) -> StageLease:
    """The writer lease of a whole pipeline run (``<run>/lease.json``): one live run or resume per run id."""
    return StageLease(layout.uri, ttl_s=config.launch.lease_ttl_s,
                      what="another posttrain run or resume of this run id is live")


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


@flow(name="post-training-pipeline", flow_run_name=flow_run_name)
def post_training_pipeline(
    config_uri: str | None = None,
    settings: RunSettings | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    run_id: str | None = None,
    config: PipelineConfig | None = None,
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

    Returns:
        The summary (tasks.report.summary.build_summary) plus summary_uri.

    Raises:
        ConfigError: invalid config or run id, a failed pre-flight check (storage root, data,
            model sources), or a stage input that nothing provides (before anything is written).
        LeaseHeldError: another live run or resume of this run id holds its lease (refused at
            once, before anything is written).
        StageFailed: a stage failed (after the summary is written; the first failure).
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
    preflight(cfg, {layout.final(s) for s in cfg.stages})
    plan = plan_run(cfg, layout)
    lease = run_lease(cfg, layout)
    lease.acquire(wait_s=0)
    try:
        return _run(cfg, run_id, layout, plan, log)
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


def _run(cfg: PipelineConfig, run_id: str, layout: RunLayout, plan: dict[str, PlannedStage], log: Any) -> dict[str, Any]:
    """The flow's body once it holds the run's lease: record the config, run the graph, summarise."""
    changes = save_run_config(cfg, layout)
    if changes:
        log.info("run %s re-planned: %d config field(s) changed since its last start: %s", run_id, len(changes),
                 "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()))
    tracking_uri = resolve_tracking_uri(cfg)
    flow_run_url = prefect_flow_run.ui_url
    run = PipelineRun(
        run_id=run_id, config=cfg, tracking_uri=tracking_uri, flow_run_url=flow_run_url,
        parent_mlflow_run_id=start_pipeline_run(cfg, run_id, tracking_uri=tracking_uri, flow_run_url=flow_run_url),
    )
    bound = max_parallel_stages(cfg)
    log.info("run %s: stages %s (at most %s at once), MLflow %s (run %s)", run_id, cfg.stages,
             bound or "unbounded", tracking_uri, run.parent_mlflow_run_id)
    graph = StageGraphRun(plan, run, bound, log)
    try:
        graph.run()
    except BaseException as interrupt:
        # The launch group stays aborted: a task thread still on its way to a launch (waiting for
        # GPU slots, retrying) must not start a trainer once the flow has gone.
        _record_interruption(run, graph, interrupt, log)
        raise
    forget_launch_group(prefect_flow_run.id or "")
    summary = build_summary(run, graph.results)
    if changes:
        summary["config_changes"] = changes
    gate_failure, release_error = None, None
    try:
        log_pipeline_metrics(run.parent_mlflow_run_id, summary["headline"], tracking_uri=tracking_uri)
        if not graph.failures:
            summary["release"] = release(run, graph.results, summary["headline"])
            gate_failure = summary["release"]["failure"]
            publish_release(run, summary["release"], log)
    except Exception as e:  # noqa: BLE001 - the summary is written first, then it is raised
        release_error = e
        summary["release"] = {"error": f"{type(e).__name__}: {e}"}
    if gate_failure or release_error:
        summary["status"] = "gate_failed" if gate_failure else "failed"
    summary["summary_uri"] = write_summary(run, summary)
    finish_pipeline_run(run.parent_mlflow_run_id, "FAILED" if gate_failure else summary["status"],
                        tracking_uri=tracking_uri)
    log.info("run %s %s; summary %s", run_id, summary["status"], summary["summary_uri"])
    if graph.failures:
        raise graph.failures[0]
    if release_error is not None:
        raise release_error
    if gate_failure:
        log.error("run %s: %s; the new version is not the champion", run_id, gate_failure)
        return Failed(message=gate_failure, data=QualityGateFailed(gate_failure))
    return summary
