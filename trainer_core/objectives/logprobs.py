"""Per-token log-probabilities shared by every objective.

Shape legend: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def compute_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of each label under the logits, for next-token prediction.

    The logits at position t score the token at t + 1, so the result is aligned with
    ``labels[:, 1:]``: ``out[:, t] = log p(labels[:, t + 1] | labels[:, :t + 1])``.

    Args:
        logits: [B, T, V] float, the model's output for ``labels``.
        labels: [B, T] long, the input token ids.

    Returns:
        [B, T - 1] float32 log-probabilities of ``labels[:, 1:]``.

    Computed as ``-cross_entropy`` in float32, which equals gathering ``log_softmax``
    (checked against TRL's ``selective_log_softmax``) without materialising [B, T, V] twice.
    """
    shifted_logits = logits[:, :-1, :].float()
    targets = labels[:, 1:]
    losses = F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)), targets.reshape(-1), reduction="none"
    )
    return -losses.view(targets.shape)


def shift_mask(loss_mask: Tensor) -> Tensor:
    """Align a [B, T] token mask with :func:`compute_logprobs`' [B, T - 1] output.

    Args:
        loss_mask: [B, T], 1 = token counted in the loss (a completion token).

    Returns:
        [B, T - 1] float mask; position t is 1 when token t + 1 is counted.
    """
    return loss_mask[:, 1:].to(torch.float32)


def sequence_logprobs(logprobs: Tensor, mask: Tensor) -> Tensor:
    """Sum of the masked per-token log-probs of each sequence.

    Args:
        logprobs: [B, T - 1] from :func:`compute_logprobs`.
        mask: [B, T - 1] from :func:`shift_mask` (1 = counted).

    Returns:
        [B] summed log-probabilities (the log-likelihood of each completion).
    """
    return (logprobs * mask).sum(dim=-1)
