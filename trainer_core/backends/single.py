"""Single-device backend: the numerical reference the distributed backends are tested against.

Also the ``full`` checkpoint format (:func:`put_full_state`, :func:`load_full_state`): one copy of
the weights (``model.safetensors``) and of the optimizer state (``optimizer.pt``), written by
this backend and by DDP, whose replicas are identical.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import safetensors.torch
import torch
from torch import Tensor, nn

from trainer_core import storage
from trainer_core.backends import memory
from trainer_core.checkpoint.components import Sharing, state_checksum, torch_bytes
from trainer_core.config import BackendConfig, TrainStageConfig
from trainer_core.storage import join_uri


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """Map ``auto`` / ``cpu`` / ``cuda`` to a ``torch.device`` (CUDA: the ``local_rank``-th GPU).

    Raises:
        RuntimeError: ``cuda`` was asked for and no CUDA device is visible.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("backend.device=cuda but no CUDA device is visible")
        return torch.device("cuda", local_rank)
    return torch.device(device)


def full_weights_bytes(state_dict: dict[str, Tensor]) -> bytes:
    """Safetensors bytes of a (CPU-copied) state dict."""
    return safetensors.torch.save({k: v.detach().to("cpu").clone().contiguous() for k, v in state_dict.items()})


def place_trainable(model: nn.Module, device: torch.device, cfg: BackendConfig | None = None) -> nn.Module:
    """A trainable model on ``device``, in train mode (what every backend does before wrapping).

    With ``cfg``: parameters cast to the precision's weights dtype (float32, or bf16 for pure
    ``bf16``) and activation checkpointing enabled if asked (:mod:`trainer_core.backends.memory`).
    """
    if cfg is not None:
        precision = memory.resolve_precision(cfg.precision, device)
        memory.prepare_trainable(model, precision, cfg.activation_checkpointing)
    model.to(device)
    model.train()
    return model


def place_frozen(model: nn.Module, device: torch.device, cfg: BackendConfig | None = None) -> nn.Module:
    """A frozen model on ``device``: eval mode, ``requires_grad`` off (no optimizer ever sees it).

    With ``cfg`` and precision ``bf16``: parameters cast to bf16. Otherwise they keep the dtype
    they were loaded in (``model.dtype``); under ``bf16-mixed`` a forward in :meth:`autocast`
    computes in bf16 all the same.
    """
    if cfg is not None and memory.resolve_precision(cfg.precision, device) == "bf16":
        memory.cast_parameters(model, torch.bfloat16)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def torch_optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None, skip_nonfinite: bool = False
) -> Tensor:
    """Clip to ``max_grad_norm`` (if set), step and zero the gradients of a torch-optimised model.

    Args:
        model: the (wrapped) model whose gradients to clip.
        optimizer: its optimizer.
        max_grad_norm: clip the global L2 norm to this; None: no clipping.
        skip_nonfinite: when the norm is NaN or infinite, zero the gradients and do not step (the
            weights and the optimizer state stay as they were). It reads the norm on the host.

    Returns:
        Scalar: the L2 norm of all gradients before clipping. For DTensor (FSDP2) gradients
        ``clip_grad_norm_`` reduces over the shards; the result is made a plain tensor.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_grad_norm if max_grad_norm is not None else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, limit)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    if not (skip_nonfinite and not torch.isfinite(grad_norm)):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


class SingleDeviceBackend:
    """Everything on one device; all collectives are identities.

    Args:
        cfg: the backend config, or only a device name (``auto``, ``cpu``, ``cuda``: the other
            settings at their defaults).
    """

    name = "single"
    checkpoint_format = "full"
    sharded_forward = False
    process_group = False

    def __init__(self, cfg: BackendConfig | str = "auto") -> None:
        self.cfg = BackendConfig(device=cfg) if isinstance(cfg, str) else cfg
        self.device = resolve_device(self.cfg.device)
        self.precision = memory.resolve_precision(self.cfg.precision, self.device)
        self.rank = 0
        self.world_size = 1
        self.validate_replicas = self.cfg.validate_replicas

    def wrap(self, model: nn.Module) -> nn.Module:
        model = place_trainable(model, self.device, self.cfg)
        if self.cfg.compile:
            memory.compile_blocks(model)
        return model

    def autocast(self) -> contextlib.AbstractContextManager:
        return memory.autocast(self.precision, self.device)

    def setup_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainStageConfig
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        return model, optimizer

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        return place_frozen(model, self.device, self.cfg)

    def grad_sync(self, model: nn.Module, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, model: nn.Module, loss: Tensor) -> None:
        loss.backward()

    def optimizer_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_grad_norm: float | None,
        skip_nonfinite: bool = False,
    ) -> Tensor:
        return torch_optimizer_step(model, optimizer, max_grad_norm, skip_nonfinite)

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def full_state_dict(self, model: nn.Module) -> dict[str, Tensor] | None:
        return model.state_dict()

    def save_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, out: Any) -> None:
        put_full_state(out, model, optimizer)

    def load_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, uri: str) -> None:
        load_full_state(model, optimizer, uri)

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None


def put_full_state(out: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Put the ``full`` format's two REPLICATED components through ``out`` (a ``RankWriter`` or
    ``StagedWriter``): ``model.safetensors`` (the plain model's state dict) and ``optimizer.pt``.

    A model with frozen parameters (LoRA: the base weights) writes its trainable ones only: the
    frozen ones are the stage's input, loaded again on resume (:func:`load_full_state`).
    Their checksums over the live state are computed only when ``out`` compares replicas.
    """
    validate = getattr(out, "validate", False)
    weights = saved_state_dict(model)
    out.put(
        "model.safetensors",
        Sharing.REPLICATED,
        full_weights_bytes(weights),
        state_checksum(weights) if validate else None,
    )
    state = optimizer.state_dict()
    out.put("optimizer.pt", Sharing.REPLICATED, torch_bytes(state), state_checksum(state) if validate else None)


def saved_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """What a checkpoint holds of ``model``: its state dict, less the frozen parameters when some
    parameters train and others do not (LoRA's base weights; their input is loaded again)."""
    state = model.state_dict()
    if not partly_frozen(model):
        return state
    params = model.named_parameters(remove_duplicate=False)  # tied weights under every name
    frozen = {name for name, p in params if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


def partly_frozen(model: nn.Module) -> bool:
    """True when some of ``model``'s parameters train and others are frozen (LoRA's base):
    every checkpoint format then saves and loads the trainable ones only."""
    trainable = [p.requires_grad for p in model.parameters()]
    return any(trainable) and not all(trainable)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, uri: str) -> None:
    """Load ``model.safetensors`` and ``optimizer.pt`` of a ``full``-format checkpoint.

    Strict: the file holds exactly :func:`saved_state_dict`'s keys (every tensor, or every
    trainable one of a model with frozen parameters).

    Raises:
        RuntimeError: a key is missing or unexpected (another model, or a full checkpoint for a
            LoRA model and the reverse).
    """
    weights = safetensors.torch.load(storage.read_bytes(join_uri(uri, "model.safetensors")))
    device = next(model.parameters()).device
    expected = set(saved_state_dict(model))
    if set(weights) != expected:
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise RuntimeError(
            f"checkpoint {uri}: model.safetensors does not match the model (missing {missing[:3]}"
            f"{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}"
            f"{'...' if len(unexpected) > 3 else ''})"
        )
    model.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=False)
    optimizer.load_state_dict(
        torch.load(io.BytesIO(storage.read_bytes(join_uri(uri, "optimizer.pt"))), weights_only=True)
    )
