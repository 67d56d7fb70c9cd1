"""Causal-LM forwards that score counted tokens only: per-token log-probs, their sum per
sequence, and SFT's summed NLL, the LM head on the counted positions in chunks, inside any wrapper.

SFT and DPO need log-probabilities of completion tokens only. A plain forward materialises
logits [B, T, V] for every position, prompts and padding included; here the decoder runs on
the whole sequence and the LM head only on the N hidden states of counted positions, a chunk
at a time (:mod:`trainer_core.modeling.forwards.kernels`): the head's matmul costs O(N V) instead
of O(B T V), and its extra memory O(chunk_size V) instead of O(N V) float32. The head runs inside
the wrapper's forward call (:mod:`trainer_core.modeling.forwards.heads`), ``loss_mask`` travelling
through the wrapper's forward as a keyword argument.

Shape legend: B batch, T tokens, H hidden, V vocabulary, N counted tokens.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

from trainer_core.modeling.forwards.heads import forward_replaced, head_parts, unwrap_causal_lm
from trainer_core.modeling.forwards.kernels import (
    CHUNK_SIZE_TOKENS,
    NLL_SUM_KERNELS,
    HeadFn,
    chunked_linear_logprobs,
    nll_sum_kernel,
)
from trainer_core.objectives.logprobs import compute_logprobs, sequence_logprobs, shift_mask


def _counted_head_forward(
    decoder: nn.Module,
    head: nn.Linear,
    head_fn: HeadFn,
    chunk_size: int,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    loss_mask: Tensor,
    position_ids: Tensor | None = None,
    counted_index: Tensor | None = None,
) -> Tensor:
    """The causal LM's forward for one call: the decoder on the whole batch, ``head_fn`` on counted positions.

    Args:
        decoder: the model's decoder (returns ``last_hidden_state`` [B, T, H]).
        head: the LM head; its weight and bias go to ``head_fn`` (the module itself is not
            called, so no per-chunk hook or collective runs, whatever each rank's N).
        head_fn: see :data:`HeadFn`.
        chunk_size: tokens per chunk of the head.
        input_ids: [B, T] long.
        attention_mask: [B, T] long, 1 = real token; None for a packed batch.
        loss_mask: [B, T] long, 1 = token counted (aligned with ``input_ids``).
        position_ids: [B, T] long restarting at each packed sequence, or None (positions 0..T-1).
        counted_index: [N] long from the host (:func:`~trainer_core.data.batching.counted_index`):
            the positions are selected without waiting for the device; None: by the boolean mask
            (a host synchronisation on CUDA).

    Returns:
        What ``head_fn`` returns for the N counted next-token predictions.
    """
    hidden = decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state  # [B, T, H]
    if counted_index is None:
        counted = loss_mask[:, 1:].bool()
        selected = hidden[:, :-1][counted]  # [N, H]
        targets = input_ids[:, 1:][counted]  # [N]
    else:
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, counted_index)  # [N, H]
        targets = input_ids.reshape(-1).index_select(0, counted_index + 1)  # [N]
    return head_fn(selected, head.weight, head.bias, targets, chunk_size)


def _through_wrapper(
    model: nn.Module,
    head_fn: HeadFn,
    chunk_size: int,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    loss_mask: Tensor,
    position_ids: Tensor | None,
    counted_index: Tensor | None,
) -> Tensor | None:
    """``head_fn`` on the counted positions, computed by one call of ``model`` (wrapped or not).

    Returns None when the unwrapped model's logits are not a plain linear head (the caller
    then takes the full-logits path).
    """
    inner = unwrap_causal_lm(model)
    parts = head_parts(inner)
    if parts is None:
        return None
    forward = partial(_counted_head_forward, *parts, head_fn, chunk_size)
    with forward_replaced(inner, forward):
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            position_ids=position_ids,
            counted_index=counted_index,
        )


def _full_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    loss_mask: Tensor,
    position_ids: Tensor | None,
    counted_index: Tensor | None = None,
) -> Tensor:
    # No KV cache: transformers keeps a packed batch's rows apart (by ``position_ids``) only without one.
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits  # [B, T, V]
    return compute_logprobs(logits, input_ids) * shift_mask(loss_mask)


def masked_token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    loss_mask: Tensor,
    *,
    chunk_size: int = CHUNK_SIZE_TOKENS,
    position_ids: Tensor | None = None,
    counted_index: Tensor | None = None,
) -> Tensor:
    """Next-token log-probs at counted positions, zero elsewhere.

    Equal (up to float rounding) to ``compute_logprobs(model(...).logits, input_ids) *
    shift_mask(loss_mask)``, without the [B, T, V] logits: the LM head runs on the counted
    positions, ``chunk_size`` at a time (:func:`~trainer_core.modeling.forwards.kernels.chunked_linear_logprobs`).
    Models whose logits are not a plain linear head over the decoder's last hidden state
    (soft-capping, logit scaling) take that full path.

    Args:
        model: an HF causal LM, plain or as a backend wrapped it (DDP, FSDP2, DeepSpeed engine).
        input_ids: [B, T] long.
        attention_mask: [B, T] long, 1 = real token; None for a packed batch (``position_ids`` given).
        loss_mask: [B, T] long, 1 = token counted in the loss (aligned with ``input_ids``); 0 on
            the first token of each packed sequence.
        chunk_size: tokens per chunk of the LM head (the extra memory is O(chunk_size x V)).
        position_ids: [B, T] long, restarting at 0 at each packed sequence
            (:func:`~trainer_core.data.batching.collate_causal_packed`); None: 0..T-1.
        counted_index: [N] long, the host's :func:`~trainer_core.data.batching.counted_index` of
            ``loss_mask`` (the collated batches carry it): no host synchronisation; None: the
            positions come from ``loss_mask`` on the device.

    Returns:
        [B, T - 1] float32; position t holds log p(input_ids[:, t + 1]) where
        ``loss_mask[:, t + 1] == 1``, else 0.
    """
    args = (input_ids, attention_mask, loss_mask, position_ids, counted_index)
    logprobs = _through_wrapper(model, chunked_linear_logprobs, chunk_size, *args)  # [N]
    if logprobs is None:
        return _full_logprobs(model, *args)
    num_rows, length = input_ids.shape
    if counted_index is None:
        counted = loss_mask[:, 1:].bool()
        out = torch.zeros(counted.shape, dtype=logprobs.dtype, device=logprobs.device)
        return out.masked_scatter(counted, logprobs)
    out = torch.zeros(num_rows * (length - 1), dtype=logprobs.dtype, device=logprobs.device)
    # b * T + t (a position of [B, T]) -> b * (T - 1) + t (one of [B, T - 1]): minus b.
    return out.index_copy(0, counted_index - torch.div(counted_index, length, rounding_mode="floor"), logprobs).view(
        num_rows, length - 1
    )


def masked_nll_sum(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    loss_mask: Tensor,
    *,
    chunk_size: int = CHUNK_SIZE_TOKENS,
    position_ids: Tensor | None = None,
    counted_index: Tensor | None = None,
) -> Tensor:
    """Summed next-token NLL of the counted tokens: SFT's ``loss_sum``.

    Equal (up to float rounding) to ``sft_loss(masked_token_logprobs(...), shift_mask(loss_mask))[0]``.
    On CUDA with ``liger-kernel`` installed, Liger's fused linear cross-entropy computes it
    (:data:`~trainer_core.modeling.forwards.kernels.NLL_SUM_KERNELS`); elsewhere the chunked head.

    Args:
        model: as :func:`masked_token_logprobs`.
        input_ids: [B, T] long.
        attention_mask: [B, T] long, 1 = real token; None for a packed batch.
        loss_mask: [B, T] long, 1 = token counted in the loss.
        chunk_size: tokens per chunk of the torch implementation.
        position_ids: as :func:`masked_token_logprobs`.
        counted_index: as :func:`masked_token_logprobs`.

    Returns:
        Scalar float32 sum of ``-log p`` over the counted next tokens.
    """
    args = (input_ids, attention_mask, loss_mask, position_ids, counted_index)
    kernel = NLL_SUM_KERNELS[nll_sum_kernel(input_ids.device)]
    loss_sum = _through_wrapper(model, kernel, chunk_size, *args)
    if loss_sum is None:
        return -_full_logprobs(model, *args).sum()
    return loss_sum


def padded_sequence_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    loss_mask: Tensor,
    counted_index: Tensor | None,
    chunk_size: int = CHUNK_SIZE_TOKENS,
) -> Tensor:
    """Summed log-probs [B] float32 of the counted tokens of each padded [B, T] row, the LM head
    on counted positions only: ``sequence_logprobs(masked_token_logprobs(...), shift_mask(loss_mask))``.

    The one forward of a sequence's log-likelihood: DPO's pairs, KTO's completions and KL
    sequences (:mod:`trainer_core.modeling.forwards.pairs`) and the implicit reward
    (:func:`~trainer_core.modeling.forwards.rewards.sequence_rewards`) all call it.

    Args:
        model: as :func:`masked_token_logprobs`.
        input_ids: [B, T] long, right-padded.
        attention_mask: [B, T] long, 1 = real token.
        loss_mask: [B, T] long, 1 = token counted (a completion token).
        counted_index: the collated batch's ``counted_index`` of ``loss_mask``, or None
            (:func:`masked_token_logprobs`).
        chunk_size: tokens per chunk of the LM head.

    Returns:
        [B] float32, the sum of log p over each row's counted next tokens.
    """
    token_logprobs = masked_token_logprobs(
        model, input_ids, attention_mask, loss_mask, chunk_size=chunk_size, counted_index=counted_index
    )
    return sequence_logprobs(token_logprobs, shift_mask(loss_mask))
