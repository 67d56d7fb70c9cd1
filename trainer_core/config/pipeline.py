"""The whole pipeline's config (:class:`PipelineConfig`), and loading it from YAML plus overrides.

One :class:`PipelineConfig` holds the stage list and every hyper-parameter. Each field has a
description: they become the CLI help and the Prefect UI form. YAML files select and
override; ``--set key.path=value`` overrides one leaf (see :func:`apply_overrides`). Which
stages exist, and which of them train, comes from the stage registry
(:mod:`trainer_core.registry`).
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_core import to_jsonable_python

from trainer_core.config.backend import BackendConfig
from trainer_core.config.base import ConfigBase, Neutral
from trainer_core.config.distill import DistillConfig, TeacherConfig, teacher_init_problem
from trainer_core.config.generation import engine_problem
from trainer_core.config.run_ids import MAX_NAME_CHARS, check_name
from trainer_core.config.sections import (
    DataConfig,
    LaunchConfig,
    LoraConfig,
    ModelConfig,
    ModelInit,
    StorageConfig,
    SweepConfig,
    TokenizerConfig,
    TrackingConfig,
)
from trainer_core.config.evaluation import EvaluateConfig, ScoreConfig
from trainer_core.config.stages import (
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    PPOConfig,
    PretrainConfig,
    RewardModelConfig,
    RLStageConfig,
    SFTConfig,
    TrainStageConfig,
    implicit_reward_problem,
)
from trainer_core.errors import ConfigError
from trainer_core.registry import (
    DEFAULT_STAGES,
    EVALUATED_METRICS,
    INIT_SOURCE,
    STAGE_ORDER,
    TRAINING_STAGES,
    get_stage,
)

MAX_SEED = 2**32 - 1
"""The largest ``seed``: numpy's limit (``np.random.seed``, which lm-evaluation-harness calls with
it), the tightest of its consumers; torch takes up to 2**64 - 1 and ``random`` any int. Seeds
derived from it stay in torch's range: ``seed + epoch``, ``seed + 1``, and an RL rank's sampler
``seed + 1_000_003 * rank`` (below 2**64 for any rank under 10**13)."""


class PipelineConfig(ConfigBase):
    """The whole pipeline: stage list, data, model, and every stage's hyper-parameters."""

    name: str = Field(
        "posttrain",
        description="Pipeline name: run ids are made of it (<name>-<YYYYmmdd-HHMMSS>-<6 hex>), so it "
        f"takes 1 to {MAX_NAME_CHARS} ASCII letters, digits and ._-, starting with a letter or digit.",
    )
    seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description="Global seed: data split, shuffling, init, sampling. At most 2**32 - 1 "
        "(numpy's seed range: lm-evaluation-harness seeds numpy with it).",
    )
    stages: list[str] = Field(
        default_factory=lambda: list(DEFAULT_STAGES),
        description="Stages to run, in pipeline order: "
        + ", ".join(STAGE_ORDER)
        + " (default: all but "
        + ", ".join(s for s in STAGE_ORDER if s not in DEFAULT_STAGES)
        + ").",
    )
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Output storage.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    data: DataConfig = Field(default_factory=DataConfig, description="Input data.")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer training.")
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(init=ModelInit()), description="Base model.")
    backend: BackendConfig = Field(default_factory=BackendConfig, description="Training backend.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="Stage task launching and retries.")
    lora: LoraConfig = Field(
        default_factory=LoraConfig, description="LoRA adapters for every training stage (a stage's `lora` overrides)."
    )
    pretrain: Annotated[PretrainConfig, Neutral(None)] = Field(
        default_factory=PretrainConfig, description="Continued-pretraining stage."
    )
    sft: SFTConfig = Field(default_factory=SFTConfig, description="SFT stage.")
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig, description="Reward model stage.")
    score: ScoreConfig = Field(default_factory=ScoreConfig, description="Scoring stage.")
    dpo: DPOConfig = Field(default_factory=DPOConfig, description="DPO stage.")
    kto: Annotated[KTOConfig, Neutral(None)] = Field(default_factory=KTOConfig, description="KTO stage.")
    ppo: PPOConfig = Field(default_factory=PPOConfig, description="PPO stage.")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="GRPO stage.")
    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="SFT of a distillation teacher.")
    distill: DistillConfig = Field(default_factory=DistillConfig, description="On-policy distillation stage.")
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig, description="Evaluation stage.")
    sweep: SweepConfig = Field(default_factory=SweepConfig, description="A grid of recipes (posttrain sweep).")

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        return check_name(name)

    @field_validator("stages", mode="before")
    @classmethod
    def _split_stages(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [s.strip() for s in value.split(",") if s.strip()]
        return value

    @field_validator("stages")
    @classmethod
    def _check_stages(cls, value: list[str]) -> list[str]:
        unknown = [s for s in value if s not in STAGE_ORDER]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; known stages: {list(STAGE_ORDER)}")
        if len(set(value)) != len(value):
            raise ValueError(f"duplicate stage in {value}")
        if not value:
            raise ValueError("at least one stage is required")
        return sorted(value, key=STAGE_ORDER.index)

    def section(self, stage: str) -> BaseModel:
        """The config section of ``stage`` (``data`` for prepare_data; see the stage registry).

        Raises:
            ConfigError: unknown stage.
        """
        return getattr(self, get_stage(stage).section)

    @model_validator(mode="after")
    def _check_stage_backends(self) -> PipelineConfig:
        for stage in TRAINING_STAGES:
            backend, section = self.backend_for(stage), self.section(stage)
            try:
                if isinstance(section, TrainStageConfig):  # the supervised loop's batches
                    section.accum_steps(backend.world_size)
            except ConfigError as e:
                raise ValueError(f"{stage}: {e}") from None
            if backend.name == "deepspeed" and section.max_nonfinite_steps:
                raise ValueError(
                    f"{stage}.max_nonfinite_steps={section.max_nonfinite_steps}: skipping non-finite steps needs a "
                    "backend whose optimizer step posttrain runs (single, ddp, fsdp2); DeepSpeed's engine steps itself"
                )
            if backend.name == "deepspeed" and isinstance(section, RLStageConfig) and section.padding_free:
                raise ValueError(
                    f"{stage}.padding_free is not supported with backend.name=deepspeed yet: a 2-rank ZeRO-3 distill "
                    "run gave non-finite advantages with it (use fsdp2, ddp or single)"
                )
            lora = self.lora_for(stage)
            if lora.enabled and lora.quantize is not None and backend.name != "single":
                raise ValueError(
                    f"{stage}.lora.quantize={lora.quantize}: QLoRA's 4-bit base (bitsandbytes NF4) runs on the single "
                    f"backend; this stage runs on backend {backend.name!r}"
                )
        return self

    @model_validator(mode="after")
    def _check_rl_stages(self) -> PipelineConfig:
        """The RL loop's refusals (``check_rl_config``, the engine check) at load, for the RL stages
        this run trains: a sampling temperature, equal prompt shares per rank, enough sequences
        for the mini-batches, and ``hf`` generation under a sharded policy (FSDP2, ZeRO-3)."""
        for stage in TRAINING_STAGES:
            section = self.section(stage)
            if stage not in self.stages or not isinstance(section, RLStageConfig):
                continue
            backend = self.backend_for(stage)
            sharded = backend.name == "fsdp2" or (backend.name == "deepspeed" and backend.zero_stage == 3)
            problem = rl_config_problem(
                stage, section, section.samples_per_prompt_of_rollout, backend.world_size
            ) or engine_problem(f"{stage}.generation", section.generation.engine, backend.name, sharded)
            if problem:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_stage_models(self) -> PipelineConfig:
        """The stages' refusals of a model setting that the config alone decides, at load for the
        stages this run trains (each stage raises the same message when it runs): an implicit
        reward model with LoRA; ``teacher.model_init`` for a teacher that is loaded."""
        problems = []
        if "reward_model" in self.stages:
            problems.append(implicit_reward_problem(self.reward_model, self.lora_for("reward_model").enabled))
        if "teacher" in self.stages:  # the teacher's input model, as the registry gives it
            problems.append(
                teacher_init_problem(self.teacher, self.teacher.init_from or self.model.name_or_path or INIT_SOURCE)
            )
        for problem in problems:
            if problem:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_stage_data(self) -> PipelineConfig:
        for stage in ("kto", "pretrain"):
            if stage in self.stages and getattr(self.data, stage) is None:
                raise ValueError(
                    f"stage {stage!r} reads data.{stage}, which is not set: give data.{stage} a source "
                    f"(uri null: the synthetic task)"
                )
        return self

    @model_validator(mode="after")
    def _check_gates(self) -> PipelineConfig:
        for i, gate in enumerate(self.evaluate.gates):
            stage = gate.metric.split("/", 1)[0].removesuffix("_vs_sft") if "/" in gate.metric else None
            if stage != "base" and stage not in STAGE_ORDER:
                raise ValueError(
                    f"evaluate.gates[{i}].metric={gate.metric!r}: names no stage; a gate's metric is "
                    "<stage>/<metric>, <stage>_vs_sft/<metric> or base/<metric> (e.g. dpo/exact_match, "
                    f"dpo_vs_sft/win_rate) with a stage of {list(STAGE_ORDER)}"
                )
            if gate.metric in EVALUATED_METRICS and "evaluate" in self.stages:
                raise ValueError(
                    f"evaluate.gates[{i}].metric={gate.metric!r}: with evaluate in the run this "
                    f"quantity is {EVALUATED_METRICS[gate.metric]!r} (evaluate's measure of the final "
                    "model on held-out data); gate on that name"
                )
            if gate.vs_champion and not self.tracking.registered_model_name:
                raise ValueError(
                    f"evaluate.gates[{i}] ({gate.metric}): vs_champion needs "
                    "tracking.registered_model_name (the registered model whose champion it compares with)"
                )
        if self.tracking.registered_model_name and not self.tracking.log_models:
            raise ValueError(
                "tracking.registered_model_name needs tracking.log_models (the version is the logged model)"
            )
        chosen = self.tracking.registered_stage
        if chosen is not None and (chosen not in self.stages or not get_stage(chosen).produces_model):
            raise ValueError(
                f"tracking.registered_stage={chosen!r}: must be a stage of this run that produces a "
                f"model ({[s for s in self.stages if get_stage(s).produces_model]})"
            )
        return self

    def lora_for(self, stage: str) -> LoraConfig:
        """The LoRA settings of ``stage``: the pipeline's, with the fields the stage's ``lora`` sets replaced.

        Stages that train nothing (prepare_data, score, evaluate) never use adapters.

        Raises:
            ValueError: the merged settings are not a valid :class:`LoraConfig` (the message names
                ``<stage>.lora``).
        """
        if stage not in TRAINING_STAGES:
            return LoraConfig()
        return self.section(stage).lora.merged_over(self.lora, f"{stage}.lora")

    def backend_for(self, stage: str) -> BackendConfig:
        """The backend ``stage`` runs on: the pipeline's, with the fields the stage's ``backend`` sets replaced.

        Stages without an optimizer loop (prepare_data, score, evaluate) run one process on
        the pipeline's device whatever the backend: they generate and score, they do not train.

        Raises:
            ValueError: the merged backend is not a valid :class:`BackendConfig` (the message
                names ``<stage>.backend``).
        """
        if stage not in TRAINING_STAGES:
            return BackendConfig(device=self.backend.device)
        return self.section(stage).backend.merged_over(self.backend, f"{stage}.backend")


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        got = f" (got {e.get('input')!r})" if e["loc"] else ""  # a check of the whole config: not all of it again
        lines.append(f"  {path}: {e['msg']}{got}")
    return "\n".join(lines)


def config_value(config: BaseModel, path: str) -> Any:
    """The value at the dotted ``path`` of ``config`` (e.g. ``dpo.beta``), JSON-ready (pydantic's
    JSON mode: a section as a dict, a secret masked).

    Raises:
        AttributeError: a part of ``path`` is not a field.
    """
    value: Any = config
    for key in path.split("."):
        value = getattr(value, key)
    return to_jsonable_python(value)


def _set_path(data: dict, path: str, value: Any) -> None:
    keys = path.split(".")
    node = data
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override '{path}': '{k}' is not a section")
        node = nxt
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``key.path=value``; the value is read as YAML (numbers, booleans, null, lists).

    Raises:
        ConfigError: when ``text`` has no ``=`` or an empty key.
    """
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_overrides(data: dict, overrides: dict[str, Any] | None) -> dict:
    """Return a copy of ``data`` with each ``{key.path: value}`` override set."""
    out = json.loads(json.dumps(data, default=str))
    for key, value in (overrides or {}).items():
        _set_path(out, key, value)
    return out


def load_config(
    uri: str | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    base: dict | None = None,
) -> PipelineConfig:
    """Load a YAML config (any fsspec URI), apply overrides and validate.

    Args:
        uri: YAML file; None: defaults only (or ``base``).
        overrides: ``{key.path: value}`` or a list of ``key.path=value`` strings.
        base: a dict to start from instead of reading ``uri``.

    Raises:
        ConfigError: a missing or empty file (only comments: an empty mapping ``{}`` takes
            every default), unreadable YAML, a bad override, or a validation failure; the
            message names the file, or each failing field path.
    """
    import fsspec

    data: dict = dict(base or {})
    source = uri or "defaults"
    if uri is not None:
        try:
            with fsspec.open(uri, "r") as f:
                loaded = yaml.safe_load(f)
        except FileNotFoundError as e:
            raise ConfigError(f"config file not found: {uri}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {uri} is not valid YAML: {e}") from e
        if loaded is None:  # an empty file, or comments only: most likely the wrong file or a failed write
            raise ConfigError(
                f"config file {uri} is empty (no settings, at most comments); to run every default "
                "on purpose, write {} in it"
            )
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {uri}: top level must be a mapping")
        data = loaded
    if isinstance(overrides, list):
        overrides = dict(parse_override(o) for o in overrides)
    data = apply_overrides(data, overrides)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def resolve_local_root(config: PipelineConfig) -> PipelineConfig:
    """Make a relative local ``storage.root`` absolute, so child processes agree on it."""
    root = config.storage.root
    if "://" not in root:
        root = os.path.abspath(root)
    elif root.startswith("file://"):
        root = os.path.abspath(root[len("file://") :])
    if root != config.storage.root:
        config = config.model_copy(deep=True)
        config.storage.root = root
    return config


def rl_config_problem(stage: str, cfg: RLStageConfig, samples_per_prompt: int, world_size: int) -> str | None:
    """Why the RL stage ``stage`` cannot run with ``cfg`` on ``world_size`` data-parallel ranks, or
    None: temperature 0 (RL samples); ``prompts_per_rollout`` not a multiple of the world size
    (every rank takes an equal share: sharded forwards run in lockstep); more ``num_mini_batches``
    than the rollout batch has sequences (``prompts_per_rollout x samples_per_prompt``)."""
    if cfg.generation.temperature <= 0:
        return f"{stage}.generation.temperature must be > 0: RL stages sample"
    if cfg.prompts_per_rollout % world_size:
        return (
            f"{stage}.prompts_per_rollout={cfg.prompts_per_rollout} must be a multiple of the world size "
            f"({world_size}): every rank samples an equal share of each rollout's prompts"
        )
    if cfg.num_mini_batches > cfg.prompts_per_rollout * samples_per_prompt:
        return (
            f"{stage}.num_mini_batches={cfg.num_mini_batches} exceeds the rollout batch's number of sequences "
            f"({cfg.prompts_per_rollout * samples_per_prompt} = prompts_per_rollout x samples per prompt)"
        )
    return None
