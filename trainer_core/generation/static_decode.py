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
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from trainer_core.generation.sampling import sample_with_noise

GROUPED_DECODE_ATTENTION = "posttrain_sdpa_grouped_decode"
"""The attention implementation the ``static`` engine gives an ``sdpa`` model while it generates
(registered with transformers' ``AttentionInterface``; see :func:`sdpa_grouped_decode`)."""


def sdpa_grouped_decode(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' ``sdpa`` attention, with a one-token query attending to grouped KV heads
    without copying them.

    With a padding mask, transformers' ``sdpa_attention_forward`` repeats each KV head
    ``num_key_value_groups`` times (``repeat_kv``: SDPA's ``enable_gqa`` is only taken without a
    mask) before SDPA: in a decode step over a static cache, two copies of the whole cache per
    layer, then attention over the copies: most of a decode step's GPU time at a rollout's batch
    size (the profile and the speed-up: ``bench/GPU.md``, "grouped-KV attention measured"). For one query
    token the ``G`` query heads
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

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    grouped = query.reshape(batch, key.shape[1], groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
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
    ``index_copy_``; 5.24 keeps fp32 keys, twice the memory.
    Casting both to the autocast dtype on the way in changes no result: SDPA under autocast
    reads the cached keys in bf16 either way.
    """
    from transformers import StaticCache

    class TypedStaticCache(StaticCache):
        def __init__(self, config: Any, max_cache_len: int, dtype: torch.dtype) -> None:
            super().__init__(config=config, max_cache_len=max_cache_len)
            self.kv_dtype = dtype

        def update(
            self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
        ) -> tuple[Tensor, Tensor]:
            return super().update(
                key_states.to(self.kv_dtype), value_states.to(self.kv_dtype), layer_idx, *args, **kwargs
            )

    return TypedStaticCache


def typed_static_cache(config: Any, max_cache_len: int, dtype: torch.dtype) -> Any:
    """A transformers ``StaticCache`` for ``config``'s model, ``max_cache_len`` tokens a row (the
    rows and the device taken from the first update), that stores keys and values in ``dtype``
    (see :func:`_typed_static_cache_class`)."""
    return _typed_static_cache_class()(config, max_cache_len, dtype)


def causal_lm(model: nn.Module) -> nn.Module:
    """The HF causal LM inside DDP / a DeepSpeed engine (``.module``) or ``PolicyAndValue`` (``.policy``)."""
    from transformers import PreTrainedModel

    while not isinstance(model, PreTrainedModel):
        inner = getattr(model, "module", None)
        inner = inner if isinstance(inner, nn.Module) else getattr(model, "policy", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are sharded: FSDP2 (``DTensor``) or ZeRO-3 (``ds_id``)."""
    try:
        from torch.distributed.tensor import DTensor

        distributed: tuple[type, ...] = (DTensor,)
    except ImportError:  # a build without torch.distributed
        distributed = ()
    return any(isinstance(p, distributed) or hasattr(p, "ds_id") for p in model.parameters())


def floats_as_constants(compiled: Callable) -> Callable:
    """``compiled`` (the compiled decode step) with dynamo tracing its float arguments as
    constants (``specialize_float``, where this torch has it) at every call. By default a float
    argument becomes a graph input once a second value is seen: a float64 CPU scalar tensor, and
    CUDA graphs skip a graph with a CPU input (torch 2.13's
    ``VariableBuilder.wrap_unspecialized_primitive``)."""
    config = torch._dynamo.config
    return config.patch(specialize_float=True)(compiled) if hasattr(config, "specialize_float") else compiled


@functools.cache
def cache_argument() -> str:
    """The name transformers gives a forward's KV-cache argument and its output's cache field:
    ``cache`` from 5.24 on (``past_key_values`` then still works, with a deprecation warning on
    every run, until 5.40), ``past_key_values`` before (5.17, the GPU machine's)."""
    import inspect

    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def decode_and_sample(
    model: nn.Module,
    input_ids: Tensor,
    position_ids: Tensor,
    attention_mask: Tensor,
    cache: Any,
    noise: Tensor | None,
    temperature: float,
    top_p: float,
    cache_arg: str = "past_key_values",
) -> tuple[Tensor, Tensor]:
    """One decoding step ([N, 1] token and position, [N, L] mask) that writes its keys and values
    into the static ``cache`` and samples the next token with ``noise`` (see
    :func:`trainer_core.generation.sampling.sample_with_noise`): ([N] tokens, [N] float32 log-probs). The
    unit the ``static`` engine compiles: the forward and the sampling as one graph.
    ``cache_arg``: the forward's name for the cache (:func:`cache_argument`, given by the caller
    so that the compiled graph sees a constant)."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **{cache_arg: cache},
        use_cache=True,
    )
    return sample_with_noise(out.logits[:, -1, :], noise, temperature, top_p)


class CompletionBuffers:
    """A decoding loop's completions as [N, T] buffers written in place, one column per step,
    without lists or host reads: the bookkeeping of both engines.

    Shapes: N rows, T = ``max_new_tokens`` columns. :meth:`record` writes the sampled tokens, their
    float32 log-probs and their mask at column ``column`` [1] long of ``tokens``, ``logprobs`` and
    ``mask`` [N, T], then advances ``token`` [N] long (the tokens as fed back), ``finished`` [N] bool
    and ``column`` in place. A row ends after ``eos_id``; its later tokens are ``pad_id``, masked,
    log-prob 0.
    """

    def __init__(self, num_rows: int, max_new_tokens: int, device: torch.device) -> None:
        self.token = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.finished = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.zeros(num_rows, max_new_tokens, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(num_rows, max_new_tokens, dtype=torch.float32, device=device)
        self.mask = torch.zeros(num_rows, max_new_tokens, dtype=torch.bool, device=device)

    def record(self, token: Tensor, logprob: Tensor, eos_id: int, pad_id: int) -> None:
        """Record sampled [N] tokens and their [N] float32 log-probs at the next column; the
        tokens as fed back (``pad_id`` for rows that had already ended) become ``token``."""
        real = ~self.finished
        token = torch.where(self.finished, torch.full_like(token, pad_id), token)
        self.tokens.index_copy_(1, self.column, token[:, None])
        self.logprobs.index_copy_(1, self.column, (logprob * real)[:, None])
        self.mask.index_copy_(1, self.column, real[:, None])
        self.finished |= token == eos_id
        self.token.copy_(token)
        self.column += 1

    def result(self, columns: int) -> tuple[Tensor, Tensor, Tensor]:
        """The first ``columns`` columns, trimmed to the longest row: (ids [N, T'] long, mask
        [N, T'] float, log-probs [N, T'] float32), copies (the buffers may serve the next call)."""
        mask = self.mask[:, :columns].float()
        length = int(mask.sum(1).max())  # >= 1: every row's first token is real
        return self.tokens[:, :length].clone(), mask[:, :length], self.logprobs[:, :length].clone()


class DecodeState(CompletionBuffers):
    """The ``static`` engine's decoding loop as tensors at fixed addresses, so that one decode step
    (noise, forward, sampling and this bookkeeping) can be captured once as a CUDA graph and
    replayed for every token (:class:`DecodeGraph`).

    Adds to :class:`CompletionBuffers` (N rows, T columns) what the step reads: ``position``
    [N, 1] long, advanced by each :meth:`record`, and ``attention`` [N, L] long over the L cache
    slots (1 = a prompt token or a completion slot); :meth:`start` resets all of it for a call.
    """

    def __init__(self, num_rows: int, length: int, max_new_tokens: int, device: torch.device) -> None:
        super().__init__(num_rows, max_new_tokens, device)
        self.attention = torch.zeros(num_rows, length, dtype=torch.long, device=device)
        self.position = torch.zeros(num_rows, 1, dtype=torch.long, device=device)

    def start(self, prompt_mask: Tensor, max_new_tokens: int, last_position: Tensor) -> None:
        """Reset for prompts with [N, P] ``prompt_mask`` (left-padded): the attention mask covers
        the prompt's real tokens and the next ``max_new_tokens`` slots; [N, 1] ``last_position``
        is the last prompt token's position (each :meth:`record` advances it)."""
        prompt_len = prompt_mask.shape[1]
        self.attention.zero_()
        self.attention[:, :prompt_len] = prompt_mask.long()
        self.attention[:, prompt_len : prompt_len + max_new_tokens] = 1
        self.position.copy_(last_position)
        self.finished.zero_()
        self.column.zero_()

    def record(self, token: Tensor, logprob: Tensor, eos_id: int, pad_id: int) -> None:
        """:meth:`CompletionBuffers.record`, then the next position."""
        super().record(token, logprob, eos_id, pad_id)
        self.position += 1


class DecodeGraph:
    """One decode step captured as a CUDA graph (``torch.cuda.CUDAGraph``), replayed per token.

    Everything the step reads and writes lives at fixed addresses (the model's parameters, the
    static cache, the noise buffer, a :class:`DecodeState`), so a replay needs no host work but
    the launch: no guards, no CUDA-graph-tree bookkeeping, no per-op launches. ``generator``'s
    state is registered with the graph (``register_generator_state``): each replay draws the
    next noise from it and advances it as an eager step would. The capture runs on a side stream
    with a memory pool of the graph's own, which the graph frees when it is dropped.

    Args:
        step: the decode step to capture (compiled without CUDA graphs, already run once with
            these inputs, so that nothing compiles, autotunes or allocates a workspace during
            the capture).
        generator: the CUDA generator the step draws from, or None (greedy).

    Raises:
        RuntimeError: from CUDA, when the step does something a capture forbids (a host read).
    """

    def __init__(self, step: Callable[[], None], generator: torch.Generator | None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        if generator is not None:
            self.graph.register_generator_state(generator)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.graph.capture_begin()
            try:
                step()
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)

    def replay(self) -> None:
        """Run the captured step once, on the current stream."""
        self.graph.replay()


# --- fused projections ---------------------------------------------------------------------------

FUSED_ATTENTION = ("LlamaAttention", "Qwen2Attention", "Qwen3Attention")
"""Attention classes whose forward :func:`_fused_attention_forward` reproduces (transformers 5.x:
q/k/v projections, Qwen3's ``q_norm``/``k_norm``, RoPE, the cache update, the attention
interface, ``o_proj``)."""

FUSED_MLP = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
"""MLP classes computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""


def _plain_linears(*layers: Any) -> bool:
    """Whether ``layers`` are plain ``nn.Linear`` (not LoRA-wrapped, quantised or sharded) of one
    dtype and device, all with a bias or all without."""
    if not all(type(layer) is nn.Linear for layer in layers):
        return False
    weights = [layer.weight for layer in layers]
    return (
        len({(w.dtype, w.device) for w in weights}) == 1
        and len({layer.bias is None for layer in layers}) == 1
        and all(type(w) is nn.Parameter for w in weights)
    )


def _fused_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    """A gated MLP's forward (``FUSED_MLP``) with gate and up as one GEMM."""
    gate, up = torch.nn.functional.linear(x, self._fused_weight, self._fused_bias).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def _fused_attention_forward(
    self: nn.Module,
    hidden_states: Tensor,
    position_embeddings: tuple[Tensor, Tensor],
    attention_mask: Tensor | None = None,
    past_key_values: Any = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention forward (``FUSED_ATTENTION``, 5.17 and 5.24) with q, k and v as one GEMM.

    ``past_key_values`` (5.17) and ``cache`` (5.24) are the same argument under two names.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

    cache = cache if cache is not None else past_key_values
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, key, value = torch.nn.functional.linear(hidden_states, self._fused_weight, self._fused_bias).split(
        self._fused_sizes, dim=-1
    )
    query, key, value = query.reshape(hidden_shape), key.reshape(hidden_shape), value.reshape(hidden_shape)
    if hasattr(self, "q_norm"):  # Qwen3
        query, key = self.q_norm(query), self.k_norm(key)
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx)
    implementation = self.config._attn_implementation
    if implementation == "eager":
        attention = eager_attention_forward
    else:
        attention = ALL_ATTENTION_FUNCTIONS[implementation]
    extra = {"sliding_window": self.sliding_window} if hasattr(self, "sliding_window") else {}
    output, weights = attention(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **extra,
        **kwargs,
    )
    return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


class FusedProjections:
    """The q/k/v projections of each attention layer, and the gate/up projections of each gated
    MLP, concatenated into one weight each, for one GEMM where the model runs three (two).

    In a decode step of 128 rows the projections are small GEMMs whose launch and tail cost more
    than their weights take to read, so one GEMM where there were three is faster
    (``bench/GPU.md``), with the same tokens and log-probs to the bit: no split-K over a reduction
    as narrow as a small model's hidden size, so each output sums in the same order.

    Only the layers of :data:`FUSED_ATTENTION` and :data:`FUSED_MLP` classes with plain
    ``nn.Linear`` projections are fused (a LoRA-wrapped or quantised projection is left as it
    is). The fused weights are copies, at fixed addresses (a CUDA graph reads them): their memory
    (the q/k/v and gate/up weights once more) is held until :meth:`release`, and :meth:`refresh`
    copies the model's current weights in (after each optimizer update; 2 x 8.7 MB a layer for the
    0.5B model's MLP).

    Args:
        model: an HF causal LM.
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers: list[tuple[nn.Module, list[nn.Linear]]] = []
        for module in model.modules():
            name = type(module).__name__
            if name in FUSED_ATTENTION:
                parts = [getattr(module, p, None) for p in ("q_proj", "k_proj", "v_proj")]
            elif name in FUSED_MLP:
                parts = [getattr(module, p, None) for p in ("gate_proj", "up_proj")]
            else:
                continue
            if _plain_linears(*parts):
                self.layers.append((module, parts))
        self.weights = [torch.cat([p.weight.detach() for p in parts]) for _, parts in self.layers]
        self.biases = [
            None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts]) for _, parts in self.layers
        ]

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the model's current projection weights into the fused ones, in place."""
        for (_, parts), weight, bias in zip(self.layers, self.weights, self.biases):
            torch.cat([p.weight for p in parts], out=weight)
            if bias is not None:
                torch.cat([p.bias for p in parts], out=bias)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Within the context, each fused layer's forward runs one GEMM on the fused weights
        (an instance attribute over the class's forward); restored on the way out, errors included."""
        try:
            for (module, parts), weight, bias in zip(self.layers, self.weights, self.biases):
                module._fused_weight, module._fused_bias = weight, bias
                if type(module).__name__ in FUSED_MLP:
                    module.forward = types.MethodType(_fused_mlp_forward, module)
                else:
                    module._fused_sizes = [p.out_features for p in parts]
                    module.forward = types.MethodType(_fused_attention_forward, module)
            yield
        finally:
            for module, _ in self.layers:
                for attribute in ("forward", "_fused_weight", "_fused_bias", "_fused_sizes"):
                    module.__dict__.pop(attribute, None)
