"""DeepSpeed backend: ZeRO stage 0-3 with optional optimizer / parameter offload.

The DeepSpeed config is generated from the pydantic config (micro-batch size, gradient
accumulation, clipping, ZeRO stage, offload, precision) and ``backend.ds_config`` is merged over
it recursively, for settings this project does not model. ``backend.precision``: ``bf16-mixed``
is DeepSpeed's ``bf16`` section (bf16 module, fp32 master weights and optimizer state in the
ZeRO optimizer), ``bf16`` adds ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``
(no fp32 copy; ZeRO 1-3), ``fp32`` disables it. Activation checkpointing and ``torch.compile``
per block are applied to the module before ``deepspeed.initialize``
(:mod:`trainer_core.backends.memory`). The engine takes the loop's own
AdamW (``zero_allow_untested_optimizer``) or, with optimizer offload, a ``DeepSpeedCPUAdam``
with the same groups; the loop's LR schedule drives the optimizer's groups as on one device.

Gradient accumulation: the loop marks each micro-batch's boundary with
``set_gradient_accumulation_boundary`` (the documented pattern) and calls ``engine.step()``
once per optimizer step. ``engine.backward(..., scale_wrt_gas=False)``: the loop already
divided the loss by the step's global count; the loss is multiplied by ``world_size`` since
ZeRO averages gradients over ranks.

Checkpoints (format ``deepspeed``): ``engine.save_checkpoint`` into a local staging directory
per rank (model states on rank 0, one ZeRO partition file per rank: PER_RANK components),
uploaded under ``deepspeed/`` of the checkpoint directory; loading downloads them and calls
``engine.load_checkpoint``. A ZeRO-1/2/3 checkpoint written at another world size (elastic resume) is
first converted to DeepSpeed's universal checkpoint (``deepspeed.checkpoint.ds_to_universal``, every
parameter and its optimizer state whole, with ``--inject_missing_state`` since no Megatron
client writes ``universal_checkpoint_info``) and loaded with ``checkpoint.load_universal``, which
re-partitions it over this run's ranks. After a universal load each param group gets its own
settings back (:func:`restore_group_hyperparameters`) and each state its own step counter
(:func:`untie_step_counts`): DeepSpeed 0.19.8's ZeRO-3 loader shares both between groups.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import torch
from torch import Tensor, nn

from trainer_core.backends import memory
from trainer_core.backends.distributed import ProcessGroupBackend
from trainer_core.backends.single import partly_frozen, place_trainable
from trainer_core import storage
from trainer_core.config import BackendConfig, TrainStageConfig
from trainer_core.errors import ConfigError
from trainer_core.storage import join_uri

log = logging.getLogger(__name__)

DS_DIR = "deepspeed"
"""Sub-directory of a checkpoint holding DeepSpeed's files."""

DS_TAG = "state"
"""The tag (sub-directory) DeepSpeed saves under inside :data:`DS_DIR`."""


