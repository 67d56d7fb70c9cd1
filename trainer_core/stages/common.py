"""What every stage entry point shares: context, logging, batch sources, the final commit."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from trainer_core.backends import Backend, build_backend
from trainer_core.checkpoint.manifest import ArtifactWriter, Manifest
from trainer_core.config import PipelineConfig, TrainStageConfig
from trainer_core.data.batching import BucketedBatchSampler, DataPosition
from trainer_core.errors import ConfigError
from trainer_core.fingerprint import stage_fingerprint
from trainer_core.loop import BatchSource, Objective, TrainLoop, summarize
from trainer_core.models import save_pretrained_to
from trainer_core.spec import StageSpec, checkpoints_uri, final_uri
from trainer_core.stages.prepare_data import load_split, load_tokenizer_from
from trainer_core.tracking import MetricLogger

log = logging.getLogger(__name__)


@dataclass
class StageContext:
    """A running stage: its spec, backend, tokenizer and metric sink.

    Attributes:
        spec: the stage spec the task wrote.
        backend: where models run.
        tokenizer: the pipeline's tokenizer (from prepare_data's output).
        metrics: MLflow metric logger of the stage's nested run (no-op without one).
    """

    spec: StageSpec
    backend: Backend
    tokenizer: PreTrainedTokenizerBase
    metrics: MetricLogger
    _stage_hash: str | None = None

    @property
    def config(self) -> PipelineConfig:
        return self.spec.config

    @property
    def data_uri(self) -> str:
        return self.input("data")

    def input(self, role: str) -> str:
        """The URI of input ``role``.

        Raises:
            ConfigError: the spec has no such input (a stage it needs was not run).
        """
        try:
            return self.spec.inputs[role]
        except KeyError:
            raise ConfigError(
                f"stage {self.spec.stage!r} needs input {role!r}; spec inputs: {sorted(self.spec.inputs)}"
            ) from None

    def stage_hash(self) -> str:
        """This stage's fingerprint: its config and its inputs' hashes (see ``fingerprint.py``)."""
        if self._stage_hash is None:
            self._stage_hash = stage_fingerprint(self.config, self.spec.stage, self.spec.inputs)
        return self._stage_hash

    @property
    def is_main(self) -> bool:
        """True on rank 0: the one process that prints metrics, talks to MLflow and commits."""
        return self.backend.rank == 0

    def print_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Print a compact metrics line (the task streams it into the Prefect log); rank 0 only."""
        if not self.is_main:
            return
        shown = {k: v for k, v in metrics.items() if not k.startswith(("time/", "memory/", "first/"))}
        text = " ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items()))
        # One write call: print() writes the text and the newline separately, and a log line
        # from the async checkpoint saver's thread can land between them on a shared pipe.
        sys.stdout.write(f"[{self.spec.stage}] step {step}: {text}\n")
        sys.stdout.flush()

    def commit_metrics(self, batch: list[tuple[dict[str, float], int]]) -> None:
        """Send ``(metrics, step)`` pairs to the stage's MLflow run (rank 0 holds the only logger)."""
        for metrics, step in batch:
            self.metrics.log(metrics, step)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Print and send to MLflow at once (stages without checkpoints)."""
        self.print_metrics(metrics, step)
        self.commit_metrics([(metrics, step)])


def open_stage(spec: StageSpec) -> StageContext:
    """Build a stage's context: backend, tokenizer from the prepared data, MLflow logger."""
    backend = build_backend(spec.config.backend_for(spec.stage))
    tokenizer = load_tokenizer_from(spec.inputs["data"]) if "data" in spec.inputs else None
    main = backend.rank == 0
    metrics = MetricLogger(spec.tracking_uri if main else None, spec.mlflow_run_id if main else None)
    return StageContext(spec=spec, backend=backend, tokenizer=tokenizer, metrics=metrics)


def batch_source(
    rows: list[dict],
    lengths: list[int],
    collate: Callable[[list[dict]], dict[str, Tensor]],
    micro_batch_size: int,
    seed: int,
    device: torch.device,
    shuffle: bool = True,
) -> BatchSource:
    """A deterministic, length-bucketed :class:`BatchSource` over ``rows``.

    Raises:
        ConfigError: ``rows`` is empty.
    """
    if not rows:
        raise ConfigError("a training or eval split is empty: check the data config and max lengths")
    sampler = BucketedBatchSampler(lengths, micro_batch_size, seed=seed, shuffle=shuffle)
    return BatchSource(rows=rows, sampler=sampler, collate=collate, device=device)


