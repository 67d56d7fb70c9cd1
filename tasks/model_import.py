"""Import the base model before any stage: a GGUF ``model.name_or_path`` becomes the HF directory
every stage loads (``trainer_core.modeling.gguf``, ``trainer_core.modeling.gguf_import``).

The flow calls :func:`import_base_model` after its pre-flight checks. A file already imported
under the storage root (its sha256 names a committed directory) costs a hash of the file; a new
one is checked (its architecture) and dequantized in a child process (``python -m
trainer_core.modeling.gguf_import``), so that the flow never loads torch or transformers nor
holds the model's memory, with the trainers' environment and the stage timeout. The
returned config names the imported directory in ``model.name_or_path``: the stages' fingerprints,
the recorded run config and MLflow's parameters show the content-addressed directory.
"""

from __future__ import annotations

import sys
from typing import Any

from tasks.launch.failures import raise_for_result, trainer_error
from tasks.launch.process import launch_stage_process
from tasks.stages import _spec_config_and_env
from trainer_core.checkpoint.manifest import sha256_file
from trainer_core.config import PipelineConfig
from trainer_core.errors import ConfigError
from trainer_core.modeling.gguf import IMPORTED_LINE, PACKAGE_SCHEME, imported_uri, is_gguf, is_imported, local_gguf

IMPORT_TASK = "import_model"


def _already_imported(config: PipelineConfig, source: str) -> str | None:
    """The committed import of a local (or packaged) ``source`` under the storage root, or None."""
    if "://" in source and not source.startswith(("file://", PACKAGE_SCHEME)):
        return None  # a remote file is hashed by the importer, which downloads it anyway
    uri = imported_uri(config.storage.root, sha256_file(local_gguf(source)))
    return uri if is_imported(uri) else None


def import_base_model(config: PipelineConfig, run_id: str, log: Any) -> PipelineConfig:
    """``config`` with a GGUF ``model.name_or_path`` replaced by its imported directory (imported
    now when the storage root has no import of that file); any other config is returned as is.

    Raises:
        ConfigError: the importer refused the file (its message names the file and the type).
        StageFailed: the importer failed otherwise (naming ``import_model`` and its last lines).
    """
    source = config.model.name_or_path
    if not is_gguf(source):
        return config
    uri = _already_imported(config, source)
    if uri is None:
        log.info("importing the GGUF model %s (dequantized once per storage root)", source)
        _, env = _spec_config_and_env(config)
        cmd = [sys.executable, "-m", "trainer_core.modeling.gguf_import", source, config.storage.root, run_id]
        result = launch_stage_process(cmd, env=env, log=log, timeout_s=config.launch.timeout_s)
        if result.returncode == 2:
            raise ConfigError(f"model.name_or_path: {trainer_error(result.tail) or chr(10).join(result.tail[-5:])}")
        raise_for_result(result, IMPORT_TASK)
        uri = next(
            line.removeprefix(IMPORTED_LINE).strip() for line in reversed(result.tail) if line.startswith(IMPORTED_LINE)
        )
    log.info("model.name_or_path %s: the imported directory %s", source, uri)
    out = config.model_copy(deep=True)
    out.model.name_or_path = uri
    return out
