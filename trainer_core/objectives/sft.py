"""Supervised fine-tuning loss: next-token cross-entropy on completion tokens only.

Shape legend: B batch, T tokens.
"""

from __future__ import annotations

from torch import Tensor


def sft_loss(token_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Masked next-token negative log-likelihood, summed (not averaged).

    The loop divides the sum by ``num_valid_tokens`` counted over every micro-batch of the
    optimizer step (and every data-parallel rank), so a step's loss does not depend on how
    the global batch is cut into micro-batches.

    Args:
        token_logprobs: [B, T - 1] log p(token t + 1), from ``compute_logprobs`` or
            ``forward.masked_token_logprobs``.
        mask: [B, T - 1] from ``shift_mask(loss_mask)``: 1 = the predicted token is a
            completion token counted in the loss; prompt and padding are 0.

    Returns:
        (loss_sum, num_valid_tokens): a scalar float32 sum of the per-token NLL over counted
        tokens, and a scalar long count of the counted tokens.

    Checked by hand: with uniform logits every counted token costs ``log V``.
    """
    return -(token_logprobs * mask).sum(), mask.sum().long()
