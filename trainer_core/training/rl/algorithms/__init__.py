"""What the RL loop optimises: the :class:`~trainer_core.training.rl.algorithms.base.Algorithm`
contract and its entries, PPO, the GRPO family and on-policy distillation's two losses. Below the
loop (``.importlinter``): an algorithm never imports :mod:`trainer_core.training.rl.trainer`.
"""

from trainer_core.training.rl.algorithms.base import Algorithm, UpdateForwards
from trainer_core.training.rl.algorithms.distill import DISTILL_ALGORITHMS, GeneralizedJSDDistill, ReverseKLDistill
from trainer_core.training.rl.algorithms.grpo import GRPOAlgorithm
from trainer_core.training.rl.algorithms.ppo import PPOAlgorithm

__all__ = [
    "DISTILL_ALGORITHMS",
    "Algorithm",
    "GRPOAlgorithm",
    "GeneralizedJSDDistill",
    "PPOAlgorithm",
    "ReverseKLDistill",
    "UpdateForwards",
]
