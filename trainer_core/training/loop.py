"""The training loop shared by every training stage (SFT, reward model, DPO).

A stage supplies an :class:`Objective` (how to count, step and evaluate a batch); the loop
owns optimisation: gradient accumulation normalised by the counted units of the whole
optimizer step, clipping, the LR schedule, periodic evaluation with early stopping,
checkpoints every ``save_every`` steps and exact resume from the latest complete one (both
through a :class:`~trainer_core.checkpoint.session.CheckpointSession`, whose metrics buffer
takes every logged value).

Units: ``global_step`` counts optimizer steps; a step consumes ``grad_accum_steps``
micro-batches of ``micro_batch_size`` examples each.

Host synchronisation (kept out of the step as torchtitan's train step keeps it out): within an
optimizer step the loop never makes the host wait for the device. Counts come from the collated
micro-batches on the host (:meth:`Objective.count`, and ``Objective.num_tokens`` where the
objective has it) before they are copied to the device without blocking; the step's loss, gradient norm and metric sums stay device tensors in a
:class:`StepRecord`. The loop reads them in ONE device-to-host copy (:func:`read_scalars`) when
it next needs a number: logging (every ``log_every`` steps), evaluation, a checkpoint, the end.
That read also runs the non-finite guard over every step since the previous read, in step order,
so a non-finite step still fails the stage before any checkpoint of it is written (a NaN step the
stage may not skip is reported up to ``log_every - 1`` steps later). Timings use CUDA events on
CUDA (:mod:`~trainer_core.training.timing`), read at logging time. What may still wait within a
step lies outside the loop: the objective's forward (an ``int(tensor)``, boolean-mask indexing,
transformers' padding-mask check) and the backend's ``optimizer_step(skip_nonfinite=True)``
decision.
"""

from __future__ import annotations

import abc
import logging
import math
import resource
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import Tensor, nn

from trainer_core.backends.base import Backend
from trainer_core.checkpoint.session import CheckpointSession
from trainer_core.checkpoint.train_state import TrainProgress
from trainer_core.config import OptimizerStageConfig, TrainStageConfig
from trainer_core.data.batching import BucketedBatchSampler, DataPosition, iterate_batches
from trainer_core.training.guard import check_finite_metrics, finite_only, step_is_finite
from trainer_core.training.schedule import build_scheduler
from trainer_core.training.timing import PhaseTimer, phase_timer

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """One micro-batch's contribution to an optimizer step.

    Attributes:
        loss_sum: scalar, the loss summed over the micro-batch's counted units (tokens for
            SFT, pairs for reward model and DPO); the loop divides by the step's total count.
        num_tokens: non-padding tokens processed (for throughput): a host int, or a device
            scalar (summed on the device, read at logging time). Not used (may be None) when the
            objective has ``num_tokens(batch)``, which counts them on the host batch; an
            ``int(mask.sum())`` of a device tensor here makes the host wait for the device.
        metric_sums: per-unit metrics summed over the micro-batch (detached, on the device); the
            loop reports them divided by the step's total count.
        aux_loss: a scalar loss of the whole micro-batch (a mixture of experts' router
            load-balancing loss, already weighted), or None; the loop adds it weighted by the
            micro-batch's share of the step's count, so the step's loss gains the count-weighted
            mean of its micro-batches' aux losses.
    """

    loss_sum: Tensor
    num_tokens: int | Tensor | None = None
    metric_sums: dict[str, Tensor] = field(default_factory=dict)
    aux_loss: Tensor | None = None


