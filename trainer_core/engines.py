"""Generation engines for RL rollouts: sample completions and the sampler's own log-probs.

Shape legend: N sequences (prompts x samples per prompt), P prompt tokens (left-padded to the
longest prompt), T completion tokens (right-padded after each row's end), L cache length
(P + max_new_tokens, rounded up when compiled), V vocabulary. Token ids are ``torch.long``;
masks are float, 1 = a real token.

An engine turns left-padded prompts into :class:`Generated` completions, drawing every random
choice from one ``torch.Generator`` that the stage checkpoints. It also returns the log-prob of
each sampled token under the distribution it sampled from, temperature-scaled but without the
top-p cut ("engine log-probs"): the trainer recomputes them with its own forward and compares
(``rollout/logprob_diff_*``) or weights the loss by their ratio (truncated importance sampling;
Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training").
Temperature 0 is greedy; its log-probs are then those of the unscaled logits (0 counts as 1,
as in ``rollout.completion_logprobs``). A row ends after its EOS token.

Engines (:data:`ENGINES`, chosen by ``generation.engine``):

- ``hf`` (:class:`HFEngine`): a plain KV-cached loop over the model's forward with a dynamic
  cache: the sampling loop the RL stages had before the engines, bit-exactly (a copy of that
  loop pins it in ``tests/unit/test_engines.py``), so earlier runs resume as they did. Any causal LM,
  wrapped or sharded: with ``sync`` (FSDP2, ZeRO-3) it runs in lockstep across ranks. It holds
  nothing between calls; ``load_weights`` just points it at the module it is given (the policy
  being trained: nothing is copied), ``release`` does nothing.
- ``static`` (:class:`StaticCacheEngine`): a transformers ``StaticCache`` of [N, L] reserved up
  front, one batched prefill of every prompt, then one token per step with the full-length 2D
  attention mask prepared once. On CUDA (or with ``compile=True``) the decode step is
  ``torch.compile(mode="reduce-overhead", fullgraph=True)``: CUDA graphs replay each step with
  no per-kernel launch overhead, and the step samples the next token inside the graph (the
  exponential race that ``torch.multinomial`` runs, fed Exp(1) noise drawn from the generator
  before each step: the same draws, without multinomial's per-step host reads).
  Unsharded policies only (single device, DDP). It serves the
  policy's own parameters (colocated): the optimizer updates them in place, at the addresses the
  CUDA graphs read, so ``load_weights`` of that same model costs nothing; a different model's
  weights are copied into the engine's in place. ``release`` drops the KV cache and the
  sampler's noise buffer.

Static cache, as transformers 5.x has it (checked 5.17 and 5.23, ``cache_utils.StaticLayer``):
the model's forward takes no ``cache_position``; each layer writes the new keys at its own
``cumulative_length`` tensor and advances it in place (a tensor at a static address, so it can
live inside a CUDA graph); the mask covers the whole cache (``get_mask_sizes`` returns L) and
causality hides the slots not written yet. ``generate(cache_implementation="static")`` works the
same way, with the mask built outside its compiled call; here it is built inside (a traced
``q_offset`` tensor, one graph per step).

Stopping on CUDA graphs: reading "have all rows ended?" on the host waits for the device, once
per token. With a compiled step the loop asks only every :data:`CHECK_EVERY_STEPS` steps; the
extra steps after the last row ended sample padding (masked, trimmed from the result), so the
completions are the same, but the generator advances by up to ``CHECK_EVERY_STEPS - 1`` more
draws than the ``hf`` engine's (still deterministic for a given engine, seed and device).

Memory and CUDA graphs: ``release`` frees the cache tensors and the noise buffer (back to
PyTorch's allocator, for the update to use); the next call reserves new ones, whose addresses may
differ, and the CUDA graph trees then re-record the decode step once
(``torch._dynamo.mark_static_address``, unguarded: a re-record, not a recompile). Under the
trainer's ``autocast`` with fp32 weights the decode graph casts the weights to bf16 at every step;
the bench runs bf16 weights.

A vLLM engine would drop in behind the same Protocol, not implemented here: a colocated
``vllm.LLM`` on the trainer's GPU (``enable_sleep_mode=True``, a ``gpu_memory_utilization``
share, ``distributed_executor_backend="external_launcher"`` under torchrun, as TRL's
``vllm_mode="colocate"`` and verl run it); ``load_weights`` pushes the policy's (gathered) state
dict into the model of vLLM's model runner (``model_runner.model.load_weights(state_dict.items())``,
TRL's ``_move_model_to_vllm``) and resets the prefix cache; ``release`` is ``llm.sleep(level=1)``
(KV cache discarded, weights offloaded) and ``generate`` calls ``llm.wake_up()`` first;
``generate`` sends the unpadded prompts as token ids with ``SamplingParams(temperature, top_p,
max_tokens, logprobs=0, seed)`` and returns vLLM's sampled-token log-probs, with ``logprobs_mode``
set so that they come after the temperature (``processed_logprobs``; whether vLLM's processed
log-probs also carry the top-p cut depends on its version: check before comparing them with the
trainer's uncut ones when ``top_p < 1``). vLLM does not draw from this ``torch.Generator``, so a
resumed run does not sample the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from trainer_core.config import GenerationConfig
from trainer_core.sampling import exponential_noise, next_tokens, sample_with_noise, token_logprobs
from trainer_core.static_decode import grouped_decode_attention, typed_static_cache

CHECK_EVERY_STEPS = 16
"""Decode steps between "all rows ended?" host reads with a compiled (CUDA-graph) decode step."""

CACHE_LEN_MULTIPLE = 128
"""With a compiled decode step, the cache length is rounded up to a multiple of this, so that
rollouts whose longest prompt differs share the compiled graph (fewer shapes to record)."""


@dataclass
class Generated:
    """What an engine sampled.

    Attributes:
        completion_ids: [N, T] long, sampled tokens (EOS included), ``pad_id`` after a row's end.
        completion_mask: [N, T] float, 1 = a real completion token.
        logprobs: [N, T] float32, the sampler's log-probs of ``completion_ids`` under the
            temperature-scaled distribution without the top-p cut, 0 on padding.
    """

    completion_ids: Tensor
    completion_mask: Tensor
    logprobs: Tensor


class GenerationEngine(Protocol):
    """Samples completions for the RL loop; ``load_weights`` after each optimizer update,
    ``release`` before it."""

    name: str

    def generate(
        self, prompt_ids: Tensor, prompt_mask: Tensor, gen: GenerationConfig, *, eos_id: int, pad_id: int,
        generator: torch.Generator,
    ) -> Generated:
        """Sample up to ``gen.max_new_tokens`` tokens after each prompt.

        Args:
            prompt_ids: [N, P] long, left-padded.
            prompt_mask: [N, P] float, 1 = real token.
            gen: a ``RolloutGenerationConfig`` (temperature, top_p, max_new_tokens).
            eos_id: a row ends after it samples this token.
            pad_id: written after a row's end.
            generator: the only source of randomness (on the model's device).

        Returns:
            The :class:`Generated` completions, T <= max_new_tokens the longest row.
        """
        ...

    def load_weights(self, model: nn.Module) -> None:
        """Serve ``model``'s current weights (the policy after an optimizer update)."""
        ...

    def release(self) -> None:
        """Free what the engine holds between calls (KV cache) before the update."""
        ...


class _Completions:
    """The tokens, masks and log-probs of a decoding loop, one step at a time."""

    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.finished = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.tokens: list[Tensor] = []
        self.masks: list[Tensor] = []
        self.logprobs: list[Tensor] = []

    def sample(self, logits: Tensor, gen: GenerationConfig, generator: torch.Generator, eos_id: int,
               pad_id: int) -> Tensor:
        """Draw the next [N] tokens from [N, V] logits (``pad_id`` for rows that have ended)."""
        token = next_tokens(logits, gen, generator)
        return self.add(token, token_logprobs(logits, token, gen.temperature), eos_id, pad_id)

    def add(self, token: Tensor, logprob: Tensor, eos_id: int, pad_id: int) -> Tensor:
        """Record sampled [N] tokens and their [N] float32 log-probs; the tokens as fed back
        (``pad_id`` for rows that had already ended)."""
        real = ~self.finished
        self.logprobs.append(logprob * real)
        self.masks.append(real)
        token = torch.where(self.finished, torch.full_like(token, pad_id), token)
        self.tokens.append(token)
        self.finished = self.finished | (token == eos_id)
        return token

    def result(self) -> Generated:
        """The :class:`Generated` completions, trimmed to the longest row."""
        mask = torch.stack(self.masks, dim=1).float()
        length = int(mask.sum(1).max())  # >= 1: every row's first token is real
        ids, logprobs = torch.stack(self.tokens, dim=1), torch.stack(self.logprobs, dim=1)
        return Generated(ids[:, :length], mask[:, :length], logprobs[:, :length].float())


def _all_finished(finished: Tensor, sync: Callable[[Tensor], Tensor] | None) -> bool:
    """Whether every row (of every rank, with ``sync``) has ended; ``finished`` [N] bool."""
    if sync is None:
        return bool(finished.all())
    unfinished = (~finished).sum().to(torch.float32)
    return float(sync(unfinished)) == 0.0


def _prompt_positions(prompt_mask: Tensor) -> Tensor:
    """[N, P] long position ids that skip the left padding (0 on the padding)."""
    return (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)


# --- hf: a dynamic KV cache ----------------------------------------------------------------------


class HFEngine:
    """The rollout loop: the model's forward with a dynamic KV cache, one token at a time.

    The reference engine: any causal LM (the ``PolicyAndValue`` module, wrapped by DDP, sharded
    by FSDP2 or ZeRO-3), bit-exact resume (every draw from the checkpointed generator), and the
    same tokens as the RL stages' sampling loop before the engines for the same generator state.

    Args:
        model: a causal LM (any mode; no dropout is assumed).
        sync: for a sharded ``model``, a sum over ranks (``Backend.all_reduce_sum``): the loop
            then stops only once no rank has an unfinished row, so every rank runs the same
            number of forwards (one all-reduce of a scalar per step). None: stop when this
            process's rows are done.
    """

    name = "hf"

    def __init__(self, model: nn.Module, sync: Callable[[Tensor], Tensor] | None = None) -> None:
        self.model = model
        self.sync = sync

    @torch.no_grad()
    def generate(
        self, prompt_ids: Tensor, prompt_mask: Tensor, gen: GenerationConfig, *, eos_id: int, pad_id: int,
        generator: torch.Generator,
    ) -> Generated:
        """See :meth:`GenerationEngine.generate` (T the same with or without ``sync``)."""
        attention = prompt_mask.long()
        positions = _prompt_positions(prompt_mask)
        out = self.model(input_ids=prompt_ids, attention_mask=attention, position_ids=positions, use_cache=True)
        next_position = positions[:, -1:] + 1
        done = _Completions(prompt_ids.shape[0], prompt_ids.device)
        for _ in range(gen.max_new_tokens):
            token = done.sample(out.logits[:, -1, :], gen, generator, eos_id, pad_id)
            if len(done.tokens) == gen.max_new_tokens or _all_finished(done.finished, self.sync):
                break
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            out = self.model(
                input_ids=token[:, None], attention_mask=attention, position_ids=next_position,
                past_key_values=out.past_key_values, use_cache=True,
            )
            next_position = next_position + 1
        return done.result()

    def load_weights(self, model: nn.Module) -> None:
        """Sample from ``model`` from now on (a reference: nothing is copied; the policy being
        trained, updated in place, is served as it is)."""
        self.model = model

    def release(self) -> None:
        """Nothing to free: the dynamic cache of a call dies with it."""


# --- static: a static KV cache, a compiled decode step -------------------------------------------


def _causal_lm(model: nn.Module) -> nn.Module:
    """The HF causal LM inside DDP / a DeepSpeed engine (``.module``) or ``PolicyAndValue`` (``.policy``)."""
    from transformers import PreTrainedModel

    while not isinstance(model, PreTrainedModel):
        inner = getattr(model, "module", None)
        inner = inner if isinstance(inner, nn.Module) else getattr(model, "policy", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def _is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are sharded: FSDP2 (``DTensor``) or ZeRO-3 (``ds_id``)."""
    try:
        from torch.distributed.tensor import DTensor

        distributed: tuple[type, ...] = (DTensor,)
    except ImportError:  # a build without torch.distributed
        distributed = ()
    return any(isinstance(p, distributed) or hasattr(p, "ds_id") for p in model.parameters())


def _floats_as_constants(compiled: Callable) -> Callable:
    """``compiled`` (the compiled decode step) with dynamo tracing its float arguments as
    constants (``specialize_float``, where this torch has it) at every call. By default a float
    argument becomes a graph input once a second value is seen: a float64 CPU scalar tensor, and
    CUDA graphs skip a graph with a CPU input (torch 2.13's
    ``VariableBuilder.wrap_unspecialized_primitive``)."""
    config = torch._dynamo.config
    return config.patch(specialize_float=True)(compiled) if hasattr(config, "specialize_float") else compiled


def _decode_and_sample(model: nn.Module, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
                       cache: Any, noise: Tensor | None, temperature: float, top_p: float) -> tuple[Tensor, Tensor]:
    """One decoding step ([N, 1] token and position, [N, L] mask) that writes its keys and values
    into the static ``cache`` and samples the next token with ``noise`` (see
    :func:`trainer_core.sampling.sample_with_noise`): ([N] tokens, [N] float32 log-probs). The compiled unit: the
    forward and the sampling in one CUDA graph."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=cache, use_cache=True)
    return sample_with_noise(out.logits[:, -1, :], noise, temperature, top_p)


class StaticCacheEngine:
    """A static KV cache reserved once per call, batched prefill, and a (compiled) decode step.

    On CPU in fp32 with ``compile`` off it samples the same tokens as :class:`HFEngine` (and
    log-probs equal within 1e-5): the same draws from the same generator, logits that differ only
    in float rounding (attention over the whole cache, the LM head on the last position only).
    While it generates, an ``sdpa`` model attends with
    :func:`trainer_core.static_decode.sdpa_grouped_decode` (no copies of
    grouped KV heads); its keys and values are cached in one dtype (autocast's under
    ``bf16-mixed``, see :func:`trainer_core.static_decode.typed_static_cache`). Each decode step
    (:func:`_decode_and_sample`) also samples: the [N, V] float32 Exp(1) noise is drawn from the
    generator into a buffer kept with the cache, then the step turns it into tokens as
    ``torch.multinomial`` would (:func:`trainer_core.sampling.sample_with_noise`), the sampling
    settings as constants (:func:`_floats_as_constants`). Measured on an H100 (``bench/GPU.md``,
    2026-11-27): 42,886 tokens/s before in-graph sampling, 49,876 after (128 x 256, 0.5B, bf16).

    Args:
        model: an HF causal LM, or a module holding one (``PolicyAndValue``, DDP): its parameters
            are served as they are (colocated).
        device: the model's device.
        compile: compile the decode step with ``torch.compile(mode="reduce-overhead",
            fullgraph=True)`` (CUDA graphs); None: on CUDA only.
        check_every: decode steps between checks that every row has ended; None:
            :data:`CHECK_EVERY_STEPS` with a compiled step on CUDA, else 1.
        compile_options: ``torch.compile`` keywords replacing the default (tests trace the
            step on CPU with ``{"backend": "eager", "fullgraph": True}``).

    Raises:
        ValueError: a sharded policy (FSDP2, ZeRO-3), or ``check_every`` < 1.
        RuntimeError: from :meth:`generate`, when a sampled token's log-prob is NaN (NaN or
            infinite logits, at any row), where the ``hf`` engine's ``torch.multinomial`` raises
            when sampling (greedy, the ``hf`` engine returns the argmax and does not).
    """

    name = "static"

    def __init__(self, model: nn.Module, device: torch.device | str, compile: bool | None = None, *,
                 check_every: int | None = None, compile_options: dict[str, Any] | None = None) -> None:
        self.model = _causal_lm(model)
        if _is_sharded(self.model):
            raise ValueError("the 'static' generation engine needs an unsharded policy (single device or DDP); "
                             "with FSDP2 or ZeRO-3 use engine 'hf'")
        self.device = torch.device(device)
        self.compiled = self.device.type == "cuda" if compile is None else compile
        graphs = self.compiled and self.device.type == "cuda"
        self.check_every = check_every if check_every is not None else (CHECK_EVERY_STEPS if graphs else 1)
        if self.check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {self.check_every}")
        options = compile_options or {"mode": "reduce-overhead", "fullgraph": True}
        self._decode = (_floats_as_constants(torch.compile(_decode_and_sample, **options)) if self.compiled
                        else _decode_and_sample)
        self._cache: Any = None
        self._noise: Tensor | None = None
        self._cache_key: tuple | None = None

    def _kv_dtype(self) -> torch.dtype:
        """The dtype the keys and values will have: autocast's, else the model's."""
        if torch.is_autocast_enabled(self.device.type):
            return torch.get_autocast_dtype(self.device.type)
        return next(self.model.parameters()).dtype

    def _reserve(self, num_rows: int, length: int) -> Any:
        """A reset ``StaticCache`` of ``num_rows`` x at least ``length`` tokens: the one kept from
        the last call when it fits (same rows and dtype, long enough), else a new one."""
        if self.compiled:
            length = math.ceil(length / CACHE_LEN_MULTIPLE) * CACHE_LEN_MULTIPLE
        key = (num_rows, self._kv_dtype())
        kept = self._cache_key
        if self._cache is not None and kept is not None and kept[:2] == key and kept[2] >= length:
            self._cache.reset()
            return self._cache
        self.release()
        self._cache = typed_static_cache(self.model.config, length, key[1])
        self._cache_key = (*key, length)
        return self._cache

    def _noise_for(self, logits: Tensor) -> Tensor:
        """The [N, V] float32 buffer of the sampler's Exp(1) draws for ``logits`` [N, V]: one per
        cache, at a static address (the CUDA graph reads it in place; refilled before each step)."""
        if self._noise is None or self._noise.shape != logits.shape or self._noise.device != logits.device:
            self._noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
            if self.compiled:
                torch._dynamo.mark_static_address(self._noise)
        return self._noise

    def _step(self, token: Tensor, position: Tensor, attention: Tensor, cache: Any, noise: Tensor | None,
              gen: GenerationConfig) -> tuple[Tensor, Tensor]:
        """The next [N] tokens and their [N] log-probs after feeding [N] ``token`` at [N, 1] ``position``."""
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
        return self._decode(self.model, token[:, None], position, attention, cache, noise, gen.temperature, gen.top_p)

    @torch.no_grad()
    def generate(
        self, prompt_ids: Tensor, prompt_mask: Tensor, gen: GenerationConfig, *, eos_id: int, pad_id: int,
        generator: torch.Generator,
    ) -> Generated:
        """See :meth:`GenerationEngine.generate`."""
        with grouped_decode_attention(self.model):
            return self._generate(prompt_ids, prompt_mask, gen, eos_id, pad_id, generator)

    def _generate(self, prompt_ids: Tensor, prompt_mask: Tensor, gen: GenerationConfig, eos_id: int, pad_id: int,
                  generator: torch.Generator) -> Generated:
        num_rows, prompt_len = prompt_ids.shape
        cache = self._reserve(num_rows, prompt_len + gen.max_new_tokens)
        length = self._cache_key[2]
        attention = torch.zeros(num_rows, length, dtype=torch.long, device=prompt_ids.device)  # [N, L]
        attention[:, :prompt_len] = prompt_mask.long()
        attention[:, prompt_len : prompt_len + gen.max_new_tokens] = 1
        positions = _prompt_positions(prompt_mask)
        out = self.model(input_ids=prompt_ids, attention_mask=attention, position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1, :]
        del out
        sampling = gen.temperature > 0
        noise = self._noise_for(logits) if sampling else None

        def draw() -> Tensor | None:
            return exponential_noise(noise, generator) if sampling else None

        next_position = positions[:, -1:] + 1
        done = _Completions(num_rows, prompt_ids.device)
        token = done.add(*sample_with_noise(logits, draw(), gen.temperature, gen.top_p), eos_id, pad_id)
        del logits
        for count in range(1, gen.max_new_tokens):  # count: tokens sampled so far
            if count % self.check_every == 0 and bool(done.finished.all()):
                break
            token = done.add(*self._step(token, next_position, attention, cache, draw(), gen), eos_id, pad_id)
            next_position = next_position + 1
        result = done.result()
        if bool(result.logprobs.isnan().any()):
            raise RuntimeError("the 'static' generation engine sampled from invalid probabilities (NaN or infinite "
                               "logits): check the policy's weights and the generation settings")
        return result

    def load_weights(self, model: nn.Module) -> None:
        """Serve ``model``'s weights: nothing to do when it is (or holds) the engine's own model,
        updated in place by the optimizer; else its state dict is copied into the engine's
        parameters in place (their addresses, read by the CUDA graphs, stay).

        Raises:
            ValueError: ``model`` is sharded (FSDP2, ZeRO-3).
        """
        source = _causal_lm(model)
        if source is self.model:
            return
        if _is_sharded(source):
            raise ValueError("the 'static' generation engine cannot load a sharded policy's weights; use engine 'hf'")
        self.model.load_state_dict(source.state_dict())

    def release(self) -> None:
        """Drop the KV cache and the sampler's noise buffer (their memory goes back to PyTorch's
        allocator); the next call reserves them again."""
        self._cache = None
        self._cache_key = None
        self._noise = None


# --- registry ------------------------------------------------------------------------------------


def _build_hf(model: nn.Module, device: torch.device | str, compile: bool | None,
              sync: Callable[[Tensor], Tensor] | None) -> GenerationEngine:
    del device, compile  # the hf engine runs the model's forward as it is
    return HFEngine(model, sync=sync)


def _build_static(model: nn.Module, device: torch.device | str, compile: bool | None,
                  sync: Callable[[Tensor], Tensor] | None) -> GenerationEngine:
    if sync is not None:
        raise ValueError("the 'static' generation engine does not run in lockstep across ranks (a sharded "
                         "policy: FSDP2 or ZeRO-3); use engine 'hf'")
    return StaticCacheEngine(model, device, compile)


ENGINES: dict[str, Callable[..., GenerationEngine]] = {"hf": _build_hf, "static": _build_static}
"""Engine builders by ``generation.engine``: ``(model, device, compile, sync) -> GenerationEngine``."""


def build_engine(kind: str, model: nn.Module, *, device: torch.device | str, compile: bool | None = None,
                 sync: Callable[[Tensor], Tensor] | None = None) -> GenerationEngine:
    """The generation engine ``kind`` serving ``model``.

    Args:
        kind: a key of :data:`ENGINES` (``"hf"`` or ``"static"``).
        model: the policy (``hf``: the module to call, wrapped or sharded; ``static``: an HF causal
            LM or a module holding one).
        device: the model's device.
        compile: ``static``: compile the decode step (None: on CUDA only); ignored by ``hf``.
        sync: a sum over ranks for a sharded policy (``hf`` only), else None.

    Raises:
        ValueError: an unknown ``kind``, or ``static`` with a sharded policy (``sync`` given or
            sharded parameters).
    """
    if kind not in ENGINES:
        raise ValueError(f"unknown generation engine {kind!r}; choose one of {sorted(ENGINES)}")
    return ENGINES[kind](model, device, compile, sync)
