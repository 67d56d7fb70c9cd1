"""Supervised fine-tuning loss: next-token cross-entropy on completion tokens only.

Shape legend: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

from torch import Tensor

from trainer_core.objectives.logprobs import compute_logprobs, shift_mask


def sft_loss(logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Masked next-token negative log-likelihood, summed (not averaged).

    The loop divides the sum by ``num_valid_tokens`` counted over every micro-batch of the
    optimizer step (and every data-parallel rank), so a step's loss does not depend on how
    the global batch is cut into micro-batches.

    Args:
        logits: [B, T, V] model output for ``input_ids``.
        input_ids: [B, T] long token ids.
        loss_mask: [B, T] 1 = token counted in the loss (completion tokens; prompt and
            padding are 0). Aligned with ``input_ids``; the shift is done here.

    Returns:
        (loss_sum, num_valid_tokens): a scalar float32 sum of the per-token NLL over counted
        tokens, and a scalar long count of the counted tokens.

    Checked by hand: with uniform logits every counted token costs ``log V``.
    """
    mask = shift_mask(loss_mask)
    nll = -compute_logprobs(logits, input_ids)
    return (nll * mask).sum(), mask.sum().long()
