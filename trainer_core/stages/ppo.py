"""PPO stage: a policy with a value head (shared trunk), per-token KL penalty against a frozen
reference, the score added at the last token, GAE, whitened advantages, clipped policy and
value losses; several epochs of mini-batches per rollout (see :mod:`trainer_core.stages.rl_common`).

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

from torch import Tensor

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import PPOConfig
from trainer_core.objectives.ppo import (
    KL_ESTIMATORS,
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    masked_mean,
    penalized_rewards,
    whiten,
)
from trainer_core.rollout import RolloutBatch
from trainer_core.spec import StageSpec
from trainer_core.stages.common import commit_final, open_stage
from trainer_core.stages.rl_common import PolicyForward, run_rl_stage, value_head_bytes


class PPOAlgorithm:
    """GAE advantages and the clipped policy + ``vf_coef`` x clipped value loss."""

    samples_per_prompt = 1
    uses_values = True

    def __init__(self, cfg: PPOConfig) -> None:
        self.cfg = cfg

    def prepare(self, batch: RolloutBatch, kl_coef: float) -> None:
        """Per-token rewards (KL penalty + final score), GAE advantages and returns, whitened."""
        mask = batch.completion_mask
        kl = KL_ESTIMATORS[self.cfg.kl_estimator](batch.logprobs, batch.ref_logprobs)
        rewards, _ = penalized_rewards(batch.scores, kl, mask, kl_coef)
        advantages, returns = gae(rewards, batch.values, mask, self.cfg.gamma, self.cfg.lam)
        batch.advantages = whiten(advantages, mask) if self.cfg.whiten_advantages else advantages
        batch.returns = returns

    def loss(self, batch: RolloutBatch, out: PolicyForward) -> tuple[Tensor, dict[str, Tensor]]:
        """Masked means over the mini-batch's real tokens of the policy and value losses."""
        mask, cfg = batch.completion_mask, self.cfg
        pg_losses, pg = clipped_policy_loss(out.logprobs, batch.logprobs, batch.advantages, cfg.clip_eps)
        vf_losses, vf = clipped_value_loss(out.values, batch.values, batch.returns, cfg.value_clip_eps)
        pg_loss, vf_loss = masked_mean(pg_losses, mask), masked_mean(vf_losses, mask)
        metrics = {
            "loss/policy_avg": pg_loss.detach(),
            "loss/value_avg": vf_loss.detach(),
            "policy/approxkl_avg": masked_mean(pg["approxkl"], mask),
            "policy/clipfrac_avg": masked_mean(pg["clipped"], mask),
            "policy/entropy_avg": masked_mean(out.entropies, mask),
            "val/clipfrac_avg": masked_mean(vf["clipped"], mask),
            "val/ratio": masked_mean(pg["ratio"], mask),
        }
        return pg_loss + cfg.vf_coef * vf_loss, metrics


def run(spec: StageSpec) -> Manifest:
    """Train the PPO policy and value head; commit the policy (HF format) and the value head."""
    ctx = open_stage(spec)
    cfg = ctx.config.ppo
    trainer, metrics = run_rl_stage(ctx, cfg, PPOAlgorithm(cfg), uses_reference=True)
    files = {"value_head.safetensors": value_head_bytes(trainer.value_head)}
    return commit_final(ctx, metrics, model=trainer.policy, files=files)
