"""The training loop shared by every training stage (SFT, reward model, DPO).

A stage supplies an :class:`Objective` (how to count, step and evaluate a batch); the loop
owns optimisation: gradient accumulation normalised by the counted units of the whole
optimizer step, clipping, the LR schedule, periodic evaluation with early stopping,
checkpoints every ``save_every`` steps and exact resume from the latest complete one (both
through a :class:`~trainer_core.checkpoint.session.CheckpointSession`, whose metrics buffer
takes every logged value).

Units: ``global_step`` counts optimizer steps; a step consumes ``grad_accum_steps``
micro-batches of ``micro_batch_size`` examples each.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from trainer_core.backends.base import Backend
from trainer_core.checkpoint.manifest import step_dirname
from trainer_core.checkpoint.session import CheckpointSession
from trainer_core.checkpoint.train_state import TrainProgress
from trainer_core.config import TrainStageConfig
from trainer_core.data.batching import BucketedBatchSampler, DataPosition, iterate_batches
from trainer_core.training.guard import check_finite_metrics, finite_only, step_is_finite

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """One micro-batch's contribution to an optimizer step.

    Attributes:
        loss_sum: scalar, the loss summed over the micro-batch's counted units (tokens for
            SFT, pairs for reward model and DPO); the loop divides by the step's total count.
        num_tokens: non-padding tokens processed (for throughput).
        metric_sums: per-unit metrics summed over the micro-batch (detached); the loop
            reports them divided by the step's total count.
    """

    loss_sum: Tensor
    num_tokens: int
    metric_sums: dict[str, Tensor] = field(default_factory=dict)


class Objective(Protocol):
    """What a training stage plugs into the loop."""

    def count(self, batch: dict[str, Tensor]) -> int:
        """Counted units (loss tokens or pairs) in a micro-batch."""

    def step(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        """Forward one micro-batch; returns the summed loss with its graph."""

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics; must contain ``loss`` (lower is better, drives early stopping)."""


@dataclass
class BatchSource:
    """Deterministic micro-batches of a tokenised split.

    Attributes:
        rows: the split's rows (dicts from the prepared Parquet).
        sampler: length-bucketed batch sampler, fully determined by (seed, epoch).
        collate: rows -> tensors dict.
        device: where batches go.
    """

    rows: list[dict]
    sampler: BucketedBatchSampler
    collate: Callable[[list[dict]], dict[str, Tensor]]
    device: torch.device

    def stream(
        self, position: DataPosition, rank: int = 0, world_size: int = 1
    ) -> Iterator[tuple[dict[str, Tensor] | None, DataPosition, int]]:
        """Yield (batch, position after it, number of examples) forever, from ``position``.

        With ``world_size`` > 1 the i-th micro-batch from ``position`` belongs to rank
        ``i % world_size``: only this rank's are collated; the others come as ``None`` (their
        position and size still count).
        """
        for i, (indices, after) in enumerate(iterate_batches(self.sampler, position)):
            if i % world_size != rank:
                yield None, after, len(indices)
                continue
            batch = self.collate([self.rows[i] for i in indices])
            yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}, after, len(indices)


