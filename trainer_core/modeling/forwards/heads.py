"""The LM head of a model as a backend holds it: the HF model inside a wrapper, its decoder and
plain linear head, the whole head of a frozen (sharded) model, and a forward replaced for one call.

Wrapped models (DDP, FSDP2, a DeepSpeed engine) run the forwards of this package inside the
wrapper's forward call, so that DDP's forward bookkeeping, FSDP2's all-gather of the root's
parameters (the LM head's weight is one of them) with its pre-backward hook on the output, and
ZeRO-3's parameter fetch happen as for a plain forward. Like Liger-Kernel's model patches
(``liger_kernel.transformers.model.llama.lce_forward`` replaces ``LlamaForCausalLM.forward`` so
that the wrapped module's forward computes the loss), the causal LM's ``forward`` is replaced;
here only on the instance and only for the duration of one call (:func:`forward_replaced`). The
class, the parameters and the state dict stay those of the HF model, and nothing stays on the
instance afterwards (no reference cycle keeps a freed model alive).

Shape legend: H hidden, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import Tensor, nn
from transformers import PreTrainedModel


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The HF model inside a DDP module or a DeepSpeed engine (``.module``); FSDP2 shards in place."""
    while not isinstance(model, PreTrainedModel) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def head_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(decoder, lm_head) of an unwrapped model whose logits are exactly ``lm_head(decoder(x))``, else None.

    None for models that transform the logits after the head (Gemma-2's soft-capping,
    Cohere's ``logit_scale``, Granite's ``logits_scaling``) and for non-HF modules.
    """
    if not isinstance(model, PreTrainedModel):
        return None
    config = getattr(model, "config", None)
    if config is None or getattr(config, "final_logit_softcapping", None) is not None:
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in ("logit_scale", "logits_scaling")):
        return None
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or not isinstance(head, nn.Linear):
        return None
    return decoder, head


def frozen_head(model: nn.Module) -> tuple[Tensor, Tensor | None]:
    """A frozen causal LM's whole output projection, ``(weight [V, H], bias [V] or None)``, detached:
    gathered from its shards under FSDP2 (``DTensor.full_tensor``) and ZeRO-3
    (``deepspeed.zero.GatheredParameters``, copied), so collective there (every rank calls it).

    Raises:
        ValueError: the model's logits are not a plain linear head.
    """
    parts = head_parts(unwrap_causal_lm(model))
    if parts is None:
        raise ValueError(f"{type(unwrap_causal_lm(model)).__name__}: its logits are not a plain linear head")
    head = parts[1]
    params = [p for p in (head.weight, head.bias) if p is not None]
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return head.weight.detach().clone(), None if head.bias is None else head.bias.detach().clone()
    whole = lambda p: None if p is None else (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
    return whole(head.weight), whole(head.bias)


@contextlib.contextmanager
def forward_replaced(module: nn.Module, forward: Callable[..., Tensor]) -> Iterator[None]:
    """``module.forward`` is ``forward`` inside the block (an instance attribute shadowing the class's)."""
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous
