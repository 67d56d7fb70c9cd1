"""GRPO stage: ``group_size`` samples per prompt, group-relative advantages, the clipped
objective with an optional k3 KL to the reference, no critic; the GRPO family (Dr. GRPO, DAPO,
RLOO, REINFORCE++) by configuration (see :mod:`trainer_core.training.rl.trainer` for the loop,
:class:`~trainer_core.training.rl.algorithms.grpo.GRPOAlgorithm`, :mod:`trainer_core.objectives.grpo_family`
and :mod:`trainer_core.objectives.grpo` for the math).

Default reward: the verifier (exact match of the final number plus a format bonus). The
reference model is loaded only when ``grpo.kl_coef`` > 0 (or the KL controller is adaptive).

"""

from __future__ import annotations

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.stages.commit import commit_final
from trainer_core.stages.context import StageContext
from trainer_core.stages.rl_common import run_rl_stage
from trainer_core.training.rl.algorithms import GRPOAlgorithm


def run(ctx: StageContext) -> Manifest:
    """Train the GRPO policy and commit it as an HF model directory (collective when distributed)."""
    cfg = ctx.config.grpo
    trainer, metrics = run_rl_stage(ctx, cfg, GRPOAlgorithm(cfg), uses_reference=cfg.kl_coef > 0 or cfg.adaptive_kl)
    return commit_final(ctx, metrics, model=trainer.policy)
