"""trainer_core: the post-training library under the posttrain pipeline (no Prefect in it).

The public API has three tiers (``docs/reference/api.md`` documents each name with shapes and errors):

- **Tier 0, interfaces**: what you implement to plug in. ``Backend`` (a Protocol: how a model
  runs: single device, DDP, FSDP2, DeepSpeed ZeRO), ``Objective`` (the base class of what the
  supervised loop optimises), the ``StepOutput`` an objective returns, and ``Algorithm`` (the
  base class of what the RL loop optimises: PPO, the GRPO family, distillation).
- **Tier 1, primitives**, each usable on its own: pure losses and log-prob functions, model and
  tokenizer loading, the optimizer and scheduler factories, the backend factory, and the
  manifest commit protocol (write files, commit a ``manifest.json`` last, read and verify it).
- **Tier 2, factories**: ``build_trainer(config, "dpo").run()`` builds and runs a whole stage from
  a config (the 80% case); ``TrainLoop`` with a ``CheckpointSession`` runs your own objective
  with the pipeline's checkpointing, resume and metric bookkeeping.

Names are imported lazily (PEP 562), so ``import trainer_core`` and the light modules the
flow process uses (``trainer_core.registry``, ``trainer_core.config``) do not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

TIER_0: dict[str, str] = {
    "Backend": "trainer_core.backends.base",
    "Objective": "trainer_core.training.loop",
    "Algorithm": "trainer_core.training.rl.algorithms.base",
    "StepOutput": "trainer_core.training.loop",
}
"""The interfaces (and the value an ``Objective`` returns): name -> defining module."""

TIER_1: dict[str, str] = {
    "sft_loss": "trainer_core.objectives.sft",
    "bradley_terry_loss": "trainer_core.objectives.reward",
    "PairLogprobs": "trainer_core.objectives.dpo",
    "dpo_loss": "trainer_core.objectives.dpo",
    "preference_loss": "trainer_core.objectives.dpo",
    "kto_loss": "trainer_core.objectives.kto",
    "group_advantages": "trainer_core.objectives.grpo",
    "grpo_loss": "trainer_core.objectives.grpo",
    "gae": "trainer_core.objectives.ppo",
    "whiten": "trainer_core.objectives.ppo",
    "clipped_policy_loss": "trainer_core.objectives.ppo",
    "clipped_value_loss": "trainer_core.objectives.ppo",
    "compute_logprobs": "trainer_core.objectives.logprobs",
    "sequence_logprobs": "trainer_core.objectives.logprobs",
    "shift_mask": "trainer_core.objectives.logprobs",
    "masked_token_logprobs": "trainer_core.modeling.forwards.token",
    "load_causal_lm": "trainer_core.modeling.models",
    "load_reward_model": "trainer_core.modeling.models",
    "save_pretrained_to": "trainer_core.modeling.models",
    "load_tokenizer": "trainer_core.data.tokenizer",
    "train_tokenizer": "trainer_core.data.tokenizer",
    "encode_chat": "trainer_core.data.tokenizer",
    "collate_causal": "trainer_core.data.batching",
    "load_split": "trainer_core.data.prepared",
    "load_tokenizer_from": "trainer_core.data.prepared",
    "build_optimizer": "trainer_core.training.loop",
    "build_scheduler": "trainer_core.training.loop",
    "build_backend": "trainer_core.backends",
    "ArtifactWriter": "trainer_core.checkpoint.manifest",
    "Manifest": "trainer_core.checkpoint.manifest",
    "read_manifest": "trainer_core.checkpoint.manifest",
    "load_verified": "trainer_core.checkpoint.manifest",
}
"""Primitives: name -> defining module."""

TIER_2: dict[str, str] = {
    "load_config": "trainer_core.config",
    "PipelineConfig": "trainer_core.config",
    "build_trainer": "trainer_core.stages.runner",
    "StageTrainer": "trainer_core.stages.runner",
    "TrainLoop": "trainer_core.training.loop",
    "BatchSource": "trainer_core.training.loop",
    "causal_source": "trainer_core.training.supervised",
    "CheckpointSession": "trainer_core.checkpoint.session",
    "MetricsBuffer": "trainer_core.checkpoint.session",
}
"""Factories and the loop they build: name -> defining module."""

_EXPORTS = {**TIER_0, **TIER_1, **TIER_2}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainer_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
