"""The contract between the RL loop (:mod:`trainer_core.training.rl.trainer`) and what it
optimises: :class:`Algorithm`, an ABC like the supervised loop's
:class:`~trainer_core.training.loop.Objective` (declared hooks, defaults that do nothing special),
and :class:`UpdateForwards`, the frozen record of what an algorithm's update forward may use.

Shape legend: N sequences (this rank's), T completion tokens.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from trainer_core.modeling.forwards.completion import Completions, PolicyForward, TeacherTarget, completion_forward
from trainer_core.training.rl.batches import MiniBatchCounts
from trainer_core.training.rl.rollout import RolloutBatch

AllReduceSum = Callable[[Tensor], Tensor]
"""The sum of a tensor over the data-parallel ranks (``Backend.all_reduce_sum``)."""


@dataclass(frozen=True)
class UpdateForwards:
    """What an algorithm's update forward may use (never the loop itself).

    Attributes:
        model: the trainable policy-and-value module as the backend wrapped it (DDP, FSDP2, a
            DeepSpeed engine): a forward through it records the graph the loop backwards.
        reference: the frozen reference model (distillation's teacher), or None (no KL term, or
            the reference is the LoRA policy with its adapter disabled).
        temperature: the rollout's sampling temperature (logits are divided by it, as sampling did).
        with_values: the module has a value head (PPO): ``values`` are returned too.
        padding_free: the stage's ``padding_free`` (rows packed into one sequence).
    """

    model: nn.Module
    reference: nn.Module | None
    temperature: float
    with_values: bool
    padding_free: bool

    def policy(self, part: Completions, teacher: TeacherTarget | None = None) -> PolicyForward:
        """:func:`~trainer_core.modeling.forwards.completion.completion_forward` of ``part`` through :attr:`model`
        (with gradients): log-probs and entropies [N, T], values [N, T] with a value head, and with
        ``teacher`` the per-token divergences to it."""
        return completion_forward(
            self.model,
            part,
            temperature=self.temperature,
            with_values=self.with_values,
            teacher=teacher,
            padding_free=self.padding_free,
        )


class Algorithm(abc.ABC):
    """What an RL stage plugs into the loop: subclass it and define :meth:`prepare` and :meth:`loss`;
    :meth:`forward` and the class attributes have defaults (one sample per prompt, no value head,
    no dynamic sampling, every iteration on the policy's own samples).

    Attributes:
        samples_per_prompt: completions sampled per prompt (GRPO's group size G), as the stage's
            config states it (``RLStageConfig.samples_per_prompt_of_rollout``, which the load-time
            checks read too); a group's rows are contiguous and stay on one rank.
        uses_values: the policy has a value head (PPO's critic): rollouts record ``values``.
        dynamic_sampling: keep only groups whose scores are not all equal (DAPO;
            :func:`~trainer_core.training.rl.batches.groups_with_signal`), sampling more rounds.
        max_sampling_rounds: the most sampling rounds one iteration takes with ``dynamic_sampling``.
        lmbda: the probability that an iteration trains on the policy's own samples (GKD's
            lambda, distillation's ``lmbda``); otherwise on the dataset's completions of its
            prompts (:mod:`~trainer_core.training.rl.dataset_completions`). 1: always on-policy.
    """

    samples_per_prompt: int = 1
    uses_values: bool = False
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 1
    lmbda: float = 1.0

    @abc.abstractmethod
    def prepare(self, batch: RolloutBatch, kl_coef: float, all_reduce_sum: AllReduceSum) -> None:
        """Set ``batch.advantages`` [N, T] float32 (and ``batch.returns`` for a critic) from the scores,
        values and reference log-probs, without gradients; ``kl_coef`` is the KL controller's value
        for this iteration; ``all_reduce_sum`` for statistics over every rank's rows."""

    def forward(self, forwards: UpdateForwards, part: RolloutBatch) -> PolicyForward:
        """The update's forward of one micro-batch, with gradients. Default: the policy's
        (:meth:`UpdateForwards.policy`); distillation's generalised JSD forwards the teacher too."""
        return forwards.policy(part)

    @abc.abstractmethod
    def loss(
        self, batch: RolloutBatch, out: PolicyForward, counts: MiniBatchCounts, *, kl_coef: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(this rank's share of the mini-batch loss: summed over ranks it is the loss of the whole
        mini-batch, whose sizes ``counts`` gives; detached scalar metric sums over this rank's real
        tokens, which the loop divides by ``counts.num_tokens``). ``kl_coef`` is the value
        :meth:`prepare` got, for a KL term in the loss."""
