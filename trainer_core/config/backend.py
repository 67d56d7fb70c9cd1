"""How a training stage runs its processes: backend, world size, launcher, rendezvous."""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from trainer_core.config.base import ConfigBase, Neutral, override_of

BACKENDS: tuple[str, ...] = ("single", "ddp", "fsdp2", "deepspeed")
"""Training backends; every one but ``single`` runs one process per rank under a launcher."""


def read_mixed_precision(data: Any) -> Any:
    """``data`` (a backend mapping, the pipeline's or a stage's override) with the deprecated
    ``mixed_precision`` (auto | fp32 | bf16, fsdp2 and deepspeed only) read as ``precision``: its
    ``bf16`` was already bf16 compute over fp32 master weights, i.e. ``bf16-mixed``. Where both are
    given (a stage's override of one over the pipeline's other) it wins.

    Raises:
        ValueError: a value other than auto, fp32 or bf16.
    """
    if isinstance(data, dict) and "mixed_precision" in data:
        data = dict(data)
        old = data.pop("mixed_precision")
        mapped = {"auto": "auto", "fp32": "fp32", "bf16": "bf16-mixed"}.get(old)
        if mapped is None:
            raise ValueError(
                f"backend.mixed_precision (deprecated, use backend.precision): {old!r} is not auto, fp32 or bf16"
            )
        warnings.warn(
            f"backend.mixed_precision is deprecated: read as backend.precision={mapped}", FutureWarning, stacklevel=2
        )
        data["precision"] = mapped
    return data


class BackendConfig(ConfigBase):
    """How a training stage runs its processes: backend, world size, launcher and rendezvous.

    World size is ``nnodes * nproc_per_node``. ``single`` runs one plain process; the others
    run under ``torchrun`` (or the ``deepspeed`` launcher) with one process per rank: gloo
    process groups on CPU, NCCL on GPU. Multi-node: every node's worker runs the same stage
    command with its own ``node_rank`` and the same ``rdzv_endpoint`` (host:port of node 0).
    ``precision``, ``activation_checkpointing`` and ``compile`` apply to every backend (their
    semantics per backend: :mod:`trainer_core.backends.memory`).
    """

    name: Literal["single", "ddp", "fsdp2", "deepspeed"] = Field(
        "single", description="Training backend: single (one device), ddp, fsdp2 or deepspeed (ZeRO)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device; 'auto' picks cuda when present.")
    nproc_per_node: int = Field(1, ge=1, description="Processes (ranks) per node; 1 with the single backend.")
    nnodes: int = Field(1, ge=1, description="Nodes in the job (multi-node: one worker per node).")
    node_rank: int = Field(0, ge=0, description="This node's rank in [0, nnodes).")
    rdzv_endpoint: str | None = Field(
        None, description="host:port of the c10d rendezvous (node 0); default on one node: 127.0.0.1 and a free port."
    )
    rdzv_id: str | None = Field(None, description="Rendezvous id shared by the job's nodes; default: run id + stage.")
    launcher: Literal["torchrun", "deepspeed"] = Field(
        "torchrun", description="Launcher of multi-process stages: torchrun, or the deepspeed launcher."
    )
    dist_timeout_s: float = Field(600.0, gt=0, description="Collective timeout: a rank that waits longer fails.")
    precision: Literal["auto", "bf16-mixed", "bf16", "fp32"] = Field(
        "auto",
        description="Training precision on every backend: bf16-mixed (fp32 master weights, gradients and optimizer "
        "state, bf16 compute), bf16 (all bf16, no master copy), fp32; auto = bf16-mixed on CUDA, fp32 on CPU. "
        "The deprecated mixed_precision is read as this field (its bf16 as bf16-mixed).",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each transformer block's activations in the backward instead of keeping them: "
        "activation memory of one block instead of all, for about one more forward of compute.",
    )
    compile: Annotated[bool, Neutral(None)] = Field(
        False,
        description="torch.compile each transformer block's training forward (inductor; CPU needs a C++ compiler).",
    )
    cpu_offload: bool = Field(False, description="fsdp2: keep parameters, gradients and optimizer state on CPU.")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="deepspeed: ZeRO stage.")
    offload_optimizer: bool = Field(
        False, description="deepspeed: ZeRO optimizer-state offload to CPU (DeepSpeedCPUAdam)."
    )
    offload_params: bool = Field(False, description="deepspeed: ZeRO-3 parameter offload to CPU.")
    ds_config: dict[str, Any] = Field(
        default_factory=dict,
        description="deepspeed: raw DeepSpeed config merged (recursively) over the generated one, for experts.",
    )
    validate_replicas: bool = Field(
        True, description="At each checkpoint, check by checksum that replicated state is identical on every rank."
    )

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return self.nnodes * self.nproc_per_node

    @model_validator(mode="before")
    @classmethod
    def _deprecated_mixed_precision(cls, data: Any) -> Any:
        return read_mixed_precision(data)

    @model_validator(mode="after")
    def _check(self) -> BackendConfig:
        if self.name == "single" and self.world_size != 1:
            raise ValueError(
                f"backend.name=single runs one process; got nnodes={self.nnodes}, nproc_per_node={self.nproc_per_node}"
                " (choose ddp, fsdp2 or deepspeed)"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(f"backend.node_rank={self.node_rank} must be < backend.nnodes={self.nnodes}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("backend.rdzv_endpoint (host:port of node 0) is required when backend.nnodes > 1")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("backend.offload_params needs backend.zero_stage=3")
        if self.name == "deepspeed" and self.precision == "bf16" and self.zero_stage == 0:
            raise ValueError("backend.precision=bf16 (no fp32 master copy) on deepspeed needs backend.zero_stage 1-3")
        return self


class BackendOverride(override_of(BackendConfig)):  # type: ignore[misc]
    """A stage's ``backend``: the fields of :class:`BackendConfig` it sets over the pipeline-wide
    ``backend`` (e.g. ``{name: ddp}``), unset ones inherited; the merged backend is validated as a
    whole (``PipelineConfig.backend_for``). An unknown key fails at load, named
    ``<stage>.backend.<key>``."""

    @model_validator(mode="before")
    @classmethod
    def _deprecated_mixed_precision(cls, data: Any) -> Any:
        return read_mixed_precision(data)
