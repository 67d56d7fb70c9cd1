"""Reward-model stage: Bradley-Terry loss on preference pairs, scalar head on the SFT model.

The objective is :class:`~trainer_core.training.supervised.RewardObjective`.
"""

from __future__ import annotations

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.stages.context import StageContext, commit_final, train_stage
from trainer_core.training.supervised import RewardObjective, pair_source


def run(ctx: StageContext) -> Manifest:
    """Train the reward model and commit it as an HF sequence-classification directory."""
    cfg, seed = ctx.config.reward_model, ctx.config.seed
    pad_id, device = ctx.tokenizer.pad_token_id, ctx.backend.device
    train = pair_source(
        ctx.load_rows("preference/train"), pad_id, cfg.micro_batch_size, seed, device,
        max_tokens=cfg.max_tokens_per_micro_batch,
    )
    held_out = pair_source(ctx.load_rows("preference/eval"), pad_id, cfg.micro_batch_size, seed, device, shuffle=False)
    model = ctx.backend.wrap(ctx.reward_model("model"))
    metrics = train_stage(ctx, model, RewardObjective(held_out, cfg.eval_max_batches), train, cfg)
    return commit_final(ctx, metrics, model=model)
