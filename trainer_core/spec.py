"""The contract between a stage task and the trainer process it launches.

The task builds a :class:`StageSpec` with :func:`build_spec` (which computes the stage's
fingerprint, once), writes it as JSON to ``<run>/specs/<stage>.json`` and launches
``python -m trainer_core.run <spec-uri>``. The trainer writes its result under
``spec.output_uri``: step checkpoints in ``checkpoints/step-XXXXXXXX/`` and the stage's result
in ``final/``, each committed by a ``manifest.json`` written last (layout:
:mod:`trainer_core.storage.layout`).
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field

from trainer_core import storage
from trainer_core.checkpoint.manifest import MANIFEST_NAME
from trainer_core.config import PipelineConfig
from trainer_core.errors import ConfigError
from trainer_core.fingerprint import stage_fingerprint
from trainer_core.registry import STAGE_ORDER
from trainer_core.storage import RunLayout, join_uri


class StageSpec(BaseModel):
    """Everything a trainer process needs to run one stage.

    ``inputs`` maps role names to URIs; the roles are listed in :mod:`trainer_core.registry`.
    """

    model_config = ConfigDict(extra="forbid")

    stage: str = Field(description="Stage name, one of trainer_core.registry.STAGE_ORDER.")
    run_id: str = Field(description="Pipeline run id.")
    config: PipelineConfig = Field(description="The whole pipeline config (secrets removed).")
    inputs: dict[str, str] = Field(default_factory=dict, description="Input role -> URI.")
    output_uri: str = Field(description="The stage's output directory URI.")
    fingerprint: str = Field(
        description="The stage's fingerprint (trainer_core/fingerprint.py) for these inputs: recorded as "
        "config_hash in every manifest the stage commits; checkpoints with another one are not resumed."
    )
    tracking_uri: str | None = Field(None, description="MLflow tracking URI.")
    mlflow_run_id: str | None = Field(None, description="The stage's nested MLflow run (metrics go there).")
    writer_id: str | None = Field(
        None,
        description="Identity of the writer (e.g. the Prefect task run id, the same across its retries); "
        "None: this process. See checkpoint/lease.py.",
    )


def build_spec(
    config: PipelineConfig,
    stage: str,
    run_id: str,
    inputs: dict[str, str],
    *,
    tracking_uri: str | None = None,
    mlflow_run_id: str | None = None,
    writer_id: str | None = None,
    output_uri: str | None = None,
) -> StageSpec:
    """The spec of ``stage`` in run ``run_id``, its output under ``config.storage.root``.

    Computes the stage fingerprint (reading each input's manifest once): the one place it is
    computed for a stage attempt. ``output_uri`` defaults to ``<root>/runs/<run_id>/stages/<stage>``.

    Raises:
        ConfigError: unknown stage.
    """
    return StageSpec(
        stage=stage,
        run_id=run_id,
        config=config,
        inputs=inputs,
        output_uri=output_uri or RunLayout(config.storage.root, run_id).stage(stage).output,
        fingerprint=stage_fingerprint(config, stage, inputs),
        tracking_uri=tracking_uri,
        mlflow_run_id=mlflow_run_id,
        writer_id=writer_id,
    )


def committed_outputs(layout: RunLayout, stages: tuple[str, ...] | list[str] = STAGE_ORDER) -> dict[str, str]:
    """Stage -> final directory, for each of ``stages`` committed in the run at ``layout``.

    A final directory counts when its ``manifest.json`` exists (one existence check per stage).
    """
    return {s: layout.final(s) for s in stages if storage.exists(join_uri(layout.final(s), MANIFEST_NAME))}


def read_spec(uri: str) -> StageSpec:
    """Read and validate a stage spec (any fsspec URI).

    Raises:
        ConfigError: the spec is missing, not JSON, or fails validation.
    """
    import fsspec
    from pydantic import ValidationError

    try:
        with fsspec.open(uri, "r") as f:
            return StageSpec.model_validate(json.load(f))
    except FileNotFoundError as e:
        raise ConfigError(f"stage spec not found: {uri}") from e
    except (json.JSONDecodeError, ValidationError) as e:
        raise ConfigError(f"invalid stage spec {uri}: {e}") from e
