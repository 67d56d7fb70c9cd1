"""A pipeline run's state on storage: its saved config, which stages are done, where each stands.

Used by the stage task (reuse a stage whose committed output already carries the fingerprint
it would produce now) and by ``posttrain status`` / ``posttrain resume``. Reads storage only;
no MLflow.
"""

from __future__ import annotations

import logging
from typing import Any

from tasks.results import StageResult
from trainer_core import storage
from trainer_core.checkpoint.manifest import MANIFEST_NAME, find_latest, read_manifest
from trainer_core.config import PipelineConfig
from trainer_core.errors import ConfigError
from trainer_core.registry import STAGE_ORDER
from trainer_core.storage import RunLayout, join_uri

log = logging.getLogger(__name__)


def save_run_config(config: PipelineConfig, layout: RunLayout) -> str:
    """Record the config a run is started with (secrets excluded); returns its URI."""
    data = config.model_dump(mode="json", exclude={"storage": {"access_key_id", "secret_access_key"}})
    storage.write_json(layout.config, data)
    return layout.config


def load_run_config(root: str, run_id: str) -> dict[str, Any]:
    """The config dict a run was started with.

    Raises:
        ConfigError: the run has no saved config under ``root``.
    """
    uri = RunLayout(root, run_id).config
    try:
        return storage.read_json(uri)
    except FileNotFoundError:
        raise ConfigError(f"no run {run_id!r} under {root}: {uri} does not exist") from None


def completed_result(layout: RunLayout, stage: str, fingerprint: str) -> StageResult | None:
    """The result of ``stage`` if its committed final output carries ``fingerprint``.

    Returns:
        A completed, ``reused`` result (``wall_s`` 0, the manifest's metrics and MLflow run),
        or None when the stage must run (no committed output, or one made from another config
        or other inputs).
    """
    output = layout.final(stage)
    try:
        manifest = read_manifest(output)
    except (FileNotFoundError, ValueError):
        return None
    if manifest.config_hash != fingerprint:
        log.info("stage %s: committed output has fingerprint %s, expected %s: re-running", stage, manifest.config_hash, fingerprint)
        return None
    return StageResult(
        stage=stage,
        status="completed",
        reused=True,
        output_uri=output,
        manifest_uri=join_uri(output, MANIFEST_NAME),
        fingerprint=fingerprint,
        wall_s=0.0,
        metrics=dict(manifest.metrics),
        mlflow_run_id=manifest.extra.get("mlflow_run_id"),
    )


def stage_status(root: str, run_id: str, stage: str) -> dict[str, Any]:
    """Where one stage of a run stands on storage.

    Returns:
        ``{"stage", "state": "completed" | "in progress" | "not started", "latest_step":
        int | None (newest committed checkpoint), "final_step": int | None, "output_uri"}``.
    """
    paths = RunLayout(root, run_id).stage(stage)
    latest = find_latest(paths.checkpoints)
    try:
        final = read_manifest(paths.final)
    except (FileNotFoundError, ValueError):
        final = None
    state = "completed" if final else "in progress" if latest or storage.exists(paths.output) else "not started"
    return {
        "stage": stage,
        "state": state,
        "latest_step": latest[1].global_step if latest else None,
        "final_step": final.global_step if final else None,
        "output_uri": paths.final if final else paths.output,
    }


def run_status(root: str, run_id: str) -> list[dict[str, Any]]:
    """:func:`stage_status` of every stage the run's saved config lists.

    Raises:
        ConfigError: the run has no saved config under ``root``.
    """
    stages = load_run_config(root, run_id).get("stages", list(STAGE_ORDER))
    return [stage_status(root, run_id, s) for s in stages]
