"""The post-training pipeline flow: prepare_data -> sft -> reward_model -> score -> dpo -> evaluate.

Re-running a run id skips every stage whose committed final output carries the fingerprint
the stage would produce now (its config and its inputs' hashes: ``trainer_core/fingerprint.py``)
and resumes the first unfinished stage from its latest checkpoint; a stage whose config
changed runs again, and so does every stage that consumes its output.

The flow only sequences stage tasks and passes URIs between them (see :func:`stage_inputs`
for who reads whose output). Each stage runs in its own trainer process
(``tasks.stages.run_stage``); the flow writes ``<root>/runs/<run_id>/summary.json`` at the end,
also when a stage failed, and then re-raises the failure.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, SecretStr

from tasks.stages import stage_task
from tasks.runs import completed_result, save_run_config
from tasks.summary import build_summary, write_summary
from tasks.tracking import finish_pipeline_run, resolve_tracking_uri, start_pipeline_run
from trainer_core.checkpoint import storage
from trainer_core.checkpoint.manifest import MANIFEST_NAME
from trainer_core.config import PipelineConfig, load_config, resolve_local_root
from trainer_core.errors import ConfigError
from trainer_core.spec import INIT_SOURCE, final_uri, join_uri, stage_uri

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


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
    config: PipelineConfig | None, config_uri: str | None, overrides: dict[str, Any] | None
) -> PipelineConfig:
    """``config`` (or the YAML at ``config_uri``, or defaults) with ``overrides``, validated,
    with an absolute local storage root.

    Raises:
        ConfigError: unreadable YAML, a bad override or a failed validation (names the field).
    """
    if config is not None:
        base = _reveal(config.model_dump()) if isinstance(config, BaseModel) else dict(config)
        resolved = load_config(base=base, overrides=overrides)
    else:
        resolved = load_config(config_uri, overrides=overrides)
    return resolve_local_root(resolved)


def _committed_final(config: PipelineConfig, run_id: str, stage: str) -> str | None:
    """The final directory of ``stage`` in this run when it is committed, else None."""
    uri = final_uri(stage_uri(config.storage.root, run_id, stage))
    return uri if storage.exists(join_uri(uri, MANIFEST_NAME)) else None


def prior_outputs(config: PipelineConfig, run_id: str) -> dict[str, str]:
    """Committed final directories of this run's stages that are not in ``config.stages``.

    Raises:
        ConfigError: ``prepare_data`` is neither in the stage list nor committed in this run.
    """
    found = {
        stage: uri
        for stage in ("prepare_data", "sft", "reward_model", "dpo", "ppo", "grpo")
        if stage not in config.stages and (uri := _committed_final(config, run_id, stage))
    }
    if "prepare_data" not in config.stages and "prepare_data" not in found:
        where = stage_uri(config.storage.root, run_id, "prepare_data")
        raise ConfigError(
            f"stages {config.stages} need prepared data: add 'prepare_data' to stages, or pass the "
            f"--run-id of a run that has {final_uri(where)}/{MANIFEST_NAME}"
        )
    return found


def stage_inputs(stage: str, config: PipelineConfig, outputs: dict[str, str]) -> dict[str, str]:
    """The input URIs of ``stage``.

    Args:
        stage: The stage about to run.
        config: The pipeline config (its ``*_from`` fields override the defaults).
        outputs: Stage name -> final directory URI of the stages available so far.

    Returns:
        Role -> URI: ``data`` for every stage but prepare_data; ``model`` (and ``reference``,
        ``reward_model``, ``sft_model``, ``dpo_model``, ``ppo_model``, ``grpo_model``,
        ``base_model``) per stage. PPO and GRPO get ``reward_model`` only when their reward
        kind reads one (a missing one fails the stage with a clear error).
    """
    if stage == "prepare_data":
        return {}
    source = config.model.name_or_path or INIT_SOURCE
    sft = outputs.get("sft")
    inputs = {"data": outputs["prepare_data"]}
    if stage == "sft":
        inputs["model"] = config.sft.init_from or source
    elif stage == "reward_model":
        inputs["model"] = config.reward_model.init_from or sft or source
    elif stage == "score":
        inputs["model"] = config.score.policy_from or sft or source
        reward_model = config.score.reward_model_from or outputs.get("reward_model")
        if reward_model:
            inputs["reward_model"] = reward_model
    elif stage == "dpo":
        inputs["model"] = config.dpo.init_from or sft or source
        inputs["reference"] = config.dpo.reference_from or inputs["model"]
    elif stage in ("ppo", "grpo"):
        rl = config.ppo if stage == "ppo" else config.grpo
        inputs["model"] = rl.init_from or sft or source
        inputs["reference"] = rl.reference_from or inputs["model"]
        reward_model = rl.reward.reward_model_from or outputs.get("reward_model")
        if rl.reward.kind != "verifier" and reward_model:
            inputs["reward_model"] = reward_model
    elif stage == "evaluate":
        roles = {
            "sft_model": "sft", "reward_model": "reward_model", "dpo_model": "dpo", "ppo_model": "ppo",
            "grpo_model": "grpo",
        }
        inputs.update({role: outputs[name] for role, name in roles.items() if name in outputs})
        inputs["base_model"] = source
    return inputs


def _failed_record(error: BaseException) -> dict[str, Any]:
    return {"status": "failed", "error": f"{type(error).__name__}: {error}"[:2000]}


def flow_run_name() -> str:
    """The Prefect flow run's name: the ``run_id`` parameter, else ``<pipeline name>-<YYYYmmdd-HHMMSS>``."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    if params.get("run_id"):
        return str(params["run_id"])
    try:
        name = resolve_config(params.get("config"), params.get("config_uri"), params.get("overrides")).name
    except Exception:  # noqa: BLE001 - the flow body reports a bad config; the name falls back
        name = "posttrain"
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


