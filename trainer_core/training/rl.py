"""The online RL loop shared by the PPO and GRPO stages: rollout, then epochs of mini-batch updates.

One iteration (``global_step`` counts iterations, as ``max_steps`` does), on every rank:

1. take the next ``prompts_per_rollout`` prompts (a seeded shuffle per epoch of the prompt set);
   rank ``r`` of ``world_size`` takes prompts ``r, r + world_size, ...`` (equal shares; a GRPO
   group stays on one rank);
2. sample ``samples_per_prompt`` completions of each from the policy (:mod:`trainer_core.rollout`),
   score them, and compute the rollout log-probs (and values), the reference log-probs and the
   advantages without gradients (PPO whitens with statistics summed over ranks);
3. ``ppo_epochs`` passes over the rollout batch, each rank cutting its rows into
   ``num_mini_batches`` parts in a seeded random order (see :meth:`RLTrainer.update` for uneven
   parts); one optimizer step per mini-batch, the loss normalised by the mini-batch's
   ``num_valid_tokens`` summed over ranks (the step one device takes on the union of the ranks'
   rows); the LR schedule steps once per iteration;
4. update the KL controller with the KL of the whole batch, log metrics computed over every
   rank's sequences and tokens (rank 0 prints them), checkpoint every ``save_every`` iterations.

The trainable :class:`~trainer_core.rollout.PolicyAndValue` goes through ``Backend.wrap`` and
``setup_optimizer`` whole (TRL's ``PolicyAndValueWrapper``: one optimizer over policy and value
head). Gradient-free forwards call the unwrapped module (a DDP forward broadcasts buffers, a
collective). Under a sharded backend (``Backend.sharded_forward``: FSDP2, ZeRO-3) every forward
is a collective, so ranks run the same forwards in the same order: equal prompt shares, equal
reward-model and reference batches, and sampling that runs until every rank's rows are done.

Checkpoints go through the stage's :class:`~trainer_core.checkpoint.session.CheckpointSession`
(as in :class:`~trainer_core.training.loop.TrainLoop`): the model, optimizer, scheduler, each
rank's global RNG and progress (the prompt position is ``progress.epoch`` /
``progress.batch_index``), plus this loop's ``rl_state.json`` (the KL controller: replicated,
its checksums compared across ranks first) and ``sampler_rng.pt`` (every rank's sampling
generator, in rank order), so a resumed run samples and steps as one never stopped. Metrics go
to MLflow once the checkpoint covering them is committed.

Unused fields of the shared stage config: ``micro_batch_size``, ``grad_accum_steps``,
``global_batch_size`` (a DeepSpeed engine takes one step per mini-batch), ``eval_every``,
``eval_max_batches``, ``keep_best_metric``, ``early_stopping_patience``; held-out evaluation
is the ``evaluate`` stage's job.

Shape legend: N sequences (this rank's), T completion tokens.
"""

from __future__ import annotations

import io
import json
import logging
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from trainer_core.backends.base import Backend
from trainer_core.checkpoint.components import ReplicaMismatchError, state_checksum, torch_bytes
from trainer_core.checkpoint.manifest import Manifest
from trainer_core.checkpoint.session import CheckpointSession
from trainer_core.checkpoint.train_state import TrainProgress
from trainer_core.config import RLStageConfig
from trainer_core.data.batching import collate_prompts_left
from trainer_core.errors import ConfigError
from trainer_core.objectives.ppo import KL_ESTIMATORS, AdaptiveKLController, FixedKLController
from trainer_core.rewards import PromptItem, RewardFunction, is_correct
from trainer_core.rollout import (
    PolicyAndValue,
    PolicyForward,
    RolloutBatch,
    forward_completions,
    masked_row,
    policy_forward,
    sample_completions,
)
from trainer_core.storage import join_uri, read_bytes
from trainer_core.training.guard import check_finite_metrics, check_finite_tensors, finite_only, step_is_finite
from trainer_core.training.loop import build_optimizer, build_scheduler

