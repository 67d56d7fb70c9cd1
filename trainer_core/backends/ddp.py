"""DDP backend: the model replicated on every rank, gradients all-reduced (averaged) in backward.

Precision, activation checkpointing and compile as on one device (:mod:`trainer_core.backends.memory`):
the parameters are cast, layers checkpointed and blocks compiled before ``DistributedDataParallel``
wraps the model (its hooks then see fp32 gradients under ``bf16-mixed``).

Weights and optimizer state are REPLICATED state components: rank 0 writes one copy (the
``full`` format, the same files as the single-device backend), after the ranks' checksums
are compared when ``backend.validate_replicas`` is on.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from trainer_core.backends import memory
from trainer_core.backends.distributed import ProcessGroupBackend
from trainer_core.backends.single import load_full_state, place_trainable, put_full_state
from trainer_core.config import BackendConfig


class DDPBackend(ProcessGroupBackend):
    """``torch.nn.parallel.DistributedDataParallel`` over gloo (CPU) or NCCL (CUDA)."""

    name = "ddp"
    checkpoint_format = "full"

    def __init__(self, cfg: BackendConfig) -> None:
        super().__init__(cfg)

    def wrap(self, model: nn.Module) -> nn.Module:
        place_trainable(model, self.device, self.cfg)
        if self.cfg.compile:
            memory.compile_blocks(model)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def autocast(self) -> contextlib.AbstractContextManager:
        return memory.autocast(self.precision, self.device)

    def grad_sync(self, model: nn.Module, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        if is_last_micro_batch or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def full_state_dict(self, model: nn.Module) -> dict[str, Tensor] | None:
        return self.unwrap(model).state_dict() if self.rank == 0 else None

    def save_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, out: Any) -> None:
        put_full_state(out, self.unwrap(model), optimizer)

    def load_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, uri: str) -> None:
        load_full_state(self.unwrap(model), optimizer, uri)