class Objective(abc.ABC):
    """What a training stage plugs into the loop: subclass it and define :meth:`count`,
    :meth:`step` and :meth:`evaluate`; the other hooks do nothing unless a subclass overrides them.

    Attributes:
        metric_denominators: metric -> the metric whose step sum divides its step sum (KTO's
            per-label means), instead of the step's count; empty by default.
    """

    metric_denominators: Mapping[str, str] = MappingProxyType({})

    @abc.abstractmethod
    def count(self, batch: dict[str, Tensor]) -> int:
        """Counted units (loss tokens or pairs) in a micro-batch; the loop calls it on the collated
        batch on the host (CPU tensors), before the batch is copied to the device."""

    @abc.abstractmethod
    def step(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        """Forward one micro-batch; returns the summed loss with its graph."""

    @abc.abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics; must contain ``loss`` (lower is better, drives early stopping)."""

    def num_tokens(self, batch: dict[str, Tensor]) -> int | None:
        """The non-padding tokens of a micro-batch, counted on the host batch as :meth:`count` is;
        None (the default): the loop takes :attr:`StepOutput.num_tokens` instead."""
        return None

    def finalize_metrics(self, metric_sums: dict[str, Tensor]) -> dict[str, Tensor]:
        """Called with the step's metric sums (summed over ranks): removes the sums it consumes and
        returns metrics reported as they are (a mixture of experts' expert-usage shares and
        entropies). Default: nothing."""
        return {}

    def begin_step(self, steps_done: int) -> None:
        """Called before each optimizer step's first micro-batch with the steps taken so far
        (``global_step``; a mixture of experts' router temperature). Default: nothing."""


@dataclass
class BatchSource:
    """Deterministic micro-batches of a tokenised split.

    Attributes:
        rows: the split's rows: a list of dicts, or the lazy memory-mapped
            :class:`~trainer_core.data.prepared.PreparedRows` of a prepared split (a row is built
            when its micro-batch is collated, on the rank that trains on it).
        sampler: length-bucketed batch sampler, fully determined by (seed, epoch).
        collate: rows -> tensors dict.
        device: where batches go.
    """

    rows: Sequence[dict]
    sampler: BucketedBatchSampler
    collate: Callable[[list[dict]], dict[str, Tensor]]
    device: torch.device

    def host_stream(
        self, position: DataPosition, rank: int = 0, world_size: int = 1
    ) -> Iterator[tuple[dict[str, Tensor] | None, DataPosition, int]]:
        """Yield (collated batch on the host, position after it, number of examples) forever, from
        ``position``.

        With ``world_size`` > 1 the i-th micro-batch from ``position`` belongs to rank
        ``i % world_size``: only this rank's are collated; the others come as ``None`` (their
        position and size still count).
        """
        for i, (indices, after) in enumerate(iterate_batches(self.sampler, position)):
            if i % world_size != rank:
                yield None, after, len(indices)
                continue
            yield self.collate([self.rows[i] for i in indices]), after, len(indices)

    def to_device(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``batch`` copied to :attr:`device` without making the host wait (pinned first on CUDA)."""
        if self.device.type == "cuda":
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def stream(
        self, position: DataPosition, rank: int = 0, world_size: int = 1
    ) -> Iterator[tuple[dict[str, Tensor] | None, DataPosition, int]]:
        """As :meth:`host_stream`, with each batch on :attr:`device`."""
        for batch, after, size in self.host_stream(position, rank, world_size):
            yield (None if batch is None else self.to_device(batch)), after, size


def build_optimizer(model: nn.Module, cfg: OptimizerStageConfig) -> torch.optim.AdamW:
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


def peak_memory_bytes(device: torch.device) -> int:
    """The process's peak memory in bytes (the ``memory/peak_bytes`` metric): CUDA's peak
    allocation on ``device`` since the last reset, else the process's peak resident set size
    (``getrusage``'s ``ru_maxrss``, KiB on Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def scalar_on(value: float | Tensor, device: torch.device) -> Tensor:
    """``value`` as a float32 scalar (or tensor, when it is one) on ``device``, copied without making the host wait
    (``torch.tensor(x, device=cuda)`` copies synchronously: it waits for the stream)."""
    value = value if isinstance(value, Tensor) else torch.tensor(float(value), dtype=torch.float32)
    return value.to(device=device, dtype=torch.float32, non_blocking=True)


def read_scalars(values: list[float | int | Tensor], device: torch.device) -> list[float]:
    """Host floats of ``values`` (numbers, or scalar tensors), in order.

    The tensors on ``device``'s type come back in ONE device-to-host copy (the one place the loop
    waits for the device); each is converted to float64 on the device first, which is exact for
    every floating dtype up to float64 and integers below 2**53, so each value equals ``float(t)``.
    Tensors elsewhere (a CPU scalar from DeepSpeed on a CUDA run) are host values, read directly.
    """
    on_device = [isinstance(v, Tensor) and v.device.type == device.type for v in values]
    stacked = [v.detach().reshape(()).to(torch.float64) for v, d in zip(values, on_device) if d]
    read = iter(torch.stack(stacked).tolist() if stacked else [])
    return [next(read) if d else float(v) for v, d in zip(values, on_device)]


@dataclass
class StepRecord:
    """One optimizer step's results, kept on the device until the loop next reads it.

    Attributes:
        global_step: the step.
        metrics: name -> scalar (a device tensor, or a host number), in logging order; always
            ``train/loss`` and ``train/grad_norm`` (the non-finite guard reads them).
        num_tokens: the step's non-padding tokens over every rank (host int, or device scalar).
        timer: the step's phase timer (records nothing on a step that does not log).
    """

    global_step: int
    metrics: dict[str, float | Tensor]
    num_tokens: int | Tensor
    timer: PhaseTimer


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
        self._unread: list[StepRecord] = []

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
        stream = self.batches.host_stream(
            DataPosition(progress.epoch, progress.batch_index), backend.rank, backend.world_size
        )
        while progress.global_step < cfg.max_steps:
            logs = self._logs_at(progress.global_step + 1)
            self._unread.append(self._optimizer_step(stream, phase_timer(backend.device, enabled=logs)))
            if logs:
                self._log()
            stop = False
            if progress.global_step % cfg.eval_every == 0 or progress.global_step == cfg.max_steps:
                stop = self._evaluate()
            if progress.global_step % cfg.save_every == 0:
                self.save()
            if stop:
                log.info("early stopping at global_step %d", progress.global_step)
                progress.history["stopped_early"] = 1.0
                break
        self._read()

    def _logs_at(self, global_step: int) -> bool:
        """Whether the metrics of ``global_step`` are logged."""
        return global_step % self.cfg.log_every == 0 or global_step == self.cfg.max_steps

    def _optimizer_step(self, stream: Iterator, timer: PhaseTimer) -> StepRecord:
        """One optimizer step over ``grad_accum_steps`` micro-batches on every rank.

        The loss is summed over every counted unit of the global batch (all micro-batches of
        all ranks) and divided by their number, so the step equals one taken on a single
        device over ``grad_accum_steps x world_size`` micro-batches. Nothing here waits for the
        device (see the module docstring); the step's numbers come back as a :class:`StepRecord`.

        Args:
            stream: :meth:`BatchSource.host_stream` of this rank.
            timer: times the forward, backward and optimizer phases.
        """
        cfg, progress, backend, objective = self.cfg, self.progress, self.backend, self.objective
        objective.begin_step(progress.global_step)
        drawn = [next(stream) for _ in range(self.accum_steps * backend.world_size)]
        hosts = [batch for batch, _, _ in drawn if batch is not None]
        counts = [objective.count(batch) for batch in hosts]
        count = sum(counts)
        host_tokens = [objective.num_tokens(batch) for batch in hosts]
        counts_tokens = None not in host_tokens
        num_tokens: int | Tensor = sum(host_tokens) if counts_tokens else 0  # type: ignore[arg-type]
        micro = [self.batches.to_device(batch) for batch in hosts]
        total = backend.all_reduce_sum(scalar_on(count, backend.device)).clamp(min=1.0)
        loss_sum = torch.zeros((), device=backend.device)
        metric_sums: dict[str, Tensor] = {}
        for i, batch in enumerate(micro):
            with backend.grad_sync(self.model, is_last_micro_batch=i == len(micro) - 1):
                with timer.phase("forward"), backend.autocast():
                    out = objective.step(self.model, batch)
                loss = out.loss_sum if out.aux_loss is None else out.loss_sum + out.aux_loss * counts[i]
                with timer.phase("backward"):
                    backend.backward(self.model, loss / total)
            loss_sum += loss.detach()
            if not counts_tokens:
                if out.num_tokens is None:
                    raise TypeError(f"{type(objective).__name__}.num_tokens(batch) gave None and its step gave none")
                num_tokens = num_tokens + out.num_tokens
            for k, v in out.metric_sums.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + v
        with timer.phase("optimizer"):
            lr = self.scheduler.get_last_lr()[0]
            grad_norm = backend.optimizer_step(
                self.model, self.optimizer, cfg.max_grad_norm, skip_nonfinite=cfg.max_nonfinite_steps > 0
            )
            self.scheduler.step()
        if backend.world_size > 1:
            loss_sum, num_tokens, metric_sums = self._sum_over_ranks(loss_sum, num_tokens, metric_sums)
        _, last_position, _ = drawn[-1]
        progress.global_step += 1
        progress.epoch, progress.batch_index = last_position.epoch, last_position.batch_index
        progress.consumed_samples += sum(n for _, _, n in drawn)
        metrics = {"train/loss": loss_sum / total, "train/grad_norm": grad_norm, "train/lr": lr}
        metrics.update({f"train/{k}": v for k, v in objective.finalize_metrics(metric_sums).items()})
        per = objective.metric_denominators
        metrics.update(
            {
                f"train/{k}": v / (metric_sums[per[k]].clamp(min=1.0) if k in per else total)
                for k, v in metric_sums.items()
            }
        )
        return StepRecord(progress.global_step, metrics, num_tokens, timer)

    def _sum_over_ranks(
        self, loss_sum: Tensor, num_tokens: int | Tensor, metric_sums: dict[str, Tensor]
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Collective: a step's loss sum, token count and metric sums summed over every rank (one
        all-reduce; the results stay on the device). A metric sum may be a tensor of any shape
        (a mixture of experts' [blocks, experts] counts); it comes back in its shape."""
        device, keys = self.backend.device, sorted(metric_sums)
        values = [scalar_on(v, device) for v in [loss_sum, num_tokens] + [metric_sums[k] for k in keys]]
        summed = self.backend.all_reduce_sum(torch.cat([v.reshape(-1) for v in values]))
        out, start = [], 0
        for v in values:
            out.append(summed[start : start + v.numel()].reshape(v.shape))
            start += v.numel()
        return out[0], out[1], dict(zip(keys, out[2:]))

    def _read(self) -> StepRecord | None:
        """Read every step not read yet in one device-to-host copy: the non-finite guard checks each
        in step order and its tokens join ``progress.consumed_tokens``. Returns the latest step's
        record with host floats (None when nothing was unread).

        Raises:
            NonFiniteError: a non-finite step the stage may not skip (see :mod:`.guard`).
        """
        records, self._unread = self._unread, []
        if not records:
            return None
        values = [v for r in records for v in (*r.metrics.values(), r.num_tokens)]
        floats = iter(read_scalars(values, self.backend.device))
        read = [
            StepRecord(r.global_step, {k: next(floats) for k in r.metrics}, int(next(floats)), r.timer) for r in records
        ]
        cfg, progress = self.cfg, self.progress
        for r in read:
            progress.consumed_tokens += r.num_tokens
            step_is_finite(
                progress,
                stage=self.session.stage,
                global_step=r.global_step,
                max_nonfinite_steps=cfg.max_nonfinite_steps,
                loss=r.metrics["train/loss"],
                grad_norm=r.metrics["train/grad_norm"],
            )
        return read[-1]

    def _log(self) -> None:
        """Log the latest step (read with every unread one: the step's one wait for the device)."""
        record = self._read()
        metrics = dict(record.metrics)
        values = {k: metrics.pop(k) for k in ("train/loss", "train/grad_norm", "train/lr")}
        if self.progress.nonfinite_steps:
            values["train/nonfinite_steps"] = float(self.progress.nonfinite_steps)
        values.update(metrics)
        seconds = record.timer.seconds()
        t_fwd, t_bwd, t_opt = (seconds.get(phase, 0.0) for phase in ("forward", "backward", "optimizer"))
        values.update(
            {
                "train/tokens_per_s": record.num_tokens / max(t_fwd + t_bwd + t_opt, 1e-9),
                "time/forward_s": t_fwd,
                "time/backward_s": t_bwd,
                "time/optimizer_s": t_opt,
            }
        )
        values["memory/peak_bytes"] = float(peak_memory_bytes(self.backend.device))
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
        """Evaluate, log, update early-stopping state; True when training should stop.

        The steps not read yet are read first (their non-finite guard runs before evaluating).
        """
        self._read()
        model = self.model
        was_training = model.training
        model.eval()
        with torch.no_grad(), self.backend.autocast():
            metrics = {f"eval/{k}": float(v) for k, v in self.objective.evaluate(model).items()}
        model.train(was_training)
        check_finite_metrics(
            metrics,
            stage=self.session.stage,
            global_step=self.progress.global_step,
            what="held-out evaluation after that step",
        )
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
        overlap the next steps on one process. The steps not read yet are read first, so a
        non-finite one fails the stage before its checkpoint and the progress saved is complete."""
        self._read()
        self._track_best(self.session.dirname(self.progress.global_step))
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
