"""LoRA adapters on a stage's model (``peft``): inject, disable for the reference, merge on commit.

The adapters are injected into the Hugging Face model itself (``peft.inject_adapter_in_model``)
rather than wrapped in a ``PeftModel``: the model stays a ``PreTrainedModel``, so every path
that reads its decoder and LM head (the chunked losses, the RL completion forward, generation)
and every backend (DDP, FSDP2's per-block sharding, DeepSpeed) sees the same module tree as
without adapters, with ``lora_A`` / ``lora_B`` inside the adapted linear layers. State-dict
keys are then peft's (``...q_proj.base_layer.weight``, ``...q_proj.lora_A.default.weight``);
:func:`merged_state_dict` turns them back into the plain model's keys for the committed model.

A LoRA layer computes ``W x + (alpha / r) B A dropout(x)`` (Hu et al. 2021, eq. 3; ``alpha /
sqrt(r)`` with rsLoRA, Kalajdzievski 2023), ``A`` [r, in] Kaiming-uniform and ``B`` [out, r]
zero at initialisation, so a fresh adapter leaves the model's outputs unchanged: the policy
with its adapter disabled is the model it started from, which is how DPO, PPO and GRPO use it
as their reference (:func:`adapter_disabled`), as TRL does with ``PeftModel.disable_adapter``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from trainer_core.config import LoraConfig
from trainer_core.errors import ConfigError

ADAPTER_NAME = "default"
"""peft's adapter name; it appears in state-dict keys (``lora_A.default.weight``)."""

TRAINABLE_HEADS = ("score",)
"""Modules trained in full next to the adapters: a sequence-classification model's score head
(freshly initialised on the reward-model stage, so it must learn). PPO's value head sits
outside the causal LM (``PolicyAndValue``) and trains in full anyway."""


def default_target_modules(model: nn.Module) -> list[str]:
    """Names (last components) of the ``nn.Linear`` layers inside the model's transformer blocks.

    For Llama / Qwen2 / Mistral-style blocks: ``q_proj k_proj v_proj o_proj gate_proj up_proj
    down_proj``, the set peft's ``all-linear`` picks, found from the blocks rather than a table
    of architectures, and never the LM or score head.

    Raises:
        ConfigError: the model has no transformer blocks with linear layers.
    """
    from trainer_core.backends.memory import transformer_blocks

    names = sorted({
        name.rsplit(".", 1)[-1]
        for block in transformer_blocks(model)
        for name, module in block.named_modules()
        if isinstance(module, nn.Linear)
    })
    if not names:
        raise ConfigError(f"lora: no linear layers found in the transformer blocks of {type(model).__name__}; "
                          "set lora.target_modules")
    return names


def peft_config(cfg: LoraConfig, model: nn.Module):
    """The ``peft.LoraConfig`` of ``cfg`` for ``model`` (target modules resolved)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules or default_target_modules(model),
        use_rslora=cfg.use_rslora,
        bias="none",
    )


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place and freeze everything else; returns ``model``.

    Trainable afterwards: every ``lora_A`` / ``lora_B`` weight and the :data:`TRAINABLE_HEADS`.
    The ``A`` matrices are drawn after ``torch.manual_seed(seed)``, so every rank of a
    distributed stage builds the same adapter (FSDP2 shards each rank's copy).

    Args:
        model: a Hugging Face ``PreTrainedModel`` (causal LM or sequence classifier).
        cfg: the stage's resolved :class:`~trainer_core.config.LoraConfig` (``enabled``).
        seed: the pipeline seed.

    Raises:
        ConfigError: a target module matches no layer of the model.
    """
    from peft import inject_adapter_in_model

    config = peft_config(cfg, model)
    model.requires_grad_(False)
    torch.manual_seed(seed)
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as e:
        raise ConfigError(f"lora.target_modules={cfg.target_modules}: {str(e).splitlines()[0]}") from e
    for name, param in model.named_parameters():
        parts = name.split(".")
        param.requires_grad_(("lora_A" in parts or "lora_B" in parts) or parts[0] in TRAINABLE_HEADS)
    model.posttrain_lora = config  # read by merged_state_dict; not a module, never in a state dict
    return model


def has_lora(model: nn.Module) -> bool:
    """True when ``model`` (plain, DDP- or DeepSpeed-wrapped, or FSDP2-sharded) holds LoRA layers."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


@contextlib.contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[None]:
    """Inside the block, every LoRA layer of ``model`` computes its base layer only.

    What ``PeftModel.disable_adapter`` does (``BaseTunerLayer.enable_adapters``); the adapters'
    ``requires_grad`` is off inside and back on after. For gradient-free forwards (the reference).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merged_state_dict(model: nn.Module, state: dict[str, Tensor], copy: bool) -> dict[str, Tensor]:
    """The plain model's state dict, with every adapter merged: ``W' = W + scaling B A``.

    The merge is peft's own (``LoraLayer.merge``, then the layer replaced by its base layer, as
    ``LoraModel.merge_and_unload`` does), run on a copy of the architecture whose tensors are
    those of ``state``: a CPU state dict (``Backend.full_state_dict`` of a sharded model, or the
    state dict of a plain one) becomes the merged model without a second copy in memory.

    Args:
        model: the unwrapped model :func:`apply_lora` adapted (its config and class are read).
        state: its full state dict (peft's keys), on CPU or the model's device.
        copy: copy the tensors first (they are the live model's: the merge writes into ``W``).

    Returns:
        Plain Hugging Face keys (``...q_proj.weight``), tied weights under their first name only
        (as ``named_parameters`` lists them), on CPU.
    """
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    tensors = {k: (v.detach().to("cpu", copy=True) if copy else v.detach().to("cpu")) for k, v in state.items()}
    with torch.device("meta"):
        shell = type(model)(model.config)
    inject_adapter_in_model(model.posttrain_lora, shell, adapter_name=ADAPTER_NAME)
    shell.load_state_dict(tensors, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        shell.tie_weights()
    missing = [n for n, p in shell.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"merged_state_dict: the state dict lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name, module in list(shell.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge(safe_merge=False)
            parent_name, _, child = name.rpartition(".")
            setattr(shell.get_submodule(parent_name) if parent_name else shell, child, module.get_base_layer())
    names = {n for n, _ in shell.named_parameters()}
    return {
        k: v.detach()
        for k, v in shell.state_dict(keep_vars=True).items()
        if (k in names if isinstance(v, nn.Parameter) else not v.is_meta)
    }
