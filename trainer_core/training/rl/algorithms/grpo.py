"""The GRPO family (Shao et al. 2024, DeepSeekMath; Dr. GRPO, DAPO, RLOO, REINFORCE++ by
configuration): group-relative advantages from a registry estimator, the public
:func:`~trainer_core.objectives.grpo.grpo_loss` per token, a registry loss aggregation.
Checked against TRL's ``GRPOTrainer`` and ``RLOOTrainer`` (``tests/parity``).

Shape legend: N sequences (prompts x G, groups contiguous), T completion tokens.
"""

from __future__ import annotations

from torch import Tensor

from trainer_core.config import GRPOConfig
from trainer_core.modeling.forwards.completion import PolicyForward
from trainer_core.objectives.grpo import grpo_loss
from trainer_core.objectives.grpo_family import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS, dapo_overlong_penalty
from trainer_core.training.rl.algorithms.base import AllReduceSum, Algorithm
from trainer_core.training.rl.batches import MiniBatchCounts, masked_sum, policy_metric_sums
from trainer_core.training.rl.rollout import RolloutBatch


def grpo_estimator(cfg: GRPOConfig) -> str:
    """The advantage estimator ``cfg`` names; ``grpo`` without ``scale_rewards`` is Dr. GRPO's."""
    if cfg.advantage_estimator == "grpo" and not cfg.scale_rewards:
        return "dr_grpo"
    return cfg.advantage_estimator


class GRPOAlgorithm(Algorithm):
    """The GRPO family: an advantage estimator of the registry, :func:`grpo_loss` (the clipped
    loss, clip-higher optional, + ``kl_coef`` x KL per token), a loss aggregation of the registry,
    and DAPO's dynamic sampling and overlong shaping when configured.

    Recipes (``docs/guides/online-rl.md``): GRPO = the defaults; Dr. GRPO = ``advantage_estimator: dr_grpo``,
    ``loss_aggregation: constant``; DAPO = ``clip_eps_high: 0.28``, ``dynamic_sampling: true``,
    ``overlong_buffer_tokens``, token_mean; RLOO = ``advantage_estimator: rloo``; REINFORCE++ =
    ``advantage_estimator: reinforce_pp`` with ``kl_coef`` > 0 (the KL enters the reward, not the loss).

    Attributes:
        estimator: the key of :data:`ADVANTAGE_ESTIMATORS` in use (:func:`grpo_estimator`).
        kl_in_loss: the KL term is in the loss (every estimator but REINFORCE++, which puts it in
            the reward).
    """

    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        self.samples_per_prompt = cfg.samples_per_prompt_of_rollout
        self.dynamic_sampling = cfg.dynamic_sampling
        self.max_sampling_rounds = cfg.dynamic_sampling_max_rounds
        self.estimator = grpo_estimator(cfg)
        self.kl_in_loss = self.estimator != "reinforce_pp"

    def prepare(self, batch: RolloutBatch, kl_coef: float, all_reduce_sum: AllReduceSum) -> None:
        """``batch.advantages`` [N, T] from the scores (plus DAPO's overlong shaping of the scores when
        configured) by the configured estimator. Groups are contiguous and never span ranks; only
        REINFORCE++ whitens with statistics over every rank (``all_reduce_sum``)."""
        cfg, mask = self.cfg, batch.completion_mask
        scores = batch.scores.float()
        if cfg.overlong_buffer_tokens is not None:
            scores = scores + dapo_overlong_penalty(
                mask.sum(1), cfg.generation.max_new_tokens, cfg.overlong_buffer_tokens, cfg.overlong_penalty
            )
        batch.advantages = ADVANTAGE_ESTIMATORS[self.estimator](
            scores,
            mask,
            cfg.group_size,
            logprobs=batch.logprobs,
            ref_logprobs=batch.ref_logprobs,
            kl_coef=kl_coef,
            kl_estimator=cfg.kl_estimator,
            all_reduce_sum=all_reduce_sum,
        )

    def loss(
        self, batch: RolloutBatch, out: PolicyForward, counts: MiniBatchCounts, *, kl_coef: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """This rank's share of the mini-batch loss under ``loss_aggregation`` (the shares of all
        ranks sum to the loss of the whole mini-batch), each token's policy loss (not its KL term)
        weighted by ``batch.is_weights`` when set, and the token sums of the metrics."""
        mask, cfg = batch.completion_mask, self.cfg
        losses, m = grpo_loss(
            out.logprobs,
            batch.logprobs,
            batch.advantages,
            batch.ref_logprobs,
            clip_eps=cfg.clip_eps,
            kl_coef=kl_coef if self.kl_in_loss else 0.0,
            kl_estimator=cfg.kl_estimator,
            clip_eps_high=cfg.clip_eps_high,
            is_weights=batch.is_weights,
        )
        loss = LOSS_AGGREGATIONS[cfg.loss_aggregation](
            losses,
            mask,
            num_tokens=counts.num_tokens,
            num_sequences=counts.num_sequences,
            max_new_tokens=cfg.generation.max_new_tokens,
        )
        metric_sums = {
            "loss/policy_avg": masked_sum(losses.detach(), mask),
            **policy_metric_sums(m, out.entropies, mask),
        }
        if "kl" in m:
            metric_sums["policy/kl_avg"] = masked_sum(m["kl"], mask)
        return loss, metric_sums
