"""A pipeline run's state on storage: its saved config, which stages are done, where each stands.

Used by the flow (skip stages whose committed output already matches what they would
produce) and by ``posttrain status`` / ``posttrain resume``. Reads storage only; no MLflow.
"""

from __future__ import annotations

import logging
from typing import Any

from trainer_core.checkpoint import storage
from trainer_core.checkpoint.manifest import find_latest, read_manifest
from trainer_core.config import STAGE_ORDER, PipelineConfig
from trainer_core.errors import ConfigError
from trainer_core.fingerprint import stage_fingerprint
from trainer_core.spec import checkpoints_uri, final_uri, join_uri, run_uri, stage_uri

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
"""The pipeline config a run was last started with, at ``<root>/runs/<run_id>/config.json``."""


def config_uri_of(root: str, run_id: str) -> str:
    """``<root>/runs/<run_id>/config.json``."""
    return join_uri(run_uri(root, run_id), CONFIG_NAME)


def save_run_config(config: PipelineConfig, run_id: str) -> str:
    """Record the config a run is started with (secrets excluded); returns its URI."""
    data = config.model_dump(mode="json", exclude={"storage": {"access_key_id", "secret_access_key"}})
    uri = config_uri_of(config.storage.root, run_id)
    storage.write_json(uri, data)
    return uri


def load_run_config(root: str, run_id: str) -> dict[str, Any]:
    """The config dict a run was started with.

    Raises:
        ConfigError: the run has no saved config under ``root``.
    """
    uri = config_uri_of(root, run_id)
    try:
        return storage.read_json(uri)
    except FileNotFoundError:
        raise ConfigError(f"no run {run_id!r} under {root}: {uri} does not exist") from None


def completed_result(config: PipelineConfig, run_id: str, stage: str, inputs: dict[str, str]) -> dict[str, Any] | None:
    """The result record of ``stage`` if its committed final output matches its fingerprint.

    Returns:
        ``{"stage", "status": "completed", "reused": True, "output_uri", "manifest_uri",
        "wall_s": 0.0, "metrics", "mlflow_run_id"}``, or None when the stage must run (no
        committed output, or one made from another config or other inputs).
    """
    output = final_uri(stage_uri(config.storage.root, run_id, stage))
    try:
        manifest = read_manifest(output)
    except (FileNotFoundError, ValueError):
        return None
    expected = stage_fingerprint(config, stage, inputs)
    if manifest.config_hash != expected:
        log.info("stage %s: committed output has fingerprint %s, expected %s: re-running", stage, manifest.config_hash, expected)
        return None
    return {
        "stage": stage,
        "status": "completed",
        "reused": True,
        "output_uri": output,
        "manifest_uri": join_uri(output, "manifest.json"),
        "wall_s": 0.0,
        "metrics": dict(manifest.metrics),
        "mlflow_run_id": manifest.extra.get("mlflow_run_id"),
    }


def stage_status(root: str, run_id: str, stage: str) -> dict[str, Any]:
    """Where one stage of a run stands on storage.

    Returns:
        ``{"stage", "state": "completed" | "in progress" | "not started", "latest_step":
        int | None (newest committed checkpoint), "final_step": int | None, "output_uri"}``.
    """
    base = stage_uri(root, run_id, stage)
    latest = find_latest(checkpoints_uri(base))
    try:
        final = read_manifest(final_uri(base))
    except (FileNotFoundError, ValueError):
        final = None
    state = "completed" if final else "in progress" if latest or storage.exists(base) else "not started"
    return {
        "stage": stage,
        "state": state,
        "latest_step": latest[1].global_step if latest else None,
        "final_step": final.global_step if final else None,
        "output_uri": final_uri(base) if final else base,
    }


def run_status(root: str, run_id: str) -> list[dict[str, Any]]:
    """:func:`stage_status` of every stage the run's saved config lists.

    Raises:
        ConfigError: the run has no saved config under ``root``.
    """
    stages = load_run_config(root, run_id).get("stages", list(STAGE_ORDER))
    return [stage_status(root, run_id, s) for s in stages]
