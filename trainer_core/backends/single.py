"""Single-device backend: the numerical reference the distributed backends are tested against."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn


def resolve_device(device: str) -> torch.device:
    """Map ``auto`` / ``cpu`` / ``cuda`` to a ``torch.device``.

    Raises:
        RuntimeError: ``cuda`` was asked for and no CUDA device is visible.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("backend.device=cuda but no CUDA device is visible")
    return torch.device(device)


class SingleDeviceBackend:
    """Everything on one device; all collectives are identities."""

    name = "single"

    def __init__(self, device: str = "auto") -> None:
        self.device = resolve_device(device)
        self.rank = 0
        self.world_size = 1

    def wrap(self, model: nn.Module) -> nn.Module:
        model.to(self.device)
        model.train()
        return model

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        model.to(self.device)
        model.eval()
        model.requires_grad_(False)
        return model

    def grad_sync(self, model: nn.Module, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float | None) -> Tensor:
        params = [p for p in model.parameters() if p.grad is not None]
        limit = max_norm if max_norm is not None else float("inf")
        return torch.nn.utils.clip_grad_norm_(params, limit)

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return tensor

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None
