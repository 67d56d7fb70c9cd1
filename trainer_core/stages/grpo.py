"""GRPO stage: ``group_size`` samples per prompt, group-relative advantages, the clipped
objective with an optional k3 KL to the reference, no critic; the GRPO family (Dr. GRPO, DAPO,
RLOO, REINFORCE++) by configuration (see :mod:`trainer_core.training.rl.trainer` for the loop,
:mod:`trainer_core.objectives.grpo_family` and :mod:`trainer_core.objectives.grpo` for the math).

Default reward: the verifier (exact match of the final number plus a format bonus). The
reference model is loaded only when ``grpo.kl_coef`` > 0 (or the KL controller is adaptive).

Shape legend: N sequences (prompts x G), T completion tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import GRPOConfig
from trainer_core.objectives.grpo_family import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGGREGATIONS,
    clipped_policy_loss_asymmetric,
    dapo_overlong_penalty,
)
from trainer_core.objectives.ppo import KL_ESTIMATORS
from trainer_core.stages.context import StageContext, commit_final
from trainer_core.stages.rl_common import run_rl_stage
from trainer_core.training.rl.rollout import PolicyForward, RolloutBatch
from trainer_core.training.rl.batches import policy_metric_sums
from trainer_core.training.rl.trainer import MiniBatchCounts, masked_sum


class GRPOAlgorithm:
    """The GRPO family: an advantage estimator of the registry, the clipped loss (clip-higher
    optional) + ``kl_coef`` x KL per token, a loss aggregation of the registry, and DAPO's dynamic
    sampling and overlong shaping when configured.

    Recipes (``docs/guides/online-rl.md``): GRPO = the defaults; Dr. GRPO = ``advantage_estimator: dr_grpo``,
    ``loss_aggregation: constant``; DAPO = ``clip_eps_high: 0.28``, ``dynamic_sampling: true``,
    ``overlong_buffer_tokens``, token_mean; RLOO = ``advantage_estimator: rloo``; REINFORCE++ =
    ``advantage_estimator: reinforce_pp`` with ``kl_coef`` > 0 (the KL enters the reward, not the loss).
    """

    uses_values = False

    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        self.samples_per_prompt = cfg.group_size
        self.dynamic_sampling = cfg.dynamic_sampling
        self.max_sampling_rounds = cfg.dynamic_sampling_max_rounds
        estimator = cfg.advantage_estimator
        if estimator == "grpo" and not cfg.scale_rewards:
            estimator = "dr_grpo"  # the grpo estimator without the std division is Dr. GRPO's
        self.estimator = estimator
        # REINFORCE++ puts the KL in the reward (token-level); the others add it to the loss.
        self.kl_in_loss = estimator != "reinforce_pp"

    def prepare(self, batch: RolloutBatch, kl_coef: float, all_reduce_sum: Callable[[Tensor], Tensor]) -> None:
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
            scores, mask, cfg.group_size, logprobs=batch.logprobs, ref_logprobs=batch.ref_logprobs, kl_coef=kl_coef,
            kl_estimator=cfg.kl_estimator, all_reduce_sum=all_reduce_sum,
        )
        self.kl_coef = kl_coef

    def loss(
        self, batch: RolloutBatch, out: PolicyForward, counts: MiniBatchCounts
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """This rank's share of the mini-batch loss under ``loss_aggregation`` (the shares of all
        ranks sum to the loss of the whole mini-batch), each token's policy loss (not its KL
        term) weighted by ``batch.is_weights`` (truncated importance weights) when set, and the
        token sums of the metrics."""
        mask, cfg = batch.completion_mask, self.cfg
        clip_high = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps
        losses, m = clipped_policy_loss_asymmetric(
            out.logprobs, batch.logprobs, batch.advantages, cfg.clip_eps, clip_high
        )
        if batch.is_weights is not None:  # truncated IS weights the policy term only (verl's tis_imp_ratio_cap)
            losses = losses * batch.is_weights
        kl_coef = self.kl_coef if self.kl_in_loss else 0.0
        if kl_coef > 0:  # DeepSeekMath eq. 3: + beta * KL(pi || pi_ref) per token (k3, eq. 4)
            kl = KL_ESTIMATORS[cfg.kl_estimator](out.logprobs, batch.ref_logprobs)
            losses = losses + kl_coef * kl
            m["kl"] = kl.detach()
        loss = LOSS_AGGREGATIONS[cfg.loss_aggregation](
            losses, mask,
            num_tokens=counts.num_tokens, num_sequences=counts.num_sequences,
            max_new_tokens=cfg.generation.max_new_tokens,
        )
        metric_sums = {
            "loss/policy_avg": masked_sum(losses.detach(), mask),
            **policy_metric_sums(m, out.entropies, mask),
        }
        if "kl" in m:
            metric_sums["policy/kl_avg"] = masked_sum(m["kl"], mask)
        return loss, metric_sums


def run(ctx: StageContext) -> Manifest:
    """Train the GRPO policy and commit it as an HF model directory (collective when distributed)."""
    cfg = ctx.config.grpo
    trainer, metrics = run_rl_stage(ctx, cfg, GRPOAlgorithm(cfg), uses_reference=cfg.kl_coef > 0 or cfg.adaptive_kl)
    return commit_final(ctx, metrics, model=trainer.policy)
