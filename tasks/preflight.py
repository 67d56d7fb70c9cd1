"""Checks before any stage runs: the storage root, the data files and the model sources (a GGUF
file's header and tensor types among them).

A pipeline run that would fail an hour in (an unwritable storage root, a data URI without
credentials, a model directory that is not there) fails here instead, in seconds, with a
:class:`~trainer_core.errors.ConfigError` naming the config field, and nothing of the run written.
Hub ids (``org/name``) are not checked: whether the hub is reachable is the trainer's concern.
"""

from __future__ import annotations

import os
import uuid

from tenacity import stop_after_attempt

from trainer_core import storage
from trainer_core.config import PipelineConfig
from trainer_core.errors import ConfigError, PosttrainError, classify
from trainer_core.modeling.gguf import PACKAGE_SCHEME, check_tensor_types, is_gguf, local_gguf, read_info
from trainer_core.storage import join_uri, names_a_path

_PROBE = ".posttrain-preflight-{}"

PROBE_ATTEMPTS = 1
"""Attempts of the storage root's probe write. Storage operations retry transient failures for
up to :data:`~trainer_core.storage.RETRY_MAX_DELAY_S` (a long run must outlive a network blip);
before anything ran a re-run costs nothing, so the probe makes one attempt (botocore's own retries
included, about 8 s against a refused endpoint): an unreachable root fails in seconds, not
after minutes of retried reads and writes."""


def _reason(exc: BaseException) -> str:
    error = classify(exc)
    return str(error) if error is not None else f"{type(exc).__name__}: {exc}"


def check_storage_root(root: str) -> None:
    """``storage.root`` is a directory (or can be made one) that this process can write.

    One probe write (:data:`PROBE_ATTEMPTS`); ``posttrain run`` checks this before it reads or
    writes anything of the run, so an unreachable root is refused in seconds.

    Raises:
        ConfigError: it is a file or under one, not writable, or (``s3://``) unreachable or
            without credentials.
    """
    if "://" not in root:
        node = root
        while node and not os.path.exists(node):
            node = os.path.dirname(node)
        if node and not os.path.isdir(node):
            raise ConfigError(f"storage.root {root!r}: {node!r} is a file, not a directory")
    probe = join_uri(root, _PROBE.format(uuid.uuid4().hex))
    once = stop_after_attempt(PROBE_ATTEMPTS)
    try:
        storage.write_bytes.retry_with(stop=once)(probe, b"ok")
        storage.remove(probe, recursive=False)
    except PosttrainError:
        raise
    except Exception as e:  # noqa: BLE001 - reported with the field it concerns
        raise ConfigError(f"storage.root {root!r} is not writable: {_reason(e)}") from e


def _check_exists(field: str, source: str, uri: str, missing: str) -> None:
    """``uri`` exists; else a :class:`ConfigError` naming ``field`` and ``source``, ending in ``missing``."""
    try:
        found = storage.exists(uri)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{field} {source!r} cannot be read: {_reason(e)}") from e
    if not found:
        raise ConfigError(f"{field} {source!r} {missing}")


def check_data(config: PipelineConfig) -> None:
    """Each ``data.<set>.uri`` prepare_data will read exists and is readable (``hf://`` ids aside).

    Raises:
        ConfigError: naming ``data.<set>.uri`` and the URI.
    """
    if "prepare_data" not in config.stages:
        return
    for name in ("sft", "preference", "eval", "kto", "pretrain"):
        source = getattr(config.data, name)
        uri = source.uri if source is not None else None
        if uri is not None and not uri.startswith("hf://"):
            _check_exists(f"data.{name}.uri", uri, uri, "does not exist")
            if "://" not in uri and os.path.isdir(uri):
                raise ConfigError(f"data.{name}.uri {uri!r} is a directory, not a file")


def _model_fields(config: PipelineConfig) -> dict[str, str]:
    """Config field -> model source, for every model source the config names explicitly."""
    fields = {"model.name_or_path": config.model.name_or_path}
    for stage in config.stages:
        section = config.section(stage)
        for name in ("init_from", "reference_from", "policy_from", "reward_model_from"):
            fields[f"{stage}.{name}"] = getattr(section, name, None)
        reward = getattr(section, "reward", None)
        if reward is not None:
            fields[f"{stage}.reward.reward_model_from"] = reward.reward_model_from
    return {k: v for k, v in fields.items() if v}


def check_models(config: PipelineConfig, planned: set[str] = frozenset()) -> None:
    """Each model source named in the config is a model directory (local or fsspec URI); a name
    that is neither a local path nor a URI is taken for a hub id and not checked, and so is an
    output this run will produce (``planned``).

    Raises:
        ConfigError: naming the field and the source.
    """
    for field, source in _model_fields(config).items():
        if is_gguf(source):
            check_gguf(field, source)
            continue
        if source in planned or not names_a_path(source):
            continue
        config_json = join_uri(os.path.expanduser(source.removeprefix("file://")), "config.json")
        _check_exists(field, source, config_json, "is not a model directory (no config.json there)")


def check_gguf(field: str, source: str) -> None:
    """A GGUF model source is ``model.name_or_path``, exists, and (when it is local or in a
    package) is a GGUF file whose tensor types the ``gguf`` package can dequantize
    (``trainer_core.modeling.gguf.check_tensor_types``); its architecture, and a remote file's
    header, are checked by the import (``tasks.model_import``), still before any stage.

    Raises:
        ConfigError: naming the field, the file and what is wrong with it.
    """
    if field != "model.name_or_path":
        raise ConfigError(
            f"{field} {source!r} is a GGUF file: only model.name_or_path is imported from GGUF; "
            "point this field at an HF model directory"
        )
    if "://" in source and not source.startswith(("file://", PACKAGE_SCHEME)):
        _check_exists(field, source, source, "does not exist")
        return
    try:
        path = local_gguf(source)
        check_tensor_types(read_info(path, source), source)
    except ConfigError as e:
        raise ConfigError(f"{field}: {e}") from e


def preflight(config: PipelineConfig, planned_outputs: set[str] = frozenset()) -> None:
    """Run every check above (storage root first: the others may read from it).

    Args:
        config: the resolved config.
        planned_outputs: final URIs this run will commit (model sources pointing there are skipped).

    Raises:
        ConfigError: the first problem found, naming its config field.
    """
    check_storage_root(config.storage.root)
    check_data(config)
    check_models(config, planned_outputs)
