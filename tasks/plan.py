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
            in it (e.g. no ``prepare_data``); nothing has been written.
    """
    prior = committed_outputs(layout, [s for s in STAGE_ORDER if s not in config.stages])
    planned: dict[str, PlannedStage] = {}
    for stage in config.stages:
        available = {**prior, **{s: layout.final(s) for s in planned}}
        inputs = stage_inputs(config, stage, available)
        depends_on = tuple(s for s in planned if layout.final(s) in inputs.values())
        planned[stage] = PlannedStage(stage, inputs, depends_on)
    return planned
