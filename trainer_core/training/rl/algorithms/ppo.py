"""PPO (Ziegler et al. 2019; Ouyang et al. 2022): a per-token KL penalty against the frozen
reference, the score added at the last token, GAE, whitened advantages, clipped policy and value
losses. Checked against TRL's ``PPOTrainer`` (``tests/parity``).

Shape legend: N sequences (this rank's), T completion tokens.
"""

from __future__ import annotations

from torch import Tensor

from trainer_core.config import PPOConfig
from trainer_core.modeling.forwards.completion import PolicyForward
from trainer_core.objectives.ppo import (
    KL_ESTIMATORS,
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    penalized_rewards,
    whiten,
)
from trainer_core.training.rl.algorithms.base import AllReduceSum, Algorithm
from trainer_core.training.rl.batches import MiniBatchCounts, masked_sum, policy_metric_sums
from trainer_core.training.rl.rollout import RolloutBatch


class PPOAlgorithm(Algorithm):
    """GAE advantages and the clipped policy + ``vf_coef`` x clipped value loss."""

    uses_values = True

    def __init__(self, cfg: PPOConfig) -> None:
        self.cfg = cfg

    def prepare(self, batch: RolloutBatch, kl_coef: float, all_reduce_sum: AllReduceSum) -> None:
        """Per-token rewards (KL penalty + final score), GAE advantages and returns, the advantages
        whitened over the whole rollout batch (every rank's tokens) with ``whiten_advantages``."""
        mask = batch.completion_mask
        kl = KL_ESTIMATORS[self.cfg.kl_estimator](batch.logprobs, batch.ref_logprobs)
        rewards, _ = penalized_rewards(batch.scores, kl, mask, kl_coef)
        advantages, returns = gae(rewards, batch.values, mask, self.cfg.gamma, self.cfg.lam)
        if self.cfg.whiten_advantages:
            advantages = whiten(advantages, mask, all_reduce_sum=all_reduce_sum)
        batch.advantages = advantages
        batch.returns = returns

    def loss(
        self, batch: RolloutBatch, out: PolicyForward, counts: MiniBatchCounts, *, kl_coef: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """This rank's share of the mini-batch loss: policy (weighted by ``batch.is_weights`` when
        set) and value losses summed over its real tokens, each divided by ``counts.num_tokens``
        (the mini-batch's count over every rank), and the token sums of the metrics. The KL is in
        the rewards, not here."""
        mask, cfg = batch.completion_mask, self.cfg
        pg_losses, pg = clipped_policy_loss(
            out.logprobs, batch.logprobs, batch.advantages, cfg.clip_eps, is_weights=batch.is_weights
        )
        vf_losses, vf = clipped_value_loss(out.values, batch.values, batch.returns, cfg.value_clip_eps)
        pg_sum, vf_sum = masked_sum(pg_losses, mask), masked_sum(vf_losses, mask)
        metric_sums = {
            "loss/policy_avg": pg_sum.detach(),
            "loss/value_avg": vf_sum.detach(),
            **policy_metric_sums(pg, out.entropies, mask),
            "val/clipfrac_avg": masked_sum(vf["clipped"], mask),
        }
        num_tokens = counts.num_tokens
        return pg_sum / num_tokens + cfg.vf_coef * (vf_sum / num_tokens), metric_sums
