"""The GRPO family: advantage estimators and loss aggregations, each a pure function in a registry.

Shape legend: B prompts, G completions per prompt (``group_size``), N = B * G sequences with the
rows of a group contiguous (rows ``i*G .. i*G+G-1`` answer prompt i), T completion tokens.
``mask`` is a float [N, T] tensor, 1 = a real completion token. Scores are float32 [N].

Advantage estimators (:data:`ADVANTAGE_ESTIMATORS`, ``grpo.advantage_estimator``), each
``(scores, mask, group_size, *, logprobs, ref_logprobs, kl_coef, kl_estimator, all_reduce_sum)
-> advantages [N, T]`` float32, zero on padding:

- ``grpo``: ``(r_i - mean(r_group)) / (std(r_group) + 1e-4)`` on every token of completion i
  (Shao et al. 2024, DeepSeekMath, section 4.1.2, outcome supervision; TRL's ``GRPOTrainer``:
  torch's unbiased std and ``+ 1e-4``);
- ``dr_grpo``: ``r_i - mean(r_group)`` (Liu et al. 2025, "Understanding R1-Zero-Like Training",
  section 3.2: no std division);
- ``rloo``: ``r_i - mean_{j != i} r_j`` (Ahmadian et al. 2024, "Back to Basics", eq. 7; verl's
  ``compute_rloo_outcome_advantage``: ``r_i * G / (G - 1) - mean(r) * G / (G - 1)``);
- ``reinforce_pp``: REINFORCE++ (Hu 2025, eq. 5-6; OpenRLHF's ``reinforce`` advantage and verl's
  ``compute_reinforce_plus_plus_outcome_advantage``): token rewards ``-kl_coef * KL_t`` plus the
  score on the last real token, the return-to-go ``G_t = sum_{s >= t} r_s`` (gamma 1) as the
  advantage, whitened (:func:`~trainer_core.objectives.ppo.whiten`: mean and unbiased variance)
  over every real token of the batch, over all ranks when ``all_reduce_sum`` is given. No group baseline.

Loss aggregations (:data:`LOSS_AGGREGATIONS`, ``grpo.loss_aggregation``), each ``(losses [N, T],
mask, *, num_tokens, num_sequences, max_new_tokens) -> scalar``: this rank's share of the
mini-batch loss (``num_tokens`` and ``num_sequences`` are the mini-batch's counts over every
rank, so the shares of all ranks sum to the single-device value):

- ``token_mean``: ``sum(losses * mask) / num_tokens`` (DAPO, Yu et al. 2025, eq. 12,
  token-level policy gradient; TRL ``loss_type="dapo"``, verl ``token-mean``);
- ``sequence_mean``: the mean over sequences of each sequence's token mean (GRPO's eq. 3;
  verl ``seq-mean-token-mean``);
- ``constant``: ``sum(losses * mask) / (num_sequences * max_new_tokens)`` (Dr. GRPO, eq. in
  section 3.2; TRL ``loss_type="dr_grpo"``, verl ``seq-mean-token-sum-norm``).

Plus DAPO's soft overlong punishment (:func:`dapo_overlong_penalty`, eq. 13) and clip-higher
(:func:`clipped_policy_loss_asymmetric`, eq. 10).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from trainer_core.objectives.ppo import KL_ESTIMATORS, clipped_policy_loss, last_real_index, whiten

STD_EPS = 1e-4
"""Added to the group std before dividing (TRL's value)."""

AllReduceSum = Callable[[Tensor], Tensor]


def _grouped(scores: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """[B, G] float32 view of ``scores`` [N]; checks the shapes.

    Raises:
        ValueError: ``group_size`` < 2, ``scores`` not [N] or not a multiple of G, or ``mask`` not [N, T].
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2, got {group_size}")
    if scores.ndim != 1 or scores.numel() % group_size:
        raise ValueError(f"scores of shape {tuple(scores.shape)} do not split into groups of {group_size}")
    if mask.ndim != 2 or mask.shape[0] != scores.shape[0]:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not match scores of shape {tuple(scores.shape)}")
    return scores.float().reshape(-1, group_size)


def _per_token(advantages: Tensor, mask: Tensor) -> Tensor:
    """[N] sequence advantages broadcast over each sequence's real tokens: [N, T] float32."""
    return advantages.reshape(-1)[:, None] * mask.float()


def grpo_advantages(scores: Tensor, mask: Tensor, group_size: int, **_: object) -> Tensor:
    """GRPO: ``(r_i - mean) / (std + 1e-4)`` within each group, on every real token.

    Worked value: one group [1, 0, 0, 1]: mean 0.5, unbiased std 0.5774 ->
    [0.8659, -0.8659, -0.8659, 0.8659]; a group of equal scores -> 0.
    """
    grouped = _grouped(scores, mask, group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + STD_EPS)
    return _per_token(centred, mask)


def dr_grpo_advantages(scores: Tensor, mask: Tensor, group_size: int, **_: object) -> Tensor:
    """Dr. GRPO: ``r_i - mean`` within each group (no std division), on every real token.

    Worked value: one group [1, 0, 0, 1] -> [0.5, -0.5, -0.5, 0.5].
    """
    grouped = _grouped(scores, mask, group_size)
    return _per_token(grouped - grouped.mean(dim=1, keepdim=True), mask)


def rloo_advantages(scores: Tensor, mask: Tensor, group_size: int, **_: object) -> Tensor:
    """RLOO: ``r_i`` minus the mean of the other ``G - 1`` scores of its group, on every real token.

    Worked value: one group [1, 0, 0, 1]: 1 - 1/3 = 2/3 and 0 - 2/3 ->
    [0.6667, -0.6667, -0.6667, 0.6667].
    """
    grouped = _grouped(scores, mask, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return _per_token(grouped - others, mask)


def reinforce_pp_advantages(
    scores: Tensor,
    mask: Tensor,
    group_size: int,
    *,
    logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k1",
    all_reduce_sum: AllReduceSum | None = None,
    **_: object,
) -> Tensor:
    """REINFORCE++: return-to-go of KL-penalised token rewards, whitened over the batch.

    Args:
        scores: [N] sequence scores; mask: [N, T] (real tokens a prefix of each row).
        group_size: validated only (no group baseline).
        logprobs, ref_logprobs: [N, T] under the rollout policy and the reference; needed when
            ``kl_coef`` > 0.
        kl_coef: weight of the per-token KL penalty in the reward.
        kl_estimator: a key of :data:`~trainer_core.objectives.ppo.KL_ESTIMATORS`.
        all_reduce_sum: sum over data-parallel ranks for the whitening statistics (None: this
            process's tokens only).

    Raises:
        ValueError: ``kl_coef`` > 0 without log-probs; shapes as :func:`grpo_advantages`.

    Worked value (kl_coef 0): scores [1, 0], mask [[1, 1, 0], [1, 1, 1]]: returns
    [[1, 1, 0], [0, 0, 0]], mean of the 5 real tokens 0.4, unbiased var 0.3 ->
    [[1.0954, 1.0954, 0], [-0.7303, -0.7303, -0.7303]].
    """
    _grouped(scores, mask, group_size)
    mask = mask.float()
    rewards = torch.zeros_like(mask)
    if kl_coef > 0:
        if logprobs is None or ref_logprobs is None:
            raise ValueError("reinforce_pp with kl_coef > 0 needs logprobs and ref_logprobs")
        rewards = -kl_coef * KL_ESTIMATORS[kl_estimator](logprobs.float(), ref_logprobs.float()) * mask
    last = last_real_index(mask)  # the policy's last token, also after a tool's observation
    rewards[torch.arange(scores.shape[0], device=scores.device), last] += scores.float()
    returns = rewards.flip(1).cumsum(1).flip(1) * mask  # G_t = sum_{s >= t} r_s
    return whiten(returns, mask, all_reduce_sum=all_reduce_sum)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}
"""``grpo.advantage_estimator`` -> estimator (module docstring)."""


def token_mean(losses: Tensor, mask: Tensor, *, num_tokens: Tensor | float, **_: object) -> Tensor:
    """DAPO's token-level mean: ``sum(losses * mask) / num_tokens``.

    Worked value: losses [[1, 2], [3, 0]], mask [[1, 1], [1, 0]], 3 tokens -> 2.0.
    """
    return (losses * mask).sum() / num_tokens


def sequence_mean(losses: Tensor, mask: Tensor, *, num_sequences: Tensor | float, **_: object) -> Tensor:
    """GRPO's sample-level mean: each sequence's token mean, summed, over ``num_sequences``
    (a row without real tokens contributes 0).

    Worked value: losses [[1, 2], [3, 0]], mask [[1, 1], [1, 0]], 2 sequences -> (1.5 + 3) / 2 = 2.25.
    """
    per_row = (losses * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return per_row.sum() / num_sequences


def constant(
    losses: Tensor, mask: Tensor, *, num_sequences: Tensor | float, max_new_tokens: int, **_: object
) -> Tensor:
    """Dr. GRPO's constant normaliser: ``sum(losses * mask) / (num_sequences * max_new_tokens)``.

    Worked value: losses [[1, 2], [3, 0]], mask [[1, 1], [1, 0]], 2 sequences, 4 max tokens -> 6 / 8 = 0.75.
    """
    return (losses * mask).sum() / (num_sequences * max_new_tokens)


LOSS_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token_mean": token_mean,
    "sequence_mean": sequence_mean,
    "constant": constant,
}
"""``grpo.loss_aggregation`` -> aggregation (module docstring)."""


def dapo_overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl's ``overlong_buffer``).

    ``0`` for ``L <= L_max - L_cache``; ``((L_max - L_cache) - L) / L_cache * penalty`` up to
    ``L_max``; ``-penalty`` beyond.

    Args:
        lengths: [N] completion lengths in tokens.
        max_new_tokens: L_max.
        buffer_tokens: L_cache (``0 < L_cache <= L_max``).
        penalty: the largest punishment (1 in the paper).

    Returns:
        [N] float32 additions to the scores (<= 0).

    Raises:
        ValueError: ``buffer_tokens`` not in ``(0, max_new_tokens]``.

    Worked values (L_max 20, L_cache 4): L 16 -> 0; L 18 -> -0.5; L 20 -> -1; L 21 -> -1.
    """
    if not 0 < buffer_tokens <= max_new_tokens:
        raise ValueError(f"overlong buffer_tokens must be in (0, {max_new_tokens}], got {buffer_tokens}")
    expected = max_new_tokens - buffer_tokens
    over = (lengths.float() - expected).clamp(min=0.0)
    return -(over / buffer_tokens).clamp(max=1.0) * penalty


def clipped_policy_loss_asymmetric(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_eps: float, clip_eps_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate with DAPO's clip-higher (eq. 10): the ratio clipped to
    ``[1 - clip_eps, 1 + clip_eps_high]``; per token, as
    :func:`~trainer_core.objectives.ppo.clipped_policy_loss` (same metrics).

    Args:
        logprobs, old_logprobs, advantages: [N, T].
        clip_eps, clip_eps_high: the lower and upper clip ranges (> 0).

    Raises:
        ValueError: a clip range that is not positive.

    Worked values (eps 0.2, eps_high 0.28, A = 1): ratio 1.3 -> loss -1.28, clipped; A = -1,
    ratio 0.7 -> loss 0.8, clipped.
    """
    return clipped_policy_loss(logprobs, old_logprobs, advantages, clip_eps, clip_eps_high)
