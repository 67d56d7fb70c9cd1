"""The RL loop's data: prompt order, the rollout's sampling rounds (DAPO's dynamic sampling),
mini- and micro-batch sizes, and the rollout's metrics
(:mod:`trainer_core.training.rl.trainer` runs them).

Shape legend: N sequences (this rank's), G completions per prompt, P prompt tokens, T
completion tokens.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from trainer_core.backends.base import Backend
from trainer_core.checkpoint.train_state import TrainProgress
from trainer_core.config import OptimizerStageConfig, RLStageConfig, TrainStageConfig
from trainer_core.config.pipeline import rl_config_problem
from trainer_core.errors import ConfigError
from trainer_core.generation.engines import Generated
from trainer_core.objectives.ppo import KL_ESTIMATORS
from trainer_core.training.rl.environments import ToolSession
from trainer_core.training.rl.rewards import PromptItem, RewardFunction, is_correct
from trainer_core.training.rl.rollout import RolloutBatch


@dataclass(frozen=True)
class MiniBatchCounts:
    """A mini-batch's size over every rank, the denominators of its loss.

    Attributes:
        num_tokens: scalar float32, real completion tokens (``num_valid_tokens``), at least 1.
        num_sequences: scalar float32, sequences with at least one real token, at least 1.
    """

    num_tokens: Tensor
    num_sequences: Tensor


def groups_with_signal(scores: Tensor, group_size: int) -> Tensor:
    """[N / G] bool: the groups whose scores are not all equal (DAPO's dynamic sampling keeps
    these: a group of equal rewards has zero advantage under a group baseline and adds nothing
    but noise to the token-mean normalisation). ``scores`` [N], groups contiguous."""
    grouped = scores.reshape(-1, group_size)
    return (grouped.max(dim=1).values - grouped.min(dim=1).values) > 0


@dataclass
class SampledRound:
    """One sampling round of this rank: prompts, what the engine generated, decoded and scored.

    Attributes:
        items: [N] the prompt of each row (a prompt repeated G times, contiguously).
        prompt_ids: [N, P] long, left-padded; prompt_mask: [N, P] float.
        generated: the engine's :class:`~trainer_core.generation.engines.Generated` ([N, T] ids, mask, log-probs).
        texts: [N] decoded completions.
        scores: [N] float32 rewards.
        reward_parts: a weighted reward's parts, name -> [N] float32 unweighted scores
            (:meth:`~trainer_core.training.rl.rewards.WeightedReward.scored_parts`); empty for
            one reward, and in the rows that :meth:`rows` and :func:`concat_rounds` build (the
            metrics read the first round's).
        tool_stats: with an environment, per-episode counts ``tool_calls``, ``tool_errors`` and
            ``observation_tokens`` ([N] each; :meth:`~trainer_core.training.rl.environments.ToolSession.stats`);
            empty without one, and in the rows :meth:`rows` and :func:`concat_rounds` build.
    """

    items: list[PromptItem]
    prompt_ids: Tensor
    prompt_mask: Tensor
    generated: Generated
    texts: list[str]
    scores: Tensor
    reward_parts: dict[str, Tensor] = field(default_factory=dict)
    tool_stats: dict[str, list[float]] = field(default_factory=dict)

    def rows(self, rows: list[int]) -> SampledRound:
        """The rows ``rows`` of every field."""
        index = torch.tensor(rows, dtype=torch.long, device=self.scores.device)
        g = self.generated
        return SampledRound(
            [self.items[i] for i in rows],
            self.prompt_ids[index],
            self.prompt_mask[index],
            Generated(
                g.completion_ids[index],
                g.completion_mask[index],
                g.logprobs[index],
                None if g.observation_mask is None else g.observation_mask[index],
            ),
            [self.texts[i] for i in rows],
            self.scores[index],
        )


def score_round(
    reward_fn: RewardFunction, items: list[PromptItem], texts: list[str], session: ToolSession | None
) -> tuple[Tensor, dict[str, Tensor], dict[str, list[float]]]:
    """(the [N] float32 rewards of ``texts``, plus each episode's environment rewards with a
    ``session``; a weighted reward's parts (else empty); the session's per-episode tool counts
    (else empty)). Closes the session."""
    scored_parts = getattr(reward_fn, "scored_parts", None)
    scores, parts = scored_parts(items, texts) if scored_parts else (reward_fn(items, texts), {})
    if session is None:
        return scores, parts, {}
    session.close()
    return scores + session.rewards().to(scores.device), parts, session.stats()


def masked_out(sample: SampledRound) -> SampledRound:
    """``sample`` with every completion masked out (mask and log-probs 0, tokens kept): rows that
    still go through the forwards, so that ranks run the same ones, but count nothing (as
    :func:`~trainer_core.training.rl.rollout.masked_row`): no loss, no gradient, no token or sequence count."""
    g = sample.generated
    hidden = Generated(
        g.completion_ids,
        torch.zeros_like(g.completion_mask),
        torch.zeros_like(g.logprobs),
        None if g.observation_mask is None else torch.zeros_like(g.observation_mask),
    )
    return SampledRound(sample.items, sample.prompt_ids, sample.prompt_mask, hidden, sample.texts, sample.scores)


def _pad_to(x: Tensor, width: int, value: float, left: bool) -> Tensor:
    """[N, W] ``x`` padded with ``value`` to [N, width] (on the left or the right)."""
    missing = width - x.shape[1]
    if missing <= 0:
        return x
    pad = torch.full((x.shape[0], missing), value, dtype=x.dtype, device=x.device)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def concat_rounds(parts: list[SampledRound], pad_id: int) -> SampledRound:
    """The rows of several rounds as one: prompts left-padded and completions right-padded to the
    widest (``pad_id``, mask 0, log-prob 0)."""
    if len(parts) == 1:
        return parts[0]
    width_p = max(p.prompt_ids.shape[1] for p in parts)
    width_t = max(p.generated.completion_ids.shape[1] for p in parts)
    cat = lambda xs: torch.cat(xs, dim=0)
    return SampledRound(
        [i for p in parts for i in p.items],
        cat([_pad_to(p.prompt_ids, width_p, pad_id, left=True) for p in parts]),
        cat([_pad_to(p.prompt_mask, width_p, 0.0, left=True) for p in parts]),
        Generated(
            cat([_pad_to(p.generated.completion_ids, width_t, pad_id, left=False) for p in parts]),
            cat([_pad_to(p.generated.completion_mask, width_t, 0.0, left=False) for p in parts]),
            cat([_pad_to(p.generated.logprobs, width_t, 0.0, left=False) for p in parts]),
            None
            if parts[0].generated.observation_mask is None
            else cat([_pad_to(p.generated.observation_mask, width_t, 0.0, left=False) for p in parts]),
        ),
        [t for p in parts for t in p.texts],
        cat([p.scores for p in parts]),
    )


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Scalar sum of ``x`` [N, T] where ``mask`` [N, T] is 1 (the numerator of ``masked_mean``)."""
    return (x * mask).sum()


def policy_metric_sums(clip: dict[str, Tensor], entropies: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The token sums of the clipped policy loss's metrics (``clip``: the metrics of
    :func:`~trainer_core.objectives.ppo.clipped_policy_loss`) and the policy's entropy over
    ``mask``: ``policy/approxkl_avg``, ``policy/clipfrac_avg``, ``policy/entropy_avg``,
    ``val/ratio`` (TRL's names), as every RL algorithm logs them."""
    return {
        "policy/approxkl_avg": masked_sum(clip["approxkl"], mask),
        "policy/clipfrac_avg": masked_sum(clip["clipped"], mask),
        "policy/entropy_avg": masked_sum(entropies, mask),
        "val/ratio": masked_sum(clip["ratio"], mask),
    }


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
    problem = rl_config_problem(stage, cfg, samples_per_prompt, world_size)
    if problem:
        raise ConfigError(problem)


def engine_config(cfg: RLStageConfig, samples_per_prompt: int, world_size: int) -> TrainStageConfig:
    """``cfg`` as ``Backend.setup_optimizer`` sees it: one optimizer step per mini-batch.

    A DeepSpeed engine's config takes the micro-batch size, accumulation and clipping from a
    supervised-loop config; here a mini-batch (this rank's rows of it) is cut into micro-batches
    of ``forward_micro_batch_size`` rows (all of them when None), accumulated into one step (no
    ``global_batch_size``). The fields both loops read are ``cfg``'s.
    """
    rows = cfg.prompts_per_rollout // world_size * samples_per_prompt
    mini = max(1, math.ceil(rows / cfg.num_mini_batches))
    micro = min(mini, cfg.forward_micro_batch_size or mini)
    shared = {name: getattr(cfg, name) for name in OptimizerStageConfig.model_fields}
    return TrainStageConfig(**shared, micro_batch_size=micro, grad_accum_steps=math.ceil(mini / micro))


def micro_batch_rows(lengths: Tensor, size: int | None) -> list[Tensor]:
    """The rows of each forward micro-batch: longest first, cut into micro-batches of ``size`` rows.

    Each micro-batch is cut to its own longest prompt and longest completion
    (:meth:`~trainer_core.modeling.forwards.completion.Completions.trimmed`), so rows of like length go
    together (like verl's sequence balancing, but within a rank). Ties keep their order; the sort
    is deterministic, so a resumed run cuts as an uninterrupted one.

    Args:
        lengths: [N] real tokens of each row (prompt and completion).
        size: rows per micro-batch; None: one micro-batch of every row, in order.

    Returns:
        [k] long row indices (on ``lengths``' device) of each micro-batch, together every row once.
    """
    num_rows = lengths.shape[0]
    if size is None or size >= num_rows:
        return [torch.arange(num_rows, device=lengths.device)]
    order = torch.sort(lengths, descending=True, stable=True).indices
    return list(order.split(size))


def logprob_diff_metrics(batch: RolloutBatch, backend: Backend) -> dict[str, float]:
    """``rollout/logprob_diff_mean`` and ``_max``: |trainer log-prob - engine log-prob| over every
    rank's real completion tokens (0 when the engine computes as the trainer does)."""
    mask = batch.completion_mask
    diff = (batch.logprobs - batch.engine_logprobs).abs() * mask
    sums = backend.all_reduce_sum(torch.stack([diff.sum(), mask.sum()]).float())
    largest = max(backend.all_gather_object(float(diff.max()) if diff.numel() else 0.0))
    return {"rollout/logprob_diff_mean": float(sums[0] / sums[1].clamp(min=1.0)), "rollout/logprob_diff_max": largest}


SAMPLED_ONLY_KEYS = (
    "objective/scores",
    "reward_mean",
    "reward_std",
    "objective/rlhf_reward",
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
)
"""The metrics :func:`rollout_metrics` leaves out of an iteration nothing was sampled in: the
rewards (nothing was scored) and the per-sample KL and entropy estimates, which estimate the
policy's KL and entropy only over its own samples."""


def rollout_metrics(
    batch: RolloutBatch,
    first: SampledRound,
    backend: Backend,
    eos_id: int,
    kl_coef: float,
    kl_estimator: str,
) -> dict[str, float]:
    """TRL's ``objective/*`` metrics plus reward (and each part of a weighted reward,
    ``reward/<name>``, unweighted), length (the policy's tokens), verifier accuracy and, with an
    environment, ``env/tool_calls`` and ``env/observation_tokens`` per episode and
    ``env/tool_errors`` in the rollout: every rank's
    per-sequence values are gathered (in rank order), so every rank computes the same numbers
    (the KL controller's input among them). Rewards and accuracy are those of the first
    sampling round (every completion sampled, before dynamic sampling's filter); KL, entropy
    and length those of the batch the update trains on. A batch of the dataset's completions
    (``batch.sampled`` False, distill's ``lmbda``): none of :data:`SAMPLED_ONLY_KEYS` and no
    accuracy."""
    mask = batch.completion_mask
    kl_seq = torch.zeros_like(batch.scores, dtype=torch.float32)
    if batch.ref_logprobs is not None:
        kl_seq = (KL_ESTIMATORS[kl_estimator](batch.logprobs, batch.ref_logprobs) * mask).sum(1)
    eos = (batch.completion_ids == eos_id) & (mask > 0)
    local = {"entropy": (-batch.logprobs * mask).sum(1), "length": mask.sum(1), "eos": eos.sum(1), "kl": kl_seq}
    mine: dict[str, Any] = {k: v.detach().cpu() for k, v in local.items()}
    mine["scores"] = first.scores.detach().float().cpu()
    mine["parts"] = {k: v.detach().float().cpu() for k, v in first.reward_parts.items()}
    mine["tools"] = first.tool_stats
    answered = batch.sampled and all(i.answer is not None for i in first.items)
    mine["correct"] = [is_correct(t, i.answer) for t, i in zip(first.texts, first.items)] if answered else None
    ranks = backend.all_gather_object(mine)
    seq = {k: torch.cat([r[k] for r in ranks]) for k in [*local, "scores"]}
    scores = seq["scores"]
    real = seq["length"] > 0  # rows masked out by dynamic sampling's filler count nothing
    if bool(real.any()):
        seq.update({k: seq[k][real] for k in local})
    m = {
        "objective/entropy": float(seq["entropy"].mean()),
        "objective/scores": float(scores.mean()),
        "objective/kl_coef": kl_coef,
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std()) if scores.numel() > 1 else 0.0,
        "response_length_tokens": float(seq["length"].mean()),
        "val/num_eos_tokens": float(seq["eos"].sum()),
        "objective/kl": float(seq["kl"].mean()),
    }
    for name in first.reward_parts:
        m[f"reward/{name}"] = float(torch.cat([r["parts"][name] for r in ranks]).mean())
    if first.tool_stats:  # per episode, except the errors: their count in the rollout
        tools = {k: [v for r in ranks for v in r["tools"][k]] for k in first.tool_stats}
        m["env/tool_calls"] = statistics.fmean(tools["tool_calls"])
        m["env/tool_errors"] = float(sum(tools["tool_errors"]))
        m["env/observation_tokens"] = statistics.fmean(tools["observation_tokens"])
    m["objective/non_score_reward"] = -kl_coef * m["objective/kl"]
    m["objective/rlhf_reward"] = m["objective/scores"] + m["objective/non_score_reward"]
    if all(r["correct"] is not None for r in ranks):
        m["verifier_accuracy"] = statistics.fmean(c for r in ranks for c in r["correct"])
    if not batch.sampled:
        m = {k: v for k, v in m.items() if k not in SAMPLED_ONLY_KEYS}
    return m
