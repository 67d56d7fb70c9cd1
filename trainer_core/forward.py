"""Causal-LM forward that computes logits only where the loss needs them.

SFT and DPO need log-probabilities of completion tokens only. A plain forward materialises
logits [B, T, V] for every position, prompts and padding included; here the decoder runs on
the whole sequence and the LM head only on the hidden states of counted positions, so the
head's matmul and the softmax cost O(N V) for N counted tokens instead of O(B T V).

Shape legend: B batch, T tokens, H hidden, V vocabulary, N counted tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformers import PreTrainedModel

from trainer_core.objectives.logprobs import compute_logprobs, shift_mask


def _is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(model, FSDPModule)


def _head_parts(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(decoder, lm_head) when the logits are exactly ``lm_head(decoder(x))``, else None.

    None also for a wrapped or sharded model (DDP, FSDP2, a DeepSpeed engine): their
    gradient and all-gather hooks run on the wrapper's forward, which calling the decoder and
    the head directly would skip.
    """
    if not isinstance(model, PreTrainedModel) or _is_fsdp(model):
        return None
    config = getattr(model, "config", None)
    if config is None or getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or not isinstance(head, nn.Linear):
        return None
    return decoder, head


def masked_token_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor) -> Tensor:
    """Next-token log-probs at counted positions, zero elsewhere.

    Equal (up to float rounding) to ``compute_logprobs(model(...).logits, input_ids) *
    shift_mask(loss_mask)``; models whose logits are not a plain linear head over the
    decoder's last hidden state (soft-capping, logit scaling) take that full path.

    Args:
        model: an HF causal LM (unwrapped: the decoder is called directly).
        input_ids: [B, T] long.
        attention_mask: [B, T] long, 1 = real token.
        loss_mask: [B, T] long, 1 = token counted in the loss (aligned with ``input_ids``).

    Returns:
        [B, T - 1] float32; position t holds log p(input_ids[:, t + 1]) where
        ``loss_mask[:, t + 1] == 1``, else 0.
    """
    mask = shift_mask(loss_mask)
    parts = _head_parts(model)
    if parts is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return compute_logprobs(logits, input_ids) * mask
    decoder, head = parts
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, H]
    counted = mask.bool()
    selected = hidden[:, :-1][counted]  # [N, H]
    logits = head(selected).float()  # [N, V]
    logprobs = -F.cross_entropy(logits, input_ids[:, 1:][counted], reduction="none")  # [N]
    out = torch.zeros(counted.shape, dtype=logprobs.dtype, device=logprobs.device)
    return out.masked_scatter(counted, logprobs)
