"""The stage graph of one pipeline run: each stage's inputs and the stages it waits for.

Inputs come from the stage registry (``trainer_core.registry``): every stage of the run reads
the outputs of the stages before it in this run (their ``final/`` URIs are known before they
exist), and the committed outputs of earlier runs of the same run id for stages it does not
run. A stage depends on exactly the stages of this run whose output URI is among its inputs;
the flow submits it once they have completed, so independent stages run side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer_core.config import PipelineConfig
from trainer_core.errors import ConfigError
from trainer_core.registry import STAGE_ORDER, stage_inputs
from trainer_core.spec import committed_outputs
from trainer_core.storage import RunLayout


@dataclass(frozen=True)
class PlannedStage:
    """One stage of a run's graph.

    Attributes:
        stage: the stage name.
        inputs: role -> URI (upstream outputs of this run are committed by the time it runs).
        depends_on: the stages of this run whose outputs it reads, in pipeline order.
    """

    stage: str
    inputs: dict[str, str]
    depends_on: tuple[str, ...]


def plan_run(config: PipelineConfig, layout: RunLayout) -> dict[str, PlannedStage]:
    """The graph of ``config.stages`` in the run at ``layout``, in pipeline order.

    Raises:
        ConfigError: a stage needs an output that is neither produced in this run nor committed
            in it (e.g. no ``prepare_data``, or the reward model of a ``<stage>.reward`` that reads
            one); nothing has been written.
    """
    prior = committed_outputs(layout, [s for s in STAGE_ORDER if s not in config.stages])
    planned: dict[str, PlannedStage] = {}
    for stage in config.stages:
        available = {**prior, **{s: layout.final(s) for s in planned}}
        inputs = stage_inputs(config, stage, available)
        _check_reward_model(config, stage, inputs, available)
        depends_on = tuple(s for s in planned if layout.final(s) in inputs.values())
        planned[stage] = PlannedStage(stage, inputs, depends_on)
    return planned


def _check_reward_model(config: PipelineConfig, stage: str, inputs: dict[str, str], available: dict[str, str]) -> None:
    """``<stage>.reward`` reads a reward model only if the stage's inputs (the registry's) hold one.

    Raises:
        ConfigError: the reward reads a reward model (kind 'reward_model', or 'weighted' with it)
            and none is among the stage's inputs: the message says which field and how to give one.
    """
    reward = getattr(config.section(stage), "reward", None)
    if reward is None or not reward.reads_reward_model or "reward_model" in inputs:
        return
    parts = f"kind {reward.kind!r}" + (f", weights {reward.kind_weights()}" if reward.kind == "weighted" else "")
    what = f"{stage}.reward ({parts}) reads a trained reward model"
    if reward.reward_model_from or "reward_model" in available:  # one exists, and the stage reads none
        raise ConfigError(
            f"{what}, and the {stage} stage takes none: choose a {stage}.reward.kind without "
            "reward_model (verifier, math_verify, function, or 'weighted' with weights that omit it)"
        )
    raise ConfigError(
        f"{what}, and none is available: add the reward_model stage to stages, set "
        f"{stage}.reward.reward_model_from to a trained reward model, or choose a {stage}.reward.kind "
        "without reward_model (e.g. verifier)"
    )
