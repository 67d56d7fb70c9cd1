"""The contract between a stage task and the trainer process it launches.

The task writes a :class:`StageSpec` as JSON to ``<run>/specs/<stage>.json`` and launches
``python -m trainer_core.run <spec-uri>``. The trainer writes its result under
``spec.output_uri``: step checkpoints in ``checkpoints/step-XXXXXXXX/`` and the stage's
result in ``final/``, each committed by a ``manifest.json`` written last.

Layout under ``<storage.root>/runs/<run_id>/``::

    specs/<stage>.json
    stages/<stage>/checkpoints/step-00000010/{..., manifest.json}
    stages/<stage>/final/{..., manifest.json}
    summary.json
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from trainer_core.config import PipelineConfig


INIT_SOURCE = "init"
"""The model-source URI meaning "build the model from ``config.model.init``"."""


def join_uri(base: str, *parts: str) -> str:
    """Join URI path parts with '/' (a ``pathlib.Path`` would mangle ``s3://``)."""
    out = base.rstrip("/")
    for p in parts:
        p = str(p).strip("/")
        if p:
            out = f"{out}/{p}"
    return out


def run_uri(root: str, run_id: str) -> str:
    """``<root>/runs/<run_id>``."""
    return join_uri(root, "runs", run_id)


def stage_uri(root: str, run_id: str, stage: str) -> str:
    """``<root>/runs/<run_id>/stages/<stage>``: a stage's ``output_uri``."""
    return join_uri(run_uri(root, run_id), "stages", stage)


def final_uri(stage_output_uri: str) -> str:
    """The committed result directory of a stage."""
    return join_uri(stage_output_uri, "final")


def checkpoints_uri(stage_output_uri: str) -> str:
    """The directory holding a stage's ``step-XXXXXXXX`` checkpoints."""
    return join_uri(stage_output_uri, "checkpoints")


class StageSpec(BaseModel):
    """Everything a trainer process needs to run one stage.

    ``inputs`` maps role names to URIs. Roles: ``data`` (the prepare_data final directory),
    ``model`` (policy / starting model directory), ``reference`` (DPO reference model),
    ``reward_model`` (reward model directory), ``sft_model``, ``dpo_model`` (for evaluate).
    """

    model_config = ConfigDict(extra="forbid")

    stage: str = Field(description="Stage name, one of config.STAGE_ORDER.")
    run_id: str = Field(description="Pipeline run id.")
    config: PipelineConfig = Field(description="The whole pipeline config.")
    inputs: dict[str, str] = Field(default_factory=dict, description="Input role -> URI.")
    output_uri: str = Field(description="The stage's output directory URI.")
    tracking_uri: str | None = Field(None, description="MLflow tracking URI.")
    mlflow_run_id: str | None = Field(None, description="The stage's nested MLflow run (metrics go there).")
    writer_id: str | None = Field(
        None,
        description="Identity of the writer (e.g. the Prefect task run id, the same across its retries); "
        "None: this process. See checkpoint/lease.py.",
    )
