"""PPO stage: a policy with a value head (shared trunk), per-token KL penalty against a frozen
reference, the score added at the last token, GAE, whitened advantages, clipped policy and
value losses (:class:`~trainer_core.training.rl.algorithms.ppo.PPOAlgorithm`); several epochs of
mini-batches per rollout (see :mod:`trainer_core.training.rl.trainer`).

Default reward: the trained reward model (``ppo.reward.kind``). The final directory holds the
policy as an HF model plus ``value_head.safetensors`` (``weight`` [1, H], ``bias`` [1]).


Sources: Ziegler et al. 2019 and Ouyang et al. 2022 for the RLHF recipe; checked against
TRL's ``PPOTrainer`` (metric names and definitions: ``objective/kl``, ``objective/entropy``,
``objective/scores``, ``objective/rlhf_reward``, ``policy/approxkl_avg``, ``policy/clipfrac_avg``,
``loss/policy_avg``, ``loss/value_avg``, ``val/clipfrac_avg``, ``val/ratio``). Departure: TRL
averages ``val/ratio`` over padding too (where the ratio is 1); here it is over real tokens.
"""

from __future__ import annotations

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.stages.commit import commit_final
from trainer_core.stages.context import StageContext
from trainer_core.stages.rl_common import run_rl_stage, value_head_bytes
from trainer_core.training.rl.algorithms import PPOAlgorithm


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
