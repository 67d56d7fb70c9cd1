"""The records of online RL's rollouts: :class:`RolloutBatch` (prompts, the sampled completions
and everything the update needs about them) and :func:`masked_row`, the row a rank without data
forwards.

Shape legend: N sequences in the rollout batch (prompts x samples per prompt), P prompt tokens
(left-padded to the longest prompt), T completion tokens (right-padded after each completion's
end). Token ids are ``torch.long``; masks are float, 1 = a real token.

Sampling is the generation engines' job (:mod:`trainer_core.generation.engines`); the forwards
that score completions (log-probs, entropies, values) and the trainable module they run
(``PolicyAndValue``) are :mod:`trainer_core.modeling.forwards.completion`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer_core.modeling.forwards.completion import Completions


@dataclass
class RolloutBatch(Completions):
    """One rollout: prompts, sampled completions and everything the update needs about them.

    Attributes:
        prompt_ids, prompt_mask, completion_ids, completion_mask: the
            :class:`~trainer_core.modeling.forwards.completion.Completions`; the
            completions are sampled tokens (EOS included) and the mask is float.
        logprobs: [N, T] float32, log-probs of ``completion_ids`` under the policy at rollout
            time (``old_logprobs`` of the PPO ratio), 0 on padding.
        scores: [N] float32, the reward function's score of each completion.
        prompt_index: [N] long, index of each row's prompt in the rollout (groups for GRPO).
        ref_logprobs: [N, T] float32 under the frozen reference, or None (no KL term).
        values: [N, T] float32 value predictions V(s_t) at rollout time (PPO), or None.
        advantages: [N, T] (PPO) or [N] (GRPO) float32, set by the algorithm; None before.
        returns: [N, T] float32 GAE returns (PPO), or None.
        engine_logprobs: [N, T] float32 the generation engine's log-probs of the sampled tokens
            (0 on padding), or None.
        is_weights: [N, T] float32 truncated importance weights ``min(exp(logprobs -
            engine_logprobs), cap)`` (0 on padding) that multiply each token's policy loss, or
            None (no correction).
        sampled: True when the policy sampled the completions; False when they are the
            dataset's (distill's ``lmbda``), where a mean of ``logprobs - ref_logprobs`` or of
            ``-logprobs`` over them estimates no KL or entropy of the policy.
    """

    logprobs: Tensor
    scores: Tensor
    prompt_index: Tensor
    ref_logprobs: Tensor | None = None
    values: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    engine_logprobs: Tensor | None = None
    is_weights: Tensor | None = None
    sampled: bool = True

    @property
    def num_sequences(self) -> int:
        return self.completion_ids.shape[0]


def masked_row(batch: RolloutBatch) -> RolloutBatch:
    """A one-row mini-batch that counts nothing: ``batch``'s first row with its completion mask
    and every per-token input of the losses zeroed (ratio 1, KL 0: finite losses times a zero
    mask). A rank with no row in a mini-batch forwards it, so that it still takes part in the
    step's collectives (gradient all-reduce, sharded forwards) with zero loss and gradient."""
    row = batch.select(torch.zeros(1, dtype=torch.long, device=batch.completion_mask.device))
    zeroed = (
        "completion_mask",
        "observation_mask",
        "logprobs",
        "ref_logprobs",
        "values",
        "advantages",
        "returns",
        "engine_logprobs",
        "is_weights",
    )
    for name in zeroed:
        value = getattr(row, name)
        if value is not None:
            setattr(row, name, torch.zeros_like(value))
    return row
