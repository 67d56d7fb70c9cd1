"""A pipeline run's state on storage: its saved config, which stages are done, where each stands.

Used by the stage task (reuse a stage whose committed output already carries the fingerprint
it would produce now) and by ``posttrain status`` / ``posttrain resume`` (:func:`resume_config`).
Reads storage only; no MLflow. Also a run's id (:func:`new_run_id`, :func:`check_run_id`) and its writer lease
(:func:`run_lease`).
"""

from __future__ import annotations

import logging
from typing import Any

from tasks.results import StageResult
from trainer_core import storage
from trainer_core.checkpoint.lease import StageLease, read_lease
from trainer_core.checkpoint.manifest import MANIFEST_NAME, find_latest, read_manifest
from trainer_core.config import PipelineConfig, RLStageConfig, load_config, resolve_local_root, run_ids
from trainer_core.config.stages import without_supervised_loop_fields
from trainer_core.errors import ConfigError
from trainer_core.registry import STAGE_ORDER
from trainer_core.storage import RunLayout, join_uri

log = logging.getLogger(__name__)

RL_SECTIONS = frozenset(
    name
    for name, field in PipelineConfig.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, RLStageConfig)
)
"""The config sections of the online RL stages (ppo, grpo, distill)."""


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data}


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """``{"dotted.field": [before, after]}`` for every leaf that differs (absent: None)."""
    old, new = _flat(before), _flat(after)
    return {k: [old.get(k), new.get(k)] for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}


def save_run_config(config: PipelineConfig, layout: RunLayout) -> dict[str, list[Any]]:
    """Record the config a run is (re)started with (secrets excluded) at ``<run>/config.json``.

    The first start writes it. A later start with another config is a re-plan: the config it
    replaces is kept as ``<run>/config-history/NNNN.json`` (the order of the re-plans), the new
    one written, and the changed fields returned (and logged by the caller); the fingerprints then
    decide which stages run again. Only the holder of the run's lease calls this.

    Returns:
        The changes from the previous config (empty for a first start or an identical config).

    Raises:
        ConfigError: the existing ``config.json`` is damaged (the message names it).
    """
    data = config.model_dump(mode="json", exclude={"storage": {"access_key_id", "secret_access_key"}})
    try:
        previous = _read_config(layout)
    except ConfigError as e:
        if "does not exist" not in str(e):
            raise
        previous = None
    if previous is None or previous == data:
        storage.write_json(layout.config, data)
        return {}
    history = join_uri(layout.uri, "config-history")
    number = len(storage.list_files(history)) + 1
    storage.write_json(join_uri(history, f"{number:04d}.json"), previous)
    storage.write_json(layout.config, data)
    return config_changes(previous, data)


def _read_config(layout: RunLayout) -> dict[str, Any]:
    try:
        data = storage.read_json(layout.config)
    except FileNotFoundError:
        raise ConfigError(f"no run {layout.run_id!r} under {layout.root}: {layout.config} does not exist") from None
    except ValueError as e:
        raise ConfigError(f"{layout.config} is damaged (not JSON: {e}); restore it or start a new run id") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{layout.config} is damaged (not a JSON object); restore it or start a new run id")
    return data


def load_run_config(root: str, run_id: str) -> dict[str, Any]:
    """The config dict a run was last started with, less the supervised loop's fields in its RL
    sections when it was saved before they lost them (the RL loop never read them; logged).

    Raises:
        ConfigError: the run has no saved config under ``root``, or it is damaged (named).
    """
    data = _read_config(RunLayout(root, run_id))
    for name, section in data.items():
        if name in RL_SECTIONS and isinstance(section, dict):
            data[name], dropped = without_supervised_loop_fields(section)
            if dropped:
                log.info(
                    "run %s: %s.{%s} dropped from its saved config (the RL stages do not have them)",
                    run_id,
                    name,
                    ",".join(dropped),
                )
    return data


_LOCAL_PREFIXES = ("", "file://", "sqlite:///")
"""How a config value names a local path: plainly, as a ``file://`` URI, or as a SQLite MLflow store."""


