"""The short, typed run form of the Prefect UI: the settings people change between runs.

A deployment's Custom run form shows the flow's parameters. The full :class:`PipelineConfig`
(about 250 fields) makes a form of some twenty screens that opens on the class defaults, not on
the deployment's YAML; so deployments show :class:`RunSettings` instead: the stages, the model,
the data, the backend, and per stage its steps, learning rate and batch sizes. ``posttrain
deploy`` fills the deployment's ``settings`` parameter with the values of its YAML config
(:func:`settings_of`), so the form opens on the values a run will use, and a run applies them on
top of that YAML (:func:`settings_overrides`). Everything else goes through ``overrides``.

Descriptions are plain text (they render verbatim in both Prefect UIs): no markup, no angle
brackets.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trainer_core.config import PipelineConfig
from trainer_core.registry import STAGE_ORDER

StageName = Literal[STAGE_ORDER]  # type: ignore[valid-type]


def _described(path: str, title: str, **constraints: Any) -> Any:
    """A required field titled ``title``, described as :class:`PipelineConfig`'s field at ``path``."""
    model: Any = PipelineConfig
    *sections, name = path.split(".")
    for section in sections:
        model = model.model_fields[section].annotation
    return Field(title=title, description=model.model_fields[name].description, **constraints)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSettings(_Section):
    """The model every stage starts from."""

    model_config = ConfigDict(title="Model")

    name_or_path: str | None = Field(
        None,
        title="Model name or path",
        description="Hugging Face model id, local directory or fsspec URI of the base model. Empty: the config "
        "file's model (the demo builds a tiny Llama from the model.init settings).",
    )


class DataSettings(_Section):
    """Input data sets (JSONL or Parquet URIs, or hf:// dataset ids)."""

    model_config = ConfigDict(title="Data")

    sft_uri: str | None = Field(
        None, title="SFT data", description="SFT data URI. Empty: the config file's (the synthetic task if none)."
    )
    preference_uri: str | None = Field(
        None, title="Preference data",
        description="Preference pairs URI (chosen and rejected). Empty: the config file's (synthetic if none).",
    )


class BackendSettings(_Section):
    """How training stages run."""

    model_config = ConfigDict(title="Backend")

    name: Literal["single", "ddp", "fsdp2", "deepspeed"] = _described("backend.name", "Backend")
    device: Literal["auto", "cpu", "cuda"] = _described("backend.device", "Device")
    # The world size stays in overrides (backend.nproc_per_node): it is valid only with a
    # multi-process backend, and a form field must be editable on its own.


class SupervisedSettings(_Section):
    """An offline training stage (SFT, reward model, DPO)."""

    max_steps: int = _described("sft.max_steps", "Max steps", ge=1)
    learning_rate: float = _described("sft.learning_rate", "Learning rate", gt=0)
    micro_batch_size: int = _described("sft.micro_batch_size", "Micro-batch size", ge=1)
    grad_accum_steps: int = _described("sft.grad_accum_steps", "Gradient accumulation steps", ge=1)


class RLSettings(_Section):
    """An online RL stage (PPO, GRPO)."""

    max_steps: int = Field(title="Max steps", ge=1, description="Rollout-update iterations.")
    learning_rate: float = _described("ppo.learning_rate", "Learning rate", gt=0)
    prompts_per_rollout: int = _described("ppo.prompts_per_rollout", "Prompts per rollout", ge=1)


class EvaluateSettings(_Section):
    """The held-out evaluation."""

    model_config = ConfigDict(title="Evaluate")

    num_problems: int = _described("evaluate.num_problems", "Problems", ge=1)


def _titled(cls: type[_Section], name: str, title: str) -> type[_Section]:
    """A subclass ``name`` of ``cls`` whose form section reads ``title`` (one JSON-schema definition each)."""
    return type(name, (cls,), {"model_config": ConfigDict(title=title, extra="forbid"), "__module__": __name__})


SFTSettings = _titled(SupervisedSettings, "SFTSettings", "SFT")
RewardModelSettings = _titled(SupervisedSettings, "RewardModelSettings", "Reward model")
DPOSettings = _titled(SupervisedSettings, "DPOSettings", "DPO")
PPOSettings = _titled(RLSettings, "PPOSettings", "PPO")
GRPOSettings = _titled(RLSettings, "GRPOSettings", "GRPO")


class RunSettings(_Section):
    """The commonly changed settings of a run, applied on top of the config file.

    Every field sets one config key (SFT max steps sets sft.max_steps; a model name or path also
    clears model.init); an empty optional field keeps the file's value. Overrides apply after
    these. (This docstring is the form's description: plain text only.)
    """

    model_config = ConfigDict(title="Run settings", extra="forbid")

    stages: list[StageName] = Field(  # type: ignore[valid-type]
        title="Stages", description="Stages to run; they run in pipeline order whatever the order here."
    )
    seed: int = _described("seed", "Seed")
    model: ModelSettings = Field(default_factory=ModelSettings, title="Model")
    data: DataSettings = Field(default_factory=DataSettings, title="Data")
    backend: BackendSettings = Field(title="Backend")
    sft: SFTSettings = Field(title="SFT")  # type: ignore[valid-type]
    reward_model: RewardModelSettings = Field(title="Reward model")  # type: ignore[valid-type]
    dpo: DPOSettings = Field(title="DPO")  # type: ignore[valid-type]
    ppo: PPOSettings = Field(title="PPO")  # type: ignore[valid-type]
    grpo: GRPOSettings = Field(title="GRPO")  # type: ignore[valid-type]
    evaluate: EvaluateSettings = Field(title="Evaluate")


_STAGE_SECTIONS = ("sft", "reward_model", "dpo", "ppo", "grpo", "evaluate")
_DATA_KEYS = {"sft_uri": "data.sft.uri", "preference_uri": "data.preference.uri"}


def settings_of(config: PipelineConfig) -> RunSettings:
    """The settings ``config`` holds (what ``posttrain deploy`` puts in a deployment's form)."""
    data = config.model_dump(mode="json")
    sections = {
        name: {key: data[name][key] for key in RunSettings.model_fields[name].annotation.model_fields}
        for name in (*_STAGE_SECTIONS, "backend")
    }
    return RunSettings(
        stages=list(config.stages),
        seed=config.seed,
        model=ModelSettings(name_or_path=config.model.name_or_path),
        data=DataSettings(sft_uri=config.data.sft.uri, preference_uri=config.data.preference.uri),
        **sections,
    )


def settings_overrides(settings: RunSettings) -> dict[str, Any]:
    """``{key.path: value}`` overrides that give a config the values of ``settings``.

    Empty optional fields (model, data URIs) give no override: the file's value stays.
    """
    out: dict[str, Any] = {"stages": list(settings.stages), "seed": settings.seed}
    if settings.model.name_or_path:
        out.update({"model.name_or_path": settings.model.name_or_path, "model.init": None})
    for field, key in _DATA_KEYS.items():
        value = getattr(settings.data, field)
        if value:
            out[key] = value
    for name in (*_STAGE_SECTIONS, "backend"):
        for key, value in getattr(settings, name).model_dump(mode="json").items():
            out[f"{name}.{key}"] = value
    return out
