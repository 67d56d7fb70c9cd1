"""What a stage's output depends on, as one hash: its config and its inputs' hashes.

``stage_fingerprint`` hashes the stage's own config section, the settings every stage
shares (seed, model, tokenizer), the config fields outside its section that the stage
registry lists for it (evaluate reads ``dpo.beta``) and, for each input, the ``config_hash``
of the input's committed manifest (or the literal source, e.g. ``init`` or a hub id). Inputs
carry their own inputs' hashes, so the chain covers everything upstream: change the SFT
config and the fingerprints of SFT, reward model, DPO and evaluation all change; change
only DPO's and only DPO and evaluation change.

The backend and launch settings are not part of it: a checkpoint resumes under another
backend or world size. It is computed once per stage attempt, by whoever writes the
:class:`~trainer_core.spec.StageSpec` (``trainer_core.spec.build_spec``), and travels in the
spec; the trainer records it as ``config_hash`` in every manifest it commits (checkpoints and
final). A checkpoint with another fingerprint is not resumed from; a final output with the
expected fingerprint lets a re-run of the same run id skip the stage.
Light on purpose (no torch): the flow process imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from trainer_core.checkpoint.manifest import read_manifest
from trainer_core.config import PipelineConfig, config_hash, config_value
from trainer_core.config.base import neutral_of
from trainer_core.registry import get_stage

log = logging.getLogger(__name__)


def input_identity(uri: str) -> str:
    """The ``config_hash`` of the manifest committed at ``uri``; the URI itself when it has none.

    A URI without a manifest is a source outside the pipeline (``init``, a hub id, a plain
    model directory): it is identified by its name.
    """
    try:
        return read_manifest(uri).config_hash or uri
    except (FileNotFoundError, ValueError):
        return uri


POST_HOC_FIELDS = ("gates",)
"""Fields judged by the flow after a stage committed (evaluate's quality gates): never hashed."""

RUNTIME_FIELDS = ("num_proc",)
"""Fields that change how a stage runs, not what it commits (``data.num_proc``: prepare_data's
tokenising processes; the output is byte-identical for any value): never hashed."""


def _not_hashed(section) -> dict[str, Any]:
    """Fields of a stage section that do not change its result, as a pydantic ``exclude``: the
    backend override, the LoRA override (hashed resolved, when enabled, by the caller), the :data:`POST_HOC_FIELDS` and
    :data:`RUNTIME_FIELDS`, the accumulation steps when
    ``global_batch_size`` fixes the batch (they follow the world size), and every field at the
    :class:`~trainer_core.config.base.Neutral` value it declares (a field added after runs were
    committed), in sub-sections too (``generation.engine``)."""
    fields = type(section).model_fields
    out: dict[str, Any] = {name: True for name in ("backend", "lora") if name in fields}
    out |= {name: True for name in (*POST_HOC_FIELDS, *RUNTIME_FIELDS) if name in fields}
    if getattr(section, "global_batch_size", None) is not None:
        out["grad_accum_steps"] = True
    for name, info in fields.items():
        declared, neutral = neutral_of(info)
        if declared and getattr(section, name) == neutral:
            out[name] = True
    for name in fields:
        value = getattr(section, name)
        if name not in out and isinstance(value, BaseModel):
            nested = _not_hashed(value)
            if nested:
                out[name] = nested
    return out


def stage_fingerprint(
    config: PipelineConfig, stage: str, inputs: dict[str, str], identities: Mapping[str, str] | None = None
) -> str:
    """The hash a stage's committed outputs must carry to be reused.

    Reads the manifest of every input that has one (one GET each on object storage).

    Args:
        config: the pipeline config.
        stage: the stage name.
        inputs: input role -> URI, as given to the stage.
        identities: URI -> identity of inputs not committed yet (the fingerprint the stage
            writing it will record): a sweep computes every point's fingerprints before any
            stage ran (``tasks/sweep.py``). Other inputs: :func:`input_identity`.

    Returns:
        16 hex characters (see :func:`trainer_core.config.config_hash`).

    Raises:
        ConfigError: unknown stage.
    """
    definition = get_stage(stage)
    section = config.section(stage)
    payload = {
        "stage": stage,
        "config": section.model_dump(mode="json", exclude=_not_hashed(section)),
        "seed": config.seed,
        "model": config.model.model_dump(mode="json", exclude=_not_hashed(config.model)),
        "tokenizer": config.tokenizer.model_dump(mode="json"),
        "inputs": {role: (identities or {}).get(uri) or input_identity(uri) for role, uri in sorted(inputs.items())},
    }
    lora = config.lora_for(stage)
    if lora.enabled:  # the resolved settings (pipeline-wide and the stage's override); absent when off
        payload["lora"] = lora.model_dump(mode="json")
    for path in definition.fingerprint_fields:
        payload[path.replace(".", "_")] = config_value(config, path)
    return config_hash(payload)
