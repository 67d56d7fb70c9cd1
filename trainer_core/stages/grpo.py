"""GRPO stage: ``group_size`` samples per prompt, group-normalised advantages, the clipped
objective with an optional k3 KL to the reference, no critic (see
:mod:`trainer_core.training.rl` for the loop and :mod:`trainer_core.objectives.grpo`
for the math).

Default reward: the verifier (exact match of the final number plus a format bonus). The
reference model is loaded only when ``grpo.kl_coef`` > 0.

Shape legend: N sequences (prompts x G), T completion tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import GRPOConfig
from trainer_core.objectives.grpo import group_advantages, grpo_loss
from trainer_core.rollout import PolicyForward, RolloutBatch
from trainer_core.stages.context import StageContext, commit_final
from trainer_core.stages.rl_common import run_rl_stage
from trainer_core.training.rl import masked_sum


class GRPOAlgorithm:
    """Group-relative advantages of the sequence scores; clipped loss + ``kl_coef`` x KL per token."""

    uses_values = False

    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        self.samples_per_prompt = cfg.group_size

    def prepare(self, batch: RolloutBatch, kl_coef: float, all_reduce_sum: Callable[[Tensor], Tensor]) -> None:
        """``batch.advantages`` [N]: each score against its prompt's group (rows are grouped
        contiguously, and a group never spans ranks: no statistic crosses ranks)."""
        batch.advantages = group_advantages(batch.scores, self.cfg.group_size, scale=self.cfg.scale_rewards)
        self.kl_coef = kl_coef

    def loss(
        self, batch: RolloutBatch, out: PolicyForward, num_valid_tokens: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """This rank's real tokens' losses summed and divided by ``num_valid_tokens`` (the
        mini-batch's count over every rank: a token-level mean, see the objective's departure
        note), and the token sums of the metrics."""
        mask, cfg = batch.completion_mask, self.cfg
        losses, m = grpo_loss(
            out.logprobs, batch.logprobs, batch.advantages, batch.ref_logprobs,
            clip_eps=cfg.clip_eps, kl_coef=self.kl_coef, kl_estimator=cfg.kl_estimator,
        )
        loss_sum = masked_sum(losses, mask)
        metric_sums = {
            "loss/policy_avg": loss_sum.detach(),
            "policy/approxkl_avg": masked_sum(m["approxkl"], mask),
            "policy/clipfrac_avg": masked_sum(m["clipped"], mask),
            "policy/entropy_avg": masked_sum(out.entropies, mask),
            "val/ratio": masked_sum(m["ratio"], mask),
        }
        if "kl" in m:
            metric_sums["policy/kl_avg"] = masked_sum(m["kl"], mask)
        return loss_sum / num_valid_tokens, metric_sums


def run(ctx: StageContext) -> Manifest:
    """Train the GRPO policy and commit it as an HF model directory (collective when distributed)."""
    cfg = ctx.config.grpo
    trainer, metrics = run_rl_stage(ctx, cfg, GRPOAlgorithm(cfg), uses_reference=cfg.kl_coef > 0 or cfg.adaptive_kl)
    return commit_final(ctx, metrics, model=trainer.policy)
