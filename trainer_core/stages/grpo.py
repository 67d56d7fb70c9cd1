"""GRPO stage: ``group_size`` samples per prompt, group-normalised advantages, the clipped
objective with an optional k3 KL to the reference, no critic (see
:mod:`trainer_core.stages.rl_common` for the loop and :mod:`trainer_core.objectives.grpo`
for the math).

Default reward: the verifier (exact match of the final number plus a format bonus). The
reference model is loaded only when ``grpo.kl_coef`` > 0.

Shape legend: N sequences (prompts x G), T completion tokens.
"""

from __future__ import annotations

from torch import Tensor

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import GRPOConfig
from trainer_core.objectives.grpo import group_advantages, grpo_loss
from trainer_core.objectives.ppo import masked_mean
from trainer_core.rollout import RolloutBatch
from trainer_core.spec import StageSpec
from trainer_core.stages.common import commit_final, open_stage
from trainer_core.stages.rl_common import PolicyForward, run_rl_stage


class GRPOAlgorithm:
    """Group-relative advantages of the sequence scores; clipped loss + ``kl_coef`` x KL per token."""

    uses_values = False

    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        self.samples_per_prompt = cfg.group_size

    def prepare(self, batch: RolloutBatch, kl_coef: float) -> None:
        """``batch.advantages`` [N]: each score against its prompt's group (rows are grouped contiguously)."""
        batch.advantages = group_advantages(batch.scores, self.cfg.group_size, scale=self.cfg.scale_rewards)
        self.kl_coef = kl_coef

    def loss(self, batch: RolloutBatch, out: PolicyForward) -> tuple[Tensor, dict[str, Tensor]]:
        """Token-level mean over the mini-batch's real tokens (see the objective's departure note)."""
        mask, cfg = batch.completion_mask, self.cfg
        losses, m = grpo_loss(
            out.logprobs, batch.logprobs, batch.advantages, batch.ref_logprobs,
            clip_eps=cfg.clip_eps, kl_coef=self.kl_coef, kl_estimator=cfg.kl_estimator,
        )
        loss = masked_mean(losses, mask)
        metrics = {
            "loss/policy_avg": loss.detach(),
            "policy/approxkl_avg": masked_mean(m["approxkl"], mask),
            "policy/clipfrac_avg": masked_mean(m["clipped"], mask),
            "policy/entropy_avg": masked_mean(out.entropies, mask),
            "val/ratio": masked_mean(m["ratio"], mask),
        }
        if "kl" in m:
            metrics["policy/kl_avg"] = masked_mean(m["kl"], mask)
        return loss, metrics


def run(spec: StageSpec) -> Manifest:
    """Train the GRPO policy and commit it as an HF model directory."""
    ctx = open_stage(spec)
    cfg = ctx.config.grpo
    trainer, metrics = run_rl_stage(ctx, cfg, GRPOAlgorithm(cfg), uses_reference=cfg.kl_coef > 0 or cfg.adaptive_kl)
    return commit_final(ctx, metrics, model=trainer.policy)
