"""The ``static`` generation engine's attention and KV cache, around transformers' own.

* :func:`sdpa_grouped_decode`: transformers' ``sdpa`` attention, except that a one-token query
  attends to grouped KV heads without copying them (:func:`grouped_decode_attention` puts it in
  place while the engine generates).
* :func:`typed_static_cache`: transformers' ``StaticCache`` with keys and values in one dtype.

Checked against transformers 5.17 (the GPU machine's) and 5.24 (this machine's):
``integrations/sdpa_attention.py`` and ``cache_utils.StaticLayer``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

GROUPED_DECODE_ATTENTION = "posttrain_sdpa_grouped_decode"
"""The attention implementation the ``static`` engine gives an ``sdpa`` model while it generates
(registered with transformers' ``AttentionInterface``; see :func:`sdpa_grouped_decode`)."""


def sdpa_grouped_decode(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                        dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' ``sdpa`` attention, with a one-token query attending to grouped KV heads
    without copying them.

    With a padding mask, transformers' ``sdpa_attention_forward`` repeats each KV head
    ``num_key_value_groups`` times (``repeat_kv``: SDPA's ``enable_gqa`` is only taken without a
    mask) before SDPA: in a decode step over a static cache, two copies of the whole cache per
    layer, then attention over the copies. Profiled on an H100 before this function existed
    (2026-11-26, Qwen2.5-0.5B architecture in bf16, 128 rows x 256 new tokens, a 384-token cache):
    the copies and the attention over them took 0.88 s of the call's 1.43 s of GPU time. Without
    the copies the call ran at 40,608 tokens/s against 21,369 with them (same H100 run,
    2026-11-27; ``bench/GPU.md``). For one query token the ``G`` query heads
    that share a KV head can instead go as ``G`` query positions of that head: query [B, H, 1, D] ->
    [B, H_kv, G, D] (head ``h`` uses KV head ``h // G``, ``repeat_kv``'s order), the [B, 1, 1, L]
    mask broadcast over them; the result is the same attention, reshaped back.

    Args:
        module: the attention layer (``num_key_value_groups``, as transformers' layers carry).
        query: [B, H, Q, D]; key, value: [B, H_kv, L, D].
        attention_mask: None, or [B, 1, Q, L] boolean (True = attend) or additive float.

    Returns:
        ([B, Q, H, D] attention output, None), as ``sdpa_attention_forward``. Anything but a
        one-token query with grouped KV heads (prefill, training forwards) is handed to
        ``sdpa_attention_forward`` unchanged.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, dim = query.shape
    if q_len != 1 or groups == 1 or kwargs.get("position_bias") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    grouped = query.reshape(batch, key.shape[1], groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


@functools.cache
def _register_grouped_decode() -> str:
    """Register :func:`sdpa_grouped_decode` (with ``sdpa``'s mask function) under
    :data:`GROUPED_DECODE_ATTENTION`; the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_DECODE_ATTENTION, sdpa_grouped_decode)
    AttentionMaskInterface.register(GROUPED_DECODE_ATTENTION, sdpa_mask)
    return GROUPED_DECODE_ATTENTION


@contextlib.contextmanager
def grouped_decode_attention(model: nn.Module) -> Iterator[None]:
    """Within the context, an HF model configured for ``sdpa`` attends with
    :func:`sdpa_grouped_decode`; its implementation is restored on the way out, errors included.
    Any other implementation (``eager``, ``flash_attention_2``, ...) is left as it is."""
    config = model.config
    previous = config._attn_implementation
    if previous == "sdpa":
        config._attn_implementation = _register_grouped_decode()
    try:
        yield
    finally:
        config._attn_implementation = previous


@functools.cache
def _typed_static_cache_class() -> type:
    """A subclass of transformers' ``StaticCache`` whose keys and values are kept in one dtype.

    Under ``autocast`` with fp32 weights an attention layer hands the cache bf16 values but fp32
    keys (RoPE multiplies the bf16 projection by fp32 ``cos``/``sin``, which follow the fp32
    hidden states). transformers' ``StaticLayer`` allocates its buffers on the first update from
    those tensors: 5.17 gives both buffers the keys' dtype, so the bf16 values fail its
    ``index_copy_`` (measured on an H100, 2026-11-26); 5.24 keeps fp32 keys, twice the memory.
    Casting both to the autocast dtype on the way in changes no result: SDPA under autocast
    reads the cached keys in bf16 either way.
    """
    from transformers import StaticCache

    class TypedStaticCache(StaticCache):
        def __init__(self, config: Any, max_cache_len: int, dtype: torch.dtype) -> None:
            super().__init__(config=config, max_cache_len=max_cache_len)
            self.kv_dtype = dtype

        def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
                   **kwargs: Any) -> tuple[Tensor, Tensor]:
            return super().update(key_states.to(self.kv_dtype), value_states.to(self.kv_dtype), layer_idx,
                                  *args, **kwargs)

    return TypedStaticCache


def typed_static_cache(config: Any, max_cache_len: int, dtype: torch.dtype) -> Any:
    """A transformers ``StaticCache`` for ``config``'s model, ``max_cache_len`` tokens a row (the
    rows and the device taken from the first update), that stores keys and values in ``dtype``
    (see :func:`_typed_static_cache_class`)."""
    return _typed_static_cache_class()(config, max_cache_len, dtype)
