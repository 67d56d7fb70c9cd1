"""The online RL loop shared by the PPO and GRPO stages: rollout, then epochs of mini-batch updates.

One iteration (``global_step`` counts iterations, as ``max_steps`` does):

1. take the next ``prompts_per_rollout`` prompts (a seeded shuffle per epoch of the prompt set);
2. sample ``samples_per_prompt`` completions of each from the policy (:mod:`trainer_core.rollout`),
   score them with the reward function, and compute the rollout log-probs (and values), the
   reference log-probs and the algorithm's advantages, all without gradients;
3. ``ppo_epochs`` passes over the rollout batch, each cut into ``num_mini_batches`` mini-batches
   in a seeded random order; one optimizer step per mini-batch, its loss normalised by the
   mini-batch's ``num_valid_tokens``; the LR schedule steps once per iteration;
4. update the KL controller, log the metrics, checkpoint every ``save_every`` iterations.

A checkpoint holds the policy, optimizer (policy and value head parameters in one AdamW, as
TRL's ``PolicyAndValueWrapper``), scheduler, global RNG and progress (the prompt position is
``progress.epoch`` / ``progress.batch_index``), plus ``value_head.safetensors``,
``rl_state.json`` (KL controller) and ``sampler_rng.pt`` (the sampling generator). A resumed run
therefore samples the same prompts and tokens and takes the same steps as one never stopped.
Metrics are printed at once and sent to MLflow only once the checkpoint covering them is
committed (as in :class:`~trainer_core.loop.TrainLoop`).

Unused fields of the shared stage config: ``micro_batch_size``, ``grad_accum_steps``,
``eval_every``, ``eval_max_batches``, ``keep_best_metric``, ``early_stopping_patience``; held-out
evaluation of the trained policy is the ``evaluate`` stage's job.

Shape legend: N sequences, T completion tokens, H hidden size.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import safetensors.torch
import torch
from torch import Tensor, nn

from trainer_core.checkpoint.manifest import find_latest, purge_checkpoints, step_dirname
from trainer_core.checkpoint.storage import read_bytes
from trainer_core.checkpoint.train_state import (
    METRICS_FILE,
    CheckpointSaver,
    TrainProgress,
    checkpoint_metrics,
    load_train_state,
    snapshot_train_state,
    write_checkpoint,
)
from trainer_core.config import RLStageConfig
from trainer_core.data.batching import collate_prompts_left
from trainer_core.errors import ConfigError
from trainer_core.generation import messages_of, prompt_ids
from trainer_core.loop import build_optimizer, build_scheduler, summarize
from trainer_core.models import load_causal_lm, load_reward_model
from trainer_core.objectives.ppo import KL_ESTIMATORS, AdaptiveKLController, FixedKLController
from trainer_core.rewards import (
    PromptItem,
    RewardFunction,
    RewardModelReward,
    build_reward,
    is_correct,
    needs_answers,
    needs_reward_model,
)
from trainer_core.rollout import RolloutBatch, forward_completions, sample_completions
from trainer_core.spec import checkpoints_uri, join_uri
from trainer_core.stages.common import StageContext, load_rows

log = logging.getLogger(__name__)

FIRST_KEYS = ("reward_mean", "verifier_accuracy", "objective/scores", "objective/rlhf_reward")
"""Metrics whose first value is also kept (``first/<name>``) for the stage summary."""


@dataclass
class PolicyForward:
    """The policy's outputs on a mini-batch, with gradients.

    Attributes:
        logprobs: [N, T] sampled-token log-probs (0 on padding).
        entropies: [N, T] detached entropies of the next-token distribution.
        values: [N, T] value predictions, or None without a value head.
    """

    logprobs: Tensor
    entropies: Tensor
    values: Tensor | None


class Algorithm(Protocol):
    """What PPO and GRPO plug into the loop."""

    samples_per_prompt: int
    uses_values: bool

    def prepare(self, batch: RolloutBatch, kl_coef: float) -> None:
        """Set ``batch.advantages`` (and ``returns``) from scores, values and reference log-probs."""

    def loss(self, batch: RolloutBatch, out: PolicyForward) -> tuple[Tensor, dict[str, Tensor]]:
        """The mini-batch's scalar loss (normalised by its real tokens) and detached scalar metrics."""