@flow(name="post-training-pipeline", flow_run_name=flow_run_name)
def post_training_pipeline(
    config: PipelineConfig | None = None,
    config_uri: str | None = None,
    overrides: dict[str, Any] | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Run the configured stages in order, then write and return the run summary.

    Args:
        config: A config object; None: read ``config_uri`` (or use the defaults).
        config_uri: YAML config URI, used when ``config`` is None.
        overrides: ``{key.path: value}`` applied on top.
        run_id: Pipeline run id; reuse one to resume it. Default: :func:`new_run_id`.

    Returns:
        The summary (see ``tasks.summary.build_summary``) plus ``summary_uri``.

    Raises:
        ConfigError: invalid config, run id, or missing prepared data (before any stage runs).
        StageFailed: a stage failed (after the summary is written).
    """
    log = get_run_logger()
    cfg = resolve_config(config, config_uri, overrides)
    run_id = check_run_id(run_id or new_run_id(cfg))
    storage.configure(cfg.storage)
    outputs = prior_outputs(cfg, run_id)
    save_run_config(cfg, run_id)
    tracking_uri = resolve_tracking_uri(cfg)
    parent = start_pipeline_run(cfg, run_id)
    log.info("run %s: stages %s, MLflow %s (run %s)", run_id, cfg.stages, tracking_uri, parent)
    results: dict[str, dict[str, Any]] = {}
    failure: BaseException | None = None
    for stage in cfg.stages:
        if failure is not None:
            results[stage] = {"status": "skipped"}
            continue
        try:
            inputs = stage_inputs(stage, cfg, outputs)
            reused = completed_result(cfg, run_id, stage, inputs)
            if reused is not None:
                log.info("stage %s: committed output %s matches its config and inputs; not re-run", stage, reused["output_uri"])
            results[stage] = reused or stage_task(stage, cfg)(stage, cfg, run_id, inputs, parent)
            outputs[stage] = results[stage]["output_uri"]
        except BaseException as e:  # noqa: BLE001 - recorded, summarised, re-raised below
            failure, results[stage] = e, _failed_record(e)
    summary = build_summary(cfg, run_id, results, tracking_uri=tracking_uri, parent_run_id=parent)
    summary["summary_uri"] = write_summary(cfg, summary)
    finish_pipeline_run(parent, summary["status"], tracking_uri=tracking_uri)
    log.info("run %s %s; summary %s", run_id, summary["status"], summary["summary_uri"])
    if failure is not None:
        raise failure
    return summary
