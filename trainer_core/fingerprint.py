"""What a stage's output depends on, as one hash: its config and its inputs' hashes.

``stage_fingerprint`` hashes the stage's own config section, the settings every stage
shares (seed, model, tokenizer, data lengths) and, for each input, the ``config_hash`` of
the input's committed manifest (or the literal source, e.g. ``init`` or a hub id). Inputs
carry their own inputs' hashes, so the chain covers everything upstream: change the SFT
config and the fingerprints of SFT, reward model, DPO and evaluation all change; change
only DPO's and only DPO and evaluation change.

The backend and launch settings are not part of it: a checkpoint resumes under another
backend or world size. The trainer records the fingerprint as ``config_hash`` in every manifest it commits
(checkpoints and final). A checkpoint with another fingerprint is not resumed from; a final
output with the expected fingerprint lets a re-run of the same run id skip the stage.
Light on purpose (no torch): the flow process imports it.
"""

from __future__ import annotations

import logging

from trainer_core.checkpoint.manifest import read_manifest
from trainer_core.config import PipelineConfig, config_hash, stage_config

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


def _not_hashed(section) -> set[str]:
    """Fields of a stage section that do not change its result: the backend override, and the
    accumulation steps when ``global_batch_size`` fixes the batch (they follow the world size)."""
    out = {"backend"} if "backend" in type(section).model_fields else set()
    if getattr(section, "global_batch_size", None) is not None:
        out.add("grad_accum_steps")
    return out


def stage_fingerprint(config: PipelineConfig, stage: str, inputs: dict[str, str]) -> str:
    """The hash a stage's committed outputs must carry to be reused.

    Args:
        config: the pipeline config.
        stage: the stage name.
        inputs: input role -> URI, as given to the stage.

    Returns:
        16 hex characters (see :func:`trainer_core.config.config_hash`).
    """
    section = stage_config(config, stage)
    payload = {
        "stage": stage,
        "config": section.model_dump(mode="json", exclude=_not_hashed(section)) if section is not None else None,
        "seed": config.seed,
        "model": config.model.model_dump(mode="json"),
        "tokenizer": config.tokenizer.model_dump(mode="json"),
        "inputs": {role: input_identity(uri) for role, uri in sorted(inputs.items())},
    }
    if stage == "evaluate":
        payload["dpo_beta"] = config.dpo.beta
    return config_hash(payload)