def deep_merge(base: dict, override: dict) -> dict:
    """``override`` merged over ``base`` recursively (dicts merge, anything else replaces)."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def bf16_section(precision: str) -> dict[str, Any]:
    """DeepSpeed's ``bf16`` section for a resolved precision (see the module docstring)."""
    if precision == "bf16":
        return {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    return {"enabled": precision == "bf16-mixed"}


def build_ds_config(backend: BackendConfig, cfg: TrainStageConfig, world_size: int, precision: str) -> dict[str, Any]:
    """The DeepSpeed config of a training stage.

    Args:
        backend: ZeRO stage, offload and the raw ``ds_config`` override.
        cfg: micro-batch size, gradient accumulation and clipping of the stage.
        world_size: data-parallel ranks.
        precision: the resolved precision (``bf16-mixed``, ``bf16`` or ``fp32``).

    Returns:
        A DeepSpeed config dict (``train_batch_size = micro_batch_size x grad_accum_steps x world_size``).
    """
    zero: dict[str, Any] = {"stage": backend.zero_stage}
    if backend.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if backend.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.accum_steps(world_size),
        "train_batch_size": cfg.micro_batch_size * cfg.accum_steps(world_size) * world_size,
        "gradient_clipping": cfg.max_grad_norm or 0.0,
        "zero_optimization": zero,
        "bf16": bf16_section(precision),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return deep_merge(config, backend.ds_config)


def skip_shared_memory_all_reduce_build() -> None:
    """Keep ``deepspeed.init_distributed`` on CPU from compiling DeepSpeed's shared-memory
    all-reduce op (``ShareMemCommBuilder``, a C++ extension built with ninja into
    ``~/.cache/torch_extensions``, about a minute on 2 cores, again for every new virtual
    environment's path).

    DeepSpeed 0.19.8's ``TorchBackend.__init__`` (``deepspeed/comm/torch.py``) builds it on every
    CPU init, but only ``TorchBackend.inference_all_reduce`` (DeepSpeed inference's tensor
    parallelism) calls it; training's collectives are ``torch.distributed``'s, over gloo here.
    Without the op, ``inference_all_reduce`` falls back to ``torch.distributed.all_reduce``
    itself. Replaces the module's ``build_shm_op`` with one that returns ``None``, the value
    DeepSpeed itself uses where the op is not compatible.
    """
    # the module, not ``deepspeed.comm``'s attribute ``torch`` (which is torch itself)
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    ds_comm_torch.build_shm_op = lambda: None


class DeepSpeedBackend(ProcessGroupBackend):
    """DeepSpeed ZeRO (``deepspeed.initialize``); the model to call is the engine."""

    name = "deepspeed"
    checkpoint_format = "deepspeed"

    def __init__(self, cfg: BackendConfig) -> None:
        import deepspeed

        super().__init__(cfg)
        if self.device.type == "cpu":
            skip_shared_memory_all_reduce_build()
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")
        self.sharded_forward = cfg.zero_stage == 3
        self._engines: dict[int, Any] = {}  # id(module) -> its engine, for callers holding the module

    def wrap(self, model: nn.Module) -> nn.Module:
        model = place_trainable(model, self.device, self.cfg)  # the engine is built in setup_optimizer
        if self.cfg.compile:
            memory.compile_blocks(model)
        return model

    def setup_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainStageConfig
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        import deepspeed

        if self.cfg.offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in optimizer.param_groups]
            defaults = optimizer.defaults
            optimizer = DeepSpeedCPUAdam(groups, lr=defaults["lr"], betas=defaults["betas"], adamw_mode=True)
        config = build_ds_config(self.cfg, cfg, self.world_size, self.precision)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self._engines[id(engine.module)] = engine
        return engine, optimizer

    def _engine(self, model: nn.Module) -> Any:
        return model if hasattr(model, "save_checkpoint") else self._engines.get(id(model), model)

    def _owner(self, model: nn.Module) -> tuple[Any, str]:
        """(engine, key prefix) of ``model``: its own engine with prefix "", or the engine whose
        module holds ``model`` as a submodule with the submodule's name and a dot (e.g. the policy
        inside the RL stages' policy-and-value module); ``(model, "")`` when no engine has it."""
        engine = self._engine(model)
        if engine is not model or hasattr(model, "save_checkpoint"):
            return engine, ""
        for candidate in self._engines.values():
            for name, sub in candidate.module.named_modules():
                if sub is model and name:
                    return candidate, f"{name}."
        return model, ""

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        model.requires_grad_(False)
        model.eval()
        if self.precision == "bf16":
            memory.cast_parameters(model, torch.bfloat16)
        if self.cfg.zero_stage == 3:
            import deepspeed

            config = {
                "train_micro_batch_size_per_gpu": 1,
                "zero_optimization": {"stage": 3},
                "bf16": {"enabled": self.precision != "fp32"},
                "steps_per_print": 2**31 - 1,
            }
            engine, _, _, _ = deepspeed.initialize(model=model, config=deep_merge(config, self.cfg.ds_config))
            engine.eval()
            return engine
        model.to(self.device)
        return model

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the engine's bf16 module computes in bf16

    def grad_sync(self, model: nn.Module, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        if hasattr(model, "set_gradient_accumulation_boundary"):
            model.set_gradient_accumulation_boundary(is_last_micro_batch)
        return contextlib.nullcontext()

    def backward(self, model: nn.Module, loss: Tensor) -> None:
        model.backward(loss * self.world_size, scale_wrt_gas=False)

    def optimizer_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_grad_norm: float | None,
        skip_nonfinite: bool = False,
    ) -> Tensor:
        if skip_nonfinite:
            raise ConfigError(
                "max_nonfinite_steps: DeepSpeed's engine steps the optimizer itself; skipping a "
                "non-finite step needs backend single, ddp or fsdp2"
            )
        model.step()
        norm = model.get_global_grad_norm()
        return torch.as_tensor(float(norm) if norm is not None else float("nan"))

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def full_state_dict(self, model: nn.Module) -> dict[str, Tensor] | None:
        """Collective under ZeRO-3: ``model`` is the module given to ``setup_optimizer`` (or its
        engine), or a submodule of it, whose keys then come without the submodule's prefix."""
        engine, prefix = self._owner(model)
        if self.cfg.zero_stage == 3:
            if not hasattr(engine, "_zero3_consolidated_16bit_state_dict"):
                raise TypeError("full_state_dict under ZeRO-3 needs the model given to setup_optimizer")
            state = engine._zero3_consolidated_16bit_state_dict()
            if state is None or not prefix:
                return state
            return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        return self.unwrap(model).state_dict() if self.rank == 0 else None

    def save_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, out: Any) -> None:
        with tempfile.TemporaryDirectory(prefix=f"posttrain-ds-rank{self.rank}-") as tmp:
            os.makedirs(os.path.join(tmp, DS_TAG), exist_ok=True)
            # LoRA: the frozen base weights are the stage's input, not part of the checkpoint.
            frozen = partly_frozen(model)
            with frozen_aliases_excluded(model) if frozen else contextlib.nullcontext():
                model.save_checkpoint(
                    tmp, tag=DS_TAG, client_state={}, save_latest=False, exclude_frozen_parameters=frozen
                )
            for root, _, files in os.walk(tmp):
                for name in sorted(files):
                    rel = os.path.relpath(os.path.join(root, name), tmp).replace(os.sep, "/")
                    out.write_file(f"{DS_DIR}/{rel}", os.path.join(root, name))

    def load_model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, uri: str) -> None:
        """Load a checkpoint of this format; one written at another world size is converted to a
        universal checkpoint first (module docstring), in this rank's temporary directory.

        Raises:
            RuntimeError: DeepSpeed loads nothing, or the universal conversion fails (its output
                is in the message).
        """
        with tempfile.TemporaryDirectory(prefix=f"posttrain-ds-rank{self.rank}-") as tmp:
            storage.download_dir(join_uri(uri, DS_DIR), tmp)
            saved = saved_world_size(os.path.join(tmp, DS_TAG))
            universal = saved is not None and saved != self.world_size
            if universal:
                log.info(
                    "checkpoint %s: ZeRO partitions of %d ranks, this run has %d: loading it as a universal checkpoint",
                    uri,
                    saved,
                    self.world_size,
                )
                load_dir = os.path.join(tmp, "universal")
                to_universal(os.path.join(tmp, DS_TAG), os.path.join(load_dir, DS_TAG))
            else:
                load_dir = tmp
            inner = getattr(model.optimizer, "optimizer", None)  # the torch optimizer ZeRO wraps
            groups = group_hyperparameters(inner) if universal else []
            config, before = model._config, model._config.load_universal_checkpoint
            config.load_universal_checkpoint = universal
            try:
                path, _ = model.load_checkpoint(
                    load_dir,
                    tag=DS_TAG,
                    load_optimizer_states=True,
                    load_lr_scheduler_states=False,
                    load_module_strict=not partly_frozen(model),
                )
            finally:
                config.load_universal_checkpoint = before
            if path is None:
                raise RuntimeError(f"DeepSpeed could not load the checkpoint at {uri}")
            if universal and inner is not None:
                restore_group_hyperparameters(inner, groups)
                untie_step_counts(inner)


