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
import sys
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from trainer_core.config import LoraConfig
from trainer_core.errors import ConfigError
from trainer_core.modeling.architecture import transformer_blocks

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
    names = sorted(
        {
            name.rsplit(".", 1)[-1]
            for block in transformer_blocks(model)
            for name, module in block.named_modules()
            if isinstance(module, nn.Linear)
        }
    )
    if not names:
        raise ConfigError(
            f"lora: no linear layers found in the transformer blocks of {type(model).__name__}; set lora.target_modules"
        )
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
    torch.manual_seed(seed)
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as e:
        raise ConfigError(f"lora.target_modules={cfg.target_modules}: {str(e).splitlines()[0]}") from e
    train_adapters_only(model)
    model.posttrain_lora = config  # read by merged_state_dict; not a module, never in a state dict
    return model


def has_lora(model: nn.Module) -> bool:
    """True when ``model`` (plain, DDP- or DeepSpeed-wrapped, or FSDP2-sharded) holds LoRA layers.

    A model holding peft's layers was built by peft, so where peft is not imported yet the answer
    is False without importing it (seconds: peft imports bitsandbytes where installed)."""
    if "peft" not in sys.modules:
        return False
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


def merge_adapters(model: nn.Module) -> nn.Module:
    """Merge every LoRA layer of ``model`` into its base layer and remove it, in place.

    peft's ``LoraLayer.merge`` (``W' = W + scaling B A``), then the layer replaced by its base
    layer, as ``LoraModel.merge_and_unload`` does; returns ``model``, a plain HF model again.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge(safe_merge=False)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.get_base_layer())
    if hasattr(model, "posttrain_lora"):
        del model.posttrain_lora
    return model


def merged_state_dict(model: nn.Module, state: dict[str, Tensor], copy: bool) -> dict[str, Tensor]:
    """The plain model's state dict, with every adapter merged: ``W' = W + scaling B A``.

    The merge is peft's own (:func:`merge_adapters`), run on a copy of the architecture whose
    tensors are those of ``state``: a CPU state dict (``Backend.full_state_dict`` of a sharded
    model, or the state dict of a plain one) becomes the merged model without a second copy in
    memory.

    Args:
        model: the unwrapped model :func:`apply_lora` adapted (its config and class are read).
        state: its full state dict (peft's keys), on CPU or the model's device; a QLoRA base's
            4-bit weights are dequantized first (:func:`dequantized_state_dict`).
        copy: copy the tensors first (they are the live model's: the merge writes into ``W``).

    Returns:
        Plain Hugging Face keys (``...q_proj.weight``), tied weights under their first name only
        (as ``named_parameters`` lists them), on CPU.
    """
    from peft import inject_adapter_in_model

    state = dequantized_state_dict(model, state)
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
    merge_adapters(shell)
    return plain_state_dict(shell)


def dequantized_state_dict(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with each 4-bit base weight of ``model`` (a bitsandbytes ``Linear4bit``: QLoRA's
    NF4 base) replaced by its dense value and its quantization-state entries (``.absmax``,
    ``.quant_map``, ``.nested_*``, ``.quant_state.*``) dropped; ``state`` itself when ``model``
    holds none.

    The dense value is ``bitsandbytes.functional.dequantize_4bit`` of the packed weight (uint8
    ``[out * in / 2, 1]``), in the dtype it was quantized from (``quant_state.dtype``, e.g.
    bf16), shape ``[out, in]``: the weight the adapter was trained against, so the merge
    ``dequant(W) + scaling B A`` is the function the stage trained (as peft's own
    ``Linear4bit.merge`` computes it before re-quantizing, which a dense commit skips).
    """
    bnb = sys.modules.get("bitsandbytes")  # loaded by any model holding Linear4bit layers
    if bnb is None:
        return state
    out = dict(state)
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            key = f"{name}.weight"
            for extra in [k for k in out if k.startswith(key + ".")]:
                del out[extra]
            weight = module.weight
            out[key] = bnb.functional.dequantize_4bit(weight.data, weight.quant_state).to(weight.quant_state.dtype)
    return out


def plain_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with tied weights under their first name only and no meta buffers."""
    names = {n for n, _ in model.named_parameters()}
    return {
        k: v.detach()
        for k, v in model.state_dict(keep_vars=True).items()
        if (k in names if isinstance(v, nn.Parameter) else not v.is_meta)
    }


# --- Adapters committed in PEFT's format (lora.merge_on_commit: false) ---------------------------

ADAPTER_CONFIG = "adapter_config.json"
"""peft's adapter config file; a committed directory holding it (and no ``config.json``) is an adapter."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""peft's adapter weights file."""
_PEFT_PREFIX = "base_model.model."
"""Key prefix of peft's saved adapter weights (``PeftModel`` -> ``LoraModel`` -> the HF model)."""


def is_adapter(key: str) -> bool:
    """True for the state-dict keys (or parameter names) of the adapters: ``lora_A`` / ``lora_B``."""
    parts = key.split(".")
    return "lora_A" in parts or "lora_B" in parts


def is_trained(key: str) -> bool:
    """True for the state-dict keys LoRA trains: the adapters and the :data:`TRAINABLE_HEADS`."""
    return is_adapter(key) or key.split(".", 1)[0] in TRAINABLE_HEADS


def train_adapters_only(model: nn.Module) -> None:
    """Make the adapters and the :data:`TRAINABLE_HEADS` of ``model`` trainable, freeze the rest."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_trained(name))


def adapter_files(model: nn.Module, state: dict[str, Tensor], base_model: str) -> dict[str, bytes]:
    """The adapter of ``model`` in PEFT's format: ``adapter_config.json`` and
    ``adapter_model.safetensors``, the files ``PeftModel.save_pretrained`` writes.

    The weights are the adapters (``...q_proj.lora_A.weight``) and the trained heads (a reward
    model's ``score``, saved as peft saves ``modules_to_save``), keyed as peft keys them
    (``base_model.model.`` prefix, no adapter name); ``PeftModel.from_pretrained(base, dir)``
    and :func:`attach_adapter` load them.

    Args:
        model: the unwrapped model :func:`apply_lora` adapted.
        state: its full state dict (peft's live keys), on any device.
        base_model: the plain model the adapter applies to (``base_model_name_or_path``): a
            URI, a local directory or a hub id.
    """
    import json

    import safetensors.torch

    weights = {
        _PEFT_PREFIX + k.replace(f".{ADAPTER_NAME}.", "."): v.detach().to("cpu").contiguous()
        for k, v in state.items()
        if is_trained(k)
    }
    config = model.posttrain_lora.to_dict()
    classifier = "score" in dict(model.named_children())
    config.update(
        base_model_name_or_path=base_model,
        task_type="SEQ_CLS" if classifier else "CAUSAL_LM",
        modules_to_save=list(TRAINABLE_HEADS) if classifier else None,
        target_modules=sorted(config["target_modules"]),
        inference_mode=True,
    )
    return {
        ADAPTER_CONFIG: json.dumps(config, indent=2, sort_keys=True, default=list).encode(),
        ADAPTER_WEIGHTS: safetensors.torch.save(weights, metadata={"format": "pt"}),
    }


def base_state_dict(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The plain model under the adapters of ``state`` (peft's live keys): the adapters dropped,
    ``...q_proj.base_layer.weight`` renamed ``...q_proj.weight``, tensors shared under two names
    (tied embeddings) kept under the first; on CPU."""
    out: dict[str, Tensor] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for key, value in state.items():
        if is_adapter(key):
            continue
        if value.device.type != "meta" and value.numel():
            shared = (value.data_ptr(), tuple(value.shape))
            if shared in seen:
                continue
            seen.add(shared)
        out[key.replace(".base_layer.", ".")] = value.detach().to("cpu")
    return out


def is_adapter_dir(path: str) -> bool:
    """True when the local directory ``path`` holds a PEFT adapter and no full model."""
    import os

    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG)) and not os.path.isfile(os.path.join(path, "config.json"))


def adapter_base_model(path: str) -> str:
    """The ``base_model_name_or_path`` of the adapter in the local directory ``path``.

    Raises:
        ConfigError: the adapter config names no base model.
    """
    import json
    import os

    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ConfigError(
            f"{os.path.join(path, ADAPTER_CONFIG)}: no base_model_name_or_path; the adapter's base model is unknown"
        )
    return base


def _live_names(saved: dict[str, Tensor]) -> dict[str, Tensor]:
    """A PEFT adapter file's tensors under the names they have in a model the adapter is injected
    into (``base_model.model.`` dropped, ``lora_A.weight`` -> ``lora_A.<adapter>.weight``)."""
    live = {}
    for key, value in saved.items():
        name = key.removeprefix(_PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.weight", f".{part}.{ADAPTER_NAME}.weight")
        live[name] = value
    return live


def attach_adapter(model: nn.Module, path: str, trainable: bool, seed: int = 0) -> nn.Module:
    """Inject the adapter saved in the local directory ``path`` (PEFT format) into the plain
    ``model`` and load its weights; returns ``model``.

    With ``trainable``, the adapters and heads train and everything else is frozen, as after
    :func:`apply_lora` (a stage continuing an upstream adapter); otherwise the model is left
    for :func:`merge_adapters`.

    Raises:
        ConfigError: the adapter's weights and the model disagree (an adapter tensor missing
            from the file, a tensor of the file the model lacks, or a shape mismatch); the
            message names the file.
    """
    import json
    import os

    import safetensors.torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        saved = json.load(f)
    fields = set(PeftLoraConfig.__dataclass_fields__)
    config = PeftLoraConfig(
        **{
            k: v
            for k, v in saved.items()
            if k in fields
            and k
            not in (
                "task_type",
                "modules_to_save",
                "base_model_name_or_path",
                "inference_mode",
                "peft_type",
                "revision",
            )
        }
    )
    torch.manual_seed(seed)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    model.posttrain_lora = config
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    live = _live_names(safetensors.torch.load_file(weights_path))
    own = dict(model.named_parameters())
    adapters = {n for n in own if is_adapter(n)}
    missing, unexpected = sorted(adapters - set(live)), sorted(set(live) - set(own))
    wrong = sorted(n for n in set(live) & set(own) if own[n].shape != live[n].shape)
    if missing or unexpected or wrong:
        raise ConfigError(
            f"{weights_path}: the adapter does not fit the model (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}, wrong shape {wrong[:3]})"
        )
    with torch.no_grad():
        for name, value in live.items():
            own[name].copy_(value.to(own[name].dtype))
    if trainable:
        train_adapters_only(model)
    else:
        model.requires_grad_(False)
    return model


def check_continued(wanted, saved, path: str) -> None:
    """Refuse to continue the adapter in ``path`` when the stage's ``lora`` settings describe
    another one (rank, alpha, rsLoRA, target modules): the stage fingerprint would lie.

    Args:
        wanted: the stage's ``peft.LoraConfig`` (:func:`peft_config` of the plain model).
        saved: the adapter's (``model.posttrain_lora`` after :func:`attach_adapter`).
        path: the adapter's directory (named in the error).

    Raises:
        ConfigError: naming each setting that differs, with both values.
    """
    diffs = [
        f"{name}: stage {a!r}, adapter {b!r}"
        for name, a, b in (
            ("rank", wanted.r, saved.r),
            ("alpha", wanted.lora_alpha, saved.lora_alpha),
            ("use_rslora", wanted.use_rslora, saved.use_rslora),
            ("target_modules", sorted(wanted.target_modules), sorted(saved.target_modules)),
        )
        if a != b
    ]
    if diffs:
        raise ConfigError(
            f"lora.continue_adapter: the upstream adapter {path} differs from this stage's lora "
            f"settings ({'; '.join(diffs)}); set them to the adapter's or start a new adapter"
        )
