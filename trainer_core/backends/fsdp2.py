"""FSDP2 backend: ``fully_shard`` on every transformer block, then on the root.

Parameters, gradients and optimizer state are sharded across ranks as DTensors; each block's
parameters are all-gathered for its forward and backward and freed after. ``backend.precision``
(:mod:`trainer_core.backends.memory`): ``bf16-mixed`` (the default on CUDA) shards fp32
parameters and computes in bf16 with fp32 gradient reduction (``MixedPrecisionPolicy(
param_dtype=bf16, reduce_dtype=fp32)``); ``bf16`` shards bf16 parameters; ``fp32`` neither.
``backend.cpu_offload`` keeps the shards on the host (``CPUOffloadPolicy``). Reference:
torchtitan's ``apply_fsdp`` and the FSDP2 tutorial.

Activation checkpointing (per decoder layer) is applied before ``fully_shard``, as in torchtitan's
``parallelize_llama`` (``apply_ac``, ``apply_compile``, ``apply_fsdp``). ``torch.compile`` comes
after it here (torchtitan compiles first and shards the compiled wrapper): it replaces the block's
``forward``, bound to the class ``fully_shard`` gives the block. Either way FSDP2's hooks
(all-gather, reduce-scatter) stay outside the graph and the recomputed region. Parameter names,
hence DCP and full state-dict keys, are those of the plain model.

Checkpoints use ``torch.distributed.checkpoint`` (format ``dcp``): each rank writes its own
shards under ``dcp/`` and rank 0 the metadata (the trainable parameters only when some are
frozen, as LoRA's base weights are); a checkpoint written at one world size loads
at another (DCP reshards on load), so a 2-rank run resumes on 1 rank and the reverse.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from trainer_core import storage
from trainer_core.backends import memory
from trainer_core.backends.distributed import ProcessGroupBackend
from trainer_core.backends.single import partly_frozen
from trainer_core.config import BackendConfig
from trainer_core.errors import ConfigError
from trainer_core.modeling.architecture import transformer_blocks
from trainer_core.storage import join_uri

log = logging.getLogger(__name__)

DCP_DIR = "dcp"
"""Sub-directory of a checkpoint holding the DCP shards and metadata."""


class FSDP2Backend(ProcessGroupBackend):
    """Fully sharded data parallel (per-parameter DTensor sharding, ``torch.distributed.fsdp``)."""

    name = "fsdp2"
    checkpoint_format = "dcp"
    sharded_forward = True

    def __init__(self, cfg: BackendConfig) -> None:
        super().__init__(cfg)
        self.mp_policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.precision == "bf16-mixed"
            else MixedPrecisionPolicy()
        )
        if cfg.cpu_offload and self.device.type != "cuda":
            raise ConfigError(
                f"backend.cpu_offload moves GPU shards to host memory; this rank computes on {self.device}, "
                "where there is nothing to offload"
            )
        self.offload_policy = CPUOffloadPolicy() if cfg.cpu_offload else None

    def _shard(self, model: nn.Module) -> nn.Module:
        kwargs: dict[str, Any] = {"mp_policy": self.mp_policy}
        if self.offload_policy is not None:
            kwargs["offload_policy"] = self.offload_policy
        if not self.cfg.cpu_offload:
            model.to(self.device)
        for block in transformer_blocks(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        """Cast to the weights dtype, checkpoint layers (before sharding), shard, compile blocks."""
        memory.prepare_trainable(model, self.precision, self.cfg.activation_checkpointing)
        model = self._shard(model)
        if self.cfg.compile:
            memory.compile_blocks(model)  # after fully_shard: see the module docstring
        model.train()
        return model

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        model.requires_grad_(False)
        if self.precision == "bf16":
            memory.cast_parameters(model, torch.bfloat16)
        model = self._shard(model)
        model.eval()
        return model

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the MixedPrecisionPolicy casts

    def grad_sync(self, model: nn.Module, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(is_last_micro_batch)
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard changes the module's class in place: it is still the HF model

    def full_state_dict(self, model: nn.Module) -> dict[str, Tensor] | None:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        # A tied weight (lm_head = embed_tokens) is one parameter: keep its first name only,
        # as ``nn.Module.named_parameters`` (and an unsharded model's save_pretrained) do.
        names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
        return {k: v for k, v in state.items() if k in names}

    def save_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, out: Any) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_checkpoint_options(model))
        target = join_uri(out.uri, DCP_DIR)
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=FsspecWriter(target))
        for rel in sorted(storage.list_files(target)):
            name = rel.rsplit("/", 1)[-1]
            if name.startswith(f"__{self.rank}_") or (self.rank == 0 and name == ".metadata"):
                out.record(f"{DCP_DIR}/{rel}")

    def load_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, uri: str) -> None:
        options = _checkpoint_options(model)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=FsspecReader(join_uri(uri, DCP_DIR)))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
        )


def _checkpoint_options(model: nn.Module) -> StateDictOptions:
    """DCP state-dict options: a model with frozen parameters (LoRA's base) saves and loads its
    trainable ones only (``ignore_frozen_params``); the frozen ones are the stage's input."""
    frozen = partly_frozen(model)
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)
