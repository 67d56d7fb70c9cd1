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
as in :func:`~trainer_core.objectives.logprobs.completion_logprobs_entropies`). A row ends after its EOS token.

Engines (:data:`ENGINES`, chosen by ``generation.engine``):

- ``hf`` (:class:`HFEngine`): a plain KV-cached loop over the model's forward with a dynamic
  cache: the sampling loop the RL stages had before the engines, bit-exactly (a copy of that
  loop pins it in ``tests/unit/test_engines.py``), so earlier runs resume as they did. Any causal LM,
  wrapped or sharded: with ``sync`` (FSDP2, ZeRO-3) it runs in lockstep across ranks. It holds
  nothing between calls; ``load_weights`` just points it at the module it is given (the policy
  being trained: nothing is copied), ``release`` does nothing.
- ``static`` (:class:`StaticCacheEngine`): a transformers ``StaticCache`` of [N, L] reserved up
  front, one batched prefill of every prompt, then one token per decode step: the forward with
  fused q/k/v and gate/up projections and grouped-KV attention (``trainer_core.generation.static_decode``),
  and the sampling (the exponential race that ``torch.multinomial`` runs, fed Exp(1) noise drawn
  from the generator: the same draws, without multinomial's host reads), compiled by
  ``torch.compile(fullgraph=True)`` on CUDA; the loop's bookkeeping lives in tensors at fixed
  addresses, so on CUDA the whole step is captured once per call as one CUDA graph and replayed
  per token. Unsharded policies only (single device, DDP). It serves the policy's own parameters
  (colocated): the optimizer updates them in place, at the addresses the graph reads, so
  ``load_weights`` of that same model costs nothing (the fused projections are refreshed from
  them at each call); a different model's weights are copied into the engine's in place.
  ``release`` drops the cache, the buffers, the fused weights and the graph; the next call
  reserves them and captures again (a capture, not a recompile).

Static cache, as transformers 5.x has it (checked 5.17 and 5.24, ``cache_utils.StaticLayer``):
each layer writes the new keys at its own ``cumulative_length`` tensor and advances it in place,
so a step has no host state; the mask covers the whole cache and causality hides the slots not
written yet.

Stopping: reading "have all rows ended?" on the host waits for the device. With a compiled step
on CUDA the loop asks only every :data:`CHECK_EVERY_STEPS` steps; the extra steps after the last
row ended sample padding (masked, trimmed), so the completions are the same, but the generator
advances by up to ``CHECK_EVERY_STEPS - 1`` more draws than the ``hf`` engine's (deterministic for
a given engine, seed and device). Under the trainer's ``autocast`` with fp32 weights the step
casts the weights to bf16 at every token; the bench runs bf16 weights.