def value_head_for(policy: nn.Module) -> nn.Linear:
    """A zero-initialised ``Linear(H, 1)`` on the policy's last hidden state (shared trunk).

    Shared trunk rather than a separate critic initialised from the reward model (TRL,
    OpenRLHF): one forward gives log-probs and values, and one model fewer sits in memory,
    which is what a CPU run can afford. Zero init makes every initial value 0.
    """
    head = nn.Linear(policy.config.hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


def load_prompts(ctx: StageContext, cfg: RLStageConfig) -> list[PromptItem]:
    """RL prompts: the prepared ``sft/train`` rows (only those with an answer when the reward needs one).

    Raises:
        ConfigError: no usable prompt.
    """
    rows = load_rows(ctx, "sft/train")
    if needs_answers(cfg.reward):
        rows = [r for r in rows if r["answer"] is not None]
    if not rows:
        raise ConfigError("no RL prompts: sft/train has no rows (with a final answer, for the verifier reward)")
    data = ctx.config.data
    return [PromptItem(messages_of(r), prompt_ids(ctx.tokenizer, messages_of(r), data), r["answer"]) for r in rows]


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


def _reward_fn(ctx: StageContext, cfg: RLStageConfig) -> RewardFunction:
    def load() -> RewardFunction:
        rm = load_reward_model(ctx.input("reward_model"), ctx.config.model, ctx.tokenizer, ctx.config.seed)
        rm = ctx.backend.prepare_frozen(rm)
        return RewardModelReward(rm, ctx.tokenizer, ctx.config.data, cfg.generation.batch_size, ctx.backend.device)

    return build_reward(cfg.reward, load if needs_reward_model(cfg.reward) else None)


def _check(cfg: RLStageConfig, samples_per_prompt: int) -> None:
    if cfg.generation.temperature <= 0:
        raise ConfigError("RL stages sample: generation.temperature must be > 0")
    if cfg.num_mini_batches > cfg.prompts_per_rollout * samples_per_prompt:
        raise ConfigError("num_mini_batches exceeds the rollout batch's number of sequences")


@dataclass
class RLTrainer:
    """Runs one RL stage; see the module docstring.

    Attributes:
        ctx: the stage context.
        cfg: the stage config.
        algo: PPO or GRPO.
        policy: the trainable policy.
        reference: the frozen reference, or None (no KL term).
        reward_fn: scores completions.
        prompts: the RL prompt set.
    """

    ctx: StageContext
    cfg: RLStageConfig
    algo: Algorithm
    policy: nn.Module
    reference: nn.Module | None
    reward_fn: RewardFunction
    prompts: list[PromptItem]
    value_head: nn.Module | None = None
    progress: TrainProgress = field(default_factory=TrainProgress)

    def __post_init__(self) -> None:
        cfg, device = self.cfg, self.ctx.backend.device
        if self.algo.uses_values:
            self.value_head = value_head_for(self.policy).to(device)
        parts = {"policy": self.policy} | ({"value_head": self.value_head} if self.value_head is not None else {})
        self.trainable = nn.ModuleDict(parts)
        self.optimizer = build_optimizer(self.trainable, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        kl = cfg.kl_coef
        adaptive = AdaptiveKLController(kl, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl else None
        self.kl_ctl = adaptive or FixedKLController(kl)
        self.generator = torch.Generator(device=device).manual_seed(self.ctx.config.seed)
        self.saver = CheckpointSaver(asynchronous=cfg.async_save)
        self.checkpoints_uri = checkpoints_uri(self.ctx.spec.output_uri)
        self._uncommitted: list[tuple[dict[str, float], int]] = []

    # ----- rollout -----------------------------------------------------------------

    @torch.no_grad()
    def rollout(self) -> tuple[RolloutBatch, list[str], list[PromptItem]]:
        """Sample, score and evaluate one rollout batch (no gradients); advances the prompt position."""
        cfg, tok, device = self.cfg, self.ctx.tokenizer, self.ctx.backend.device
        group = self.algo.samples_per_prompt
        picked = next_prompts(self.progress, len(self.prompts), cfg.prompts_per_rollout, self.ctx.config.seed)
        items = [self.prompts[i] for i in picked for _ in range(group)]
        padded = collate_prompts_left([{"input_ids": p.input_ids} for p in items], tok.pad_token_id)
        p_ids, p_mask = padded["input_ids"].to(device), padded["attention_mask"].to(device).float()
        c_ids, c_mask = sample_completions(
            self.policy, p_ids, p_mask, cfg.generation, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
            generator=self.generator,
        )
        decoded = tok.batch_decode(c_ids.masked_fill(c_mask == 0, tok.pad_token_id), skip_special_tokens=True)
        texts = [t.strip() for t in decoded]
        temperature = cfg.generation.temperature
        logprobs, _, hidden = forward_completions(
            self.policy, p_ids, p_mask, c_ids, c_mask, temperature=temperature, with_hidden=self.value_head is not None
        )
        values = self.value_head(hidden).squeeze(-1).float() * c_mask if hidden is not None else None
        ref = None
        if self.reference is not None:
            ref, _, _ = forward_completions(self.reference, p_ids, p_mask, c_ids, c_mask, temperature=temperature)
        batch = RolloutBatch(
            prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids, completion_mask=c_mask, logprobs=logprobs,
            scores=self.reward_fn(items, texts).to(device),
            prompt_index=torch.arange(len(items), device=device) // group,
            ref_logprobs=ref, values=values,
        )
        self.algo.prepare(batch, self.kl_ctl.value)
        return batch, texts, items

    def rollout_metrics(self, batch: RolloutBatch, texts: list[str], items: list[PromptItem]) -> dict[str, float]:
        """TRL's ``objective/*`` metrics plus reward, length and verifier accuracy of a rollout."""
        mask, scores = batch.completion_mask, batch.scores.float()
        m = {
            "objective/entropy": float((-batch.logprobs * mask).sum(1).mean()),
            "objective/scores": float(scores.mean()),
            "objective/kl_coef": self.kl_ctl.value,
            "reward_mean": float(scores.mean()),
            "reward_std": float(scores.std()) if scores.numel() > 1 else 0.0,
            "response_length_tokens": float(mask.sum(1).mean()),
            "val/num_eos_tokens": float(((batch.completion_ids == self.ctx.tokenizer.eos_token_id) & (mask > 0)).sum()),
        }
        kl_seq = torch.zeros_like(scores)
        if batch.ref_logprobs is not None:
            kl_seq = (KL_ESTIMATORS[self.cfg.kl_estimator](batch.logprobs, batch.ref_logprobs) * mask).sum(1)
        m["objective/kl"] = float(kl_seq.mean())
        m["objective/non_score_reward"] = -self.kl_ctl.value * m["objective/kl"]
        m["objective/rlhf_reward"] = m["objective/scores"] + m["objective/non_score_reward"]
        if all(i.answer is not None for i in items):
            m["verifier_accuracy"] = statistics.fmean(is_correct(t, i.answer) for t, i in zip(texts, items))
        return m

    # ----- update ------------------------------------------------------------------

    def policy_forward(self, mb: RolloutBatch) -> PolicyForward:
        """The policy (and value head) on a mini-batch, with gradients."""
        logprobs, entropies, hidden = forward_completions(
            self.policy, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask,
            temperature=self.cfg.generation.temperature, with_hidden=self.value_head is not None,
        )
        values = self.value_head(hidden).squeeze(-1).float() if hidden is not None else None
        return PolicyForward(logprobs, entropies, values)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """``ppo_epochs`` x ``num_mini_batches`` optimizer steps on the rollout batch; mean metrics."""
        cfg, sums, count = self.cfg, {}, 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(batch.num_sequences, generator=self.generator, device=self.generator.device)
            for rows in torch.tensor_split(order, cfg.num_mini_batches):
                mb = batch.select(rows)
                out = self.policy_forward(mb)
                loss, metrics = self.algo.loss(mb, out)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                metrics["train/grad_norm"] = self.ctx.backend.clip_grad_norm(self.trainable, cfg.max_grad_norm)
                metrics["train/loss"] = loss.detach()
                self.optimizer.step()
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                count += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {k: v / count for k, v in sums.items()}

    # ----- loop --------------------------------------------------------------------

    def iteration(self) -> dict[str, float]:
        """One rollout + update; returns the iteration's metrics."""
        t0 = time.perf_counter()
        batch, texts, items = self.rollout()
        metrics = self.rollout_metrics(batch, texts, items)
        t1 = time.perf_counter()
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        metrics.update(self.update(batch))
        self.scheduler.step()
        t2 = time.perf_counter()
        self.kl_ctl.update(metrics["objective/kl"], batch.num_sequences)
        progress = self.progress
        progress.global_step += 1
        progress.consumed_samples += batch.num_sequences
        progress.consumed_tokens += int(batch.completion_mask.sum())
        metrics.update({"time/rollout_s": t1 - t0, "time/update_s": t2 - t1})
        return metrics

    def run(self) -> TrainProgress:
        """Iterate to ``max_steps``, checkpointing; then flush the remaining metrics."""
        try:
            while self.progress.global_step < self.cfg.max_steps:
                self._emit(self.iteration())
                if self.progress.global_step % self.cfg.save_every == 0:
                    self.save()
        finally:
            self.saver.close()
        self.ctx.commit_metrics(self._uncommitted)
        self._uncommitted = []
        return self.progress

    def _emit(self, metrics: dict[str, float]) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        values["train/consumed_samples"] = float(self.progress.consumed_samples)
        history = self.progress.history
        for k, v in values.items():
            if k in FIRST_KEYS:
                history.setdefault(f"first/{k}", v)
            history[k] = v
        step = self.progress.global_step
        self.ctx.print_metrics(values, step)
        self._uncommitted.append((values, step))

    # ----- checkpoints -------------------------------------------------------------

    def manifest_fields(self) -> dict[str, Any]:
        ctx = self.ctx
        return {
            "stage": ctx.spec.stage, "run_id": ctx.spec.run_id, "config_hash": ctx.stage_hash(),
            "backend": ctx.backend.name, "world_size": ctx.backend.world_size,
            "extra": {"mlflow_run_id": ctx.spec.mlflow_run_id},
        }

    def extra_files(self) -> dict[str, bytes]:
        """The RL state beyond the supervised checkpoint: value head, KL controller, sampling RNG."""
        buf = io.BytesIO()
        torch.save(self.generator.get_state(), buf)
        files = {
            "rl_state.json": json.dumps({"kl_controller": self.kl_ctl.state_dict()}).encode(),
            "sampler_rng.pt": buf.getvalue(),
        }
        if self.value_head is not None:
            files["value_head.safetensors"] = value_head_bytes(self.value_head)
        return files

    def save(self) -> None:
        """Snapshot now; write, commit, flush the covered metrics and purge in the saver's thread."""
        uri = join_uri(self.checkpoints_uri, step_dirname(self.progress.global_step))
        files = snapshot_train_state(
            model=self.ctx.backend.unwrap(self.policy), optimizer=self.optimizer, scheduler=self.scheduler,
            progress=self.progress,
        )
        files.update(self.extra_files())
        progress, fields = copy.deepcopy(self.progress), self.manifest_fields()
        metrics, self._uncommitted = self._uncommitted, []
        files[METRICS_FILE] = json.dumps(metrics).encode()

        def job() -> None:
            write_checkpoint(uri, files, progress, fields)
            self.ctx.commit_metrics(metrics)
            purge_checkpoints(self.checkpoints_uri, keep_last=self.cfg.keep_last_checkpoints)

        self.saver.submit(job)

    def resume(self) -> bool:
        """Load the latest complete checkpoint written under this config; True when one was loaded."""
        found = find_latest(self.checkpoints_uri)
        if found is None:
            return False
        uri, manifest = found
        if manifest.config_hash != self.ctx.stage_hash():
            log.warning("checkpoint %s was written with another config; starting fresh", uri)
            return False
        policy = self.ctx.backend.unwrap(self.policy)
        self.progress = load_train_state(uri, model=policy, optimizer=self.optimizer, scheduler=self.scheduler)
        state = json.loads(read_bytes(join_uri(uri, "rl_state.json")))
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.generator.set_state(torch.load(io.BytesIO(read_bytes(join_uri(uri, "sampler_rng.pt"))), weights_only=True))
        if self.value_head is not None:
            weights = safetensors.torch.load(read_bytes(join_uri(uri, "value_head.safetensors")))
            self.value_head.load_state_dict({k: v.to(self.ctx.backend.device) for k, v in weights.items()})
        self.ctx.metrics.log_missing(checkpoint_metrics(uri, manifest))
        return True


def value_head_bytes(head: nn.Module) -> bytes:
    """The value head's weights as safetensors bytes."""
    return safetensors.torch.save({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()})


def run_rl_stage(
    ctx: StageContext, cfg: RLStageConfig, algo: Algorithm, uses_reference: bool
) -> tuple[RLTrainer, dict[str, float]]:
    """Build the trainer, resume if a checkpoint exists, train; returns it and the final metrics."""
    _check(cfg, algo.samples_per_prompt)
    seed, device = ctx.config.seed, ctx.backend.device
    prompts = load_prompts(ctx, cfg)
    reward_fn = _reward_fn(ctx, cfg)
    reference = None
    if uses_reference:
        reference = load_causal_lm(ctx.input("reference"), ctx.config.model, ctx.tokenizer, seed)
        reference = ctx.backend.prepare_frozen(reference)
    policy = ctx.backend.wrap(load_causal_lm(ctx.input("model"), ctx.config.model, ctx.tokenizer, seed))
    torch.manual_seed(seed)
    trainer = RLTrainer(
        ctx=ctx, cfg=cfg, algo=algo, policy=policy, reference=reference, reward_fn=reward_fn, prompts=prompts
    )
    resumed = trainer.resume()
    log.info("%s: %d prompts, device %s, resumed=%s", ctx.spec.stage, len(prompts), device, resumed)
    progress = trainer.run()
    metrics = summarize(progress)
    metrics["resumed"] = float(resumed)
    return trainer, metrics
