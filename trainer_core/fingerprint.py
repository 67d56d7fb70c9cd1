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
from trainer_core.config import MoEConfig, PipelineConfig, config_hash, config_value
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


ADDED_FIELDS: dict[str, object] = {
    # the supervised loop: non-finite steps, token-budget batches, the attention kernel
    "max_nonfinite_steps": 0, "max_tokens_per_micro_batch": None, "attn_implementation": None,
    # online RL: batch sizes, importance sampling, the GRPO family's estimators, losses and sampling
    "forward_micro_batch_size": None, "num_prompts": None, "importance_sampling_cap": None, "advantage_estimator": "grpo",
    "padding_free": False,
    "loss_aggregation": "token_mean", "clip_eps_high": None, "dynamic_sampling": False,
    "dynamic_sampling_max_rounds": 4, "overlong_buffer_tokens": None, "overlong_penalty": 1.0,
    "ptx_coef": 0.0, "ptx_rows_per_step": 16,
    # generation (RL, score, evaluate) and rewards: the engine, compilation, its fused projections
    # (the same tokens to the bit), reward functions and weights
    "engine": "hf", "compile": None, "fuse_projections": True, "function": None, "weights": None,
    # DPO's loss family
    "loss_type": "sigmoid", "label_smoothing": 0.0, "simpo_gamma": 0.5, "rpo_alpha": 0.0,
    # KTO and continued pretraining data (data.kto, data.pretrain, a DataSource's text_field)
    "kto": None, "pretrain": None, "text_field": "text",
    # conversations: SFT loss on every assistant turn
    "assistant_turns": "last",
    # tool environments of multi-turn rollouts; the synthetic task's calculator annotations
    "environment": None, "annotation_fraction": 1.0, "annotation_unit": "solution",
    # evaluate's sampled answers and lm-evaluation-harness tasks
    "pass_at_k": None, "lm_eval": None,
    # the reward model's parameterisation
    "parameterization": "scalar_head", "implicit_beta": 2.0,
    # on-policy distillation's generalised JSD (distill.loss, distill.beta: DPO's beta is never None)
    "loss": "token_reverse_kl", "beta": None, "lmbda": 1.0,
    # mixture-of-experts models (model.init and every training stage's moe section)
    "num_local_experts": None, "num_experts_per_tok": None, "moe": MoEConfig(), "router_temperature": None,
}
"""Fields added to the config after runs were committed, each with the value that reproduces the
earlier behaviour (its neutral value). The rule: a field named here is hashed only when it is set
to something other than its neutral value, in whichever section (or sub-section) carries it, so
the fingerprints of runs committed before it existed, and their resume, are unchanged. A field
added from now on goes here with its neutral value; removing one changes earlier fingerprints."""


POST_HOC_FIELDS = ("gates",)
"""Fields judged by the flow after a stage committed (evaluate's quality gates): never hashed."""

RUNTIME_FIELDS = ("num_proc",)
"""Fields that change how a stage runs, not what it commits (``data.num_proc``: prepare_data's
tokenising processes; the output is byte-identical for any value): never hashed."""


def _not_hashed(section) -> dict[str, Any]:
    """Fields of a stage section that do not change its result, as a pydantic ``exclude``: the
    backend override, the LoRA override (hashed resolved, when enabled, by the caller), the :data:`POST_HOC_FIELDS` and
    :data:`RUNTIME_FIELDS`, the accumulation steps when
    ``global_batch_size`` fixes the batch (they follow the world size), and :data:`ADDED_FIELDS`
    at their neutral value, in sub-sections too (``generation.engine``)."""
    fields = type(section).model_fields
    out: dict[str, Any] = {name: True for name in ("backend", "lora") if name in fields}
    out |= {name: True for name in (*POST_HOC_FIELDS, *RUNTIME_FIELDS) if name in fields}
    if getattr(section, "global_batch_size", None) is not None:
        out["grad_accum_steps"] = True
    out |= {name: True for name, neutral in ADDED_FIELDS.items() if name in fields and getattr(section, name) == neutral}
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