A third engine, ``vllm``, samples in a vLLM server process (:mod:`trainer_core.generation.vllm`);
a colocated vLLM, inside the trainer's process, is designed in
``docs/reference/generation-designs.md`` and not built.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from trainer_core.config import GenerationConfig
from trainer_core.generation.decode_session import DecodeSession
from trainer_core.generation.sampling import exponential_noise, next_tokens, sample_with_noise
from trainer_core.generation.static_decode import (
    CompletionBuffers,
    DecodeGraph,
    DecodeState,
    FusedProjections,
    cache_argument,
    causal_lm,
    decode_and_sample,
    floats_as_constants,
    grouped_decode_attention,
    is_sharded,
    typed_static_cache,
)
from trainer_core.objectives.logprobs import token_logprobs

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
        completion_mask: [N, T] float, 1 = a real completion token (the policy's or a tool's).
        logprobs: [N, T] float32, the sampler's log-probs of ``completion_ids`` under the
            temperature-scaled distribution without the top-p cut, 0 on padding and on
            observation tokens.
        observation_mask: [N, T] float, 1 = a token an environment fed (a tool's output), or
            None (no environment: every real token is the policy's).
    """

    completion_ids: Tensor
    completion_mask: Tensor
    logprobs: Tensor
    observation_mask: Tensor | None = None

    @property
    def policy_mask(self) -> Tensor:
        """[N, T] float, 1 = a token the policy sampled (real and not an observation)."""
        if self.observation_mask is None:
            return self.completion_mask
        return self.completion_mask * (1.0 - self.observation_mask)


class GenerationEngine(abc.ABC):
    """Samples completions for the RL loop; ``load_weights`` after each optimizer update,
    ``release`` before it.

    An engine implements :meth:`_sample` (the decode loop), :meth:`load_weights` and
    :meth:`release`; :meth:`generate` is the one entry point, run without autograd inside
    :meth:`_serving`.
    """

    name: str

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        gen: GenerationConfig,
        *,
        eos_id: int,
        pad_id: int,
        generator: torch.Generator,
        session: DecodeSession | None = None,
    ) -> Generated:
        """Sample up to ``gen.max_new_tokens`` tokens after each prompt (observation tokens of
        ``session`` included).

        Args:
            prompt_ids: [N, P] long, left-padded.
            prompt_mask: [N, P] float, 1 = real token.
            gen: a ``RolloutGenerationConfig`` (temperature, top_p, max_new_tokens).
            eos_id: a row ends after it samples this token.
            pad_id: written after a row's end.
            generator: the only source of randomness (on the model's device).
            session: an environment's episodes, one per row (a ``ToolSession`` of
                :mod:`trainer_core.training.rl.environments`), told of every decode step (its
                observation tokens replace the sampled ones, the same draws made), or None.

        Returns:
            The :class:`Generated` completions, T <= max_new_tokens the longest row; with a
            session, its ``observation_mask``.
        """
        with self._serving():
            generated = self._sample(prompt_ids, prompt_mask, gen, eos_id, pad_id, generator, session)
        if session is not None:
            generated.observation_mask = session.observation_mask(
                generated.completion_ids.shape[1], generated.completion_mask.device
            )
        return generated

    def _serving(self) -> contextlib.AbstractContextManager:
        """What is installed on the model while it samples (none by default)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def _sample(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        gen: GenerationConfig,
        eos_id: int,
        pad_id: int,
        generator: torch.Generator,
        session: DecodeSession | None = None,
    ) -> Generated:
        """The decode loop of :meth:`generate` (same arguments): with a ``session``, its ``after_step``
        after each token is recorded, before the token is fed back."""

    @abc.abstractmethod
    def load_weights(self, model: nn.Module) -> None:
        """Serve ``model``'s current weights (the policy after an optimizer update)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Free what the engine holds between calls (KV cache) before the update."""

    def close(self) -> None:
        """Free everything when the stage is done with the engine (a server process too); by default
        :meth:`release`."""
        self.release()


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


class HFEngine(GenerationEngine):
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

    def _sample(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        gen: GenerationConfig,
        eos_id: int,
        pad_id: int,
        generator: torch.Generator,
        session: DecodeSession | None = None,
    ) -> Generated:
        """The decode loop (T the same with or without ``sync``)."""
        attention = prompt_mask.long()
        positions = _prompt_positions(prompt_mask)
        cache_arg = cache_argument()
        out = self.model(input_ids=prompt_ids, attention_mask=attention, position_ids=positions, use_cache=True)
        next_position = positions[:, -1:] + 1
        done = CompletionBuffers(prompt_ids.shape[0], gen.max_new_tokens, prompt_ids.device)
        for step in range(1, gen.max_new_tokens + 1):
            logits = out.logits[:, -1, :]
            token = next_tokens(logits, gen, generator)
            done.record(token, token_logprobs(logits, token, gen.temperature), eos_id, pad_id)
            if session is not None:
                session.after_step(done.tokens, done.logprobs, done.token, done.finished, step - 1)
            if step == gen.max_new_tokens or _all_finished(done.finished, self.sync):
                break
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            out = self.model(
                input_ids=done.token[:, None],
                attention_mask=attention,
                position_ids=next_position,
                **{cache_arg: getattr(out, cache_arg)},
                use_cache=True,
            )
            next_position = next_position + 1
        return Generated(*done.result(step))

    def load_weights(self, model: nn.Module) -> None:
        """Sample from ``model`` from now on (a reference: nothing is copied; the policy being
        trained, updated in place, is served as it is)."""
        self.model = model

    def release(self) -> None:
        """Nothing to free: the dynamic cache of a call dies with it."""


# --- static: a static KV cache, a compiled decode step -------------------------------------------


class StaticCacheEngine(GenerationEngine):
    """A static KV cache reserved once per call, batched prefill, and a (compiled) decode step
    that runs as one CUDA graph on CUDA.

    On CPU in fp32 with ``compile`` off it samples the same tokens as :class:`HFEngine` (and
    log-probs equal within 1e-5): the same draws from the same generator, logits that differ only
    in float rounding (attention over the whole cache, the LM head on the last position only).
    The pieces are in :mod:`trainer_core.generation.static_decode`: grouped-KV attention, fused q/k/v and
    gate/up projections, a cache of one dtype, the step (``decode_and_sample``: the forward,
    then the tokens as ``torch.multinomial`` draws them from Exp(1) noise drawn into a buffer
    kept with the cache), its bookkeeping (``DecodeState``) and its CUDA graph (``DecodeGraph``):
    one graph per step rather than torch's graph trees per compiled step, fused projections too
    (what each gained: ``bench/GPU.md``).

    Args:
        model: an HF causal LM, or a module holding one (``PolicyAndValue``, DDP): its parameters
            are served as they are (colocated).
        device: the model's device.
        compile: compile the decode step with ``torch.compile`` (``compile_options``); None: on
            CUDA only.
        check_every: decode steps between checks that every row has ended; None:
            :data:`CHECK_EVERY_STEPS` with a compiled step on CUDA, else 1.
        compile_options: ``torch.compile`` keywords; default ``{"fullgraph": True}`` (tests trace
            the step on CPU with ``{"backend": "eager", "fullgraph": True}``).
        cuda_graph: capture the step as one CUDA graph; None: on CUDA with a compiled step (and a
            torch with ``CUDAGraph.register_generator_state``); False: launch it per token.
        fuse_projections: fuse the q/k/v and gate/up projections while generating (their weights
            held once more until :meth:`release`).

    Raises:
        ValueError: a sharded policy (FSDP2, ZeRO-3), ``check_every`` < 1, or ``cuda_graph``
            without CUDA or without a compiled step.
        RuntimeError: from :meth:`generate`, when a sampled token's log-prob is NaN (NaN or
            infinite logits, at any row), where the ``hf`` engine's ``torch.multinomial`` raises
            when sampling (greedy, the ``hf`` engine returns the argmax and does not).
    """

    name = "static"

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str,
        compile: bool | None = None,
        *,
        check_every: int | None = None,
        compile_options: dict[str, Any] | None = None,
        cuda_graph: bool | None = None,
        fuse_projections: bool = True,
    ) -> None:
        self.model = causal_lm(model)
        if is_sharded(self.model):
            raise ValueError(
                "the 'static' generation engine needs an unsharded policy (single device or DDP); "
                "with FSDP2 or ZeRO-3 use engine 'hf'"
            )
        self.device = torch.device(device)
        self.compiled = self.device.type == "cuda" if compile is None else compile
        graphs = self.compiled and self.device.type == "cuda"
        capturable = graphs and hasattr(torch.cuda.CUDAGraph, "register_generator_state")  # torch >= 2.5
        self.cuda_graph = capturable if cuda_graph is None else cuda_graph
        if self.cuda_graph and not graphs:
            raise ValueError("cuda_graph needs a CUDA device and a compiled decode step")
        self.check_every = check_every if check_every is not None else (CHECK_EVERY_STEPS if graphs else 1)
        if self.check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {self.check_every}")
        options = compile_options or {"fullgraph": True}
        self._decode = (
            floats_as_constants(torch.compile(decode_and_sample, **options)) if self.compiled else decode_and_sample
        )
        self._cache: Any = None
        self._state: DecodeState | None = None
        self._noise: Tensor | None = None
        self._cache_key: tuple | None = None
        self._graph: DecodeGraph | None = None
        self._graph_key: tuple | None = None
        self.fuse_projections = fuse_projections
        self._fused: FusedProjections | None = None

    def _kv_dtype(self) -> torch.dtype:
        """The dtype the keys and values will have: autocast's, else the model's."""
        if torch.is_autocast_enabled(self.device.type):
            return torch.get_autocast_dtype(self.device.type)
        return next(self.model.parameters()).dtype

    def _reserve(self, num_rows: int, length: int, max_new_tokens: int) -> tuple[Any, DecodeState]:
        """A reset ``StaticCache`` of ``num_rows`` x at least ``length`` tokens and a
        :class:`DecodeState` for at least ``max_new_tokens`` tokens: those kept from the last call
        when they fit (same rows and dtype, long enough), else new ones."""
        if self.compiled:
            length = math.ceil(length / CACHE_LEN_MULTIPLE) * CACHE_LEN_MULTIPLE
        key = (num_rows, self._kv_dtype())
        kept = self._cache_key
        if (
            self._cache is not None
            and kept is not None
            and kept[:2] == key
            and kept[2] >= length
            and kept[3] >= max_new_tokens
        ):
            self._cache.reset()
            return self._cache, self._state
        self._drop_buffers()
        self._cache = typed_static_cache(self.model.config, length, key[1])
        self._state = DecodeState(num_rows, length, max_new_tokens, self.device)
        self._cache_key = (*key, length, max_new_tokens)
        return self._cache, self._state

    def _noise_for(self, logits: Tensor) -> Tensor:
        """The [N, V] float32 buffer of the sampler's Exp(1) draws for ``logits`` [N, V]: one per
        cache, at a fixed address (the CUDA graph reads it in place; refilled before each step)."""
        if self._noise is None or self._noise.shape != logits.shape or self._noise.device != logits.device:
            self._graph = None  # it read the old buffer
            self._noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        return self._noise

    def _decode_step(
        self,
        state: DecodeState,
        cache: Any,
        noise: Tensor | None,
        gen: GenerationConfig,
        eos_id: int,
        pad_id: int,
        generator: torch.Generator,
    ) -> None:
        """One token: draw the noise, feed ``state.token``, sample, record (all device work)."""
        if noise is not None:
            exponential_noise(noise, generator)
        token, logprob = self._decode(
            self.model,
            state.token[:, None],
            state.position,
            state.attention,
            cache,
            noise,
            gen.temperature,
            gen.top_p,
            cache_argument(),
        )
        state.record(token, logprob, eos_id, pad_id)

    def _advance(self, step: Callable[[], None], key: tuple, generator: torch.Generator | None) -> None:
        """Run ``step``: a replay of its CUDA graph when one was captured for ``key``; else run it,
        then (with ``cuda_graph``) capture it for the next tokens."""
        if not self.cuda_graph:
            step()
            return
        if self._graph is not None and self._graph_key == key:
            self._graph.replay()
            return
        step()  # this token, run as it is (compiles on the first call): the capture's warm-up
        self._graph = None
        self._graph = DecodeGraph(step, generator)
        self._graph_key = key

    @contextlib.contextmanager
    def _serving(self) -> Iterator[None]:
        """Grouped decode attention and the fused projections, installed while it samples."""
        with grouped_decode_attention(self.model), self._projections():
            yield

    def _projections(self) -> contextlib.AbstractContextManager:
        """The fused projections (:class:`trainer_core.generation.static_decode.FusedProjections`), with
        the policy's current weights, installed; kept until :meth:`release`."""
        if not self.fuse_projections:
            return contextlib.nullcontext()
        if self._fused is None:
            self._graph = None  # it read other weights
            self._fused = FusedProjections(self.model)
        else:
            self._fused.refresh()
        return self._fused.installed()

    def _sample(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        gen: GenerationConfig,
        eos_id: int,
        pad_id: int,
        generator: torch.Generator,
        session: DecodeSession | None = None,
    ) -> Generated:
        num_rows, prompt_len = prompt_ids.shape
        cache, state = self._reserve(num_rows, prompt_len + gen.max_new_tokens, gen.max_new_tokens)
        positions = _prompt_positions(prompt_mask)
        state.start(prompt_mask, gen.max_new_tokens, positions[:, -1:])
        out = self.model(
            input_ids=prompt_ids,
            attention_mask=state.attention,
            position_ids=positions,
            **{cache_argument(): cache},
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :]
        del out
        sampling = gen.temperature > 0
        noise = self._noise_for(logits) if sampling else None
        if noise is not None:
            exponential_noise(noise, generator)
        state.record(*sample_with_noise(logits, noise, gen.temperature, gen.top_p), eos_id, pad_id)
        if session is not None:  # in place on the buffers the decode step (its CUDA graph) reads
            session.after_step(state.tokens, state.logprobs, state.token, state.finished, 0)
        del logits
        step = functools.partial(self._decode_step, state, cache, noise, gen, eos_id, pad_id, generator)
        drawn_from = generator if sampling else None
        key = (gen.temperature, gen.top_p, eos_id, pad_id, drawn_from)
        columns = 1
        for count in range(1, gen.max_new_tokens):  # count: tokens sampled so far
            if count % self.check_every == 0 and bool(state.finished.all()):
                break
            self._advance(step, key, drawn_from)
            if session is not None:
                session.after_step(state.tokens, state.logprobs, state.token, state.finished, count)
            columns += 1
        ids, mask, logprobs = state.result(columns)
        if bool(logprobs.isnan().any()):
            raise RuntimeError(
                "the 'static' generation engine sampled from invalid probabilities (NaN or infinite "
                "logits): check the policy's weights and the generation settings"
            )
        return Generated(ids, mask, logprobs)

    def load_weights(self, model: nn.Module) -> None:
        """Serve ``model``'s weights: nothing to do when it is (or holds) the engine's own model,
        updated in place by the optimizer; else its state dict is copied into the engine's
        parameters in place (their addresses, read by the CUDA graphs, stay).

        Raises:
            ValueError: ``model`` is sharded (FSDP2, ZeRO-3).
        """
        source = causal_lm(model)
        if source is self.model:
            return
        if is_sharded(source):
            raise ValueError("the 'static' generation engine cannot load a sharded policy's weights; use engine 'hf'")
        self.model.load_state_dict(source.state_dict())

    def release(self) -> None:
        """Drop the KV cache, the decoding buffers, the sampler's noise buffer, the fused
        projections and the captured CUDA graph (their memory goes back to PyTorch's allocator);
        the next call reserves them again."""
        self._fused = None
        self._drop_buffers()

    def _drop_buffers(self) -> None:
        """Drop what the captured graph reads, the graph first."""
        self._graph = self._graph_key = None
        self._cache = self._state = self._cache_key = self._noise = None


# --- registry ------------------------------------------------------------------------------------


def _build_hf(
    model: nn.Module,
    device: torch.device | str,
    compile: bool | None,
    sync: Callable[[Tensor], Tensor] | None,
    fuse_projections: bool,
) -> GenerationEngine:
    del device, compile, fuse_projections  # the hf engine runs the model's forward as it is
    return HFEngine(model, sync=sync)


def _build_static(
    model: nn.Module,
    device: torch.device | str,
    compile: bool | None,
    sync: Callable[[Tensor], Tensor] | None,
    fuse_projections: bool,
) -> GenerationEngine:
    if sync is not None:
        raise ValueError(
            "the 'static' generation engine does not run in lockstep across ranks (a sharded "
            "policy: FSDP2 or ZeRO-3); use engine 'hf'"
        )
    return StaticCacheEngine(model, device, compile, fuse_projections=fuse_projections)


ENGINES: dict[str, Callable[..., GenerationEngine]] = {"hf": _build_hf, "static": _build_static}
"""Engine builders by ``generation.engine``: ``(model, device, compile, sync, fuse_projections)``."""


def build_engine(
    kind: str,
    model: nn.Module,
    *,
    device: torch.device | str,
    compile: bool | None = None,
    sync: Callable[[Tensor], Tensor] | None = None,
    fuse_projections: bool = True,
) -> GenerationEngine:
    """The generation engine ``kind`` serving ``model``.

    Args:
        kind: a key of :data:`ENGINES` (``"hf"`` or ``"static"``).
        model: the policy (``hf``: the module to call, wrapped or sharded; ``static``: an HF causal
            LM or a module holding one).
        device: the model's device.
        compile: ``static``: compile the decode step (None: on CUDA only); ignored by ``hf``.
        sync: a sum over ranks for a sharded policy (``hf`` only), else None.
        fuse_projections: ``static``: fuse the q/k/v and gate/up projections; ignored by ``hf``.

    Raises:
        ValueError: an unknown ``kind``, or ``static`` with a sharded policy (``sync`` given or
            sharded parameters).
    """
    if kind not in ENGINES:
        raise ValueError(f"unknown generation engine {kind!r}; choose one of {sorted(ENGINES)}")
    return ENGINES[kind](model, device, compile, sync, fuse_projections)
