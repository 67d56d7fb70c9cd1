"""The KTO loss (Kahneman-Tversky optimisation) on unpaired desirable / undesirable examples.

Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization",
https://arxiv.org/abs/2402.01306, equation (7); checked against TRL 1.16's
``KTOTrainer._compute_loss`` (``loss_type="kto"``). Pure: log-probs in, per-example losses out.

Shape legend: B examples of a micro-batch.
"""

from __future__ import annotations

import torch
from torch import Tensor


def kto_loss(
    logps: Tensor,
    ref_logps: Tensor,
    kl_logps: Tensor,
    ref_kl_logps: Tensor,
    labels: Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    *,
    kl: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-example KTO loss.

    With the log-ratio ``r = logps - ref_logps`` of each completion and the reference point
    ``z0 = max(0, mean(kl_logps - ref_kl_logps))`` (detached), the loss of a desirable example
    is ``lambda_D (1 - sigmoid(beta (r - z0)))`` and that of an undesirable one
    ``lambda_U (1 - sigmoid(beta (z0 - r)))``. ``z0`` estimates KL(policy || reference) from
    mismatched (prompt, completion) pairs of the same micro-batch (TRL's KL completions); TRL
    averages it over the data-parallel ranks too, which the caller does by passing ``kl``.

    Args:
        logps: [B] float32, the policy's summed log-probs of each example's completion.
        ref_logps: [B] float32, the same under the frozen reference.
        kl_logps: [B] float32, the policy's summed log-probs of the mismatched completions (no
            gradient flows through them).
        ref_kl_logps: [B] float32, the same under the reference.
        labels: [B] bool, True for a desirable example.
        beta: the implied reward's scale (TRL's ``beta``).
        desirable_weight: lambda_D.
        undesirable_weight: lambda_U.
        kl: scalar, ``mean(kl_logps - ref_kl_logps)`` as the caller computed it (averaged over
            ranks); None: computed here from ``kl_logps`` and ``ref_kl_logps``. Clamped at 0 and
            detached either way.

    Returns:
        ``(losses, metrics)``: losses [B] float32; metrics, each [B] and detached (summed by the
        caller, per example): ``kl`` (z0, repeated), ``rewards/chosen`` and ``rewards/rejected``
        (``beta r`` of the desirable / undesirable examples, 0 for the others), ``count/chosen``
        and ``count/rejected`` (1 for the desirable / undesirable examples) and ``logps/chosen``,
        ``logps/rejected`` (likewise).
    """
    kl = ((kl_logps - ref_kl_logps).mean() if kl is None else kl).detach().clamp(min=0)
    logratios = logps - ref_logps
    desirable = labels.bool()
    chosen_losses = 1 - torch.sigmoid(beta * (logratios - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - logratios))
    losses = torch.where(desirable, desirable_weight * chosen_losses, undesirable_weight * rejected_losses)
    rewards = beta * logratios.detach()
    chosen, rejected = desirable.to(rewards.dtype), (~desirable).to(rewards.dtype)
    metrics = {
        "kl": kl.expand_as(rewards),
        "rewards/chosen": rewards * chosen,
        "rewards/rejected": rewards * rejected,
        "count/chosen": chosen,
        "count/rejected": rejected,
        "logps/chosen": logps.detach() * chosen,
        "logps/rejected": logps.detach() * rejected,
    }
    return losses, metrics


PER_LABEL_METRICS: dict[str, str] = {
    "rewards/chosen": "count/chosen",
    "logps/chosen": "count/chosen",
    "rewards/rejected": "count/rejected",
    "logps/rejected": "count/rejected",
}
"""Metric -> the count metric it is averaged over (desirable or undesirable examples only), as
TRL reports ``rewards/chosen`` and ``rewards/rejected``."""
