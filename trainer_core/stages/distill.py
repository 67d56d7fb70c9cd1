"""Distill stage: on-policy distillation of a teacher into the student with the per-token reverse KL.

Each iteration the student (the SFT output by default) samples completions of the RL prompts
with the generation engine; the teacher (``distill.teacher_from``, loaded as the RL loop's
frozen reference) scores the same tokens; each completion token's advantage is the teacher's
log-probability of it minus the student's (at sampling time), the negative of a one-sample
estimate of the reverse KL ``KL(student || teacher)`` at that position, with no discounting over
later tokens; the student follows it with the clipped policy-gradient loss, token mean. Minimising
the reverse KL on the student's own samples is mode-seeking and needs no reward (Agarwal et al.
2024, GKD, with beta 1 on on-policy data; Thinking Machines, "On-Policy Distillation", 2025;
prime-rl's ``opd`` loss). Rollouts, mini-batch updates, the ptx term, tools, checkpoints and exact
resume are the RL loop's (:mod:`trainer_core.training.rl.trainer`); ``distill.reward`` is logged,
never optimised.

With ``distill.loss: generalized_jsd`` the student instead minimises, at each sampled position,
the generalised Jensen-Shannon divergence between its next-token distribution and the teacher's
over the whole vocabulary (GKD, Agarwal et al. 2024, eq. 1, with ``beta``; TRL's
``GKDTrainer``): in each update step the teacher forwards the mini-batch again (no gradient) for
its final hidden states, and the divergence is computed from both models' hidden states and
heads a chunk of tokens at a time inside the student's forward
(:func:`~trainer_core.objectives.distill.chunked_generalized_jsd`: no [N, T, V] tensor of either
model), token mean over the student's tokens (tool observations excluded).

With ``distill.lmbda`` below 1 (GKD's lambda, generalized_jsd only) an iteration trains, with
probability ``1 - lmbda`` drawn from the seed and ``global_step``, on the dataset's completions of
its prompts instead of the student's samples
(:mod:`trainer_core.training.rl.dataset_completions`).

The teacher must share the student's tokenizer (checked before anything is trained, naming both
models); its architecture and width may differ.

Shape legend: N sequences, T completion tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import DistillConfig
from trainer_core.errors import ConfigError
from trainer_core.modeling.forward import frozen_head
from trainer_core.objectives.grpo_family import LOSS_AGGREGATIONS, clipped_policy_loss_asymmetric
from trainer_core.stages.context import StageContext, commit_final
from trainer_core.stages.rl_common import run_rl_stage
from trainer_core.training.rl.rollout import (
    PolicyForward, RolloutBatch, TeacherTarget, completion_hidden, policy_forward,
)
from trainer_core.training.rl.batches import policy_metric_sums
from trainer_core.training.rl.trainer import MiniBatchCounts, RLTrainer, masked_sum


GKD_BETA = 0.5
"""``distill.beta`` when unset: GKD's default (TRL's ``GKDConfig.beta``)."""


class DistillAlgorithm:
    """Per-token reverse-KL advantages from the teacher's log-probs (the RL loop's
    ``ref_logprobs``) and the clipped policy loss, or the generalised JSD over the vocabulary;
    token mean (see the module docstring)."""

    uses_values = False

    def __init__(self, cfg: DistillConfig) -> None:
        self.cfg = cfg
        self.samples_per_prompt = cfg.samples_per_prompt
        self._teacher_head: tuple[Tensor, Tensor | None] | None = None
        if cfg.loss == "generalized_jsd":
            self.train_forward = self._jsd_forward

    def _jsd_forward(self, trainer: RLTrainer, part: RolloutBatch) -> PolicyForward:
        """The student's forward on ``part`` (with gradients, through the backend's wrapper) with
        the generalised JSD to the teacher per token (``out.divergences``); the teacher's head is
        gathered once (collective under FSDP2 and ZeRO-3), its hidden states each call."""
        teacher, temperature = trainer.reference, self.cfg.generation.temperature
        if teacher is None:
            raise RuntimeError("distill: the RL loop has no teacher model")
        if self._teacher_head is None:
            self._teacher_head = frozen_head(teacher)
        padding_free = self.cfg.padding_free
        target = TeacherTarget(completion_hidden(teacher, part, padding_free), *self._teacher_head,
                               beta=GKD_BETA if self.cfg.beta is None else self.cfg.beta, temperature=temperature)
        return policy_forward(trainer.model, part, temperature=temperature, with_values=False, teacher=target,
                              padding_free=padding_free)

    def prepare(self, batch: RolloutBatch, kl_coef: float, all_reduce_sum: Callable[[Tensor], Tensor]) -> None:
        """``batch.advantages`` [N, T] float32: ``ref_logprobs - logprobs`` on the student's tokens, 0
        elsewhere.

        Raises:
            RuntimeError: the batch has no teacher log-probs (the loop ran without the teacher).
        """
        if batch.ref_logprobs is None:
            raise RuntimeError("distill: the rollout batch has no teacher log-probs")
        batch.advantages = (batch.ref_logprobs - batch.logprobs) * batch.completion_mask

    def loss(self, batch: RolloutBatch, out: PolicyForward, counts: MiniBatchCounts) -> tuple[Tensor, dict[str, Tensor]]:
        """This rank's share of the mini-batch's token-mean clipped policy loss (each token's loss
        weighted by ``batch.is_weights`` when set), and the token sums of the metrics
        (``distill/reverse_kl_avg``: ``logprobs - ref_logprobs`` at sampling time, on the student's
        own samples only: over the dataset's completions it estimates no KL)."""
        mask, cfg = batch.completion_mask, self.cfg
        reverse_kl = {}
        if batch.sampled:
            reverse_kl["distill/reverse_kl_avg"] = masked_sum(batch.logprobs - batch.ref_logprobs, mask)
        if cfg.loss == "generalized_jsd":
            loss = LOSS_AGGREGATIONS["token_mean"](out.divergences, mask, num_tokens=counts.num_tokens,
                                                   num_sequences=counts.num_sequences,
                                                   max_new_tokens=cfg.generation.max_new_tokens)
            jsd = masked_sum(out.divergences.detach(), mask)
            return loss, {"loss/policy_avg": jsd, "distill/jsd_avg": jsd,
                          "policy/entropy_avg": masked_sum(out.entropies, mask), **reverse_kl}
        losses, m = clipped_policy_loss_asymmetric(out.logprobs, batch.logprobs, batch.advantages, cfg.clip_eps,
                                                   cfg.clip_eps)
        if batch.is_weights is not None:
            losses = losses * batch.is_weights
        loss = LOSS_AGGREGATIONS["token_mean"](losses, mask, num_tokens=counts.num_tokens,
                                               num_sequences=counts.num_sequences,
                                               max_new_tokens=cfg.generation.max_new_tokens)
        metric_sums = {
            "loss/policy_avg": masked_sum(losses.detach(), mask),
            **reverse_kl, **policy_metric_sums(m, out.entropies, mask),
        }
        return loss, metric_sums


def check_teacher_tokenizer(ctx: StageContext) -> None:
    """Refuse a teacher whose tokenizer is not the student's (the same words for the same ids).

    Raises:
        ConfigError: the teacher has no tokenizer, or another one (naming both models).
    """
    from transformers import AutoTokenizer

    from trainer_core.storage import materialize, names_a_path

    teacher, student = ctx.input("reference"), ctx.input("model")
    try:
        local = materialize(teacher) if names_a_path(teacher) else teacher
        theirs = AutoTokenizer.from_pretrained(local)
    except (OSError, ValueError) as e:
        raise ConfigError(f"distill.teacher_from: no tokenizer could be loaded from the teacher {teacher}: {e}") from None
    ours = ctx.tokenizer
    their_vocab, our_vocab = theirs.get_vocab(), ours.get_vocab()
    if their_vocab != our_vocab or theirs.all_special_tokens != ours.all_special_tokens:
        differ = sorted(set(their_vocab.items()) ^ set(our_vocab.items()))[:3]
        raise ConfigError(f"distill.teacher_from: the teacher {teacher} and the student {student} have different "
                          f"tokenizers ({len(their_vocab)} and {len(our_vocab)} words; e.g. {differ}); distillation "
                          "compares their log-probs of the same token ids, so they must share one")


def run(ctx: StageContext) -> Manifest:
    """Distil the teacher into the student and commit the student as an HF model directory
    (collective when distributed).

    Raises:
        ConfigError: the teacher's tokenizer is not the student's (before anything is trained).
    """
    cfg = ctx.config.distill
    check_teacher_tokenizer(ctx)
    trainer, metrics = run_rl_stage(ctx, cfg, DistillAlgorithm(cfg), uses_reference=True)
    return commit_final(ctx, metrics, model=trainer.policy)
