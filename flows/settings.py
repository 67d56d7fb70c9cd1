"""The short, typed run form of the Prefect UI: the settings people change between runs.

A deployment's Custom run form shows the flow's parameters. The full :class:`PipelineConfig`
(about 250 fields) makes a form of some twenty screens that opens on the class defaults, not on
the deployment's YAML; so deployments show :class:`RunSettings` instead: the stages, the model,
the data, the backend, and per stage its steps, learning rate and batch sizes. ``posttrain
deploy`` fills the deployment's ``settings`` parameter with the values of its YAML config
(:func:`settings_of`), so the form opens on the values a run will use, and a run applies them on
top of that YAML (:func:`settings_overrides`). Everything else goes through ``overrides``, a list
of ``key.path=value`` items (:func:`overrides_mapping`); :func:`resolve_config` makes the run's
config of the three, refusing an override that contradicts a field the form changed.

Descriptions are plain text (they render verbatim in both Prefect UIs): no markup, no angle
brackets.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from trainer_core.config import PipelineConfig, load_config, parse_override, resolve_local_root
from trainer_core.errors import ConfigError
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
        None,
        title="Preference data",
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


def _reveal(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, dict):
        return {k: _reveal(v) for k, v in value.items()}
    return value


def resolve_config(
    config: PipelineConfig | dict | None,
    config_uri: str | None,
    overrides: list[str] | dict[str, Any] | None,
    settings: RunSettings | dict | None = None,
) -> PipelineConfig:
    """``config`` (or the YAML at ``config_uri``, or defaults) with ``settings`` and then
    ``overrides`` applied, validated, with an absolute local storage root.

    A :class:`PipelineConfig` given without settings or overrides is used as it is (it is already
    valid); otherwise they are applied to its data and the result validated once.

    Args:
        config: A whole config (object or data), instead of ``config_uri``.
        config_uri: The YAML config file.
        overrides: ``key.path=value`` items (the value read as YAML, as ``posttrain run --set``)
            or a ``{key.path: value}`` mapping.
        settings: The run form's values (:class:`RunSettings`).

    Raises:
        ConfigError: unreadable YAML, bad settings, a bad override or a failed validation (names
            the field); an override of a key whose value the settings changed from the file's,
            to yet another value (two edits of one field: both are named; an override of a
            field the settings leave at the file's value simply applies).
    """
    overrides = overrides_mapping(overrides)
    if settings is not None:
        try:
            settings = RunSettings.model_validate(settings)
        except ValidationError as e:
            raise ConfigError(f"settings: {e}") from None
        from_settings = settings_overrides(settings)
        if overrides:
            refuse_conflicts(from_settings, overrides, _config_data(config, config_uri))
        overrides = {**from_settings, **overrides}
    if isinstance(config, PipelineConfig) and not overrides:
        return resolve_local_root(config)
    if config is not None:
        return resolve_local_root(load_config(base=_config_data(config, None), overrides=overrides))
    return resolve_local_root(load_config(config_uri, overrides=overrides))


def _config_data(config: PipelineConfig | dict | None, config_uri: str | None) -> dict[str, Any]:
    """The data of ``config``, else of the YAML at ``config_uri`` (defaults filled in when read)."""
    if isinstance(config, BaseModel):
        return _reveal(config.model_dump())
    if config is not None:
        return dict(config)
    return _reveal(load_config(config_uri).model_dump())


def overrides_mapping(overrides: list[str] | dict[str, Any] | None) -> dict[str, Any]:
    """``["key.path=value", ...]`` (values read as YAML) or a mapping, as ``{key.path: value}``.

    Raises:
        ConfigError: an item that is not ``key.path=value`` (named with its index).
    """
    if not overrides:
        return {}
    if isinstance(overrides, dict):
        return dict(overrides)
    out: dict[str, Any] = {}
    for i, item in enumerate(overrides):
        try:
            key, value = parse_override(str(item))
        except ConfigError as e:
            raise ConfigError(f"overrides[{i}]: {e}") from None
        out[key] = value
    return out


def override_items(overrides: dict[str, Any]) -> list[str]:
    """``{key.path: value}`` as the ``key.path=value`` items the run form edits (values as JSON,
    which :func:`overrides_mapping` reads back as YAML unchanged)."""
    return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]


def flat_overrides(overrides: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"sft": {"max_steps": 4}}`` and ``{"sft.max_steps": 4}`` alike as ``{"sft.max_steps": 4}``."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if isinstance(value, dict) and value:
            out.update(flat_overrides(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


_MISSING = object()


def _value_at(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return json.loads(json.dumps(node, default=str))


def refuse_conflicts(from_settings: dict[str, Any], overrides: dict[str, Any], file_data: dict[str, Any]) -> None:
    """Refuse an override of a key whose value the run settings changed from the config file's,
    to another value than the settings' (a field typed in the form, overridden again).

    Args:
        from_settings: :func:`~flows.settings.settings_overrides` of the run settings.
        overrides: The run's overrides, ``{key.path: value}``.
        file_data: The config the settings and overrides apply to, as data.

    Raises:
        ConfigError: naming each such key with both values.
    """
    flat = flat_overrides(overrides)
    clashes = [
        f"overrides sets {key}={flat[key]!r} but settings set it to {value!r} (the config file has "
        f"{_value_at(file_data, key)!r})"
        for key, value in from_settings.items()
        if key in flat and flat[key] != value and _value_at(file_data, key) != value
    ]
    if clashes:
        raise ConfigError("; ".join(clashes) + ": set each in one place (the form's field, or overrides)")
