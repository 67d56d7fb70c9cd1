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

The teacher must share the student's tokenizer (checked before anything is trained, naming both
models); its architecture and width may differ. The full-vocabulary generalised JSD
(:func:`~trainer_core.objectives.distill.chunked_generalized_jsd`) is not a loss of this stage.

Shape legend: N sequences, T completion tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import DistillConfig
from trainer_core.errors import ConfigError
from trainer_core.objectives.grpo_family import LOSS_AGGREGATIONS, clipped_policy_loss_asymmetric
from trainer_core.stages.context import StageContext, commit_final
from trainer_core.stages.rl_common import run_rl_stage
from trainer_core.training.rl.rollout import PolicyForward, RolloutBatch
from trainer_core.training.rl.batches import policy_metric_sums
from trainer_core.training.rl.trainer import MiniBatchCounts, masked_sum


class DistillAlgorithm:
    """Per-token reverse-KL advantages from the teacher's log-probs (the RL loop's
    ``ref_logprobs``), the clipped policy loss, token mean (see the module docstring)."""

    uses_values = False

    def __init__(self, cfg: DistillConfig) -> None:
        self.cfg = cfg
        self.samples_per_prompt = cfg.samples_per_prompt

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
        (``distill/reverse_kl_avg``: ``logprobs - ref_logprobs`` at sampling time)."""
        mask, cfg = batch.completion_mask, self.cfg
        losses, m = clipped_policy_loss_asymmetric(out.logprobs, batch.logprobs, batch.advantages, cfg.clip_eps,
                                                   cfg.clip_eps)
        if batch.is_weights is not None:
            losses = losses * batch.is_weights
        loss = LOSS_AGGREGATIONS["token_mean"](losses, mask, num_tokens=counts.num_tokens,
                                               num_sequences=counts.num_sequences,
                                               max_new_tokens=cfg.generation.max_new_tokens)
        metric_sums = {
            "loss/policy_avg": masked_sum(losses.detach(), mask),
            "distill/reverse_kl_avg": masked_sum(batch.logprobs - batch.ref_logprobs, mask),
            **policy_metric_sums(m, out.entropies, mask),
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
