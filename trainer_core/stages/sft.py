"""SFT stage: causal-LM loss on completion tokens of the prepared SFT split.

The objective is :class:`~trainer_core.training.supervised.SFTObjective`.
"""

from __future__ import annotations

import torch

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import SupervisedStageConfig
from trainer_core.stages.commit import commit_final
from trainer_core.stages.context import StageContext, train_stage
from trainer_core.training.supervised import SFTObjective, causal_source


def train_causal_lm(ctx: StageContext, cfg: SupervisedStageConfig, data_set: str) -> Manifest:
    """Train the ``model`` input on the loss tokens of ``<data_set>/train`` (held out:
    ``<data_set>/eval``) and commit it as an HF model directory. Shared by SFT and pretrain."""
    seed, pad_id, device = ctx.config.seed, ctx.tokenizer.pad_token_id, ctx.backend.device
    train = causal_source(
        ctx.load_rows(f"{data_set}/train"),
        pad_id,
        cfg.micro_batch_size,
        seed,
        device,
        max_tokens=cfg.max_tokens_per_micro_batch,
    )
    held_out = causal_source(
        ctx.load_rows(f"{data_set}/eval"), pad_id, cfg.micro_batch_size, seed, device, shuffle=False
    )
    model = ctx.backend.wrap(ctx.models.causal_lm("model"))
    torch.manual_seed(seed)
    metrics = train_stage(ctx, model, SFTObjective(held_out, cfg.eval_max_batches), train, cfg)
    return commit_final(ctx, metrics, model=model)


def run(ctx: StageContext) -> Manifest:
    """Train the SFT policy and commit it as an HF model directory."""
    return train_causal_lm(ctx, ctx.config.sft, "sft")
