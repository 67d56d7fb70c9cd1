"""PPO pieces for RLHF: per-token KL estimators, GAE, whitening, clipped losses, adaptive KL.

Shape legend: B batch (sequences), T completion tokens. ``mask`` is a float [B, T] tensor,
1 = a real completion token (counted), 0 = padding after the end of the completion.

Sources: Schulman et al. 2017 "Proximal Policy Optimization Algorithms" (clipped objective,
eq. 7); Schulman et al. 2016 "High-Dimensional Continuous Control Using Generalized Advantage
Estimation" (GAE, eq. 16); Ziegler et al. 2019 "Fine-Tuning Language Models from Human
Preferences" (per-token KL penalty, adaptive KL controller, section 2.2); Schulman 2020
"Approximating KL Divergence" (k1, k3). Checked against TRL's ``PPOTrainer`` (v0.12-0.19):
``masked_whiten``, the backward GAE loop, ``pg_losses``/``vf_losses`` and their clip fractions,
``AdaptiveKLController``.

Every loss comes back unreduced (per token); the caller sums ``losses * mask`` and divides by
the mini-batch's ``num_valid_tokens``, which is what TRL's ``masked_mean`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Schulman's k1 estimator of KL(policy || reference) per sampled token: ``logp - ref_logp``.

    Unbiased, can be negative on a single sample.

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the policy.
        ref_logprobs: [B, T] the same tokens under the reference.

    Returns:
        [B, T] per-token estimates (padding positions are not masked here).

    Worked value: logp = -1, ref_logp = -2 gives 1.0.
    """
    return logprobs - ref_logprobs


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Schulman's k3 estimator: ``exp(r) - r - 1`` with ``r = ref_logp - logp``.

    Unbiased for KL(policy || reference) under samples from the policy, and never negative.
    Used by DeepSeekMath's GRPO (Shao et al. 2024, eq. 4).

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the policy.
        ref_logprobs: [B, T] the same tokens under the reference.

    Returns:
        [B, T] per-token estimates, >= 0.

    Worked value: logp = -1, ref_logp = -2: r = -1, exp(-1) + 1 - 1 = 0.3679.
    """
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k3": kl_k3}
"""Config name (``kl_estimator``) -> estimator."""


def last_real_index(mask: Tensor) -> Tensor:
    """[B] long: the index of each row's last 1 in ``mask`` [B, T] (the completion's last token
    the policy wrote, also when an environment's observation tokens (0) sit between its turns);
    T - 1 for a row without one."""
    return mask.shape[1] - 1 - (mask > 0).long().flip(1).argmax(dim=1)


def penalized_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> tuple[Tensor, Tensor]:
    """Per-token rewards: ``-kl_coef * kl`` on every token, plus the score on the last real token.

    Args:
        scores: [B] sequence-level rewards (reward model or verifier).
        kl: [B, T] per-token KL estimates.
        mask: [B, T] 1 = real completion token; each row must have at least one.
        kl_coef: KL penalty coefficient (>= 0).

    Returns:
        (rewards [B, T], non_score_rewards [B, T]), both zero on padding.

    Worked value: scores [1.0], kl [[0.5, 0.5, 9]], mask [[1, 1, 0]], kl_coef 0.1 ->
    rewards [[-0.05, 0.95, 0]].
    """
    non_score = -kl_coef * kl * mask
    last = last_real_index(mask)
    rewards = non_score.clone()
    rewards[torch.arange(scores.shape[0], device=scores.device), last] += scores
    return rewards, non_score


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over each completion, backwards in time.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (V after the last real token is 0: the episode
    ends there), ``A_t = delta_t + gamma * lam * A_{t+1}``; returns ``R_t = A_t + V_t``.

    Args:
        rewards: [B, T] per-token rewards.
        values: [B, T] value predictions V(s_t) of the state before token t.
        mask: [B, T] 1 = a token the policy wrote. A multi-turn completion's observation tokens
            (an environment's, 0) may sit between its turns: the time steps are the policy's
            tokens alone, so V_{t+1} is the value at the policy's next token, after the
            observation (the environment's answer is part of the transition), as in verl's and
            OpenRLHF's multi-turn PPO.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        (advantages [B, T], returns [B, T]), zero on padding and observations; detached.

    Worked value (gamma = lam = 1): rewards [[0, 1]], values [[0.5, 0.25]] ->
    deltas [-0.25, 0.75], advantages [0.5, 0.75], returns [1.0, 1.0]; with an observation
    between the two tokens (mask [[1, 0, 1]]) the same values at positions 0 and 2.
    """
    if bool((mask[:, 1:] > mask[:, :-1]).any()):  # a gap: run on the policy's tokens moved to the front
        order = torch.sort((mask <= 0).to(torch.uint8), dim=1, stable=True).indices
        advantages, returns = gae(rewards.gather(1, order), values.gather(1, order), mask.gather(1, order), gamma, lam)
        return torch.zeros_like(advantages).scatter(1, order, advantages), torch.zeros_like(returns).scatter(
            1, order, returns
        )
    rewards, values, mask = rewards.detach() * mask, values.detach() * mask, mask.to(rewards.dtype)
    num_tokens = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(num_tokens)):
        next_values = values[:, t + 1] if t + 1 < num_tokens else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        advantages[:, t] = last
    return advantages, (advantages + values) * mask


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 when none is)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def whiten(
    x: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    all_reduce_sum: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Normalise the masked entries of ``x`` to unit variance (and zero mean with ``shift_mean``).

    As TRL's ``masked_whiten``: the variance is the unbiased (Bessel-corrected) masked variance.
    With ``all_reduce_sum`` the mean and the variance are those of every rank's tokens (their
    sums all-reduced over the data-parallel ranks), so every rank whitens with the numbers of the
    whole batch; without it (or with the identity) the result is the same operations on this
    process's tokens alone, bit for bit.

    Args:
        x: [B, T] values (advantages, REINFORCE++'s returns).
        mask: [B, T] 1 = counted.
        shift_mean: subtract the mean (False: only rescale, the mean is kept).
        eps: added to the variance.
        all_reduce_sum: the sum of a tensor over ranks (``Backend.all_reduce_sum``); None: this
            process only.

    Returns:
        [B, T] whitened values, zero on padding.

    Worked values: x [[1, 3]], mask all 1: mean 2, unbiased var 2 -> [[-0.7071, 0.7071]]; rank 0
    holding [[1]] and rank 1 [[3]] get [[-0.7071]] and [[0.7071]].
    """
    reduce = all_reduce_sum or (lambda t: t)
    sums = reduce(torch.stack([(x * mask).sum(), mask.sum()]))
    count = sums[1]
    mean = sums[0] / count.clamp(min=1.0)
    squares = reduce(((x - mean) ** 2 * mask).sum())
    var = squares / count.clamp(min=1.0) * count / (count - 1).clamp(min=1.0)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate, per token: ``max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high))``.

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: [B, T] the same under the policy that sampled them (rollout time).
        advantages: [B, T] advantages (detached).
        clip_eps: clip range epsilon (> 0).
        clip_eps_high: the upper clip range (> 0; DAPO's clip-higher, Yu et al. 2025, eq. 10);
            None: ``clip_eps``.
        is_weights: [B, T] truncated importance weights ``min(pi_old / pi_engine, cap)`` that
            multiply each token's loss (Yao et al. 2025, "Your efficient RL framework secretly
            brings you off-policy RL training"; verl's ``tis_imp_ratio_cap`` in its policy loss),
            or None. The one place PPO, GRPO and distillation apply them.

    Returns:
        (losses [B, T], metrics) with detached [B, T] ``ratio``, ``clipped`` (1.0 where the
        clipped branch is the larger loss: TRL's ``clipfrac``) and ``approxkl``
        (``0.5 * (logp - old_logp)^2``, TRL's ``approxkl``).

    Raises:
        ValueError: a clip range that is not positive.

    Worked values (eps 0.2, A = 1): ratio 1.1 (inside) -> loss -1.1, not clipped;
    ratio 1.5 (outside) -> loss -1.2, clipped; A = -1, ratio 0.5 -> loss 0.8, clipped.
    """
    clip_high = clip_eps if clip_eps_high is None else clip_eps_high
    if clip_eps <= 0 or clip_high <= 0:
        raise ValueError(f"clip ranges must be positive, got clip_eps={clip_eps}, clip_eps_high={clip_eps_high}")
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_high)
    losses = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        losses = losses * is_weights
    metrics = {
        "ratio": ratio.detach(),
        "clipped": (clipped > unclipped).float().detach(),
        "approxkl": (0.5 * log_ratio.detach() ** 2),
    }
    return losses, metrics


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, clip_eps: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss per token: ``0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)``.

    Args:
        values: [B, T] current value predictions (with grad).
        old_values: [B, T] predictions at rollout time.
        returns: [B, T] GAE returns (detached).
        clip_eps: how far V may move from V_old before the clipped branch applies (> 0).

    Returns:
        (losses [B, T], metrics) with detached [B, T] ``clipped`` (TRL's ``vf_clipfrac``).

    Raises:
        ValueError: ``clip_eps`` is not positive.

    Worked values (eps 0.2, V_old 0, R 1): V 0.1 -> 0.5 * 0.81 = 0.405, not clipped;
    V 0.5 -> clipped V 0.2, loss 0.5 * max(0.25, 0.64) = 0.32, clipped.
    """
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be positive, got {clip_eps}")
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    unclipped_losses = (values - returns) ** 2
    clipped_losses = (clipped_values - returns) ** 2
    losses = 0.5 * torch.maximum(unclipped_losses, clipped_losses)
    return losses, {"clipped": (clipped_losses > unclipped_losses).float().detach()}


@dataclass
class FixedKLController:
    """A constant ``kl_coef``; ``update`` does nothing."""

    value: float

    def update(self, current_kl: float, num_sequences: int) -> None:
        """No-op."""

    def state_dict(self) -> dict[str, float]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    """Ziegler et al. 2019's proportional controller of ``kl_coef`` (TRL's ``AdaptiveKLController``).

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``kl_coef *= 1 + e * num_sequences / horizon``.

    Attributes:
        value: the current ``kl_coef``.
        target: target KL per sequence (nats).
        horizon: controller horizon in sequences.

    Worked value: value 0.1, target 6, horizon 10000, KL 12 over 100 sequences:
    e = 0.2 (clipped from 1.0), value = 0.1 * (1 + 0.2 * 100 / 10000) = 0.1002.
    """

    value: float
    target: float
    horizon: int

    def update(self, current_kl: float, num_sequences: int) -> None:
        """Move ``value`` after a rollout whose mean per-sequence KL is ``current_kl``."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * num_sequences / self.horizon

    def state_dict(self) -> dict[str, float]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
