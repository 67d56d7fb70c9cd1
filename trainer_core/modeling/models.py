"""Build or load the models a stage trains or uses, and save them in Hugging Face format.

A model source is one of:
- ``"init"``: build from ``config.model.init`` (random weights; the tokenizer comes from
  ``prepare_data``), as the offline demo does;
- a fsspec URI of an HF-format directory (``s3://...``, ``file://``, ``memory://``),
  downloaded to a local cache first;
- a local directory, or a Hugging Face hub id (what a GPU worker loads by name);
- any of these holding a PEFT adapter (a stage committed with ``lora.merge_on_commit: false``):
  its base model is loaded from the adapter's ``base_model_name_or_path`` and the adapter
  merged into it (:func:`adapter_source` tells a stage that continues the adapter instead).
All are loaded with the ``Auto*`` classes; ``trust_remote_code`` is off unless configured.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from trainer_core.config import ModelConfig
from trainer_core.errors import ConfigError
from trainer_core.modeling.forwards.rewards import IMPLICIT_REWARD_KEY
from trainer_core.modeling.lora import (
    ADAPTER_CONFIG,
    adapter_base_model,
    attach_adapter,
    is_adapter_dir,
    merge_adapters,
)
from trainer_core.registry import INIT_SOURCE
from trainer_core.storage import names_a_path

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def local_model_path(source: str) -> str:
    """A path or hub id ``from_pretrained`` accepts: fsspec URIs are materialised locally.

    Raises:
        ConfigError: ``source`` names a local path (absolute, ``./``, ``../``, ``~`` or
            ``file://``) that does not exist or holds no ``config.json``.
    """
    if "://" in source and not source.startswith("file://"):
        from trainer_core.storage import materialize

        return materialize(source)
    path = source.removeprefix("file://")
    if names_a_path(path):
        local = os.path.expanduser(path)
        if not os.path.isdir(local):
            raise ConfigError(
                f"model source {source!r}: no such directory (a local path, an fsspec URI of an HF "
                "model directory, or a hub id is expected)"
            )
        if not any(os.path.exists(os.path.join(local, f)) for f in ("config.json", ADAPTER_CONFIG)):
            raise ConfigError(
                f"model source {source!r} is not a Hugging Face model directory (no config.json) "
                f"nor a PEFT adapter ({ADAPTER_CONFIG})"
            )
        return local
    return path


def adapter_source(source: str) -> str | None:
    """The local directory of ``source`` when it holds a PEFT adapter (and no full model), else None.

    Raises:
        ConfigError: as :func:`local_model_path`.
    """
    if source == INIT_SOURCE:
        return None
    path = local_model_path(source)
    return path if os.path.isdir(path) and is_adapter_dir(path) else None


def _merged_adapter(load, source: str, *args, **kwargs) -> nn.Module | None:
    """``load``'s model of ``source`` when ``source`` is an adapter: its base loaded by ``load``
    (recursively), the adapter attached and merged. None when ``source`` is no adapter."""
    adapter = adapter_source(source)
    if adapter is None:
        return None
    return _trainable(
        merge_adapters(attach_adapter(load(adapter_base_model(adapter), *args, **kwargs), adapter, trainable=False))
    )


def _trainable(model: nn.Module) -> nn.Module:
    """``model`` with every floating-point parameter requiring grad again, as a freshly loaded
    model's do: attaching an adapter froze the base (peft's injection), and the merged model may
    be trained in full by the stage that loads it (a 4-bit base's packed weights stay frozen)."""
    for param in model.parameters():
        if param.is_floating_point():
            param.requires_grad_(True)
    return model


def from_pretrained_merged(auto_class, source: str, **kwargs) -> nn.Module:
    """``auto_class.from_pretrained(source, **kwargs)``, where an adapter ``source`` (see
    :func:`adapter_source`) is its base model's with the adapter merged: what the committed
    model of a ``lora.merge_on_commit: false`` stage is, as a plain model (MLflow logs this)."""
    adapter = adapter_source(source)
    if adapter is None:
        return auto_class.from_pretrained(local_model_path(source), **kwargs)
    base = from_pretrained_merged(auto_class, adapter_base_model(adapter), **kwargs)
    return merge_adapters(attach_adapter(base, adapter, trainable=False))


def _from_pretrained(load, source: str, model: ModelConfig, **kwargs) -> nn.Module:
    """``load(path, ...)`` with the errors of an unusable source made :class:`ConfigError` errors naming it."""
    path = local_model_path(source)
    try:
        return load(path, trust_remote_code=model.trust_remote_code, **kwargs)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise ConfigError(
                f"model source {source!r} needs code from its repository: set "
                "model.trust_remote_code: true if you trust it"
            ) from e
        if "Unrecognized model" in str(e):
            raise ConfigError(
                f"model source {source!r} is not a model transformers knows ({str(e).splitlines()[0]})"
            ) from e
        raise
    except OSError as e:
        if getattr(e, "errno", None) is not None:
            raise  # an I/O error (disk, network socket), not a missing model
        raise ConfigError(
            f"model source {source!r} cannot be loaded ({str(e).splitlines()[0]}); it must be a "
            "model directory (local or fsspec URI) or a hub id reachable from this machine"
        ) from e


def _attn(model: ModelConfig) -> dict[str, str]:
    """``attn_implementation`` for ``from_config`` / ``from_pretrained`` when configured."""
    return {} if model.attn_implementation is None else {"attn_implementation": model.attn_implementation}


def _init_config(model: ModelConfig, tokenizer: PreTrainedTokenizerBase, **extra) -> PretrainedConfig:
    """The transformers config of a model built from ``model.init``: a ``LlamaConfig``, or a
    ``MixtralConfig`` (``num_local_experts`` experts of ``intermediate_size`` per block, top
    ``num_experts_per_tok``)."""
    if model.init is None:
        raise ConfigError("model source 'init' needs model.init to be set")
    init = model.init
    if init.architecture == "mixtral":
        config_class = MixtralConfig
        extra = {"num_local_experts": init.experts, "num_experts_per_tok": init.experts_per_token, **extra}
    else:
        config_class = LlamaConfig
    return config_class(
        vocab_size=len(tokenizer),
        hidden_size=init.hidden_size,
        intermediate_size=init.intermediate_size,
        num_hidden_layers=init.num_hidden_layers,
        num_attention_heads=init.num_attention_heads,
        num_key_value_heads=init.num_key_value_heads,
        max_position_embeddings=init.max_position_embeddings,
        rope_theta=init.rope_theta,
        tie_word_embeddings=init.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **extra,
    )


def _quantized(source: str, quantization_config) -> dict:
    """``from_pretrained`` arguments for a quantized load (QLoRA's base); none without one."""
    if quantization_config is None:
        return {}
    if source == INIT_SOURCE:
        raise ConfigError("lora.quantize loads pretrained weights in 4-bit; a model built from config (init) has none")
    return {"quantization_config": quantization_config}


def load_causal_lm(
    source: str, model: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int, quantization_config: Any = None
) -> nn.Module:
    """A causal LM from ``source`` (see the module docstring).

    Args:
        source: ``"init"``, a URI, a local directory or a hub id (of a model or an adapter).
        model: the pipeline's model config (dtype, init sizes, trust_remote_code).
        tokenizer: its vocabulary size sizes a model built from config.
        seed: seeds the random init of a model built from config.
        quantization_config: a ``transformers`` quantization config (QLoRA's 4-bit base), or None.

    Raises:
        ConfigError: ``source`` is ``"init"`` without ``model.init``; a local source that does
            not exist or is no model directory; a hub id that cannot be loaded; a model that
            needs remote code without ``model.trust_remote_code``.
    """
    merged = _merged_adapter(load_causal_lm, source, model, tokenizer, seed, quantization_config)
    if merged is not None:
        return merged
    dtype = _DTYPES[model.dtype]
    quantized = _quantized(source, quantization_config)
    if source == INIT_SOURCE:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(_init_config(model, tokenizer), dtype=dtype, **_attn(model))
    return _from_pretrained(
        AutoModelForCausalLM.from_pretrained, source, model, dtype=dtype, **_attn(model), **quantized
    )


def load_reward_model(
    source: str, model: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int, quantization_config: Any = None
) -> nn.Module:
    """A sequence-classification model with one output (``num_labels=1``): the reward; or, from
    the directory of an implicit reward model (a causal LM whose config carries
    :data:`~trainer_core.modeling.forwards.rewards.IMPLICIT_REWARD_KEY`), that causal LM.

    From a causal-LM directory (the SFT output) the backbone is reused and the score head is
    freshly initialised (seeded); from a reward-model directory everything is loaded.

    Raises:
        ConfigError: as :func:`load_causal_lm`.
    """
    merged = _merged_adapter(load_reward_model, source, model, tokenizer, seed, quantization_config)
    if merged is not None:
        return merged
    dtype = _DTYPES[model.dtype]
    quantized = _quantized(source, quantization_config)
    torch.manual_seed(seed)
    if source == INIT_SOURCE:
        config = _init_config(model, tokenizer, num_labels=1)
        return AutoModelForSequenceClassification.from_config(config, dtype=dtype, **_attn(model))
    config = _from_pretrained(AutoConfig.from_pretrained, source, model)
    if getattr(config, IMPLICIT_REWARD_KEY, None) is not None:
        return load_causal_lm(source, model, tokenizer, seed, quantization_config)
    config.num_labels = 1
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    with _quiet_load_report():  # its table of the head's missing weights: said below in one line
        reward, info = _from_pretrained(
            AutoModelForSequenceClassification.from_pretrained,
            source,
            model,
            config=config,
            dtype=dtype,
            **_attn(model),
            **quantized,
            output_loading_info=True,
        )
    missing = sorted(info.get("missing_keys") or [])
    head = [k for k in missing if k.split(".", 1)[0] in ("score", "classifier")]
    if head:
        log.info("reward model from %s: score head %s initialised (seed %d); the backbone loaded", source, head, seed)
    if len(head) < len(missing):
        log.warning(
            "reward model from %s: weights not in the checkpoint, initialised: %s",
            source,
            [k for k in missing if k not in head],
        )
    return reward


@contextlib.contextmanager
def _quiet_load_report() -> Iterator[None]:
    """transformers' loggers at ERROR for the duration: its load report (a table logged as a
    warning whenever a weight is missing) is expected for a new reward head."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def save_pretrained_to(
    writer, model: nn.Module, tokenizer: PreTrainedTokenizerBase, prefix: str = "", state_dict: dict | None = None
) -> None:
    """Write ``model`` (safetensors) and ``tokenizer`` in HF format through an ``ArtifactWriter``.

    The files are staged in a local temp directory, then each is written (and hashed) by
    the writer; nothing is committed here. ``state_dict``: the consolidated weights of a
    sharded model (``Backend.full_state_dict``) or the merged weights of a LoRA/QLoRA model, saved
    with ``model``'s config (a quantized model's without its ``quantization_config``).
    """
    if state_dict is not None and getattr(model, "hf_quantizer", None) is not None:
        model = dense_shell(model)  # a QLoRA base's merged (dense) weights, saved as a plain model
    with tempfile.TemporaryDirectory(prefix="posttrain-save-") as tmp, without_absent_integrations():
        if state_dict is None:
            model.save_pretrained(tmp, safe_serialization=True)
        else:
            model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        writer.write_dir(tmp, prefix=prefix)


@contextlib.contextmanager
def without_absent_integrations() -> Iterator[None]:
    """While a plain model is saved, the library checks for integrations this process never
    imported answer "not this model" without importing them: accelerate's ``unwrap_model``
    (inside ``save_pretrained``) imports ``deepspeed`` only to test ``isinstance(model,
    DeepSpeedEngine)``, and MLflow's ``transformers.save_model`` imports ``peft`` only to test
    ``isinstance(model, PeftModel)``; neither can hold for a model of a process that never
    imported the package, and the imports (DeepSpeed with MLflow's autotuner, peft with
    bitsandbytes where installed) cost seconds in every stage process that commits a model."""
    checks = [("accelerate.utils.other", "is_deepspeed_available", "deepspeed", lambda: False)]
    checks += [
        (f"mlflow.transformers{sub}", "is_peft_model", "peft", lambda model: False)  # each import of it
        for sub in ("", ".flavor_config", ".model_io")
    ]
    restore = []
    for module_name, attr, package, stand_in in checks:
        module = sys.modules.get(module_name)
        if package in sys.modules or module is None or not hasattr(module, attr):
            continue
        restore.append((module, attr, getattr(module, attr)))
        setattr(module, attr, stand_in)
    try:
        yield
    finally:
        for module, attr, original in restore:
            setattr(module, attr, original)


def dense_shell(model: nn.Module) -> nn.Module:
    """``model``'s architecture on the meta device, from a copy of its config without
    ``quantization_config``: what saves a quantized model's dense (dequantized, merged) state
    dict as a plain model that loads without bitsandbytes."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        return type(model)(config)


def save_tokenizer_to(writer, tokenizer: PreTrainedTokenizerBase, prefix: str = "") -> None:
    """Write ``tokenizer``'s files in HF format through an ``ArtifactWriter`` (nothing committed)."""
    with tempfile.TemporaryDirectory(prefix="posttrain-save-") as tmp:
        tokenizer.save_pretrained(tmp)
        writer.write_dir(tmp, prefix=prefix)


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (shared tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
