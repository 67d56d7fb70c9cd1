"""The online RL stages' tiny runs, shared by ``test_rl.py``, ``test_rl_family.py`` and
``test_lora.py``: the tiny pipeline config with short RL settings per stage (:func:`rl_config`)
and the spec of a run from the pipeline's SFT (and reward model) baselines (:func:`rl_spec_path`).
"""

from __future__ import annotations

import os

from tests.integration.helpers import RUN_ID, TinyPipeline, write_spec
from trainer_core.config import load_config
from trainer_core.spec import build_spec
from trainer_core.storage import StageLayout

RL_STEPS = 8
"""Iterations of each RL run here; checkpoints every SAVE_EVERY (4)."""

RL_OVERRIDES = {
    "max_steps": RL_STEPS,
    "prompts_per_rollout": 4,
    "ppo_epochs": 2,
    "num_mini_batches": 2,
    "generation.max_new_tokens": 12,
    "generation.temperature": 1.0,
    "generation.batch_size": 8,
    "learning_rate": 1e-3,
}
_STAGE_OVERRIDES = {
    # Adaptive KL: the controller's state must survive the resume too; the ptx term beside a
    # value head.
    "ppo": {"adaptive_kl": True, "kl_target": 0.5, "kl_horizon": 100, "ptx_coef": 0.5, "ptx_rows_per_step": 4},
    # A KL term, so the reference model is loaded and used; the ptx term, whose rows a resume
    # must draw as the uninterrupted run did.
    "grpo": {"group_size": 4, "kl_coef": 0.05, "ptx_coef": 0.5, "ptx_rows_per_step": 4},
    "distill": {"samples_per_prompt": 2},
}


def rl_config(pipeline: TinyPipeline, stage: str, **extra: object):
    """The tiny pipeline config with the RL overrides of ``stage`` (plus ``extra``: ``key.path`` -> value)."""
    overrides = {f"{stage}.{k}": v for k, v in {**RL_OVERRIDES, **_STAGE_OVERRIDES[stage]}.items()}
    overrides.update(extra)
    return load_config(base=pipeline.config.model_dump(mode="json"), overrides=overrides)


def rl_spec_path(
    pipeline: TinyPipeline, stage: str, name: str, config=None, model: str | None = None
) -> tuple[str, str]:
    """Write the spec of an RL run named ``name``; returns (spec path, output URI)."""
    sft = StageLayout(pipeline.baseline_uris["sft"]).final
    inputs = {"data": pipeline.data_uri, "model": model or sft, "reference": model or sft}
    if stage == "ppo":
        inputs["reward_model"] = StageLayout(pipeline.baseline_uris["reward_model"]).final
    output = os.path.join(pipeline.root, "rl", name)
    spec = build_spec(
        config or rl_config(pipeline, stage), stage, RUN_ID, inputs, output_uri=output, writer_id=f"writer-{name}"
    )
    return write_spec(spec, os.path.join(pipeline.root, "specs", f"rl-{name}.json")), output
