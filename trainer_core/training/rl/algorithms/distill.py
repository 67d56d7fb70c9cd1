"""On-policy distillation's two losses, one algorithm each (``distill.loss`` picks one from
:data:`DISTILL_ALGORITHMS`; :mod:`trainer_core.stages.distill` describes the method):

- ``token_reverse_kl``: each completion token's advantage is the teacher's log-probability of it
  minus the student's at sampling time (a one-sample reverse KL; Thinking Machines, "On-Policy
  Distillation", 2025; prime-rl's ``opd``), followed with the clipped policy-gradient loss;
- ``generalized_jsd``: the generalised Jensen-Shannon divergence to the teacher over the whole
  vocabulary at every sampled position (Agarwal et al. 2024, GKD, eq. 1; TRL's ``GKDTrainer``),
  the teacher forwarded again in each update step.

Both take the token mean over the student's tokens. The teacher is the RL loop's frozen reference.

Shape legend: N sequences, T completion tokens.
"""

from __future__ import annotations

from torch import Tensor

from trainer_core.config import DistillConfig
from trainer_core.modeling.forwards.completion import PolicyForward, TeacherTarget, completion_hidden
from trainer_core.modeling.forwards.heads import frozen_head
from trainer_core.objectives.grpo import grpo_loss
from trainer_core.objectives.grpo_family import token_mean
from trainer_core.training.rl.algorithms.base import AllReduceSum, Algorithm, UpdateForwards
from trainer_core.training.rl.batches import MiniBatchCounts, masked_sum, policy_metric_sums
from trainer_core.training.rl.rollout import RolloutBatch

GKD_BETA = 0.5
"""``distill.beta`` when unset: GKD's default (TRL's ``GKDConfig.beta``)."""


def sampled_reverse_kl(batch: RolloutBatch) -> dict[str, Tensor]:
    """``distill/reverse_kl_avg``'s token sum: ``logprobs - ref_logprobs`` at sampling time over the
    student's own samples; empty for the dataset's completions (there it estimates no KL)."""
    if not batch.sampled:
        return {}
    return {"distill/reverse_kl_avg": masked_sum(batch.logprobs - batch.ref_logprobs, batch.completion_mask)}


class ReverseKLDistill(Algorithm):
    """``distill.loss: token_reverse_kl``: per-token reverse-KL advantages from the teacher's
    log-probs (the loop's ``ref_logprobs``), the clipped policy loss, token mean."""

    def __init__(self, cfg: DistillConfig) -> None:
        self.cfg = cfg
        self.samples_per_prompt = cfg.samples_per_prompt_of_rollout
        self.lmbda = cfg.lmbda

    def prepare(self, batch: RolloutBatch, kl_coef: float, all_reduce_sum: AllReduceSum) -> None:
        """``batch.advantages`` [N, T] float32: ``ref_logprobs - logprobs`` on the student's tokens, 0
        elsewhere.

        Raises:
            RuntimeError: the batch has no teacher log-probs (the loop ran without the teacher).
        """
        if batch.ref_logprobs is None:
            raise RuntimeError("distill: the rollout batch has no teacher log-probs")
        batch.advantages = (batch.ref_logprobs - batch.logprobs) * batch.completion_mask

    def loss(
        self, batch: RolloutBatch, out: PolicyForward, counts: MiniBatchCounts, *, kl_coef: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """This rank's share of the mini-batch's token-mean clipped policy loss (each token's loss
        weighted by ``batch.is_weights`` when set), and the token sums of the metrics."""
        mask, cfg = batch.completion_mask, self.cfg
        losses, m = grpo_loss(
            out.logprobs,
            batch.logprobs,
            batch.advantages,
            None,
            clip_eps=cfg.clip_eps,
            kl_coef=0.0,
            is_weights=batch.is_weights,
        )
        loss = token_mean(losses, mask, num_tokens=counts.num_tokens)
        metric_sums = {
            "loss/policy_avg": masked_sum(losses.detach(), mask),
            **sampled_reverse_kl(batch),
            **policy_metric_sums(m, out.entropies, mask),
        }
        return loss, metric_sums


class GeneralizedJSDDistill(ReverseKLDistill):
    """``distill.loss: generalized_jsd``: the generalised JSD (``beta``) between the student's and
    the teacher's next-token distributions at every sampled position, token mean; the advantages
    of :meth:`prepare` are computed (and unused by the loss)."""

    def __init__(self, cfg: DistillConfig) -> None:
        super().__init__(cfg)
        self._teacher_head: tuple[Tensor, Tensor | None] | None = None

    def forward(self, forwards: UpdateForwards, part: RolloutBatch) -> PolicyForward:
        """The student's forward on ``part`` (with gradients, through the backend's wrapper) with
        the generalised JSD to the teacher per token (``out.divergences``); the teacher's head is
        gathered once (collective under FSDP2 and ZeRO-3), its hidden states each call.

        Raises:
            RuntimeError: the loop has no teacher model.
        """
        teacher = forwards.reference
        if teacher is None:
            raise RuntimeError("distill: the RL loop has no teacher model")
        if self._teacher_head is None:
            self._teacher_head = frozen_head(teacher)
        beta = GKD_BETA if self.cfg.beta is None else self.cfg.beta
        target = TeacherTarget(
            completion_hidden(teacher, part, forwards.padding_free),
            *self._teacher_head,
            beta=beta,
            temperature=forwards.temperature,
        )
        return forwards.policy(part, teacher=target)

    def loss(
        self, batch: RolloutBatch, out: PolicyForward, counts: MiniBatchCounts, *, kl_coef: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """This rank's share of the mini-batch's token-mean JSD, and the token sums of the metrics."""
        mask = batch.completion_mask
        loss = token_mean(out.divergences, mask, num_tokens=counts.num_tokens)
        jsd = masked_sum(out.divergences.detach(), mask)
        return loss, {
            "loss/policy_avg": jsd,
            "distill/jsd_avg": jsd,
            "policy/entropy_avg": masked_sum(out.entropies, mask),
            **sampled_reverse_kl(batch),
        }


DISTILL_ALGORITHMS: dict[str, type[ReverseKLDistill]] = {
    "token_reverse_kl": ReverseKLDistill,
    "generalized_jsd": GeneralizedJSDDistill,
}
"""``distill.loss`` -> its algorithm."""
