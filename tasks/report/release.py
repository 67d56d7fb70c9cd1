"""Release of a completed run: its headline metrics on the parent MLflow run, its quality gates,
and its final policy as a new version of the registered model.

A run whose stages all completed is judged against ``evaluate.gates`` (``tasks/report/gates.py``); with
``tracking.registered_model_name`` set, its final policy (``tracking.registered_stage``, default
the last policy stage it trained) becomes a new model version tagged with the run id and the
config and data fingerprints, and gets the alias ``champion`` only when every gate passed, else
``candidate``. So a nightly deployment never silently replaces a better model: the champion alias
moves only forward.

:func:`publish_release` then shows the outcome where an operator looks: a Prefect markdown
artifact ``release`` and a Prefect event (``posttrain.release.champion``, ``.candidate``,
``.gate-failed`` or ``.unregistered``, for automations), the flow run's tag ``gate-failed``; in
MLflow, tags and the description of the parent run and of the new model version.
"""

from __future__ import annotations

import json
from typing import Any

from mlflow.tracking import MlflowClient

from tasks.report import mlflow_models, tracking
from tasks.report.gates import ChampionSamples, GateResult, check_gates, gate_failure_message
from tasks.results import PipelineRun, StageResult
from trainer_core import storage
from trainer_core.config import PipelineConfig, config_hash
from trainer_core.objectives.paired import HARNESS_SAMPLES_FILE, SAMPLES_FILE
from trainer_core.registry import get_stage, policy_stages
from trainer_core.storage import join_uri
from trainer_core.tracking import stage_model_name

CHAMPION = "champion"
CANDIDATE = "candidate"


def registered_stage(run: PipelineRun) -> str | None:
    """The stage whose final model is registered (:func:`registered_stage_of` the run's config)."""
    return registered_stage_of(run.config)


def registered_stage_of(config: PipelineConfig) -> str | None:
    """The stage whose final model a run of ``config`` registers: ``tracking.registered_stage``,
    else its last policy stage in pipeline order; None when it trains no policy."""
    if config.tracking.registered_stage:
        return config.tracking.registered_stage
    trained = [s for s in policy_stages() if s in config.stages and get_stage(s).trains]
    return trained[-1] if trained else None


TAG_EVAL_SAMPLES = "posttrain.eval_samples_uri"
"""Tag on a model version: its run's evaluate sample table, the per-problem verdicts a later
run's ``min_gain_se`` gate pairs with its own."""


def _samples_uri(results: dict[str, StageResult]) -> str | None:
    """Evaluate's sample table of a run, or None when the run did not evaluate."""
    evaluate = results.get("evaluate")
    if evaluate is None or not evaluate.output_uri:
        return None
    return join_uri(evaluate.output_uri, SAMPLES_FILE)  # output_uri: the committed final/ directory


def read_sample_tables(uri: str | None) -> list[dict] | None:
    """The rows of a sample table (JSON lines), followed by those of the harness's sample table
    beside it when there is one (``HARNESS_SAMPLES_FILE``: its rows' keys are distinct, so both
    pair by ``prompt`` at once); None when there is no table at ``uri``."""
    if not uri or not storage.exists(uri):
        return None
    harness = f"{uri.rsplit('/', 1)[0]}/{HARNESS_SAMPLES_FILE}"
    rows = []
    for table in [uri] + ([harness] if storage.exists(harness) else []):
        rows += [json.loads(line) for line in storage.read_bytes(table).decode().splitlines() if line.strip()]
    return rows


def _champion_samples(run: PipelineRun, champion: mlflow_models.Champion) -> ChampionSamples | None:
    """The champion's sample table, when a gate pairs with it (``min_gain_se`` and
    ``vs_champion``) and the champion was registered with one."""
    if not any(g.min_gain_se is not None and g.vs_champion for g in run.config.evaluate.gates):
        return None
    rows = read_sample_tables(champion.tags.get(TAG_EVAL_SAMPLES))
    return ChampionSamples(champion.tags.get("posttrain.stage", ""), rows) if rows is not None else None


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
    samples_uri = _samples_uri(results)
    if samples_uri:
        tags[TAG_EVAL_SAMPLES] = samples_uri
    if run.flow_run_url:
        tags[tracking.TAG_FLOW_RUN_URL] = run.flow_run_url
    return tags


