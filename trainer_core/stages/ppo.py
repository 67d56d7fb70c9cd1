"""PPO stage: a policy with a value head (shared trunk), per-token KL penalty against a frozen
reference, the score added at the last token, GAE, whitened advantages, clipped policy and
value losses; several epochs of mini-batches per rollout (see :mod:`trainer_core.training.rl.trainer`).

Default reward: the trained reward model (``ppo.reward.kind``). The final directory holds the
policy as an HF model plus ``value_head.safetensors`` (``weight`` [1, H], ``bias`` [1]).

Shape legend: N sequences, T completion tokens.

Sources: Ziegler et al. 2019 and Ouyang et al. 2022 for the RLHF recipe; checked against
TRL's ``PPOTrainer`` (metric names and definitions: ``objective/kl``, ``objective/entropy``,
``objective/scores``, ``objective/rlhf_reward``, ``policy/approxkl_avg``, ``policy/clipfrac_avg``,
``loss/policy_avg``, ``loss/value_avg``, ``val/clipfrac_avg``, ``val/ratio``). Departure: TRL
averages ``val/ratio`` over padding too (where the ratio is 1); here it is over real tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import PPOConfig
from trainer_core.objectives.ppo import (
    KL_ESTIMATORS,
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    penalized_rewards,
)
from trainer_core.stages.context import StageContext, commit_final
from trainer_core.stages.rl_common import run_rl_stage, value_head_bytes
from trainer_core.training.rl.rollout import PolicyForward, RolloutBatch
from trainer_core.training.rl.batches import policy_metric_sums
from trainer_core.training.rl.trainer import MiniBatchCounts, masked_sum


def whiten_across_ranks(
    x: Tensor, mask: Tensor, all_reduce_sum: Callable[[Tensor], Tensor], eps: float = 1e-8
) -> Tensor:
    """:func:`~trainer_core.objectives.ppo.whiten` (shift_mean) with the statistics of every rank's tokens.

    The masked mean and the unbiased (Bessel-corrected) masked variance are sums all-reduced
    over the data-parallel ranks, so every rank whitens with the same numbers, those of the
    whole rollout batch. With one rank (``all_reduce_sum`` the identity) the result is
    bit-identical to ``whiten(x, mask)``: the same operations in the same order.

    Args:
        x: [N, T] this rank's advantages.
        mask: [N, T] 1 = counted.
        all_reduce_sum: sum of a tensor over ranks (``Backend.all_reduce_sum``).
        eps: added to the variance.

    Returns:
        [N, T] whitened values, zero on padding.

    Worked value: rank 0 holds x [[1]], rank 1 holds x [[3]] (masks all 1): global mean 2,
    unbiased var 2, so rank 0 gets [[-0.7071]] and rank 1 [[0.7071]], as ``whiten([[1, 3]])``.
    """
    sums = all_reduce_sum(torch.stack([(x * mask).sum(), mask.sum()]))
    count = sums[1]
    mean = sums[0] / count.clamp(min=1.0)
    squares = all_reduce_sum(((x - mean) ** 2 * mask).sum())
    var = squares / count.clamp(min=1.0) * count / (count - 1).clamp(min=1.0)
    return (x - mean) * torch.rsqrt(var + eps) * mask


class PPOAlgorithm:
    """GAE advantages and the clipped policy + ``vf_coef`` x clipped value loss."""

    samples_per_prompt = 1
    uses_values = True

    def __init__(self, cfg: PPOConfig) -> None:
        self.cfg = cfg

    def prepare(self, batch: RolloutBatch, kl_coef: float, all_reduce_sum: Callable[[Tensor], Tensor]) -> None:
        """Per-token rewards (KL penalty + final score), GAE advantages and returns, whitened
        over the whole rollout batch (every rank's tokens)."""
        mask = batch.completion_mask
        kl = KL_ESTIMATORS[self.cfg.kl_estimator](batch.logprobs, batch.ref_logprobs)
        rewards, _ = penalized_rewards(batch.scores, kl, mask, kl_coef)
        advantages, returns = gae(rewards, batch.values, mask, self.cfg.gamma, self.cfg.lam)
        if self.cfg.whiten_advantages:
            advantages = whiten_across_ranks(advantages, mask, all_reduce_sum)
        batch.advantages = advantages
        batch.returns = returns

    def loss(
        self, batch: RolloutBatch, out: PolicyForward, counts: MiniBatchCounts
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """This rank's share of the mini-batch loss: policy and value losses summed over its real
        tokens, each divided by ``counts.num_tokens`` (the mini-batch's count over every rank;
        the policy loss weighted by ``batch.policy_loss_weights``: truncated importance weights
        when the engine's log-probs differ), and the token sums of the metrics."""
        mask, cfg = batch.completion_mask, self.cfg
        pg_losses, pg = clipped_policy_loss(out.logprobs, batch.logprobs, batch.advantages, cfg.clip_eps)
        vf_losses, vf = clipped_value_loss(out.values, batch.values, batch.returns, cfg.value_clip_eps)
        pg_sum, vf_sum = masked_sum(pg_losses, batch.policy_loss_weights), masked_sum(vf_losses, mask)
        metric_sums = {
            "loss/policy_avg": pg_sum.detach(),
            "loss/value_avg": vf_sum.detach(),
            **policy_metric_sums(pg, out.entropies, mask),
            "val/clipfrac_avg": masked_sum(vf["clipped"], mask),
        }
        num_tokens = counts.num_tokens
        return pg_sum / num_tokens + cfg.vf_coef * (vf_sum / num_tokens), metric_sums


def run(ctx: StageContext) -> Manifest:
    """Train the PPO policy and value head; commit the policy (HF format) and the value head.

    Collective under a distributed backend: the value head and the policy are consolidated
    from every rank (``Backend.full_state_dict``); rank 0 writes them.
    """
    cfg = ctx.config.ppo
    trainer, metrics = run_rl_stage(ctx, cfg, PPOAlgorithm(cfg), uses_reference=True)
    head = ctx.backend.full_state_dict(trainer.value_head)
    files = {"value_head.safetensors": value_head_bytes(head)} if ctx.is_main else None
    return commit_final(ctx, metrics, model=trainer.policy, files=files)