def build_optimizer(model: nn.Module, cfg: TrainStageConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms, biases or 1-D params).

    The fused implementation (one kernel over all parameters, on CPU and CUDA) replaces the
    per-parameter loop; it is deterministic, so resumed runs stay bit-identical. Sharded
    (DTensor) parameters use the multi-tensor (``foreach``) implementation.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    sharded = any(type(p).__name__ == "DTensor" for p in params)
    impl = {"foreach": True} if sharded else {"fused": True}
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=cfg.adam_betas, **impl)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainStageConfig):
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` x peak."""
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer,
        num_warmup_steps=min(cfg.warmup_steps, cfg.max_steps),
        num_training_steps=cfg.max_steps,
        min_lr_rate=cfg.min_lr_ratio,
    )


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class TrainLoop:
    """Runs one stage's optimisation; see the module docstring.

    Attributes:
        model: the wrapped trainable model (from ``backend.wrap``); replaced by what
            ``Backend.setup_optimizer`` returns (a DeepSpeed engine).
        backend: the backend it runs on.
        objective: the stage's loss and evaluation.
        batches: the training split's batch source.
        cfg: the stage's optimisation config.
        session: checkpoints and metrics (``session.metrics`` takes every logged value: printed
            at once, sent to the tracker once a committed checkpoint covers its step).
    """

    model: nn.Module
    backend: Backend
    objective: Objective
    batches: BatchSource
    cfg: TrainStageConfig
    session: CheckpointSession

    def __post_init__(self) -> None:
        self.model, self.optimizer = self.backend.setup_optimizer(
            self.model, build_optimizer(self.model, self.cfg), self.cfg
        )
        self.scheduler = build_scheduler(self.optimizer, self.cfg)
        self.accum_steps = self.cfg.accum_steps(self.backend.world_size)
        self.progress = TrainProgress()
        self.metrics = self.session.metrics

    def resume(self) -> bool:
        """Collective: load the latest complete checkpoint, if any; True when one was loaded.

        A checkpoint written under another fingerprint (config or inputs) is not used.
        """
        resumed = self.session.resume(self.model, self.optimizer, self.scheduler)
        if resumed is None:
            return False
        self.progress = resumed.progress
        return True

    def run(self) -> TrainProgress:
        """Train until ``max_steps`` or early stopping; returns the final progress.

        Waits for the last checkpoint upload, then sends the remaining metrics to the tracker.
        On an exception the in-flight upload is still awaited (so no thread writes after the
        process decides to exit) and uncommitted metrics are dropped.
        """
        try:
            self._train()
        finally:
            self.session.close()
        self.metrics.flush()
        return self.progress

    def _train(self) -> None:
        cfg, progress = self.cfg, self.progress
        if progress.global_step == 0 and "eval/loss" not in progress.history:
            self._evaluate()
        backend = self.backend
        stream = self.batches.stream(DataPosition(progress.epoch, progress.batch_index), backend.rank, backend.world_size)
        while progress.global_step < cfg.max_steps:
            metrics = self._optimizer_step(stream)
            if progress.global_step % cfg.log_every == 0 or progress.global_step == cfg.max_steps:
                self._log(metrics)
            stop = False
            if progress.global_step % cfg.eval_every == 0 or progress.global_step == cfg.max_steps:
                stop = self._evaluate()
            if progress.global_step % cfg.save_every == 0:
                self.save()
            if stop:
                log.info("early stopping at global_step %d", progress.global_step)
                progress.history["stopped_early"] = 1.0
                break

    def _optimizer_step(self, stream: Iterator) -> dict[str, float]:
        """One optimizer step over ``grad_accum_steps`` micro-batches on every rank.

        The loss is summed over every counted unit of the global batch (all micro-batches of
        all ranks) and divided by their number, so the step equals one taken on a single
        device over ``grad_accum_steps x world_size`` micro-batches.
        """
        cfg, progress, backend = self.cfg, self.progress, self.backend
        drawn = [next(stream) for _ in range(self.accum_steps * backend.world_size)]
        micro = [batch for batch, _, _ in drawn if batch is not None]
        count = sum(self.objective.count(batch) for batch in micro)
        total = backend.all_reduce_sum(torch.tensor(float(count), device=backend.device)).clamp(min=1.0)
        t_fwd = t_bwd = 0.0
        loss_sum = torch.zeros((), device=backend.device)
        metric_sums: dict[str, Tensor] = {}
        num_tokens = 0
        for i, batch in enumerate(micro):
            with backend.grad_sync(self.model, is_last_micro_batch=i == len(micro) - 1):
                t0 = time.perf_counter()
                out = self.objective.step(self.model, batch)
                t1 = time.perf_counter()
                backend.backward(self.model, out.loss_sum / total)
                t_bwd += time.perf_counter() - t1
                t_fwd += t1 - t0
            loss_sum += out.loss_sum.detach()
            num_tokens += out.num_tokens
            for k, v in out.metric_sums.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + v
        t0 = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = backend.optimizer_step(
            self.model, self.optimizer, cfg.max_grad_norm, skip_nonfinite=cfg.max_nonfinite_steps > 0
        )
        self.scheduler.step()
        t_opt = time.perf_counter() - t0
        if backend.world_size > 1:
            loss_sum, num_tokens, metric_sums = self._sum_over_ranks(loss_sum, num_tokens, metric_sums)
        _, last_position, _ = drawn[-1]
        progress.global_step += 1
        progress.epoch, progress.batch_index = last_position.epoch, last_position.batch_index
        progress.consumed_samples += sum(n for _, _, n in drawn)
        progress.consumed_tokens += num_tokens
        step_s = t_fwd + t_bwd + t_opt
        metrics = {"train/loss": loss_sum / total, "train/grad_norm": grad_norm, "train/lr": lr}
        step_is_finite(progress, stage=self.session.stage, global_step=progress.global_step,
                       max_nonfinite_steps=cfg.max_nonfinite_steps, loss=metrics["train/loss"], grad_norm=grad_norm)
        if progress.nonfinite_steps:
            metrics["train/nonfinite_steps"] = progress.nonfinite_steps
        metrics.update({f"train/{k}": v / total for k, v in metric_sums.items()})
        metrics.update(
            {
                "train/tokens_per_s": num_tokens / max(step_s, 1e-9),
                "time/forward_s": t_fwd,
                "time/backward_s": t_bwd,
                "time/optimizer_s": t_opt,
            }
        )
        return metrics

    def _sum_over_ranks(
        self, loss_sum: Tensor, num_tokens: int, metric_sums: dict[str, Tensor]
    ) -> tuple[Tensor, int, dict[str, Tensor]]:
        """Collective: a step's loss sum, token count and metric sums summed over every rank (one all-reduce)."""
        device, keys = self.backend.device, sorted(metric_sums)
        local = torch.stack(
            [loss_sum.float(), torch.tensor(float(num_tokens), device=device)]
            + [torch.as_tensor(metric_sums[k], device=device).float() for k in keys]
        )
        summed = self.backend.all_reduce_sum(local)
        return summed[0], int(summed[1].item()), {k: summed[2 + j] for j, k in enumerate(keys)}

    def _log(self, metrics: dict[str, Any]) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        values["memory/peak_bytes"] = float(_peak_memory_bytes(self.backend.device))
        values["train/consumed_samples"] = float(self.progress.consumed_samples)
        self._emit(values)

    def _emit(self, values: dict[str, float]) -> None:
        self._remember(values)
        self.metrics.emit(values, self.progress.global_step)

    def _remember(self, values: dict[str, float]) -> None:
        """Keep the latest value of each metric, and the first of the loss and eval metrics (a
        skipped step's NaN is not kept)."""
        history = self.progress.history
        for k, v in finite_only(values).items():
            if k == "train/loss" or k.startswith("eval/"):
                history.setdefault(f"first/{k}", v)
            history[k] = v

    def _evaluate(self) -> bool:
        """Evaluate, log, update early-stopping state; True when training should stop."""
        model = self.model
        was_training = model.training
        model.eval()
        with torch.no_grad():
            metrics = {f"eval/{k}": float(v) for k, v in self.objective.evaluate(model).items()}
        model.train(was_training)
        check_finite_metrics(metrics, stage=self.session.stage, global_step=self.progress.global_step,
                             what="held-out evaluation after that step")
        self._emit(metrics)
        loss = metrics["eval/loss"]
        progress = self.progress
        if progress.best_eval_loss is None or loss < progress.best_eval_loss:
            progress.best_eval_loss, progress.evals_without_improvement = loss, 0
        else:
            progress.evals_without_improvement += 1
        patience = self.cfg.early_stopping_patience
        return patience is not None and progress.evals_without_improvement >= patience

    def save(self) -> None:
        """Checkpoint the current state (see :meth:`CheckpointSession.save`); the upload may
        overlap the next steps on one process."""
        self._track_best(step_dirname(self.progress.global_step))
        self.session.save(self.progress, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)

    def _track_best(self, name: str) -> None:
        """Record ``name`` as the best checkpoint when its latest ``keep_best_metric`` is lowest."""
        metric = self.cfg.keep_best_metric
        value = self.progress.history.get(metric) if metric else None
        if value is None:
            return
        best = self.progress.best_checkpoint_metric
        if best is None or value < best:
            self.progress.best_checkpoint, self.progress.best_checkpoint_metric = name, float(value)


def summarize(progress: TrainProgress) -> dict[str, float]:
    """Final metrics of a stage: latest and first values, global step; NaN-free."""
    out = {k: float(v) for k, v in progress.history.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    out["global_step"] = float(progress.global_step)
    return out
