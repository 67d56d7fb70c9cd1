"""Per-token log-probabilities from logits, shared by every objective: pure functions of tensors.

The forwards that produce the logits (or the log-probs without them, the LM head in chunks) take
a model and live in :mod:`trainer_core.modeling.forwards`; these take what a forward gives.

Shape legend: B batch, T tokens, V vocabulary; N rows, P prompt and T completion tokens for the
RL stages' completions.
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
    losses = F.cross_entropy(shifted_logits.reshape(-1, shifted_logits.size(-1)), targets.reshape(-1), reduction="none")
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


def completion_logprobs_entropies(
    logits: Tensor, input_ids: Tensor, completion_mask: Tensor, start: int, temperature: float
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of the completion tokens from a forward over ``[prompt | completion]``.

    Args:
        logits: [N, P + T, V] the model's logits over ``input_ids``.
        input_ids: [N, P + T] long, from
            :func:`~trainer_core.modeling.forwards.completion.completion_inputs`.
        completion_mask: [N, T] 1 = real completion token.
        start: :func:`~trainer_core.modeling.forwards.completion.completion_start` of the prompts.
        temperature: logits are divided by it (0 counts as 1).

    Returns:
        (logprobs [N, T] float32 zeroed on padding, entropies [N, T] float32 detached).
    """
    scale = temperature if temperature > 0 else 1.0
    logits = logits[:, start:, :].float() / scale  # [N, T + 1, V]; position t predicts token t
    logprobs = compute_logprobs(logits, input_ids[:, start:]) * completion_mask
    with torch.no_grad():
        log_p = torch.log_softmax(logits[:, :-1], dim=-1)
        entropies = -(log_p.exp() * log_p).sum(-1) * completion_mask
    return logprobs, entropies


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """[N] float32 log-probs of ``tokens`` [N] under softmax(logits [N, V] / temperature), no top-p
    cut (temperature 0 counts as 1)."""
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / scale, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
