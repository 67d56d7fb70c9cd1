"""GRPO: group-relative advantages and the clipped per-token objective with a KL term.

Shape legend: B prompts, G completions per prompt (group size), N = B * G sequences,
T completion tokens. ``mask`` is a float [N, T] tensor, 1 = a real completion token.

Source: Shao et al. 2024, "DeepSeekMath", section 4.1: advantages eq. (outcome supervision,
``A_i = (r_i - mean(r)) / std(r)`` for every token of completion i), objective eq. 3 with the
k3 KL of eq. 4. ``scale_rewards=False`` drops the std division as in Liu et al. 2025
"Understanding R1-Zero-Like Training" (Dr. GRPO). Checked against TRL's ``GRPOTrainer``
(``std`` is torch's unbiased std, ``+ 1e-4`` in the denominator).

Departure from the paper: the per-token losses are normalised by the number of real tokens
in the mini-batch (token-level mean, as DAPO and TRL's ``loss_type="dapo"``), not by each
completion's length and then the group; the caller does this division.
"""

from __future__ import annotations

from torch import Tensor

from trainer_core.objectives.grpo_family import STD_EPS
from trainer_core.objectives.ppo import KL_ESTIMATORS, clipped_policy_loss

__all__ = ["STD_EPS", "group_advantages", "grpo_loss"]


def group_advantages(rewards: Tensor, group_size: int, scale: bool = True) -> Tensor:
    """Each completion's reward minus its group's mean, divided by the group's std when ``scale``.

    Args:
        rewards: [N] (groups contiguous: rows ``i*G .. i*G+G-1`` share prompt i) or [B, G].
        group_size: G (>= 2).
        scale: divide by the unbiased group std + 1e-4 (False: Dr. GRPO, mean only).

    Returns:
        Advantages with the shape of ``rewards``, float32.

    Raises:
        ValueError: ``group_size`` < 2, or ``rewards`` does not split into groups of G.

    Worked value: one group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.5774 ->
    [0.8659, -0.8659, -0.8659, 0.8659] (0.5 / 0.5775); without scaling [0.5, -0.5, -0.5, 0.5].
    A group of equal rewards gets advantages 0.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2, got {group_size}")
    if rewards.numel() % group_size or (rewards.ndim == 2 and rewards.shape[1] != group_size):
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    grouped = rewards.float().reshape(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, keepdim=True) + STD_EPS)
    return centred.reshape(rewards.shape)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    ref_logprobs: Tensor | None,
    *,
    clip_eps: float,
    kl_coef: float,
    kl_estimator: str = "k3",
    clip_eps_high: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token GRPO loss: the clipped surrogate with each token's advantage, plus ``kl_coef * KL``.

    What the GRPO stage (and the family's recipes: Dr. GRPO, DAPO, RLOO, REINFORCE++ with
    ``kl_coef`` 0 here) trains with; a loss aggregation of
    :data:`~trainer_core.objectives.grpo_family.LOSS_AGGREGATIONS` reduces it.

    Args:
        logprobs: [N, T] sampled-token log-probs under the current policy (with grad).
        old_logprobs: [N, T] the same at rollout time.
        advantages: [N] one advantage per completion (broadcast over its tokens), or [N, T] per
            token (the family's estimators).
        ref_logprobs: [N, T] under the reference; None when ``kl_coef`` is 0.
        clip_eps: clip range epsilon (the lower one with ``clip_eps_high``).
        kl_coef: KL coefficient (beta in the paper); 0 disables the term.
        kl_estimator: a key of :data:`~trainer_core.objectives.ppo.KL_ESTIMATORS` (``"k3"``: the paper's).
        clip_eps_high: DAPO's clip-higher upper range (Yu et al. 2025, eq. 10); None: ``clip_eps``.
        is_weights: [N, T] truncated importance weights of the policy term (not the KL term), or None.

    Returns:
        (losses [N, T], metrics) with detached [N, T] ``ratio``, ``clipped``, ``approxkl`` and,
        when the KL term is on, ``kl``. Unreduced: mask and aggregate.

    Raises:
        ValueError: ``kl_coef`` > 0 without ``ref_logprobs``, an unknown ``kl_estimator``, or a
            non-positive clip range.

    Worked value: policy == old policy == reference, advantage 0.5: every token's loss is
    -0.5 (ratio 1, KL 0).
    """
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; known: {sorted(KL_ESTIMATORS)}")
    if advantages.ndim == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    losses, metrics = clipped_policy_loss(logprobs, old_logprobs, advantages, clip_eps, clip_eps_high, is_weights)
    if kl_coef > 0:  # DeepSeekMath eq. 3: + beta * KL(pi || pi_ref) per token (k3, eq. 4)
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = KL_ESTIMATORS[kl_estimator](logprobs, ref_logprobs)
        losses = losses + kl_coef * kl
        metrics["kl"] = kl.detach()
    return losses, metrics
