"""Build or load the models a stage trains or uses, and save them in Hugging Face format.

A model source is one of:
- ``"init"``: build from ``config.model.init`` (random weights; the tokenizer comes from
  ``prepare_data``), as the offline demo does;
- a fsspec URI of an HF-format directory (``s3://...``, ``file://``, ``memory://``),
  downloaded to a local cache first;
- a local directory, or a Hugging Face hub id (what a GPU worker loads by name).
All are loaded with the ``Auto*`` classes; ``trust_remote_code`` is off unless configured.
"""

from __future__ import annotations

import tempfile

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    PreTrainedTokenizerBase,
)

from trainer_core.config import ModelConfig
from trainer_core.errors import ConfigError
from trainer_core.registry import INIT_SOURCE

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def local_model_path(source: str) -> str:
    """A path or hub id ``from_pretrained`` accepts: fsspec URIs are materialised locally."""
    if "://" in source and not source.startswith("file://"):
        from trainer_core.storage import materialize

        return materialize(source)
    return source.removeprefix("file://")


def _init_config(model: ModelConfig, tokenizer: PreTrainedTokenizerBase, **extra) -> LlamaConfig:
    if model.init is None:
        raise ConfigError("model source 'init' needs model.init to be set")
    init = model.init
    return LlamaConfig(
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


def load_causal_lm(source: str, model: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> nn.Module:
    """A causal LM from ``source`` (see the module docstring).

    Args:
        source: ``"init"``, a URI, a local directory or a hub id.
        model: the pipeline's model config (dtype, init sizes, trust_remote_code).
        tokenizer: its vocabulary size sizes a model built from config.
        seed: seeds the random init of a model built from config.

    Raises:
        ConfigError: ``source`` is ``"init"`` without ``model.init``.
        OSError: the model cannot be found or read (from ``transformers``).
    """
    dtype = _DTYPES[model.dtype]
    if source == INIT_SOURCE:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(_init_config(model, tokenizer), dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(
        local_model_path(source), dtype=dtype, trust_remote_code=model.trust_remote_code
    )


def load_reward_model(
    source: str, model: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> nn.Module:
    """A sequence-classification model with one output (``num_labels=1``): the reward.

    From a causal-LM directory (the SFT output) the backbone is reused and the score head is
    freshly initialised (seeded); from a reward-model directory everything is loaded.

    Raises:
        ConfigError: ``source`` is ``"init"`` without ``model.init``.
        OSError: the model cannot be found or read.
    """
    dtype = _DTYPES[model.dtype]
    torch.manual_seed(seed)
    if source == INIT_SOURCE:
        config = _init_config(model, tokenizer, num_labels=1)
        return AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    path = local_model_path(source)
    config = AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code)
    config.num_labels = 1
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    return AutoModelForSequenceClassification.from_pretrained(
        path, config=config, dtype=dtype, trust_remote_code=model.trust_remote_code
    )


def save_pretrained_to(
    writer, model: nn.Module, tokenizer: PreTrainedTokenizerBase, prefix: str = "", state_dict: dict | None = None
) -> None:
    """Write ``model`` (safetensors) and ``tokenizer`` in HF format through an ``ArtifactWriter``.

    The files are staged in a local temp directory, then each is written (and hashed) by
    the writer; nothing is committed here. ``state_dict``: the consolidated weights of a
    sharded model (``Backend.full_state_dict``), saved with ``model``'s config.
    """
    with tempfile.TemporaryDirectory(prefix="posttrain-save-") as tmp:
        if state_dict is None:
            model.save_pretrained(tmp, safe_serialization=True)
        else:
            model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        writer.write_dir(tmp, prefix=prefix)


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (shared tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
