"""The online RL loop shared by the PPO and GRPO stages: rollout, then epochs of mini-batch updates.

One iteration (``global_step`` counts iterations, as ``max_steps`` does), on every rank:

1. take the next ``prompts_per_rollout`` prompts (a seeded shuffle per epoch of the prompt set);
   rank ``r`` of ``world_size`` takes prompts ``r, r + world_size, ...`` (equal shares; a GRPO
   group stays on one rank);
2. sample ``samples_per_prompt`` completions of each with the generation engine
   (:mod:`trainer_core.generation.engines`, ``generation.engine``; with DAPO's dynamic sampling, more rounds
   until enough groups carry a signal), score them, and compute the rollout log-probs (and
   values), the reference log-probs (chunked LM head, ``forward_micro_batch_size`` rows per
   forward: :mod:`trainer_core.modeling.forwards.completion`), the difference from the engine's log-probs (truncated
   importance weights with ``importance_sampling_cap``) and the advantages without gradients
   (PPO and REINFORCE++ whiten with statistics summed over ranks);
3. ``ppo_epochs`` passes over the rollout batch, each rank cutting its rows into
   ``num_mini_batches`` parts in a seeded random order (see :meth:`RLTrainer.update` for uneven
   parts); one optimizer step per mini-batch, the loss normalised by the mini-batch's
   sizes summed over ranks (the step one device takes on the union of the ranks' rows), its rows
   forward and backward ``forward_micro_batch_size`` at a time, plus the ptx term with
   ``ptx_coef`` (:mod:`trainer_core.training.rl.ptx`); the LR schedule steps once per iteration;
4. update the KL controller with the KL of the whole batch, log metrics computed over every
   rank's sequences and tokens with the iteration's time split (rank 0 prints them), checkpoint
   every ``save_every`` iterations.

The trainable :class:`~trainer_core.modeling.forwards.completion.PolicyAndValue` goes through ``Backend.wrap`` and
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

The stage config is an :class:`~trainer_core.config.RLStageConfig`: the fields both loops read
(:class:`~trainer_core.config.OptimizerStageConfig`) and the RL ones, none of the supervised loop's
(a DeepSpeed engine takes one step per mini-batch, accumulated over its micro-batches:
:func:`~trainer_core.training.rl.batches.engine_config`); held-out evaluation is ``evaluate``'s job.

Shape legend: N sequences (this rank's), T completion tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from trainer_core.backends.base import Backend
from trainer_core.checkpoint.session import CheckpointSession
from trainer_core.checkpoint.train_state import TrainProgress
from trainer_core.config import RLStageConfig
from trainer_core.data.batching import collate_prompts_left
from trainer_core.generation.completions import check_generation_engine
from trainer_core.generation.engines import GenerationEngine, build_engine
from trainer_core.generation.vllm import VLLMEngine, check_engine_logprobs
from trainer_core.modeling.forwards.completion import Completions, PolicyAndValue, PolicyForward, completion_forward
from trainer_core.modeling.lora import adapter_disabled
from trainer_core.objectives.ppo import AdaptiveKLController, FixedKLController
from trainer_core.training.guard import check_finite_metrics, check_finite_tensors, finite_only, step_is_finite
from trainer_core.training.loop import build_optimizer, build_scheduler, peak_memory_bytes
from trainer_core.training.rl.algorithms.base import Algorithm, UpdateForwards
from trainer_core.training.rl.batches import (  # noqa: F401 (also the loop's public names)
    MiniBatchCounts,
    SampledRound,
    check_rl_config,
    concat_rounds,
    engine_config,
    groups_with_signal,
    logprob_diff_metrics,
    masked_out,
    masked_sum,
    next_prompts,
    prompt_order,
    rollout_metrics,
    micro_batch_rows,
    sampler_seed,
    score_round,
)
from trainer_core.training.rl.dataset_completions import check_dataset_rows, dataset_round, on_policy_iteration
from trainer_core.training.rl.environments import Environment, ToolSession
from trainer_core.training.rl.ptx import check_demonstrations, ptx_backward, ptx_batch
from trainer_core.training.rl.rewards import PromptItem, RewardFunction
from trainer_core.training.rl.rollout import RolloutBatch, masked_row
from trainer_core.training.rl.state_files import (  # noqa: F401 (RL_CHECKPOINT_LAYOUT: also the loop's)
    RL_CHECKPOINT_LAYOUT,
    layout_problem,
    load_rl_state_files,
    rl_state_files,
)
from trainer_core.training.timing import PhaseTimer, phase_timer

log = logging.getLogger(__name__)


FIRST_KEYS = ("reward_mean", "verifier_accuracy", "objective/scores", "objective/rlhf_reward")
"""Metrics whose first value is also kept (``first/<name>``) for the stage summary."""


@dataclass
class RLTrainer:
    """Runs one RL stage; see the module docstring.

    Attributes:
        backend: the backend it runs on.
        tokenizer: decodes completions (its pad and EOS ids delimit them).
        cfg: the stage config.
        algo: what it optimises (:class:`~trainer_core.training.rl.algorithms.base.Algorithm`: PPO, GRPO, distillation).
        model: the trainable :class:`PolicyAndValue` as ``Backend.wrap`` returned it; replaced by
            what ``Backend.setup_optimizer`` returns (a DeepSpeed engine).
        reference: the frozen reference (``Backend.prepare_frozen``), or None (no KL term, or
            ``reference_is_disabled_adapter``).
        reward_fn: scores completions.
        prompts: the RL prompt set.
        seed: the pipeline seed (prompt order, sampling).
        session: checkpoints and metrics; create it with ``extra={"rl_checkpoint":
            RL_CHECKPOINT_LAYOUT}`` so that its manifests carry this loop's layout.
        reference_is_disabled_adapter: the reference is the LoRA policy with its adapter disabled
            (:func:`~trainer_core.modeling.lora.adapter_disabled`; ``reference`` is then None).
        demonstrations: the prepared ``sft/train`` rows: the ptx term's, and the dataset completions
            of distill's ``lmbda`` (each prompt's ``row``); required when ``cfg.ptx_coef`` > 0 or
            ``lmbda`` < 1 (ConfigError otherwise).
        environment: a tool environment (multi-turn rollouts, ``cfg.environment``'s limits), or None.
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
    reference_is_disabled_adapter: bool = False
    demonstrations: Sequence[dict] | None = None
    environment: Environment | None = None

    def __post_init__(self) -> None:
        cfg, backend = self.cfg, self.backend
        check_demonstrations(self.session.stage, cfg.ptx_coef, self.demonstrations)
        self.on_policy = True  # this iteration's draw (rollout; the algorithm's lmbda)
        check_dataset_rows(self.session.stage, self.algo.lmbda, self.demonstrations)
        engine_cfg = engine_config(cfg, self.algo.samples_per_prompt, backend.world_size)
        self.model, self.optimizer = backend.setup_optimizer(self.model, build_optimizer(self.model, cfg), engine_cfg)
        self.module: PolicyAndValue = backend.unwrap(self.model)  # gradient-free forwards
        self.forwards = UpdateForwards(
            self.model,
            self.reference,
            cfg.generation.temperature,
            with_values=self.module.value_head is not None,
            padding_free=cfg.padding_free,
        )
        self.scheduler = build_scheduler(self.optimizer, cfg)
        kl = cfg.kl_coef
        self.kl_ctl = (
            AdaptiveKLController(kl, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl else FixedKLController(kl)
        )
        self.generator = torch.Generator(device=backend.device).manual_seed(sampler_seed(self.seed, backend.rank))
        self.metrics = self.session.metrics
        self.engine = self._build_engine()

    def _build_engine(self) -> GenerationEngine:
        """The rollout's generation engine (``generation.engine``): ``hf`` samples from the policy-and-value
        module itself (a sharded one too, in lockstep); the others serve the HF policy inside it (colocated).

        Raises:
            ConfigError: an engine other than ``hf`` with a sharded policy (FSDP2, ZeRO-3).
        """
        gen, backend = self.cfg.generation, self.backend
        check_generation_engine(f"{self.session.stage}.generation", gen, backend)
        if gen.engine == "vllm":
            field = f"{self.session.stage}.generation.vllm"
            return VLLMEngine.launch(gen.vllm, field, backend, self.policy, self.tokenizer, self.seed)
        model = self.module if gen.engine == "hf" else self.policy
        sync = backend.all_reduce_sum if backend.sharded_forward else None
        return build_engine(
            gen.engine,
            model,
            device=backend.device,
            compile=gen.compile,
            sync=sync,
            fuse_projections=gen.fuse_projections,
        )

    @property
    def policy(self) -> nn.Module:
        """The policy (an HF causal LM; sharded in place under FSDP2, partitioned under ZeRO-3)."""
        return self.module.policy

    @property
    def value_head(self) -> nn.Module | None:
        """The value head, or None."""
        return self.module.value_head

    # ----- rollout -----------------------------------------------------------------

    def _sample_round(self, timer: PhaseTimer) -> SampledRound:
        """Sample and score this rank's share of the next ``prompts_per_rollout`` prompts
        (advances the prompt position by all of them, on every rank)."""
        cfg, tok, backend = self.cfg, self.tokenizer, self.backend
        device, group = backend.device, self.algo.samples_per_prompt
        picked = next_prompts(self.progress, len(self.prompts), cfg.prompts_per_rollout, self.seed)
        items = [self.prompts[i] for i in picked[backend.rank :: backend.world_size] for _ in range(group)]
        if not self.on_policy:  # distill's lmbda: the dataset's completions of these prompts
            return dataset_round(items, self.demonstrations, tok.pad_token_id, device)
        padded = collate_prompts_left([{"input_ids": p.input_ids} for p in items], tok.pad_token_id)
        p_ids, p_mask = padded["input_ids"].to(device), padded["attention_mask"].to(device).float()
        session = (
            None
            if self.environment is None
            else ToolSession.configured(self.environment, self.cfg.environment, tok, items)
        )
        with timer.phase("generation"), backend.autocast():
            generated = self.engine.generate(
                p_ids,
                p_mask,
                cfg.generation,
                eos_id=tok.eos_token_id,
                pad_id=tok.pad_token_id,
                generator=self.generator,
                session=session,
            )
        c_ids, c_mask = generated.completion_ids, generated.completion_mask
        decoded = tok.batch_decode(c_ids.masked_fill(c_mask == 0, tok.pad_token_id), skip_special_tokens=True)
        texts = [t.strip() for t in decoded]  # observations included: the answer may quote a tool
        with timer.phase("reward"):
            scores, parts, tool_stats = score_round(self.reward_fn, items, texts, session)
        return SampledRound(items, p_ids, p_mask, generated, texts, scores.to(device), parts, tool_stats)

    def _sample(self, timer: PhaseTimer) -> tuple[SampledRound, SampledRound, dict[str, float]]:
        """This rank's rows for the update, the first round's rows (for the reward metrics: every
        completion sampled, unfiltered) and the sampling statistics.

        With the algorithm's ``dynamic_sampling`` (DAPO), each round keeps the groups with a
        reward signal (:func:`groups_with_signal`) and another round is sampled while some rank
        has fewer than its share, up to ``max_sampling_rounds``; a rank still short then fills
        its share with dropped groups masked out (:func:`masked_out`: forwarded, so that every
        rank runs the same forwards, but counting nothing), so the update trains on the kept
        groups only (``max_sampling_rounds`` 1: filter only).
        """
        backend, group = self.backend, self.algo.samples_per_prompt
        first = self._sample_round(timer)
        if not self.algo.dynamic_sampling:
            return first, first, {}
        share = self.cfg.prompts_per_rollout // backend.world_size
        kept: list[SampledRound] = []
        dropped: list[SampledRound] = []
        sampled_groups = kept_groups = rounds = 0
        current = first
        while True:
            rounds += 1
            signal = groups_with_signal(current.scores, group).tolist()
            sampled_groups += len(signal)
            for g, keep in enumerate(signal):
                rows = current.rows(list(range(g * group, (g + 1) * group)))
                (kept if keep else dropped).append(rows)
            kept_groups += sum(signal)
            kept = kept[:share]
            short = share - len(kept)
            anyone_short = float(backend.all_reduce_sum(torch.tensor(float(short), device=backend.device))) > 0
            if not anyone_short or rounds >= self.algo.max_sampling_rounds:
                break
            current = self._sample_round(timer)
        kept += [masked_out(rows) for rows in dropped[: share - len(kept)]]
        counts = backend.all_reduce_sum(
            torch.tensor([float(kept_groups), float(sampled_groups)], device=backend.device)
        )
        stats = {"rollout/sampling_rounds": float(rounds), "rollout/groups_kept_frac": float(counts[0] / counts[1])}
        return concat_rounds(kept, self.tokenizer.pad_token_id), first, stats

    def _forward_rows(self, fn: Callable[..., PolicyForward], model: nn.Module, sample: SampledRound) -> PolicyForward:
        """``fn(model, completions)`` (:func:`completion_forward`-like) over ``sample``'s rows,
        ``forward_micro_batch_size`` at a time, rows of like length together (:func:`micro_batch_rows`)."""
        g = sample.generated
        whole = Completions(
            sample.prompt_ids, sample.prompt_mask, g.completion_ids, g.policy_mask, observation_mask=g.observation_mask
        )
        groups = micro_batch_rows(whole.row_lengths(), self.cfg.forward_micro_batch_size)
        outs = [fn(model, whole.select(rows)) for rows in groups]
        order = torch.cat(groups)

        def in_row_order(parts: list[Tensor | None]) -> Tensor | None:
            if parts[0] is None:
                return None
            rows = torch.cat(parts, dim=0)
            return torch.empty_like(rows).index_copy_(0, order, rows)

        return PolicyForward(
            *(in_row_order([getattr(o, k) for o in outs]) for k in ("logprobs", "entropies", "values"))
        )

    @torch.no_grad()
    def rollout(self, timer: PhaseTimer | None = None) -> tuple[RolloutBatch, SampledRound, dict[str, float]]:
        """Sample, score and evaluate this rank's share of one rollout batch (no gradients);
        advances the prompt position (by the whole batch, on every rank).

        Returns:
            (the batch the update trains on, the first sampling round (every completion, for the
            reward metrics), rollout statistics: sampling rounds, the engine's log-prob difference).
        """
        cfg, backend = self.cfg, self.backend
        timer = timer or phase_timer(backend.device)
        self.on_policy = on_policy = on_policy_iteration(self.algo.lmbda, self.seed, self.progress.global_step)
        if on_policy:
            with timer.phase("weight_sync"):
                self.engine.load_weights(self.module)
        sample, first, stats = self._sample(timer)
        self.engine.release()
        g, temperature = sample.generated, cfg.generation.temperature
        p_ids, p_mask, c_ids, c_mask = sample.prompt_ids, sample.prompt_mask, g.completion_ids, g.policy_mask
        # Old and reference log-probs in the training forward's precision (an on-policy ratio is 1
        # only when both compute alike); the engine's own log-probs are compared with them.
        with backend.autocast():
            with timer.phase("logprobs"):
                out = self._forward_rows(partial(self.forward), self.module, sample)
            ref = None
            ref_fn = partial(completion_forward, temperature=temperature, padding_free=cfg.padding_free)
            if self.reference is not None:
                with timer.phase("reference"):
                    ref = self._forward_rows(ref_fn, self.reference, sample).logprobs
            elif self.reference_is_disabled_adapter:
                with timer.phase("reference"), adapter_disabled(self.module):
                    ref = self._forward_rows(ref_fn, self.module, sample).logprobs
        batch = RolloutBatch(
            prompt_ids=p_ids,
            prompt_mask=p_mask,
            completion_ids=c_ids,
            completion_mask=c_mask,
            observation_mask=g.observation_mask,
            logprobs=out.logprobs,
            scores=sample.scores,
            prompt_index=torch.arange(len(sample.items), device=backend.device) // self.algo.samples_per_prompt,
            ref_logprobs=ref,
            values=out.values * c_mask if out.values is not None else None,
            engine_logprobs=g.logprobs if on_policy else None,
            sampled=on_policy,
        )
        stats.update(self._against_the_engine(batch, g.logprobs, on_policy))
        if self.algo.lmbda < 1:
            stats["rollout/on_policy"] = float(on_policy)
        self.algo.prepare(batch, self.kl_ctl.value, backend.all_reduce_sum)
        check_finite_tensors(
            {"rewards": batch.scores, "advantages": batch.advantages},
            stage=self.session.stage,
            global_step=self.progress.global_step + 1,
            all_reduce_sum=backend.all_reduce_sum,
        )
        return batch, first, stats

    def _against_the_engine(self, batch: RolloutBatch, engine_logprobs: Tensor, sampled: bool) -> dict[str, float]:
        """The trainer's log-probs of the batch against the engine's: the truncated importance
        weights when ``importance_sampling_cap`` is set; when the engine ``sampled`` the batch, the
        difference's metrics and (``vllm``) the guard of
        :func:`~trainer_core.generation.vllm.check_engine_logprobs`."""
        cfg = self.cfg
        if cfg.importance_sampling_cap is not None:
            # Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
            # brings you off-policy RL training"; verl's ``tis_imp_ratio_cap``): the engine sampled
            # from pi_engine, the loss assumes pi_old; weight by min(pi_old / pi_engine, cap).
            ratio = torch.exp(batch.logprobs - engine_logprobs).clamp(max=cfg.importance_sampling_cap)
            batch.is_weights = ratio * batch.completion_mask
        if not sampled:
            return {}
        stats = logprob_diff_metrics(batch, self.backend)
        if isinstance(self.engine, VLLMEngine):
            check_engine_logprobs(stats, self.engine.max_logprob_diff, self.session.stage, self.progress.global_step)
        return stats

    # ----- update ------------------------------------------------------------------

    def forward(self, model: nn.Module, batch: Completions) -> PolicyForward:
        """:func:`~trainer_core.modeling.forwards.completion.completion_forward` of ``batch`` under ``self.model``
        (training, through the backend's wrapper) or ``self.module`` (no gradients)."""
        temperature = self.cfg.generation.temperature
        return completion_forward(
            model,
            batch,
            temperature=temperature,
            with_values=self.value_head is not None,
            padding_free=self.cfg.padding_free,
        )

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """``ppo_epochs`` x ``num_mini_batches`` optimizer steps on the rollout batch; mean metrics.

        Each rank cuts its rows (seeded order) into ``num_mini_batches`` parts, rank ``r``'s list
        rotated by ``r x`` its row count: with uneven parts (fewer rows than mini-batches too) the
        global mini-batches stay as even as on one device. A rank with no row in a mini-batch
        forwards :func:`~trainer_core.training.rl.rollout.masked_row` (counts nothing), so that every rank
        runs the same forwards and collectives.
        """
        cfg, rank, sums, count = self.cfg, self.backend.rank, {}, 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(batch.num_sequences, generator=self.generator, device=self.generator.device)
            parts = torch.tensor_split(order, cfg.num_mini_batches)
            shift = rank * batch.num_sequences % cfg.num_mini_batches
            for rows in parts[shift:] + parts[:shift]:
                mb = batch.select(rows) if len(rows) else masked_row(batch)
                for k, v in self.train_step(mb, count).items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                count += 1
        return {k: v / count for k, v in sums.items()}

    def _micro_batches(self, mb: RolloutBatch) -> list[RolloutBatch]:
        """``mb``'s rows cut into ``forward_micro_batch_size`` rows each, rows of like length together
        (:func:`micro_batch_rows`); every rank gets as many micro-batches as the rank with the most
        (padded with :func:`masked_row`), so that ranks run the same forwards and collectives."""
        groups = micro_batch_rows(mb.row_lengths(), self.cfg.forward_micro_batch_size)
        parts = [mb] if len(groups) == 1 else [mb.select(rows) for rows in groups]
        if self.backend.world_size > 1 and self.cfg.forward_micro_batch_size is not None:
            most = max(self.backend.all_gather_object(len(parts)))
            parts += [masked_row(mb)] * (most - len(parts))
        return parts

    def train_step(self, mb: RolloutBatch, step_index: int = 0) -> dict[str, Tensor]:
        """One optimizer step on a mini-batch (this rank's rows of it; ``step_index``: the step's
        index in the iteration, which draws the ptx rows), collective.

        The mini-batch's sizes over all ranks (:class:`MiniBatchCounts`) divide the loss (the
        backend undoes its averaging over ranks), so the step is the one a single device takes on
        the union of the ranks' rows; with ``forward_micro_batch_size`` the rows go forward and
        backward in micro-batches whose gradients accumulate into that same step.

        Returns:
            Scalar metrics over every rank's tokens: the algorithm's, ``train/loss``,
            ``train/grad_norm`` (before clipping) and with ``ptx_coef`` ``train/ptx_loss``.
        """
        backend, cfg = self.backend, self.cfg
        ptx = cfg.ptx_coef > 0
        mask = mb.completion_mask
        sizes = backend.all_reduce_sum(torch.stack([mask.sum(), (mask.sum(1) > 0).sum().float()]).float())
        counts = MiniBatchCounts(num_tokens=sizes[0].clamp(min=1.0), num_sequences=sizes[1].clamp(min=1.0))
        parts = self._micro_batches(mb)
        loss_sum, metric_sums = torch.zeros((), device=mask.device), {}
        for index, part in enumerate(parts):
            with backend.grad_sync(self.model, is_last_micro_batch=index == len(parts) - 1 and not ptx):
                with backend.autocast():
                    out = self.algo.forward(self.forwards, part)
                    loss, sums = self.algo.loss(part, out, counts, kl_coef=self.kl_ctl.value)
                backend.backward(self.model, loss)
            loss_sum = loss_sum + loss.detach().float()
            for k, v in sums.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + v.float()
        if ptx:  # x num_tokens: the metrics below are sums over ranks / num_tokens
            demos = ptx_batch(
                self.demonstrations,
                cfg.ptx_rows_per_step,
                self.seed,
                self.progress.global_step,
                step_index,
                backend.rank,
                self.tokenizer.pad_token_id,
                backend.device,
            )
            ptx_loss = ptx_backward(self.model, backend, demos, cfg.ptx_coef, cfg.padding_free)
            metric_sums["train/ptx_loss"] = counts.num_tokens * ptx_loss
        grad_norm = backend.optimizer_step(
            self.model, self.optimizer, cfg.max_grad_norm, skip_nonfinite=cfg.max_nonfinite_steps > 0
        )
        keys = sorted(metric_sums)
        summed = backend.all_reduce_sum(torch.stack([loss_sum] + [metric_sums[k] for k in keys]))
        metrics = {k: summed[1 + j] / counts.num_tokens for j, k in enumerate(keys)}
        metrics["train/loss"], metrics["train/grad_norm"] = summed[0], grad_norm
        step_is_finite(
            self.progress,
            stage=self.session.stage,
            global_step=self.progress.global_step + 1,
            max_nonfinite_steps=cfg.max_nonfinite_steps,
            loss=summed[0],
            grad_norm=grad_norm,
        )
        return metrics

    # ----- loop --------------------------------------------------------------------

    def iteration(self) -> dict[str, float]:
        """One rollout + update on every rank; returns the iteration's (global) metrics, with the
        time split (``time/generation_s``, ``time/reward_s``, ``time/logprobs_s``,
        ``time/reference_s``, ``time/update_s``: CUDA events on CUDA), the generated tokens per
        second of generation time over every rank (``rollout/tokens_per_s``) and the peak device
        memory (``memory/peak_bytes``, CUDA)."""
        backend = self.backend
        timer = phase_timer(backend.device)
        batch, first, stats = self.rollout(timer)
        metrics = rollout_metrics(
            batch, first, backend, self.tokenizer.eos_token_id, self.kl_ctl.value, self.cfg.kl_estimator
        )
        metrics.update(stats)
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        with timer.phase("update"):
            metrics.update(self.update(batch))
            self.scheduler.step()
        num_sequences = self.cfg.prompts_per_rollout * self.algo.samples_per_prompt
        if batch.sampled:  # the KL controller follows the policy's KL on its own samples
            check_finite_metrics(
                {k: metrics[k] for k in ("objective/kl", "objective/entropy")},
                stage=self.session.stage,
                global_step=self.progress.global_step + 1,
                what="the rollout's log-probs",
            )
            self.kl_ctl.update(metrics["objective/kl"], num_sequences)
        progress = self.progress
        progress.global_step += 1
        progress.consumed_samples += num_sequences
        tokens = backend.all_reduce_sum(
            torch.stack([batch.completion_mask.sum(), first.generated.completion_mask.sum()])
        )
        progress.consumed_tokens += int(tokens[0])
        seconds = timer.seconds()
        metrics.update({f"time/{name}_s": value for name, value in seconds.items()})
        if seconds.get("generation"):
            metrics["rollout/tokens_per_s"] = float(tokens[1]) / seconds["generation"]
        if backend.device.type == "cuda":
            metrics["memory/peak_bytes"] = float(peak_memory_bytes(backend.device))
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

    def rl_files(self) -> dict[str, bytes]:
        """Collective: this loop's :func:`~trainer_core.training.rl.state_files.rl_state_files` (the KL
        controller, every rank's sampling generator)."""
        return rl_state_files(self.backend, self.kl_ctl, self.generator, self.session.validate_replicas)

    def save(self) -> None:
        """Collective: checkpoint the state and this loop's files (see :meth:`CheckpointSession.save`)."""
        self.session.save(
            self.progress, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, files=self.rl_files()
        )

    def resume(self) -> bool:
        """Collective: load the latest checkpoint this run can resume (same fingerprint, a format
        the backend reads, this module's layout); True when one was loaded."""
        resumed = self.session.resume(self.model, self.optimizer, self.scheduler, accept=layout_problem)
        if resumed is None:
            return False
        self.progress = resumed.progress
        load_rl_state_files(resumed.uri, self.backend, self.kl_ctl, self.generator)
        return True
