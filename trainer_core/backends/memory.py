"""What every backend applies to the model it trains: precision, activation checkpointing, compile.

Set on the backend config (``backend.precision``, ``backend.activation_checkpointing``,
``backend.compile``; a stage may override them through its ``backend`` mapping).

Precision (``resolve_precision``; ``auto`` is ``bf16-mixed`` on CUDA, ``fp32`` elsewhere):

- ``fp32``: weights, gradients, optimizer state and compute in float32.
- ``bf16-mixed``: float32 weights (the master copy the optimizer updates), float32 gradients
  and optimizer state; matmuls in bf16. Single device and DDP: ``torch.autocast(device_type,
  dtype=torch.bfloat16)`` around the forward (:func:`autocast`, which the loop enters through
  ``Backend.autocast``; the backward runs outside it, as the PyTorch AMP docs prescribe).
  FSDP2: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (torchtitan's default):
  the all-gathered parameters are bf16, gradients are reduced and kept in fp32. DeepSpeed: its
  ``bf16`` section (bf16 module and gradients, fp32 master weights and optimizer state in the
  ZeRO optimizer).
- ``bf16``: pure bf16: weights, gradients and optimizer state in bf16, no master copy (the
  trainable model's parameters are cast to bf16; DeepSpeed: ``bf16_master_weights_and_grads``
  and ``bf16_optimizer_states``, ZeRO 1-3).

The trainable model's parameters are cast to :func:`weights_dtype` whatever ``model.dtype``
loaded them in (a model loaded in bf16 trains with fp32 master weights under ``bf16-mixed``).
Frozen models (reference, reward model) keep ``model.dtype`` except under ``bf16``, which casts
them to bf16 too; under ``bf16-mixed`` their forwards compute in bf16 (autocast, FSDP2's policy,
DeepSpeed's bf16 engine) all the same.

Activation checkpointing (:func:`enable_activation_checkpointing`): every transformer block's
forward is recomputed in the backward instead of keeping its activations
(``torch.utils.checkpoint.checkpoint``, non-reentrant), as torchtitan's ``apply_ac`` does with
``checkpoint_wrapper`` before ``fully_shard``. Here the block's ``forward`` is replaced on the
instance (:class:`CheckpointedForward`) instead of the block wrapped in a module: module hooks,
FSDP2's all-gather among them, stay outside the recomputed region all the same, and parameter
names gain no ``_checkpoint_wrapped_module.``, so state dicts (checkpoints, the final Hugging
Face save) keep their keys. It checkpoints only a forward that trains (train mode, gradients
on, no KV cache): transformers' own ``activation_checkpointing_enable`` would also drop the KV
cache of gradient-free forwards in train mode, as the RL rollout's generation can be. Sources:
torchtitan ``apply_ac`` and ``apply_compile`` (torchtitan/models/llama3/infra/parallelize.py),
PyTorch ``torch.utils.checkpoint`` and AMP (``torch.autocast``) docs, FSDP2
``MixedPrecisionPolicy`` docs.

Compile (:func:`compile_blocks`): each transformer block's training forward is compiled with
``torch.compile`` (default backend ``inductor``), as torchtitan's ``apply_compile`` does: the
blocks share one code object, so one graph serves every layer. The block's ``forward`` is
replaced on the instance rather than the module wrapped in an ``OptimizedModule``, so module
hooks stay outside the graph and parameter names gain no ``_orig_mod.``. Evaluation and
generation (no grad or eval mode) run the eager forward: their shapes (KV cache) vary per call.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from trainer_core.errors import ConfigError
from trainer_core.modeling.architecture import transformer_blocks

log = logging.getLogger(__name__)

PRECISIONS: tuple[str, ...] = ("bf16-mixed", "bf16", "fp32")
"""Resolved precisions (``auto`` resolves to one of them)."""

COMPILE_BACKEND = "inductor"
"""``torch.compile`` backend of ``backend.compile`` (PyTorch's default; needs a C++ compiler on CPU)."""


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> ``bf16-mixed`` on CUDA, ``fp32`` on any other device; others unchanged.

    Raises:
        ConfigError: an unknown precision.
    """
    if precision == "auto":
        return "bf16-mixed" if device.type == "cuda" else "fp32"
    if precision not in PRECISIONS:
        raise ConfigError(f"backend.precision: {precision!r} is not one of auto, {', '.join(PRECISIONS)}")
    return precision


def weights_dtype(precision: str) -> torch.dtype:
    """Dtype of the trainable weights (the copy the optimizer updates): bf16 only for pure ``bf16``."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def compute_dtype(precision: str) -> torch.dtype:
    """Dtype matmuls run in: float32 for ``fp32``, bf16 otherwise."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``model``'s floating-point parameters to ``dtype`` in place; returns ``model``.

    Buffers keep their dtype (the rotary ``inv_freq`` stays float32, as when transformers loads
    a model in bf16). Tied parameters are one object and are cast once.
    """
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context to run a forward in: ``torch.autocast(device.type, dtype=bfloat16)`` for
    ``bf16-mixed``, else nothing (see the module docstring; FSDP2 and DeepSpeed do not use it)."""
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class CheckpointedForward:
    """A block's forward, recomputed in the backward when it trains (see the module docstring).

    Args:
        block: the module; its current ``forward`` is what is checkpointed.
    """

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.eager = block.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cached = (
            kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None
        )  # transformers <5.24, >=5.24
        if self.block.training and torch.is_grad_enabled() and not cached:
            return torch.utils.checkpoint.checkpoint(self.eager, *args, use_reentrant=False, **kwargs)
        return self.eager(*args, **kwargs)


def _forward_wrappers(block: nn.Module) -> list[Any]:
    """The wrappers this module set on ``block.forward``, outermost first."""
    out, forward = [], block.__dict__.get("forward")
    while isinstance(forward, (CheckpointedForward, CompiledForward)):
        out.append(forward)
        forward = forward.eager
    return out


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model`` whose forward is recomputed in the backward."""
    return [
        b for b in transformer_blocks(model) if any(isinstance(w, CheckpointedForward) for w in _forward_wrappers(b))
    ]


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Recompute every transformer block's forward in the backward (see the module docstring).

    Call it before sharding (FSDP2, ZeRO-3) and before :func:`compile_blocks`.

    Returns:
        The number of checkpointed blocks.

    Raises:
        ConfigError: ``model`` has no transformer blocks.
    """
    blocks = transformer_blocks(model)
    if not blocks:
        raise ConfigError(f"backend.activation_checkpointing: no transformer blocks found in {type(model).__name__}")
    for block in blocks:
        if not any(isinstance(w, CheckpointedForward) for w in _forward_wrappers(block)):
            block.forward = CheckpointedForward(block)
    log.info("activation checkpointing on %d transformer blocks", len(blocks))
    return len(blocks)


class CompiledForward:
    """A block's forward: compiled while training with gradients, eager otherwise.

    Args:
        block: the module; its current ``forward`` (a :class:`CheckpointedForward` when
            checkpointing is on: the recompute is then inside the graph) is what is compiled.
        backend: ``torch.compile`` backend.
    """

    def __init__(self, block: nn.Module, backend: str) -> None:
        self.block = block
        self.eager = block.forward
        self.compiled = torch.compile(self.eager, backend=backend)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.block.training and torch.is_grad_enabled():
            with _checkpoint_side_effects_not_replayed():
                return self.compiled(*args, **kwargs)
        return self.eager(*args, **kwargs)


def _checkpoint_side_effects_not_replayed() -> contextlib.AbstractContextManager:
    """Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint`` while a block's forward compiles.

    transformers (from 5.25, with ``kernels`` 0.19) routes a layer's kernel functions through a
    context variable its forward sets and resets (``kernels.use_kernelized_func`` on the attention
    of Llama and others). Inside ``torch.utils.checkpoint`` dynamo refuses that mutation ("HOP:
    Unsafe side effect") and, the break being at the block's first call, compiles nothing, so
    ``compile: true`` with activation checkpointing would run eager without a word. The variable
    only picks which function the graph calls, which tracing has fixed already: the recompute has
    nothing to replay. A torch without the option (older than its introduction) compiles as before.
    """
    if not hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def compile_blocks(model: nn.Module, backend: str | None = None) -> int:
    """``torch.compile`` the training forward of every transformer block of ``model`` (see the
    module docstring), after :func:`enable_activation_checkpointing` if both are on.

    Args:
        model: the model to compile blocks of (in place).
        backend: ``torch.compile`` backend; None: :data:`COMPILE_BACKEND` as it is at call time.

    Returns:
        The number of compiled blocks.

    Raises:
        ConfigError: ``model`` has no transformer blocks.
    """
    backend = backend or COMPILE_BACKEND
    blocks = transformer_blocks(model)
    if not blocks:
        raise ConfigError(f"backend.compile: no transformer blocks found in {type(model).__name__}")
    for block in blocks:
        if not any(isinstance(w, CompiledForward) for w in _forward_wrappers(block)):
            block.forward = CompiledForward(block, backend)
    log.info("torch.compile (%s) on %d transformer blocks", backend, len(blocks))
    return len(blocks)


def prepare_trainable(model: nn.Module, precision: str, activation_checkpointing: bool) -> nn.Module:
    """Cast the parameters to :func:`weights_dtype` and enable activation checkpointing if asked
    (what every backend does before placing, sharding or wrapping a trainable model)."""
    cast_parameters(model, weights_dtype(precision))
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    return model
