"""Reward-model stage: Bradley-Terry loss on preference pairs, scalar head on the SFT model.

Shape legend: B batch (pairs), T tokens.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.data.batching import collate_pairs
from trainer_core.loop import BatchSource, StepOutput
from trainer_core.models import load_reward_model
from trainer_core.objectives.reward import bradley_terry_loss
from trainer_core.spec import StageSpec
from trainer_core.stages.common import batch_source, commit_final, eval_batches, load_rows, open_stage, train_stage


def pair_source(rows: list[dict], pad_id: int, micro_batch_size: int, seed: int, device, shuffle=True, collate=None):
    """Batch source over prepared preference rows, bucketed by the longer of each pair."""
    lengths = [max(len(r["chosen_input_ids"]), len(r["rejected_input_ids"])) for r in rows]
    collate = collate or partial(collate_pairs, pad_id=pad_id)
    return batch_source(rows, lengths, collate, micro_batch_size, seed, device, shuffle=shuffle)


def concat_pairs(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Stack chosen over rejected for one forward pass.

    Args:
        batch: ``chosen_*`` and ``rejected_*`` tensors, each [B, T] with a common T.

    Returns:
        (input_ids, attention_mask, loss_mask), each [2B, T]; rows [:B] are chosen.
    """
    return tuple(torch.cat([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]) for k in ("input_ids", "attention_mask", "loss_mask"))


def pair_rewards(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Scalar rewards of chosen and rejected completions, each [B] (one concatenated forward)."""
    input_ids, attention_mask, _ = concat_pairs(batch)
    rewards = model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float()
    num_pairs = batch["chosen_input_ids"].shape[0]
    return rewards[:num_pairs], rewards[num_pairs:]


class RewardObjective:
    """Bradley-Terry loss; the count unit is a pair."""

    def __init__(self, eval_source: BatchSource, eval_max_batches: int) -> None:
        self.eval_source = eval_source
        self.eval_max_batches = eval_max_batches

    def count(self, batch: dict[str, Tensor]) -> int:
        return batch["chosen_input_ids"].shape[0]

    def step(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        chosen, rejected = pair_rewards(model, batch)
        losses, m = bradley_terry_loss(chosen, rejected)
        num_tokens = int(batch["chosen_attention_mask"].sum() + batch["rejected_attention_mask"].sum())
        sums = {"accuracy": m["accuracies"].sum(), "margin": m["margins"].sum()}
        return StepOutput(loss_sum=losses.sum(), num_tokens=num_tokens, metric_sums=sums)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out mean loss, pairwise accuracy (r_chosen > r_rejected) and mean margin."""
        return evaluate_pairs(self, model, self.eval_source, self.eval_max_batches)


def evaluate_pairs(objective, model: nn.Module, source: BatchSource, max_batches: int) -> dict[str, float]:
    """Mean loss and per-pair metrics of ``objective`` over the first ``max_batches`` batches."""
    totals: dict[str, float] = {"loss": 0.0}
    count = 0
    for batch in eval_batches(source, max_batches):
        out = objective.step(model, batch)
        totals["loss"] += float(out.loss_sum)
        for k, v in out.metric_sums.items():
            totals[k] = totals.get(k, 0.0) + float(v)
        count += objective.count(batch)
    return {k: v / max(count, 1) for k, v in totals.items()}


def run(spec: StageSpec) -> Manifest:
    """Train the reward model and commit it as an HF sequence-classification directory."""
    ctx = open_stage(spec)
    cfg, seed = ctx.config.reward_model, ctx.config.seed
    pad_id, device = ctx.tokenizer.pad_token_id, ctx.backend.device
    train = pair_source(load_rows(ctx, "preference/train"), pad_id, cfg.micro_batch_size, seed, device)
    held_out = pair_source(load_rows(ctx, "preference/eval"), pad_id, cfg.micro_batch_size, seed, device, shuffle=False)
    model = ctx.backend.wrap(load_reward_model(ctx.input("model"), ctx.config.model, ctx.tokenizer, seed))
    metrics = train_stage(ctx, model, RewardObjective(held_out, cfg.eval_max_batches), train, cfg)
    return commit_final(ctx, metrics, model=model)
