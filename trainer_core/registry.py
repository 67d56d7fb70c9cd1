"""The stage registry: what each stage of the pipeline is, in one table.

Each :class:`StageDef` says what a stage is called, which module runs it, which config section
holds its settings, whether it trains (an optimizer loop with step checkpoints, on the stage's
backend), what its committed ``final/`` directory holds, which inputs it reads (a function of
the config and of the stage outputs available), and which config fields outside its own
section change its result (they enter its fingerprint). Every other list of stages derives
from :data:`STAGES`: the config's ``stages`` validation and default, the trainer's module
lookup, the flow's dependency graph, which finals MLflow logs as models, evaluate's inputs.

Adding a stage is one entry here, one module under ``trainer_core/stages/`` with
``run(ctx) -> Manifest``, and its config section on ``PipelineConfig``.

Input roles (what a stage module asks its context for):

- ``data``: the prepare_data final directory (tokenised splits and the tokenizer);
- ``model``: the model a stage starts from (or, for score, the policy it samples);
- ``reference``: the frozen reference of DPO, KTO, PPO and GRPO; distill's teacher;
- ``reward_model``: a trained reward model;
- ``<stage>_model``: evaluate's view of each trained policy (``sft_model``, ``dpo_model``, ...);
- ``base_model``: evaluate's base model source.

A model source is a committed final URI, a Hugging Face id or directory, or
:data:`INIT_SOURCE` (build from ``model.init``).

This module imports no torch and no config at run time (the config imports it, to validate
stage names), so the flow process can use it cheaply.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from trainer_core.errors import ConfigError

if TYPE_CHECKING:
    from trainer_core.config import PipelineConfig

Output = Literal["data", "policy", "reward_model", "table", "metrics"]
"""What a stage's ``final/`` directory holds: prepared data, an HF causal LM (a policy), an HF
sequence-classification reward model, a Parquet table, or metrics only."""

INIT_SOURCE = "init"
"""The model-source URI meaning "build the model from ``config.model.init``" (a stage input)."""


class StageOutputs(Mapping[str, str]):
    """The committed final directories a stage may read: stage name -> URI.

    Args:
        outputs: stage name -> final directory URI (planned ones count: the flow runs a stage
            only once its inputs are committed).
        reader: the stage asking (named in errors).
    """

    def __init__(self, outputs: Mapping[str, str], reader: str) -> None:
        self._outputs = dict(outputs)
        self.reader = reader

    def __getitem__(self, stage: str) -> str:
        return self._outputs[stage]

    def __iter__(self) -> Iterator[str]:
        return iter(self._outputs)

    def __len__(self) -> int:
        return len(self._outputs)

    def require(self, stage: str) -> str:
        """The output of ``stage``.

        Raises:
            ConfigError: ``stage`` neither runs in this pipeline run nor has a committed output.
        """
        if stage not in self._outputs:
            raise ConfigError(
                f"stage {self.reader!r} needs the output of {stage!r}: add {stage!r} to stages, or pass the "
                f"run id of a run that has committed it"
            )
        return self._outputs[stage]


InputsFn = Callable[["PipelineConfig", StageOutputs], dict[str, str]]


@dataclass(frozen=True)
class StageDef:
    """One stage of the pipeline.

    Attributes:
        name: the stage name (``config.stages`` entries, ``runs/<id>/stages/<name>/``).
        module: the module whose ``run(ctx: StageContext) -> Manifest`` runs it.
        section: the ``PipelineConfig`` field holding its settings (hashed into its fingerprint).
        trains: runs an optimizer loop with step checkpoints on the stage's backend (the
            other stages run one process).
        output: what its final directory holds (see :data:`Output`).
        inputs: ``(config, available outputs) -> {role: URI}``.
        fingerprint_fields: dotted config paths outside ``section`` that change its result.
        description: one line for help texts.
        default: part of the default ``stages`` (the opt-in ones need data of their own).
    """

    name: str
    module: str
    section: str
    trains: bool
    output: Output
    inputs: InputsFn
    fingerprint_fields: tuple[str, ...] = ()
    description: str = ""
    default: bool = True

    @property
    def produces_model(self) -> bool:
        """True when the final directory is an HF model (logged to MLflow as one)."""
        return self.output in ("policy", "reward_model")


def _source(config: PipelineConfig) -> str:
    return config.model.name_or_path or INIT_SOURCE


def _start(init_from: str | None, config: PipelineConfig, outputs: StageOutputs) -> str:
    """The model a stage starts from: its ``init_from``, else the SFT output, else the base model."""
    return init_from or outputs.get("sft") or _source(config)


def _pretrain_inputs(config: PipelineConfig, outputs: StageOutputs) -> dict[str, str]:
    return {"data": outputs.require("prepare_data"), "model": config.pretrain.init_from or _source(config)}


def _sft_inputs(config: PipelineConfig, outputs: StageOutputs) -> dict[str, str]:
    """SFT starts from its ``init_from``, else the continued-pretraining output, else the base model."""
    model = config.sft.init_from or outputs.get("pretrain") or _source(config)
    return {"data": outputs.require("prepare_data"), "model": model}


def _reward_model_inputs(config: PipelineConfig, outputs: StageOutputs) -> dict[str, str]:
    return {"data": outputs.require("prepare_data"), "model": _start(config.reward_model.init_from, config, outputs)}


def _score_inputs(config: PipelineConfig, outputs: StageOutputs) -> dict[str, str]:
    inputs = {"data": outputs.require("prepare_data"), "model": _start(config.score.policy_from, config, outputs)}
    reward_model = config.score.reward_model_from or outputs.get("reward_model")
    if reward_model:
        inputs["reward_model"] = reward_model
    return inputs


def _offline_preference_inputs(section: str) -> InputsFn:
    """DPO / KTO: the policy's start and its frozen reference (by default the same model)."""

    def inputs(config: PipelineConfig, outputs: StageOutputs) -> dict[str, str]:
        cfg = getattr(config, section)
        model = _start(cfg.init_from, config, outputs)
        return {"data": outputs.require("prepare_data"), "model": model, "reference": cfg.reference_from or model}

    return inputs


