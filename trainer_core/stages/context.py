"""What a running stage sees: its spec, backend, tokenizer, metric sinks and model sources; and
:func:`train_stage`, the supervised stages' loop. The final commit is :mod:`trainer_core.stages.commit`'s.

:func:`~trainer_core.stages.runner.run_spec` builds a :class:`StageContext` and hands it to the
stage module's ``run(ctx)``; stage modules never build backends or loggers themselves.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from torch import nn
from transformers import PreTrainedTokenizerBase

from trainer_core.backends import Backend
from trainer_core.checkpoint.lease import WriteFence, check_fence
from trainer_core.checkpoint.session import CheckpointSession, MetricsBuffer
from trainer_core.config import OptimizerStageConfig, PipelineConfig, TrainStageConfig
from trainer_core.data.prepared import load_split
from trainer_core.modeling.forwards.padding_free import check_packed_rows_apart
from trainer_core.spec import StageSpec
from trainer_core.stages.model_sources import ModelSources
from trainer_core.storage import StageLayout
from trainer_core.tracking import MetricLogger
from trainer_core.training.loop import BatchSource, Objective, TrainLoop, summarize
from trainer_core.training.moe import MoEObjective, with_moe

log = logging.getLogger(__name__)


WALL_TIME_PREFIXES = ("time/", "memory/", "rollout/tokens_per_s")
"""Metrics that measure wall time or memory: never equal between two runs of the same work."""


@dataclass
class StageContext:
    """A running stage: its spec, backend, tokenizer and metric sink; its models come from
    :attr:`models` (:class:`~trainer_core.stages.model_sources.ModelSources`).

    Attributes:
        spec: the stage spec the task wrote.
        backend: where models run (its process group, if any, is joined).
        tokenizer: the pipeline's tokenizer (from prepare_data's output); None for prepare_data.
        metrics: the MLflow metric logger of the stage's nested run (rank 0; a no-op elsewhere
            and without tracking).
        print_timing: also print each step's wall-time metrics on a line of their own (set by
            the runner for the RL stages: the time split of an iteration).
        attempt: this launch's attempt id (the same on every rank): its checkpoints are written
            under names of their own; None: plain ``step-XXXXXXXX`` names.
        fence: what every rank checks before it writes (the stage's lease still held by this
            attempt, ``trainer_core.checkpoint.lease``); None: no check.
    """

    spec: StageSpec
    backend: Backend
    tokenizer: PreTrainedTokenizerBase | None
    metrics: MetricLogger
    print_timing: bool = False
    attempt: str | None = None
    fence: WriteFence | None = None

    def check_fence(self, what: str) -> None:
        """Collective: raise ``LeaseLostError`` on every rank unless this attempt still holds the
        stage's lease (see :func:`~trainer_core.checkpoint.lease.check_fence`)."""
        check_fence(self.fence, self.backend, what)

    @property
    def config(self) -> PipelineConfig:
        """The pipeline config."""
        return self.spec.config

    @property
    def fingerprint(self) -> str:
        """The stage fingerprint (computed once by whoever built the spec)."""
        return self.spec.fingerprint

    @property
    def layout(self) -> StageLayout:
        """The stage's output directories."""
        return StageLayout(self.spec.output_uri)

    @property
    def data_uri(self) -> str:
        """The prepare_data output this stage reads."""
        return self.input("data")

    def input(self, role: str) -> str:
        """The URI of input ``role`` (:meth:`ModelSources.input`).

        Raises:
            ConfigError: the spec has no such input (a stage it needs was not run).
        """
        return self.models.input(role)

    @property
    def is_main(self) -> bool:
        """True on rank 0: the one process that prints metrics, talks to MLflow and commits."""
        return self.backend.rank == 0

    def print_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Print a compact metrics line (the task streams it into the Prefect log); rank 0 only.

        Wall-time measurements (``time/*``, ``rollout/tokens_per_s``) and memory go on a second
        line, ``[stage] step N time: ...``, so that the first one is the same in two runs of the
        same work (what the resume tests compare)."""
        if not self.is_main:
            return
        timing = {k: v for k, v in metrics.items() if k.startswith(WALL_TIME_PREFIXES)}
        shown = {k: v for k, v in metrics.items() if k not in timing and not k.startswith("first/")}
        text = " ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items()))
        lines = f"[{self.spec.stage}] step {step}: {text}\n"
        if self.print_timing and timing:
            lines += (
                f"[{self.spec.stage}] step {step} time: "
                + " ".join(f"{k}={v:.4g}" for k, v in sorted(timing.items()))
                + "\n"
            )
        # One write call: print() writes the text and the newline separately, and a log line
        # from the async checkpoint saver's thread can land between them on a shared pipe.
        sys.stdout.write(lines)
        sys.stdout.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Print and send to MLflow at once (stages without checkpoints)."""
        self.print_metrics(metrics, step)
        self.metrics.log(metrics, step)

    def checkpoint_session(
        self, cfg: OptimizerStageConfig, *, extra: dict[str, Any] | None = None, asynchronous: bool | None = None
    ) -> CheckpointSession:
        """The stage's checkpoint session over ``<output>/checkpoints`` with a fresh metrics buffer.

        Args:
            cfg: the stage config (``keep_last_checkpoints``, ``async_save``).
            extra: more ``extra`` manifest fields (a loop's layout version).
            asynchronous: override of ``cfg.async_save``.
        """
        validate = self.backend.validate_replicas
        return CheckpointSession(
            self.layout.checkpoints,
            self.backend,
            fingerprint=self.fingerprint,
            metrics=MetricsBuffer(self.metrics, self.print_metrics),
            stage=self.spec.stage,
            run_id=self.spec.run_id,
            extra={"mlflow_run_id": self.spec.mlflow_run_id, **(extra or {})},
            keep_last=cfg.keep_last_checkpoints,
            asynchronous=cfg.async_save if asynchronous is None else asynchronous,
            validate_replicas=validate,
            attempt=self.attempt,
            fence=self.fence,
        )

    @cached_property
    def models(self) -> ModelSources:
        """Where the stage's models come from: inputs loaded, LoRA applied or continued, the
        reference's and the committed adapter's base (:class:`ModelSources`)."""
        return ModelSources(self.spec, self.tokenizer)

    def load_rows(self, name: str) -> list[dict]:
        """Rows of a prepared split (e.g. ``sft/train``)."""
        return load_split(self.data_uri, name)


def train_stage(
    ctx: StageContext,
    model: nn.Module,
    objective: Objective,
    train: BatchSource,
    cfg: TrainStageConfig,
) -> dict[str, float]:
    """Resume from the latest checkpoint if any, train, and return the stage's final metrics.

    Packed micro-batches (``max_tokens_per_micro_batch``) need a model that keeps packed rows
    apart (:func:`~trainer_core.modeling.forwards.padding_free.check_packed_rows_apart`, ConfigError otherwise).

    A mixture-of-experts model trains with its routers' load-balancing loss (``cfg.moe``) and
    logs its expert usage (:mod:`trainer_core.training.moe`)."""
    if getattr(cfg, "max_tokens_per_micro_batch", None) is not None:
        check_packed_rows_apart(model, f"{ctx.spec.stage}.max_tokens_per_micro_batch")
    objective = with_moe(model, objective, cfg.moe.aux_loss_coef, ctx.spec.stage, cfg.moe.router_temperature)
    loop = TrainLoop(
        model=model,
        backend=ctx.backend,
        objective=objective,
        batches=train,
        cfg=cfg,
        session=ctx.checkpoint_session(cfg),
    )
    resumed = loop.resume()
    progress = loop.run()
    if isinstance(objective, MoEObjective):
        objective.remove_hooks()
    metrics = summarize(progress)
    metrics["resumed"] = float(resumed)
    metrics["consumed_samples"] = float(progress.consumed_samples)
    metrics["consumed_tokens"] = float(progress.consumed_tokens)
    return metrics
