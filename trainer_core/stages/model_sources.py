"""Where a stage's models come from: each input role loaded (``load_causal_lm`` /
``load_reward_model``, seeded by the pipeline seed), the trained model's LoRA adapters (new, or
the input's own continued), QLoRA's 4-bit base, whether the reference is the policy with its
adapter disabled, and which base an adapter commit names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

from torch import nn
from transformers import PreTrainedTokenizerBase

from trainer_core.config import LoraConfig, PipelineConfig
from trainer_core.errors import ConfigError
from trainer_core.modeling.lora import adapter_base_model, apply_lora, attach_adapter, check_continued, peft_config
from trainer_core.modeling.models import adapter_source, load_causal_lm, load_reward_model
from trainer_core.registry import INIT_SOURCE
from trainer_core.spec import StageSpec

log = logging.getLogger(__name__)


@dataclass
class ModelSources:
    """The models of one stage, from its spec's inputs.

    Attributes:
        spec: the stage spec (its ``inputs``: role -> URI, and the pipeline config).
        tokenizer: the pipeline's tokenizer, given to the loaders (None: a model's own).
    """

    spec: StageSpec
    tokenizer: PreTrainedTokenizerBase | None

    @property
    def config(self) -> PipelineConfig:
        """The pipeline config."""
        return self.spec.config

    def input(self, role: str) -> str:
        """The URI of input ``role``.

        Raises:
            ConfigError: the spec has no such input (a stage it needs was not run).
        """
        try:
            return self.spec.inputs[role]
        except KeyError:
            raise ConfigError(
                f"stage {self.spec.stage!r} needs input {role!r}; spec inputs: {sorted(self.spec.inputs)}"
            ) from None

    @property
    def lora(self) -> LoraConfig:
        """The stage's resolved LoRA settings (``PipelineConfig.lora_for``)."""
        return self.config.lora_for(self.spec.stage)

    @cached_property
    def input_adapter(self) -> str | None:
        """The local directory of the input ``model`` when it was committed as a PEFT adapter
        (``models.adapter_source``; materialised once), else None."""
        return adapter_source(self.input("model"))

    @property
    def continues_adapter(self) -> bool:
        """True when the trained model continues the adapter its input was committed as
        (``lora.continue_adapter`` and the input ``model`` is a PEFT adapter)."""
        return self.lora.enabled and self.lora.continue_adapter and self.input_adapter is not None

    @property
    def reference_is_disabled_adapter(self) -> bool:
        """True when the stage's reference is its policy with the adapter disabled: LoRA on,
        ``lora.reference_model: disabled_adapter``, the policy starts from the reference's
        weights (inputs ``model`` and ``reference`` are one source) and its adapter is new (a
        continued adapter, disabled, would leave the base, not the input model)."""
        inputs = self.spec.inputs
        return (
            self.lora.enabled
            and self.lora.reference_model == "disabled_adapter"
            and "reference" in inputs
            and inputs.get("model") == inputs["reference"]
            and not self.continues_adapter
        )

    def causal_lm(self, role: str) -> nn.Module:
        """The causal LM of input ``role`` (``load_causal_lm``; seeded by the pipeline seed).

        The trained model (role ``model``) gets LoRA adapters when the stage's ``lora`` is
        enabled: new ones, or the input's own adapter with ``lora.continue_adapter``.

        Raises:
            ConfigError: the input is missing or cannot be loaded (the message names the stage,
                the role and the source).
        """
        return self._load(load_causal_lm, role)

    def reward_model(self, role: str = "reward_model") -> nn.Module:
        """The reward model of input ``role`` (``load_reward_model``). Raises as :meth:`causal_lm`."""
        return self._load(load_reward_model, role)

    def _load(self, load, role: str) -> nn.Module:
        source = self.input(role)
        lora = self.lora if role == "model" else LoraConfig()
        try:
            upstream = self.input_adapter if role == "model" and self.continues_adapter else None
            base = adapter_base_model(upstream) if upstream is not None else source
            if lora.enabled and lora.quantize is not None:
                model = self._load_quantized(load, base)
            else:
                model = load(base, self.config.model, self.tokenizer, self.config.seed)
            if not lora.enabled:
                return model
            if upstream is None:
                return apply_lora(model, lora, self.config.seed)
            wanted = peft_config(lora, model)
            attach_adapter(model, upstream, trainable=True, seed=self.config.seed)
            check_continued(wanted, model.posttrain_lora, source)
            log.info("continuing the adapter of %s (base %s)", source, base)
            return model
        except ConfigError as e:
            raise ConfigError(f"stage {self.spec.stage}, input {role!r}: {e}") from e

    def adapter_base(self) -> str:
        """The plain model this stage's adapter applies to, as committed with
        ``lora.merge_on_commit: false``: the continued adapter's base, or the input ``model``
        when it is a plain model loaded by URI or hub id; "" when the stage must commit the base
        itself (a model built from config, or an upstream adapter merged into its base)."""
        if self.input_adapter is not None:
            return adapter_base_model(self.input_adapter) if self.continues_adapter else ""
        source = self.input("model")
        return "" if source == INIT_SOURCE else source

    def _load_quantized(self, load, source: str) -> nn.Module:
        """QLoRA's base: ``source`` loaded in 4-bit NF4 (bitsandbytes), ready for k-bit training, on
        the stage's device (bitsandbytes >= 0.48 has NF4 kernels for CPU as well as CUDA)."""
        try:
            import bitsandbytes  # noqa: F401
            from transformers import BitsAndBytesConfig
        except ImportError as e:
            raise ConfigError(f"lora.quantize=4bit needs the bitsandbytes package ({e})") from e
        import torch
        from peft import prepare_model_for_kbit_training

        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = load(source, self.config.model, self.tokenizer, self.config.seed, quantization_config=quantization)
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
