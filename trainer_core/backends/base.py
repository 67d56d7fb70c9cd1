"""The one interface a training loop sees, whatever runs the model.

Backends: ``single`` (one device; the numerical reference), ``ddp`` (replicated model,
all-reduced gradients), ``fsdp2`` (``fully_shard`` per transformer block, then the root) and
``deepspeed`` (ZeRO stage 0-3). The loop calls, per optimizer step::

    for i, batch in enumerate(micro_batches):            # this rank's share
        with backend.grad_sync(model, is_last_micro_batch=i == last):
            with backend.autocast():                      # bf16-mixed on single/DDP; else nothing
                loss = objective(model, batch) / global_count # count summed over micro-batches and ranks
            backend.backward(model, loss)
    grad_norm = backend.optimizer_step(model, optimizer, max_grad_norm)
    scheduler.step()

so a step's gradient is the gradient of the loss summed over every counted unit (token or
pair) of the global batch divided by their number, whatever the world size: the backends
that average gradients over ranks (DDP, FSDP2, DeepSpeed) scale the loss by ``world_size``.

Every backend applies ``backend.precision``, ``backend.activation_checkpointing`` and
``backend.compile`` to the models it wraps (:mod:`trainer_core.backends.memory`); state-dict
keys stay those of the plain Hugging Face model with any of them on.

Checkpoint formats (``checkpoint_format``): ``full`` (single, ddp: one copy of the weights and
optimizer state, a REPLICATED state component written by rank 0), ``dcp`` (fsdp2:
``torch.distributed.checkpoint``, sharded and reshardable across world sizes) and
``deepspeed`` (the engine's own ``save_checkpoint``, one ZeRO partition file per rank).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from trainer_core.config import TrainStageConfig


@runtime_checkable
class Backend(Protocol):
    """What the loop needs from a backend.

    Attributes:
        rank: this process's global rank (0 on a single device).
        world_size: number of data-parallel processes.
        device: the device this rank computes on.
        name: the backend's config name (``single``, ``ddp``, ``fsdp2``, ``deepspeed``).
        checkpoint_format: ``full``, ``dcp`` or ``deepspeed`` (see the module docstring).
        sharded_forward: True when a forward needs every rank (FSDP2, ZeRO-3): generation then
            runs in lockstep (``synced_gpus``) and every rank must run the same number of forwards.
        precision: the resolved ``backend.precision``: ``bf16-mixed``, ``bf16`` or ``fp32``.
        process_group: True when the backend runs collectives over a process group (DDP, FSDP2,
            DeepSpeed, at any world size): a checkpoint save is then collective (never in the
            background, where it would race the training thread's collectives) and a committed
            model's weights are gathered with :meth:`full_state_dict`.
        validate_replicas: compare replicated checkpoint components' checksums across ranks
            before writing (``backend.validate_replicas``).
    """

    rank: int
    world_size: int
    device: torch.device
    name: str
    checkpoint_format: str
    sharded_forward: bool
    precision: str
    process_group: bool
    validate_replicas: bool

    def wrap(self, model: nn.Module) -> nn.Module:
        """Place (and shard, if the backend does) a trainable model; returns the model to call."""

    def setup_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainStageConfig
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Hand the optimizer to the backend; returns (model to call, optimizer the scheduler drives).

        Identity except for DeepSpeed, which returns its engine (built here, since its config
        needs the batch sizes and clipping of ``cfg``) and the client optimizer.
        """

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        """Place a frozen model (reference, reward model): eval mode, no grads, no optimizer."""

    def autocast(self) -> AbstractContextManager:
        """Context to run forwards in (training and evaluation; not the backward): bf16 autocast
        under ``bf16-mixed`` on the single-device and DDP backends, nothing otherwise (FSDP2's
        policy and DeepSpeed's engine cast themselves)."""

    def grad_sync(self, model: nn.Module, is_last_micro_batch: bool) -> AbstractContextManager:
        """Context around one micro-batch's forward and backward: gradients sync only on the last."""

    def backward(self, model: nn.Module, loss: Tensor) -> None:
        """Backward of ``loss`` (already divided by the global count); scaled to undo rank averaging."""

    def optimizer_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_grad_norm: float | None,
        skip_nonfinite: bool = False,
    ) -> Tensor:
        """Clip (when ``max_grad_norm`` is set), step and zero the gradients.

        With ``skip_nonfinite``, a step whose gradient norm is NaN or infinite leaves the weights
        and the optimizer state as they were (the gradients are zeroed). DeepSpeed's engine steps
        itself and refuses it (``ConfigError``).

        Returns:
            Scalar: the global gradient L2 norm across all shards and ranks, before clipping.
        """

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum a tensor over ranks (identity on a single device); returns the reduced tensor."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The ``transformers`` model inside the wrapper (config, ``generate``, ``save_pretrained``)."""

    def full_state_dict(self, model: nn.Module) -> dict[str, Tensor] | None:
        """Collective: the whole model's weights on CPU at rank 0 (None on other ranks)."""

    def save_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, out: Any) -> None:
        """Collective: write model and optimizer state through ``out`` (a ``RankWriter``)."""

    def load_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, uri: str) -> None:
        """Collective: restore what :meth:`save_model_state` wrote under checkpoint ``uri``."""

    def barrier(self) -> None:
        """Wait for every rank."""

    def close(self) -> None:
        """Release process groups and devices."""
