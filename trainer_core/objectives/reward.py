"""Bradley-Terry reward-model loss on preference pairs.

Shape legend: B batch (pairs).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected)``.

    Source: Ouyang et al. 2022 (InstructGPT), eq. 1; checked against TRL's RewardTrainer
    (``-nn.functional.logsigmoid(rewards_chosen - rewards_rejected)``), without its optional
    margin term.

    Args:
        chosen_rewards: [B] scalar reward of each chosen completion.
        rejected_rewards: [B] scalar reward of each rejected completion.

    Returns:
        (losses [B], metrics) where metrics holds detached [B] tensors ``accuracies``
        (1.0 where r_chosen > r_rejected) and ``margins`` (r_chosen - r_rejected).

    Worked value: equal rewards give ``log 2 = 0.6931`` per pair and accuracy 0.
    """
    margins = chosen_rewards.float() - rejected_rewards.float()
    losses = -F.logsigmoid(margins)
    metrics = {"accuracies": (margins > 0).float().detach(), "margins": margins.detach()}
    return losses, metrics