def _rebased(value: Any, old: str, new: str) -> Any:
    """``value`` with a leading ``old`` root (a path or URI, whole or as the first part of a
    longer one, and, when both roots are local paths, inside a ``file://`` or ``sqlite:///`` URI)
    put under ``new``; else ``value``. Dicts and lists are walked."""
    if isinstance(value, dict):
        return {k: _rebased(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebased(v, old, new) for v in value]
    if not isinstance(value, str) or not old.rstrip("/"):
        return value
    local = "://" not in old and "://" not in new  # a path in a URI moves only to another path
    for prefix in _LOCAL_PREFIXES if local else ("",):
        head = prefix + old.rstrip("/")
        if value == head or value.startswith(head + "/"):
            return prefix + new.rstrip("/") + value[len(head) :]
    return value


def resume_config(root: str, run_id: str, overrides: list[str] | None = None) -> tuple[PipelineConfig, dict]:
    """The config to resume ``run_id`` with: the one saved under ``root``, moved to ``root``.

    A run directory copied (or moved) elsewhere still holds the config of its first start, whose
    ``storage.root`` and every other value under that root (``tracking.tracking_uri`` of a
    SQLite store under it, a ``*_from`` model or a data file under it) name the old place. The
    resumed run reads and writes where it was found: each such value is put under ``root``, so
    the copy is resumed on its own and the original is left as it was. An input moved this way
    that the copy lacks is refused by the pre-flight checks, naming its field.

    Args:
        root: the storage root the run was found under (absolute, or a URI).
        run_id: the run.
        overrides: ``key.path=value`` items applied after the move.

    Returns:
        The resolved config, and ``{"dotted.field": [saved, resumed]}`` for each value moved.

    Raises:
        ConfigError: no (or a damaged) saved config under ``root``; an invalid override or
            config; an override of ``storage.root`` to another root (the run is where ``root`` is).
    """
    saved = load_run_config(root, run_id)
    old = str((saved.get("storage") or {}).get("root") or root)
    moved = saved
    if old.rstrip("/") != root.rstrip("/"):
        moved = _rebased(saved, old, root)
        moved["storage"] = {**(moved.get("storage") or {}), "root": root}
    config = resolve_local_root(load_config(base=moved, overrides=list(overrides or [])))
    if config.storage.root.rstrip("/") != root.rstrip("/"):
        raise ConfigError(
            f"storage.root={config.storage.root!r}: resume writes the run where it was found "
            f"(--root {root}); to resume it elsewhere copy the run there and pass that --root"
        )
    return config, config_changes(saved, moved)


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
        log.info(
            "stage %s: committed output has fingerprint %s, expected %s: re-running",
            stage,
            manifest.config_hash,
            fingerprint,
        )
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
        ``{"stage", "state", "latest_step": int | None (newest committed checkpoint),
        "final_step": int | None, "output_uri", "holder": str | None}``. ``state`` is
        ``completed`` (final committed), ``running`` (a live writer holds its lease),
        ``interrupted`` (started, no final, and no live writer: its holder died or was stopped;
        ``resume`` continues it from ``latest_step``) or ``not started``.
    """
    paths = RunLayout(root, run_id).stage(stage)
    latest = find_latest(paths.checkpoints)
    try:
        final = read_manifest(paths.final)
    except (FileNotFoundError, ValueError):
        final = None
    lease = read_lease(paths.output)
    if final is not None:
        state = "completed"
    elif lease is not None and lease["live"]:
        state = "running"
    elif latest or lease is not None or storage.exists(paths.output):
        state = "interrupted"
    else:
        state = "not started"
    return {
        "stage": stage,
        "state": state,
        "latest_step": latest[1].global_step if latest else None,
        "final_step": final.global_step if final else None,
        "output_uri": paths.final if final else paths.output,
        "holder": lease["owner"] if lease is not None and lease["live"] else None,
    }


def run_status(root: str, run_id: str) -> list[dict[str, Any]]:
    """:func:`stage_status` of every stage the run's saved config lists.

    Raises:
        ConfigError: the run has no saved config under ``root``, or it is damaged.
    """
    stages = load_run_config(root, run_id).get("stages", list(STAGE_ORDER))
    return [stage_status(root, run_id, s) for s in stages]


def run_holder(root: str, run_id: str) -> str | None:
    """The owner of the run's live lease (a ``posttrain run``/``resume`` in progress), or None."""
    lease = read_lease(RunLayout(root, run_id).uri)
    return lease["owner"] if lease is not None and lease["live"] else None


def new_run_id(config: PipelineConfig) -> str:
    """``<name>-<YYYYmmdd-HHMMSS>-<6 hex>``, e.g. ``demo-20250101-120000-a1b2c3``
    (:func:`trainer_core.config.run_ids.new_run_id`; the config's ``name`` was checked to fit)."""
    return run_ids.new_run_id(config.name)


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is usable in URIs and MLflow run names (the rule the config's
    ``name`` is checked by: :func:`trainer_core.config.run_ids.check_run_id`).

    Raises:
        ConfigError: it is empty, too long, or has characters other than letters, digits, ``._-``.
    """
    return run_ids.check_run_id(run_id)


def run_lease(config: PipelineConfig, layout: RunLayout) -> StageLease:
    """The writer lease of a whole pipeline run (``<run>/lease.json``): one live run or resume per run id."""
    return StageLease(
        layout.uri, ttl_s=config.launch.lease_ttl_s, what="another posttrain run or resume of this run id is live"
    )