def _rl_inputs(section: str) -> InputsFn:
    """PPO / GRPO: policy and reference; a reward model only when the reward kind reads one (a
    missing one then fails the stage with a clear error)."""

    def inputs(config: PipelineConfig, outputs: StageOutputs) -> dict[str, str]:
        rl = getattr(config, section)
        model = _start(rl.init_from, config, outputs)
        out = {"data": outputs.require("prepare_data"), "model": model, "reference": rl.reference_from or model}
        reward_model = rl.reward.reward_model_from or outputs.get("reward_model")
        if rl.reward.kind != "verifier" and reward_model:
            out["reward_model"] = reward_model
        return out

    return inputs


def _teacher_inputs(config: PipelineConfig, outputs: StageOutputs) -> dict[str, str]:
    """The teacher's SFT starts from its ``init_from``, else the base model (built from
    ``teacher.model_init`` when the base is built from config)."""
    return {"data": outputs.require("prepare_data"), "model": config.teacher.init_from or _source(config)}


def _distill_inputs(config: PipelineConfig, outputs: StageOutputs) -> dict[str, str]:
    """Distillation: the student (its start, as an RL stage's) and the teacher as its reference:
    ``distill.teacher_from``, else the ``teacher`` stage's output.

    Raises:
        ConfigError: neither.
    """
    cfg = config.distill
    teacher = cfg.teacher_from or outputs.get("teacher")
    if not teacher:
        raise ConfigError(
            "distill.teacher_from: the distill stage needs a teacher model (an HF model directory or "
            "URI sharing the student's tokenizer, e.g. another run's stages/sft/final), or the teacher "
            "stage in stages"
        )
    return {
        "data": outputs.require("prepare_data"),
        "model": _start(cfg.init_from, config, outputs),
        "reference": teacher,
    }


def _evaluate_inputs(config: PipelineConfig, outputs: StageOutputs) -> dict[str, str]:
    """Every trained model available: policies as ``<stage>_model``, the reward model, the base."""
    inputs = {"data": outputs.require("prepare_data")}
    for stage in STAGES:
        if stage.name in outputs and stage.output == "policy":
            inputs[policy_role(stage.name)] = outputs[stage.name]
        elif stage.name in outputs and stage.output == "reward_model":
            inputs["reward_model"] = outputs[stage.name]
    inputs["base_model"] = _source(config)
    return inputs


