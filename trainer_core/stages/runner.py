"""Running a stage: the trainer process's lifecycle (:func:`run_spec`), and the one-call factory
(:func:`build_trainer`) that builds a ready stage from a config, for scripts and notebooks.

``run_spec(spec)`` owns everything a stage holds: it configures storage, builds the backend
(joining the process group under a launcher), opens the MLflow logger, takes the stage's writer
lease on rank 0, runs the stage module's ``run(ctx)``, and in ``finally`` closes the logger and
the backend (leaving the process group). ``python -m trainer_core.run <spec-uri>`` is argument
parsing and exit codes around it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from trainer_core import storage
from trainer_core.backends import Backend, build_backend
from trainer_core.checkpoint.lease import StageLease, WriteFence, default_owner, new_attempt_id
from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import PipelineConfig, RLStageConfig, resolve_local_root
from trainer_core.data.prepared import load_tokenizer_from
from trainer_core.processes import current_launch_id
from trainer_core.registry import get_stage, stage_inputs
from trainer_core.spec import StageSpec, build_spec, committed_outputs
from trainer_core.stages.context import StageContext
from trainer_core.storage import RunLayout, StageLayout
from trainer_core.tracking import MetricLogger

log = logging.getLogger(__name__)


def run_spec(spec: StageSpec, backend: Backend | None = None) -> Manifest:
    """Run the stage ``spec`` names, in this process (one rank of it under a launcher).

    Args:
        spec: the stage spec.
        backend: a backend to run on, owned (and closed) by the caller, e.g. to run several
            stages in one job; None: build one from ``spec`` and close it at the end, leaving the
            process group.

    Once the stage committed, rank 0 logs a model-producing stage's final model into the stage's
    MLflow run as an MLflow ``transformers`` model (``trainer_core.mlflow_model``; when the spec
    names a run and ``tracking.log_models`` is on).

    Returns:
        The stage's committed final manifest (on every rank).

    Raises:
        ConfigError: unknown stage, a missing input, or a bad config value found by the stage.
        DataError: bad input data.
        LeaseHeldError: another live writer holds the stage's lease.
        Exception: anything else the stage raises (a crash: worth a retry), or MLflow refusing
            the model after the commit (the retry finds the stage committed; its task logs it).
    """
    stage = get_stage(spec.stage)
    storage.configure(spec.config.storage)
    module = importlib.import_module(stage.module)
    owned = backend is None
    backend = build_backend(spec.config.backend_for(spec.stage)) if backend is None else backend
    try:
        main = backend.rank == 0
        metrics = MetricLogger(spec.tracking_uri if main else None, spec.mlflow_run_id if main else None)
        try:
            # Rank 0 holds the stage's writer lease for the whole job, as this launch's attempt;
            # every rank checks it (the fence) before it writes.
            identity = (new_attempt_id(current_launch_id()), spec.writer_id or default_owner())
            attempt, owner = identity if backend.world_size == 1 else backend.broadcast_object(identity)
            lease = StageLease(spec.output_uri, owner=owner, ttl_s=spec.config.launch.lease_ttl_s, attempt=attempt)
            with lease if main else contextlib.nullcontext():
                if backend.world_size > 1:
                    backend.barrier()  # the lease is taken before any rank reads or writes the stage's files
                tokenizer = load_tokenizer_from(spec.inputs["data"]) if "data" in spec.inputs else None
                rl = isinstance(spec.config.section(spec.stage), RLStageConfig)  # an iteration's time split
                ctx = StageContext(
                    spec=spec,
                    backend=backend,
                    tokenizer=tokenizer,
                    metrics=metrics,
                    print_timing=rl,
                    attempt=attempt,
                    fence=WriteFence(spec.output_uri, owner, attempt),
                )
                manifest = module.run(ctx)
            if main and spec.mlflow_run_id:  # committed and tracked: the final model as an MLflow model
                # of the stage run; imported here, so an untracked stage never imports mlflow (~1 s)
                from trainer_core.mlflow_model import ensure_stage_model

                ensure_stage_model(spec, manifest.global_step)
            return manifest
        finally:
            metrics.close()
    finally:
        if owned:
            backend.close()


@dataclass(frozen=True)
class StageTrainer:
    """A stage ready to run in this process: ``build_trainer(config, "dpo").run()``.

    Attributes:
        spec: what it will run (inputs resolved, fingerprint computed).
    """

    spec: StageSpec

    @property
    def output_uri(self) -> str:
        """Where the stage writes (``final/`` and ``checkpoints/`` under it)."""
        return self.spec.output_uri

    @property
    def final_uri(self) -> str:
        """Where the stage commits its result (``<output_uri>/final``)."""
        return StageLayout(self.spec.output_uri).final

    def run(self) -> Manifest:
        """Run the stage (resuming from its latest checkpoint, if any); returns its final manifest.

        Raises:
            See :func:`run_spec`.
        """
        return run_spec(self.spec)


def build_trainer(
    config: PipelineConfig,
    stage: str,
    *,
    run_id: str = "local",
    inputs: Mapping[str, str] | None = None,
) -> StageTrainer:
    """Build a ready stage from a config: the 80% case of using ``trainer_core`` as a library.

    Inputs are resolved as the pipeline resolves them (the stage registry), from the outputs
    committed so far under ``<storage.root>/runs/<run_id>/``: e.g. DPO starts from that run's
    SFT output when there is one, else from the base model. Run the stages in pipeline order
    under one ``run_id`` (``prepare_data`` first). Nothing is tracked in MLflow.

    Args:
        config: the pipeline config (``load_config(path)``).
        stage: a stage name (:data:`trainer_core.registry.STAGE_ORDER`).
        run_id: the run whose directory holds the outputs (read and written).
        inputs: role -> URI, instead of resolving them.

    Returns:
        A :class:`StageTrainer`; call ``.run()``.

    Raises:
        ConfigError: unknown stage, or an input it needs is not committed yet (the message
            names the stage to run first).
    """
    config = resolve_local_root(config)
    layout = RunLayout(config.storage.root, run_id)
    storage.configure(config.storage)
    resolved = dict(inputs) if inputs is not None else stage_inputs(config, stage, committed_outputs(layout))
    return StageTrainer(build_spec(config, stage, run_id, resolved))
