"""Direct Preference Optimization, sigmoid loss.

Shape legend: B batch (pairs).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def dpo_loss(
    policy_chosen_logprobs: Tensor,
    policy_rejected_logprobs: Tensor,
    ref_chosen_logprobs: Tensor,
    ref_rejected_logprobs: Tensor,
    *,
    beta: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair sigmoid DPO loss.

    ``loss = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` where each term is
    the summed log-probability of the completion tokens.

    Source: Rafailov et al. 2023, "Direct Preference Optimization", eq. 7. Checked against
    TRL's DPOTrainer (``loss_type="sigmoid"``, ``label_smoothing=0``); the metrics follow
    TRL's names and definitions: ``rewards/chosen = beta * (pi_c - ref_c)``, likewise
    rejected, ``rewards/accuracies = (rewards/chosen > rewards/rejected)``,
    ``rewards/margins = rewards/chosen - rewards/rejected``.

    Args:
        policy_chosen_logprobs: [B] summed log-probs of chosen completions under the policy.
        policy_rejected_logprobs: [B] same for the rejected completions.
        ref_chosen_logprobs: [B] summed log-probs of chosen completions under the frozen reference.
        ref_rejected_logprobs: [B] same for the rejected completions.
        beta: strength of the implicit KL constraint (> 0).

    Returns:
        (losses [B], metrics): metrics are detached [B] tensors keyed ``rewards/chosen``,
        ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``.

    Raises:
        ValueError: when ``beta`` is not positive.

    Worked value: policy == reference gives ``log 2 = 0.6931`` per pair.
    """
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    chosen_logratios = policy_chosen_logprobs.float() - ref_chosen_logprobs.float()
    rejected_logratios = policy_rejected_logprobs.float() - ref_rejected_logprobs.float()
    logits = chosen_logratios - rejected_logratios
    losses = -F.logsigmoid(beta * logits)
    chosen_rewards = (beta * chosen_logratios).detach()
    rejected_rewards = (beta * rejected_logratios).detach()
    metrics = {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
        "rewards/margins": chosen_rewards - rejected_rewards,
    }
    return losses, metrics