def eval_batches(source: BatchSource, max_batches: int):
    """The first ``max_batches`` micro-batches of epoch 0 of an unshuffled source."""
    stream = source.stream(DataPosition(0, 0))
    count = min(max_batches, len(source.sampler))
    for _ in range(count):
        batch, _, _ = next(stream)
        yield batch


def train_stage(
    ctx: StageContext,
    model: nn.Module,
    objective: Objective,
    train: BatchSource,
    cfg: TrainStageConfig,
) -> dict[str, float]:
    """Resume from the latest checkpoint if any, train, and return the stage's final metrics."""
    fields: dict[str, Any] = {
        "stage": ctx.spec.stage,
        "run_id": ctx.spec.run_id,
        "config_hash": ctx.stage_hash(),
        "backend": ctx.backend.name,
        "world_size": ctx.backend.world_size,
        "extra": {"mlflow_run_id": ctx.spec.mlflow_run_id, "checkpoint_format": ctx.backend.checkpoint_format},
    }
    loop = TrainLoop(
        model=model,
        backend=ctx.backend,
        objective=objective,
        batches=train,
        cfg=cfg,
        checkpoints_uri=checkpoints_uri(ctx.spec.output_uri),
        manifest_fields=fields,
        log_metrics=ctx.print_metrics,
        commit_metrics=ctx.commit_metrics,
        recommit_metrics=ctx.metrics.log_missing,
    )
    resumed = loop.resume()
    progress = loop.run()
    metrics = summarize(progress)
    metrics["resumed"] = float(resumed)
    metrics["consumed_samples"] = float(progress.consumed_samples)
    metrics["consumed_tokens"] = float(progress.consumed_tokens)
    return metrics


def commit_final(
    ctx: StageContext,
    metrics: dict[str, float],
    *,
    model: nn.Module | None = None,
    files: dict[str, bytes] | None = None,
    extra: dict[str, Any] | None = None,
) -> Manifest:
    """Write the stage's result to ``<output_uri>/final/`` and commit it (manifest last).

    Collective under a distributed backend: the model is consolidated from every rank's
    shards into one HF-format safetensors state dict on rank 0 (``Backend.full_state_dict``),
    which alone writes and commits; every rank returns the committed manifest.

    Args:
        ctx: the stage context.
        metrics: final metrics recorded in the manifest.
        model: an HF model (possibly wrapped or sharded) to save with the tokenizer.
        files: other files, relative path -> bytes.
        extra: extra manifest fields (inputs, MLflow run id are added).
    """
    backend = ctx.backend
    weights = backend.full_state_dict(model) if model is not None and backend.name != "single" else None
    manifest = _write_final(ctx, metrics, model, weights, files, extra) if ctx.is_main else None
    if backend.world_size == 1:
        return manifest
    data = backend.broadcast_object(manifest.model_dump(mode="json") if manifest is not None else None)
    return Manifest.model_validate(data)


def _write_final(ctx, metrics, model, weights, files, extra) -> Manifest:
    writer = ArtifactWriter(final_uri(ctx.spec.output_uri), overwrite=True)
    if model is not None:
        save_pretrained_to(writer, ctx.backend.unwrap(model), ctx.tokenizer, state_dict=weights)
    for relpath, data in (files or {}).items():
        writer.write_bytes(relpath, data)
    info = {"inputs": ctx.spec.inputs, "mlflow_run_id": ctx.spec.mlflow_run_id, **(extra or {})}
    manifest = writer.commit(
        kind="final",
        stage=ctx.spec.stage,
        run_id=ctx.spec.run_id,
        global_step=int(metrics.get("global_step", 0)),
        consumed_samples=int(metrics.get("consumed_samples", 0)),
        consumed_tokens=int(metrics.get("consumed_tokens", 0)),
        config_hash=ctx.stage_hash(),
        backend=ctx.backend.name,
        world_size=ctx.backend.world_size,
        metrics=metrics,
        extra=info,
    )
    log.info("stage %s committed %s", ctx.spec.stage, writer.uri)
    return manifest


def load_rows(ctx: StageContext, name: str) -> list[dict]:
    """Rows of a prepared split (e.g. ``sft/train``)."""
    return load_split(ctx.data_uri, name)
