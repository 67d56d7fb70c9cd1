"""The one interface a training loop sees, whatever runs the model.

Backends: ``single`` (one device; the numerical reference). Distributed backends (DDP,
FSDP2, DeepSpeed) implement the same Protocol in their own modules.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn


@runtime_checkable
class Backend(Protocol):
    """What the loop needs from a backend.

    Attributes:
        rank: this process's data-parallel rank (0 on a single device).
        world_size: number of data-parallel processes.
        device: the device this rank computes on.
        name: the backend's config name (``single``, ...), recorded in manifests.
    """

    rank: int
    world_size: int
    device: torch.device
    name: str

    def wrap(self, model: nn.Module) -> nn.Module:
        """Place (and shard, if the backend does) a trainable model; returns the model to call."""

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        """Place a frozen model (reference, reward model): eval mode, no grads, no optimizer."""

    def grad_sync(self, model: nn.Module, is_last_micro_batch: bool) -> AbstractContextManager:
        """Context for one micro-batch's backward: gradients sync only on the last one."""

    def clip_grad_norm(self, model: nn.Module, max_norm: float | None) -> Tensor:
        """Global grad norm (before clipping) across all shards/ranks; clips when max_norm is set."""

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum a tensor over ranks (identity on a single device)."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain ``transformers`` model (for saving and generation)."""

    def barrier(self) -> None:
        """Wait for every rank."""

    def close(self) -> None:
        """Release process groups and devices."""