def release(
    run: PipelineRun, results: dict[str, StageResult], headline: dict[str, float], candidate_only: bool = False
) -> dict[str, Any]:
    """Judge the gates of a completed run and register its final policy.

    Args:
        run: The pipeline run (its headline metrics are already on the parent MLflow run).
        results: Every stage's result, all completed.
        headline: The run's headline metrics (``tasks.report.summary.headline_metrics``).
        candidate_only: Register it as a candidate whatever the gates say (a sweep's point other
            than its best, ``flows/sweep.py``).

    A run with a gate it could not judge (its stage not in the run, e.g. an SFT-only run of a
    config gated on GRPO's exact match) is not registered: its version could never become the
    champion, and would only crowd the registered model's versions. With
    ``tracking.registered_stage`` named it is registered, as a candidate: the champion moves
    only on a run every gate judged and passed.

    Returns:
        ``{"gates": [GateResult.as_dict()...], "passed": bool, "judged": bool, "failure": message or None,
        "registered_model": {"name", "version", "alias", "stage", "model_uri"} or None,
        "not_registered": why, when a registered model is configured but nothing was registered}``.

    Raises:
        MlflowException: the registry refused a write.
    """
    config = run.config
    name = config.tracking.registered_model_name
    champion = mlflow_models.read_champion(name, tracking_uri=run.tracking_uri) if name else None
    gates = _judge(run, results, headline, champion)
    failure = gate_failure_message(gates)
    judged = all(g.judged for g in gates)
    outcome: dict[str, Any] = {
        "gates": [g.as_dict() for g in gates],
        "passed": failure is None,
        "judged": judged,
        "failure": failure,
        "registered_model": None,
    }
    stage = registered_stage(run)
    if not name or stage is None:
        return outcome
    if not judged and not config.tracking.registered_stage:
        unjudged = ", ".join(g.metric for g in gates if not g.judged)
        outcome["not_registered"] = (
            f"the run leaves out the stage of gate(s) {unjudged}, so its {stage} model "
            "could not become the champion; set tracking.registered_stage to register it "
            "as a candidate anyway"
        )
        return outcome
    result = results[stage]
    model_uri = result.model_uri or mlflow_models.run_model_uri(result.mlflow_run_id, stage_model_name(stage))
    version = mlflow_models.register_model_version(
        name,
        model_uri,
        run_id=result.mlflow_run_id,
        tags=_version_tags(run, stage, results),
        tracking_uri=run.tracking_uri,
    )
    alias = CHAMPION if failure is None and judged and not candidate_only else CANDIDATE
    mlflow_models.set_model_alias(name, alias, version, tracking_uri=run.tracking_uri)
    outcome["registered_model"] = {
        "name": name,
        "version": version,
        "alias": alias,
        "stage": stage,
        "model_uri": model_uri,
        "previous_champion": champion.version if champion else None,
    }
    return outcome


def _judge(
    run: PipelineRun, results: dict[str, StageResult], headline: dict[str, float], champion: Any
) -> list[GateResult]:
    """The run's gates judged on ``headline``, against ``champion`` (the registered champion
    version, or None), with both sides' held-out samples where a champion has them (paired gates)."""
    config = run.config
    champion_samples = _champion_samples(run, champion) if champion is not None else None
    samples = read_sample_tables(_samples_uri(results)) if champion_samples is not None else None
    return check_gates(
        config.evaluate.gates,
        headline,
        champion,
        list(config.stages),
        samples=samples,
        champion_samples=champion_samples,
    )


TAG_RELEASE = "posttrain.release"
"""Tag on the parent MLflow run: ``champion``, ``candidate``, ``gate-failed`` or ``unregistered``."""
TAG_GATES = "posttrain.gates"
"""Tag on the parent MLflow run and the model version: ``passed``, ``failed``, ``not judged`` or ``none``."""
TAG_GATE_FAILURE = "posttrain.gate_failure"
"""Tag on the parent MLflow run and the model version: the failed gates (when one failed)."""
GATE_FAILED_TAG = "gate-failed"
"""Prefect tag added to a flow run whose final policy failed a gate."""


def release_kind(outcome: dict[str, Any]) -> str:
    """``gate-failed`` (a gate failed), ``champion``, ``candidate`` (registered, but a gate was not
    judged) or ``unregistered`` (gates passed, no registered model configured or no policy trained)."""
    if outcome.get("failure"):
        return "gate-failed"
    registered = outcome.get("registered_model")
    return registered["alias"] if registered else "unregistered"


def _gates_verdict(outcome: dict[str, Any]) -> str:
    if not outcome["gates"]:
        return "none"
    return "failed" if outcome["failure"] else "passed" if outcome["judged"] else "not judged"