STAGES: tuple[StageDef, ...] = (
    StageDef(
        "prepare_data",
        "trainer_core.stages.prepare_data",
        "data",
        False,
        "data",
        lambda config, outputs: {},
        description="read, split and tokenise the data sets; train the tokenizer for a model built from config",
    ),
    StageDef(
        "pretrain",
        "trainer_core.stages.pretrain",
        "pretrain",
        True,
        "policy",
        _pretrain_inputs,
        description="continued pretraining: next-token loss on every token of packed raw text",
        default=False,
    ),
    StageDef(
        "sft",
        "trainer_core.stages.sft",
        "sft",
        True,
        "policy",
        _sft_inputs,
        description="supervised fine-tuning on completion tokens",
    ),
    StageDef(
        "teacher",
        "trainer_core.stages.teacher",
        "teacher",
        True,
        "policy",
        _teacher_inputs,
        description="SFT of a distillation teacher: its own (wider) model on the SFT data",
        default=False,
    ),
    StageDef(
        "reward_model",
        "trainer_core.stages.reward_model",
        "reward_model",
        True,
        "reward_model",
        _reward_model_inputs,
        description="Bradley-Terry reward model on preference pairs",
    ),
    StageDef(
        "score",
        "trainer_core.stages.score",
        "score",
        False,
        "table",
        _score_inputs,
        description="sample the policy on held-out prompts; verify and reward-score the completions",
    ),
    StageDef(
        "dpo",
        "trainer_core.stages.dpo",
        "dpo",
        True,
        "policy",
        _offline_preference_inputs("dpo"),
        description="direct preference optimisation against a frozen reference",
    ),
    StageDef(
        "kto",
        "trainer_core.stages.kto",
        "kto",
        True,
        "policy",
        _offline_preference_inputs("kto"),
        description="Kahneman-Tversky optimisation on unpaired desirable/undesirable examples",
        default=False,
    ),
    StageDef(
        "ppo",
        "trainer_core.stages.ppo",
        "ppo",
        True,
        "policy",
        _rl_inputs("ppo"),
        description="online PPO with a value head, GAE and a KL penalty",
    ),
    StageDef(
        "grpo",
        "trainer_core.stages.grpo",
        "grpo",
        True,
        "policy",
        _rl_inputs("grpo"),
        description="online GRPO with group-relative advantages",
    ),
    StageDef(
        "distill",
        "trainer_core.stages.distill",
        "distill",
        True,
        "policy",
        _distill_inputs,
        description="on-policy distillation: the student's samples, the teacher's per-token reverse KL",
        default=False,
    ),
    StageDef(
        "evaluate",
        "trainer_core.stages.evaluate",
        "evaluate",
        False,
        "metrics",
        _evaluate_inputs,
        fingerprint_fields=("dpo.beta",),
        description="held-out loss, accuracy, exact match and win rates of every trained model",
    ),
)
"""Every stage, in pipeline order (a topological order of the inputs above)."""


EVALUATED_METRICS: Mapping[str, str] = {
    "sft/eval/loss": "sft/eval_loss",
    "reward_model/eval/accuracy": "reward_model/eval_accuracy",
    "dpo/eval/rewards/accuracies": "dpo/eval_reward_accuracy",
}
"""A stage's own last eval metric (``<stage>/<its trainer's key>``) -> evaluate's measure of the
same quantity on the final model (``trainer_core/stages/evaluate.py``). With evaluate in the run,
the headline metrics and quality gates use evaluate's name only (one name per quantity)."""

STAGE_ORDER: tuple[str, ...] = tuple(s.name for s in STAGES)
"""Every stage name, in pipeline order."""

DEFAULT_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES if s.default)
"""The stages a config without ``stages`` runs (pretrain and kto are opt-in)."""

TRAINING_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES if s.trains)
"""Stages that run an optimizer loop and write step checkpoints."""

MODEL_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES if s.produces_model)
"""Stages whose final directory is an HF model."""

_BY_NAME = {s.name: s for s in STAGES}


def get_stage(name: str) -> StageDef:
    """The definition of stage ``name``.

    Raises:
        ConfigError: no such stage.
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(f"unknown stage {name!r}; known stages: {list(STAGE_ORDER)}") from None


def policy_role(stage: str) -> str:
    """Evaluate's input role for the policy trained by ``stage``: ``<stage>_model``."""
    return f"{stage}_model"


def policy_stages() -> tuple[str, ...]:
    """Stages whose final directory is a policy, in pipeline order (evaluate compares them)."""
    return tuple(s.name for s in STAGES if s.output == "policy")


def stage_inputs(config: PipelineConfig, stage: str, outputs: Mapping[str, str]) -> dict[str, str]:
    """The input URIs of ``stage``: role -> URI.

    Args:
        config: the pipeline config (its ``*_from`` fields override the defaults).
        stage: the stage about to run.
        outputs: stage name -> final directory URI of every stage output available to it
            (committed, or planned in this run before it).

    Raises:
        ConfigError: unknown stage, or an input it needs is not available.
    """
    return get_stage(stage).inputs(config, StageOutputs(outputs, stage))