log = logging.getLogger(__name__)

FIRST_KEYS = ("reward_mean", "verifier_accuracy", "objective/scores", "objective/rlhf_reward")
"""Metrics whose first value is also kept (``first/<name>``) for the stage summary."""

RL_CHECKPOINT_LAYOUT = 2
"""``extra.rl_checkpoint`` of the manifests this module writes: 2 = one policy-and-value model in
the backend's format, ``sampler_rng.pt`` a list per rank. Checkpoints without it (layout 1: the
policy and ``value_head.safetensors`` apart) are not resumed from."""


class Algorithm(Protocol):
    """What PPO and GRPO plug into the loop."""

    samples_per_prompt: int
    uses_values: bool

    def prepare(self, batch: RolloutBatch, kl_coef: float, all_reduce_sum: Callable[[Tensor], Tensor]) -> None:
        """Set ``batch.advantages`` (and ``returns``) from scores, values and reference log-probs;
        ``all_reduce_sum`` (``Backend.all_reduce_sum``) for statistics over every rank's rows."""

    def loss(
        self, batch: RolloutBatch, out: PolicyForward, num_valid_tokens: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(this rank's loss: its real tokens' losses summed, divided by ``num_valid_tokens``, the
        mini-batch's count over every rank; detached scalar metric sums over its real tokens)."""


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Scalar sum of ``x`` [N, T] where ``mask`` [N, T] is 1 (the numerator of ``masked_mean``)."""
    return (x * mask).sum()


def prompt_order(num_prompts: int, seed: int, epoch: int) -> list[int]:
    """The prompt indices of ``epoch`` in order: a ``random.Random(seed + epoch)`` shuffle."""
    order = list(range(num_prompts))
    random.Random(seed + epoch).shuffle(order)
    return order


def next_prompts(progress: TrainProgress, num_prompts: int, count: int, seed: int) -> list[int]:
    """The next ``count`` prompt indices from ``(progress.epoch, progress.batch_index)``; advances it."""
    out: list[int] = []
    while len(out) < count:
        order = prompt_order(num_prompts, seed, progress.epoch)
        take = order[progress.batch_index : progress.batch_index + count - len(out)]
        out.extend(take)
        progress.batch_index += len(take)
        if progress.batch_index >= num_prompts:
            progress.epoch, progress.batch_index = progress.epoch + 1, 0
    return out


def sampler_seed(seed: int, rank: int) -> int:
    """Seed of rank ``rank``'s sampling generator: ``seed`` on rank 0 (a one-rank run samples as
    before ranks existed), distinct on the others so that ranks do not draw the same numbers."""
    return seed + 1_000_003 * rank


def check_rl_config(stage: str, cfg: RLStageConfig, samples_per_prompt: int, world_size: int) -> None:
    """Validate an RL stage's config for ``world_size`` data-parallel ranks.

    Raises:
        ConfigError: temperature 0 (RL samples); ``prompts_per_rollout`` not a multiple of the
            world size (every rank takes an equal share: sharded forwards run in lockstep);
            more ``num_mini_batches`` than the rollout batch has sequences.
    """
    if cfg.generation.temperature <= 0:
        raise ConfigError(f"{stage}.generation.temperature must be > 0: RL stages sample")
    if cfg.prompts_per_rollout % world_size:
        raise ConfigError(
            f"{stage}.prompts_per_rollout={cfg.prompts_per_rollout} must be a multiple of the world size "
            f"({world_size}): every rank samples an equal share of each rollout's prompts"
        )
    if cfg.num_mini_batches > cfg.prompts_per_rollout * samples_per_prompt:
        raise ConfigError(
            f"{stage}.num_mini_batches={cfg.num_mini_batches} exceeds the rollout batch's number of sequences "
            f"({cfg.prompts_per_rollout * samples_per_prompt} = prompts_per_rollout x samples per prompt)"
        )


def engine_config(cfg: RLStageConfig, samples_per_prompt: int, world_size: int) -> RLStageConfig:
    """``cfg`` as ``Backend.setup_optimizer`` sees it: one optimizer step per mini-batch.

    A DeepSpeed engine's config takes the micro-batch size and accumulation from the stage
    config; here a mini-batch (this rank's rows of it) is one micro-batch, and there is no
    accumulation (``grad_accum_steps`` 1, no ``global_batch_size``).
    """
    rows = cfg.prompts_per_rollout // world_size * samples_per_prompt
    micro = max(1, math.ceil(rows / cfg.num_mini_batches))
    return cfg.model_copy(update={"micro_batch_size": micro, "grad_accum_steps": 1, "global_batch_size": None})


@dataclass
class RLTrainer:
    """Runs one RL stage; see the module docstring.

    Attributes:
        backend: the backend it runs on.
        tokenizer: decodes completions (its pad and EOS ids delimit them).
        cfg: the stage config.
        algo: PPO or GRPO.
        model: the trainable :class:`PolicyAndValue` as ``Backend.wrap`` returned it; replaced by
            what ``Backend.setup_optimizer`` returns (a DeepSpeed engine).
        reference: the frozen reference (``Backend.prepare_frozen``), or None (no KL term).
        reward_fn: scores completions.
        prompts: the RL prompt set.
        seed: the pipeline seed (prompt order, sampling).
        session: checkpoints and metrics; create it with ``extra={"rl_checkpoint":
            RL_CHECKPOINT_LAYOUT}`` so that its manifests carry this loop's layout.
    """

    backend: Backend
    tokenizer: PreTrainedTokenizerBase
    cfg: RLStageConfig
    algo: Algorithm
    model: nn.Module
    reference: nn.Module | None
    reward_fn: RewardFunction
    prompts: list[PromptItem]
    seed: int
    session: CheckpointSession
    progress: TrainProgress = field(default_factory=TrainProgress)

    def __post_init__(self) -> None:
        cfg, backend = self.cfg, self.backend
        engine_cfg = engine_config(cfg, self.algo.samples_per_prompt, backend.world_size)
        self.model, self.optimizer = backend.setup_optimizer(self.model, build_optimizer(self.model, cfg), engine_cfg)
        self.module: PolicyAndValue = backend.unwrap(self.model)  # gradient-free forwards
        self.scheduler = build_scheduler(self.optimizer, cfg)
        kl = cfg.kl_coef
        adaptive = AdaptiveKLController(kl, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl else None
        self.kl_ctl = adaptive or FixedKLController(kl)
        self.generator = torch.Generator(device=backend.device).manual_seed(sampler_seed(self.seed, backend.rank))
        self.metrics = self.session.metrics

    @property
    def policy(self) -> nn.Module:
        """The policy (an HF causal LM; sharded in place under FSDP2, partitioned under ZeRO-3)."""
        return self.module.policy

    @property
    def value_head(self) -> nn.Module | None:
        """The value head, or None."""
        return self.module.value_head

    # ----- rollout -----------------------------------------------------------------

    @torch.no_grad()
    def rollout(self) -> tuple[RolloutBatch, list[str], list[PromptItem]]:
        """Sample, score and evaluate this rank's share of one rollout batch (no gradients);
        advances the prompt position (by the whole batch, on every rank)."""
        cfg, tok, backend = self.cfg, self.tokenizer, self.backend
        device, group = backend.device, self.algo.samples_per_prompt
        picked = next_prompts(self.progress, len(self.prompts), cfg.prompts_per_rollout, self.seed)
        items = [self.prompts[i] for i in picked[backend.rank :: backend.world_size] for _ in range(group)]
        padded = collate_prompts_left([{"input_ids": p.input_ids} for p in items], tok.pad_token_id)
        p_ids, p_mask = padded["input_ids"].to(device), padded["attention_mask"].to(device).float()
        # Sampling, old and reference log-probs in the training forward's precision (an
        # on-policy ratio is 1 only when both compute alike).
        with backend.autocast():
            c_ids, c_mask = sample_completions(
                self.module, p_ids, p_mask, cfg.generation, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                generator=self.generator, sync=backend.all_reduce_sum if backend.sharded_forward else None,
            )
            out = self.forward(self.module, p_ids, p_mask, c_ids, c_mask)
            ref = None
            if self.reference is not None:
                ref, _, _ = forward_completions(
                    self.reference, p_ids, p_mask, c_ids, c_mask, temperature=cfg.generation.temperature
                )
        decoded = tok.batch_decode(c_ids.masked_fill(c_mask == 0, tok.pad_token_id), skip_special_tokens=True)
        texts = [t.strip() for t in decoded]
        batch = RolloutBatch(
            prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids, completion_mask=c_mask, logprobs=out.logprobs,
            scores=self.reward_fn(items, texts).to(device),
            prompt_index=torch.arange(len(items), device=device) // group,
            ref_logprobs=ref, values=out.values * c_mask if out.values is not None else None,
        )
        self.algo.prepare(batch, self.kl_ctl.value, backend.all_reduce_sum)
        check_finite_tensors({"rewards": batch.scores, "advantages": batch.advantages}, stage=self.session.stage,
                             global_step=self.progress.global_step + 1, all_reduce_sum=backend.all_reduce_sum)
        return batch, texts, items

    def rollout_metrics(self, batch: RolloutBatch, texts: list[str], items: list[PromptItem]) -> dict[str, float]:
        """TRL's ``objective/*`` metrics plus reward, length and verifier accuracy of the whole
        rollout batch: every rank's per-sequence values are gathered (in rank order), so every
        rank computes the same numbers (the KL controller's input among them)."""
        mask = batch.completion_mask
        kl_seq = torch.zeros_like(batch.scores, dtype=torch.float32)
        if batch.ref_logprobs is not None:
            kl_seq = (KL_ESTIMATORS[self.cfg.kl_estimator](batch.logprobs, batch.ref_logprobs) * mask).sum(1)
        eos = (batch.completion_ids == self.tokenizer.eos_token_id) & (mask > 0)
        local = {
            "scores": batch.scores.float(), "entropy": (-batch.logprobs * mask).sum(1), "length": mask.sum(1),
            "eos": eos.sum(1), "kl": kl_seq,
        }
        mine: dict[str, Any] = {k: v.detach().cpu() for k, v in local.items()}
        answered = all(i.answer is not None for i in items)
        mine["correct"] = [is_correct(t, i.answer) for t, i in zip(texts, items)] if answered else None
        ranks = self.backend.all_gather_object(mine)
        seq = {k: torch.cat([r[k] for r in ranks]) for k in local}
        scores = seq["scores"]
        m = {
            "objective/entropy": float(seq["entropy"].mean()),
            "objective/scores": float(scores.mean()),
            "objective/kl_coef": self.kl_ctl.value,
            "reward_mean": float(scores.mean()),
            "reward_std": float(scores.std()) if scores.numel() > 1 else 0.0,
            "response_length_tokens": float(seq["length"].mean()),
            "val/num_eos_tokens": float(seq["eos"].sum()),
            "objective/kl": float(seq["kl"].mean()),
        }
        m["objective/non_score_reward"] = -self.kl_ctl.value * m["objective/kl"]
        m["objective/rlhf_reward"] = m["objective/scores"] + m["objective/non_score_reward"]
        if all(r["correct"] is not None for r in ranks):
            m["verifier_accuracy"] = statistics.fmean(c for r in ranks for c in r["correct"])
        return m

    # ----- update ------------------------------------------------------------------

    def forward(self, model: nn.Module, p_ids: Tensor, p_mask: Tensor, c_ids: Tensor, c_mask: Tensor) -> PolicyForward:
        """:func:`~trainer_core.rollout.policy_forward` of ``self.model`` (training, through the
        backend's wrapper) or ``self.module`` (no gradients)."""
        temperature = self.cfg.generation.temperature
        with_values = self.value_head is not None
        return policy_forward(model, p_ids, p_mask, c_ids, c_mask, temperature=temperature, with_values=with_values)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """``ppo_epochs`` x ``num_mini_batches`` optimizer steps on the rollout batch; mean metrics.

        Each rank cuts its rows (seeded order) into ``num_mini_batches`` parts, rank ``r``'s list
        rotated by ``r x`` its row count: with uneven parts (fewer rows than mini-batches too) the
        global mini-batches stay as even as on one device. A rank with no row in a mini-batch
        forwards :func:`~trainer_core.rollout.masked_row` (counts nothing), so that every rank
        runs the same forwards and collectives.
        """
        cfg, rank, sums, count = self.cfg, self.backend.rank, {}, 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(batch.num_sequences, generator=self.generator, device=self.generator.device)
            parts = torch.tensor_split(order, cfg.num_mini_batches)
            shift = rank * batch.num_sequences % cfg.num_mini_batches
            for rows in parts[shift:] + parts[:shift]:
                mb = batch.select(rows) if len(rows) else masked_row(batch)
                for k, v in self.train_step(mb).items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                count += 1
        return {k: v / count for k, v in sums.items()}

    def train_step(self, mb: RolloutBatch) -> dict[str, Tensor]:
        """One optimizer step on a mini-batch (this rank's rows of it), collective.

        The loss is every rank's real tokens' losses summed over the mini-batch's
        ``num_valid_tokens`` over all ranks (the backend undoes its averaging over ranks), so
        the step is the one a single device takes on the union of the ranks' rows.

        Returns:
            Scalar metrics over every rank's tokens: the algorithm's, ``train/loss`` and
            ``train/grad_norm`` (before clipping).
        """
        backend = self.backend
        num_valid_tokens = backend.all_reduce_sum(mb.completion_mask.sum()).clamp(min=1.0)
        with backend.grad_sync(self.model, is_last_micro_batch=True):
            with backend.autocast():
                out = self.forward(self.model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask)
                loss, metric_sums = self.algo.loss(mb, out, num_valid_tokens)
            backend.backward(self.model, loss)
        cfg = self.cfg
        grad_norm = backend.optimizer_step(
            self.model, self.optimizer, cfg.max_grad_norm, skip_nonfinite=cfg.max_nonfinite_steps > 0
        )
        keys = sorted(metric_sums)
        summed = backend.all_reduce_sum(torch.stack([loss.detach().float()] + [metric_sums[k].float() for k in keys]))
        metrics = {k: summed[1 + j] / num_valid_tokens for j, k in enumerate(keys)}
        metrics["train/loss"], metrics["train/grad_norm"] = summed[0], grad_norm
        step_is_finite(self.progress, stage=self.session.stage, global_step=self.progress.global_step + 1,
                       max_nonfinite_steps=cfg.max_nonfinite_steps, loss=summed[0], grad_norm=grad_norm)
        return metrics

    # ----- loop --------------------------------------------------------------------

    def iteration(self) -> dict[str, float]:
        """One rollout + update on every rank; returns the iteration's (global) metrics."""
        backend = self.backend
        t0 = time.perf_counter()
        batch, texts, items = self.rollout()
        metrics = self.rollout_metrics(batch, texts, items)
        t1 = time.perf_counter()
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        metrics.update(self.update(batch))
        self.scheduler.step()
        t2 = time.perf_counter()
        num_sequences = self.cfg.prompts_per_rollout * self.algo.samples_per_prompt
        check_finite_metrics({k: metrics[k] for k in ("objective/kl", "objective/entropy")}, stage=self.session.stage,
                             global_step=self.progress.global_step + 1, what="the rollout's log-probs")
        self.kl_ctl.update(metrics["objective/kl"], num_sequences)
        progress = self.progress
        progress.global_step += 1
        progress.consumed_samples += num_sequences
        progress.consumed_tokens += int(backend.all_reduce_sum(batch.completion_mask.sum()))
        metrics.update({"time/rollout_s": t1 - t0, "time/update_s": t2 - t1})
        return metrics

    def run(self) -> TrainProgress:
        """Iterate to ``max_steps``, checkpointing; then send the remaining metrics to the tracker.

        On an exception the in-flight checkpoint upload is still awaited and uncommitted
        metrics are dropped.
        """
        try:
            while self.progress.global_step < self.cfg.max_steps:
                self._emit(self.iteration())
                if self.progress.global_step % self.cfg.save_every == 0:
                    self.save()
        finally:
            self.session.close()
        self.metrics.flush()
        return self.progress

    def _emit(self, metrics: dict[str, float]) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        values["train/consumed_samples"] = float(self.progress.consumed_samples)
        history = self.progress.history
        for k, v in finite_only(values).items():
            if k in FIRST_KEYS:
                history.setdefault(f"first/{k}", v)
            history[k] = v
        self.metrics.emit(values, self.progress.global_step)

    # ----- checkpoints -------------------------------------------------------------

    def _validate_replicas(self) -> bool:
        return self.session.validate_replicas

    def rl_files(self) -> dict[str, bytes]:
        """Collective: the RL state beyond the supervised checkpoint, as GLOBAL files.

        ``rl_state.json`` (the KL controller, replicated: its checksums are compared across
        ranks first) and ``sampler_rng.pt`` (every rank's sampling generator state, in rank order).

        Raises:
            ReplicaMismatchError: the KL controller differs between ranks.
        """
        backend, state = self.backend, self.kl_ctl.state_dict()
        if backend.world_size > 1 and self._validate_replicas():
            checksums = backend.all_gather_object(state_checksum(state))
            if len(set(checksums)) != 1:
                raise ReplicaMismatchError("rl_state.json", checksums)
        sampler_states = backend.all_gather_object(self.generator.get_state())
        return {
            "rl_state.json": json.dumps({"kl_controller": state}).encode(),
            "sampler_rng.pt": torch_bytes(sampler_states),
        }

    def save(self) -> None:
        """Collective: checkpoint the state and this loop's files (see :meth:`CheckpointSession.save`)."""
        self.session.save(
            self.progress, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, files=self.rl_files()
        )

    def resume(self) -> bool:
        """Collective: load the latest checkpoint this run can resume (same fingerprint, a format
        the backend reads, this module's layout); True when one was loaded."""
        resumed = self.session.resume(self.model, self.optimizer, self.scheduler, accept=_layout_problem)
        if resumed is None:
            return False
        self.progress = resumed.progress
        state = json.loads(read_bytes(join_uri(resumed.uri, "rl_state.json")))
        self.kl_ctl.load_state_dict(state["kl_controller"])
        sampler_states = torch.load(io.BytesIO(read_bytes(join_uri(resumed.uri, "sampler_rng.pt"))), weights_only=True)
        backend = self.backend
        if backend.rank < len(sampler_states):
            self.generator.set_state(sampler_states[backend.rank])
        else:
            log.warning("checkpoint %s has no sampler state for rank %d (written by %d ranks)", resumed.uri,
                        backend.rank, len(sampler_states))
        return True


def _layout_problem(manifest: Manifest) -> str | None:
    layout = (manifest.extra or {}).get("rl_checkpoint")
    return None if layout == RL_CHECKPOINT_LAYOUT else f"RL layout {layout}, not {RL_CHECKPOINT_LAYOUT}"