def release_markdown(run_id: str, outcome: dict[str, Any]) -> str:
    """The release outcome as Markdown: one line saying what became of the model, then a table
    of every gate (metric, the run's value, the bound and what it came from, the verdict).

    Args:
        run_id: The pipeline run.
        outcome: What :func:`release` returned.
    """
    registered = outcome.get("registered_model")
    kind = release_kind(outcome)
    if registered:
        what = f"`{registered['name']}` version {registered['version']} ({registered['stage']} of run `{run_id}`)"
        previous = registered.get("previous_champion")
        stays = f"; the champion stays version {previous}" if previous else "; there is no champion yet"
        lead = {
            "champion": f"**Champion**: {what} is now `@champion`"
            + (f" (was version {previous})" if previous else " (the first)")
            + ".",
            "gate-failed": f"**Gate failed**: {what} is registered as `@candidate`{stays}.",
            "candidate": f"**Candidate**: {what} is registered as `@candidate`{stays}: "
            "a gate could not be judged (its stage is not in this run).",
        }[kind]
    else:
        why = outcome.get("not_registered") or "`tracking.registered_model_name` not set or no policy trained"
        lead = (
            f"**Gate failed** (run `{run_id}`); no model registered ({why})."
            if kind == "gate-failed"
            else f"No model registered for run `{run_id}` ({why})."
        )
    lines = [lead, ""]
    if outcome["failure"]:
        lines += [f"Why: {outcome['failure']}", ""]
    if not outcome["gates"]:
        lines.append("No quality gates are configured (`evaluate.gates`).")
        return "\n".join(lines)
    lines += ["| gate | run's value | bound | against | verdict |", "| --- | ---: | ---: | --- | --- |"]
    for gate in outcome["gates"]:
        verdict = "not judged" if not gate["judged"] else "passed" if gate["passed"] else "**failed**"
        value = "-" if gate["value"] is None else f"{gate['value']:.4g}"
        bound = "-" if gate["bound"] is None else f"{gate['op']} {gate['bound']:.4g}"
        lines.append(f"| {gate['metric']} | {value} | {bound} | {gate['against'] or '-'} | {verdict} |")
    return "\n".join(lines)


def publish_release(run: PipelineRun, outcome: dict[str, Any], log: Any) -> None:
    """Show the release outcome in both UIs (best effort: each part is logged and skipped when
    its service refuses, the outcome itself is already in ``summary.json``).

    Prefect: the markdown artifact ``release`` (:func:`release_markdown`), the event
    ``posttrain.release.<kind>`` (:func:`release_kind`) on a ``posttrain.run.<run_id>`` resource
    with the outcome as its payload, and the flow run's tag ``gate-failed`` when a gate failed.
    MLflow: the parent run's tags :data:`TAG_RELEASE`, :data:`TAG_GATES` (and
    :data:`TAG_GATE_FAILURE`) and the markdown under its description; the model version's
    description and the same gate tags.

    Args:
        run: The pipeline run.
        outcome: What :func:`release` returned.
        log: The flow run's logger.
    """
    from prefect.artifacts import create_markdown_artifact
    from prefect.events import emit_event
    from prefect.runtime import flow_run

    kind, markdown = release_kind(outcome), release_markdown(run.run_id, outcome)
    gate_tags = {TAG_GATES: _gates_verdict(outcome)}
    if outcome["failure"]:
        gate_tags[TAG_GATE_FAILURE] = outcome["failure"][:5000]
    steps = {
        "Prefect artifact": lambda: create_markdown_artifact(
            markdown, key="release", description=f"{run.run_id}: {kind}"
        ),
        "Prefect event": lambda: emit_event(
            event=f"posttrain.release.{kind}",
            resource={"prefect.resource.id": f"posttrain.run.{run.run_id}", "prefect.resource.name": run.run_id},
            related=[{"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.role": "flow-run"}]
            if flow_run.id
            else None,
            payload=outcome,
        ),
        "MLflow parent run": lambda: _tag_parent_run(run, {TAG_RELEASE: kind, **gate_tags}, markdown),
    }
    if outcome["failure"] and flow_run.id:
        steps["Prefect tag"] = lambda: _tag_flow_run(flow_run.id, [GATE_FAILED_TAG, *flow_run.tags])
    registered = outcome.get("registered_model")
    if registered:
        steps["MLflow model version"] = lambda: _describe_version(run.tracking_uri, registered, markdown, gate_tags)
    for where, step in steps.items():
        try:
            step()
        except Exception as e:  # noqa: BLE001 - the release happened; only its display failed
            log.warning("run %s: could not show the release in the %s: %s", run.run_id, where, e)


def _tag_parent_run(run: PipelineRun, tags: dict[str, str], markdown: str) -> None:
    """Tags, and the description: the link to the flow run, then the latest release (a resume
    replaces the one before)."""
    client = MlflowClient(run.tracking_uri)
    link = tracking.flow_run_note(run.flow_run_url)
    for key, value in tags.items():
        client.set_tag(run.parent_mlflow_run_id, key, value)
    client.set_tag(run.parent_mlflow_run_id, tracking.TAG_NOTE, f"{link}\n\n{markdown}" if link else markdown)


def _tag_flow_run(flow_run_id: str, tags: list[str]) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run_id, tags=list(dict.fromkeys(tags)))


def _describe_version(tracking_uri: str, registered: dict[str, Any], markdown: str, tags: dict[str, str]) -> None:
    client = MlflowClient(tracking_uri)
    client.update_model_version(registered["name"], registered["version"], description=markdown)
    for key, value in tags.items():
        client.set_model_version_tag(registered["name"], registered["version"], key, value)
