"""What every multi-process backend shares: process-group set-up from the launcher's
environment and the collectives of the :class:`~trainer_core.backends.base.Backend` Protocol."""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainer_core.backends import memory
from trainer_core.backends.single import SingleDeviceBackend, resolve_device
from trainer_core.config import BackendConfig
from trainer_core.errors import ConfigError

log = logging.getLogger(__name__)


def init_process_group(cfg: BackendConfig) -> tuple[int, int, torch.device]:
    """Join the job's default process group (gloo on CPU, NCCL on CUDA, NCCL plus gloo for CPU
    tensors on CUDA with ``cpu_offload``).

    Reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (set by ``torchrun`` and the
    ``deepspeed`` launcher) and rendezvous through ``MASTER_ADDR``/``MASTER_PORT``.

    Returns:
        (rank, world_size, device).

    Raises:
        ConfigError: the process was not started by a launcher (no ``RANK``/``WORLD_SIZE``).
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k not in os.environ]
    if missing:
        raise ConfigError(
            f"backend.name={cfg.name} runs under a launcher (torchrun / deepspeed): {', '.join(missing)} not set"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = resolve_device(cfg.device, int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=cfg.dist_timeout_s)
        if device.type == "cuda" and getattr(cfg, "cpu_offload", False):
            # FSDP2's CPU offload keeps gradients on the host: clipping all-reduces them there,
            # which NCCL cannot (torchtitan and torchtune add gloo for the CPU device the same way).
            torch.cuda.set_device(device)
            dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
        elif device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    log.info("rank %d/%d on %s (%s)", rank, world_size, device, dist.get_backend())
    return rank, world_size, device


class ProcessGroupBackend:
    """Collectives over the default process group; subclasses add wrapping and checkpoints."""

    name = "distributed"
    sharded_forward = False
    process_group = True

    def __init__(self, cfg: BackendConfig) -> None:
        self.cfg = cfg
        self.validate_replicas = cfg.validate_replicas
        self.rank, self.world_size, self.device = init_process_group(cfg)
        self.precision = memory.resolve_precision(cfg.precision, self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Nothing: FSDP2's policy and DeepSpeed's engine cast themselves (DDP overrides it)."""
        return contextlib.nullcontext()

    # As on one device (DeepSpeed overrides the optimizer's two): the optimizer as it is, its step
    # torch_optimizer_step's, frozen models placed.
    setup_optimizer = SingleDeviceBackend.setup_optimizer
    optimizer_step = SingleDeviceBackend.optimizer_step
    prepare_frozen = SingleDeviceBackend.prepare_frozen

    def backward(self, model: nn.Module, loss: Tensor) -> None:
        """``loss x world_size`` backward: DDP's all-reduce and FSDP2's reduce-scatter average the
        gradients over ranks, and the loop's loss is already divided by every rank's count
        (DeepSpeed overrides it)."""
        (loss * self.world_size).backward()

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Leave the process group, so the launcher sees a clean exit."""
        if dist.is_initialized():
            # FSDP2 modules sit in reference cycles: collect them now, while the group they hold
            # exists; freed at interpreter exit instead, they can abort the rank after its commit.
            gc.collect()
            dist.destroy_process_group()
