"""FSDP2 backend: ``fully_shard`` on every transformer block, then on the root.

Parameters, gradients and optimizer state are sharded across ranks as DTensors; each block's
parameters are all-gathered for its forward and backward and freed after. On CUDA the
compute dtype is bf16 with fp32 gradient reduction (``MixedPrecisionPolicy``) unless
``backend.mixed_precision=fp32``; ``backend.cpu_offload`` keeps the shards on the host
(``CPUOffloadPolicy``). Reference: torchtitan's ``apply_fsdp`` and the FSDP2 tutorial.

Checkpoints use ``torch.distributed.checkpoint`` (format ``dcp``): each rank writes its own
shards under ``dcp/`` and rank 0 the metadata; a checkpoint written at one world size loads
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

from trainer_core.backends.distributed import ProcessGroupBackend
from trainer_core.backends.single import torch_optimizer_step
from trainer_core import storage
from trainer_core.config import BackendConfig
from trainer_core.errors import ConfigError
from trainer_core.storage import join_uri

log = logging.getLogger(__name__)

DCP_DIR = "dcp"
"""Sub-directory of a checkpoint holding the DCP shards and metadata."""


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: modules whose class is in ``_no_split_modules``.

    Falls back to the children of the first ``nn.ModuleList`` found (``model.layers``).
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if blocks:
        return blocks
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            return list(m)
    return []


class FSDP2Backend(ProcessGroupBackend):
    """Fully sharded data parallel (per-parameter DTensor sharding, ``torch.distributed.fsdp``)."""

    name = "fsdp2"
    checkpoint_format = "dcp"
    sharded_forward = True

    def __init__(self, cfg: BackendConfig) -> None:
        super().__init__(cfg)
        bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and self.device.type == "cuda")
        self.mp_policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
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
        model = self._shard(model)
        model.train()
        return model

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        model.requires_grad_(False)
        model = self._shard(model)
        model.eval()
        return model

    def grad_sync(self, model: nn.Module, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(is_last_micro_batch)
        return contextlib.nullcontext()

    def backward(self, model: nn.Module, loss: Tensor) -> None:
        (loss * self.world_size).backward()  # the reduce-scatter averages over ranks

    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None,
        skip_nonfinite: bool = False,
    ) -> Tensor:
        return torch_optimizer_step(model, optimizer, max_grad_norm, skip_nonfinite)

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
        model_sd, optim_sd = get_state_dict(model, optimizer)
        target = join_uri(out.uri, DCP_DIR)
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=FsspecWriter(target))
        for rel in sorted(storage.list_files(target)):
            name = rel.rsplit("/", 1)[-1]
            if name.startswith(f"__{self.rank}_") or (self.rank == 0 and name == ".metadata"):
                out.record(f"{DCP_DIR}/{rel}")

    def load_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, uri: str) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=FsspecReader(join_uri(uri, DCP_DIR)))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