@contextlib.contextmanager
def frozen_aliases_excluded(engine: Any) -> Any:
    """While open, ``engine.module_state_dict(exclude_frozen_parameters=True)`` also drops a frozen
    parameter's second name.

    DeepSpeed 0.19.8 drops the names ``module.named_parameters()`` lists, which names a shared
    tensor once: a tied ``lm_head.weight`` (the frozen embedding under LoRA) stayed in every ZeRO-1/2
    checkpoint, vocab x hidden elements (in the tiny test model 9,600 beside the adapters' 4,096;
    in Qwen2.5-0.5B's, 136M). Loading is unaffected: the module loads non-strictly, and the tied
    head is the input model's embedding.
    """
    original = engine.module_state_dict

    def module_state_dict(*args: Any, exclude_frozen_parameters: bool = False, **kwargs: Any) -> dict:
        state = original(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters and state is not None:
            for name, param in engine.module.named_parameters(remove_duplicate=False):
                if not param.requires_grad:
                    state.pop(name, None)
        return state

    engine.module_state_dict = module_state_dict
    try:
        yield
    finally:
        del engine.module_state_dict


_PARTITION = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def group_hyperparameters(optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    """Each param group's settings but its parameters and its learning rate (which the LR
    schedule sets and a checkpoint restores): what :func:`restore_group_hyperparameters` puts back."""
    if optimizer is None:
        return []
    return [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]


def restore_group_hyperparameters(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Put back each param group's own settings after a universal load.

    DeepSpeed 0.19.8's ZeRO-3 universal load copies the saved param group 0's settings into every
    group, so the loop's no-decay group (norms, biases; ``weight_decay`` 0) took the decay group's
    ``weight_decay``. The settings come from this run's config, which the checkpoint's fingerprint
    says is the saved run's.

    Raises:
        RuntimeError: the optimizer has another number of groups than before the load.
    """
    if len(groups) != len(optimizer.param_groups):
        raise RuntimeError(
            f"the optimizer had {len(groups)} param groups before loading and {len(optimizer.param_groups)} after"
        )
    for group, saved in zip(optimizer.param_groups, groups):
        group.update(saved)


def untie_step_counts(optimizer: torch.optim.Optimizer | None) -> int:
    """Give every parameter's optimizer state its own ``step`` tensor, placed as torch's own
    ``Optimizer.load_state_dict`` places it (float32; on the parameter's device for a fused or
    capturable optimizer, on the CPU otherwise); returns how many were shared.

    DeepSpeed 0.19.8's ZeRO-3 universal load (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``)
    puts the *same* ``step`` tensor, read on the CPU, into the state of every parameter sub-group.
    ZeRO-3 steps its wrapped optimizer once per sub-group, and torch's Adam/AdamW increments
    ``step`` in place, so with k sub-groups the shared counter advanced k times per optimizer step
    and every group but the first took its bias correction (Kingma & Ba 2015, Alg. 1) at a wrong
    step. Measured on the tiny pipeline's SFT (2 sub-groups: decay / no decay): a 2 -> 1 rank
    resume at step 8 printed the uninterrupted losses at step 9 and was 1.3e-3 (relative) off by
    step 20; with the counters untied its unrounded losses equal an uninterrupted 1-rank run's.
    States whose ``step`` is a number, not a tensor (DeepSpeedCPUAdam), are left alone. The
    device placement for a fused optimizer on CUDA is unverified (no GPU run).
    """
    if optimizer is None:
        return 0
    on_param_device = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    seen: set[int] = set()
    shared = 0
    for param, state in optimizer.state.items():
        step = state.get("step")
        if not torch.is_tensor(step):
            continue
        if id(step) in seen:
            step = step.clone()
            shared += 1
        else:
            seen.add(id(step))
        device = param.device if on_param_device else torch.device("cpu")
        state["step"] = step.to(device=device, dtype=torch.float32)
    return shared


def saved_world_size(tag_dir: str) -> int | None:
    """The data-parallel ranks that wrote a DeepSpeed checkpoint: its ZeRO optimizer partitions
    (``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``), or None when it has none (ZeRO 0)."""
    ranks = [int(m[1]) for name in os.listdir(tag_dir) if (m := _PARTITION.match(name))]
    return max(ranks) + 1 if ranks else None


def to_universal(tag_dir: str, out_dir: str) -> None:
    """Convert the DeepSpeed checkpoint in ``tag_dir`` to a universal checkpoint in ``out_dir``
    (``python -m deepspeed.checkpoint.ds_to_universal``, one worker, in a child process).

    Raises:
        RuntimeError: the conversion failed (its output is in the message).
    """
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        tag_dir,
        "--output_folder",
        out_dir,
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
        "--inject_missing_state",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-20:])
        raise RuntimeError(f"converting {tag_dir} to a universal checkpoint failed:\n{tail}")
