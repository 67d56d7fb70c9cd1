"""Preference losses: DPO (sigmoid) and its family, chosen by ``dpo.loss_type``.

Each loss is a pure function of per-pair summed completion log-probs (and, for the
length-normalised ones, completion lengths), returning per-pair losses [B] and TRL-named reward
metrics. :data:`PREFERENCE_LOSSES` maps ``loss_type`` to the function; :data:`REFERENCE_FREE`
names the ones that need no reference model (SimPO, ORPO).

Shape legend: B batch (pairs). Log-probs are float32 sums over a completion's tokens; lengths
are the number of completion tokens summed (float32 or long).

Arguments every loss names alike: ``policy_chosen_logprobs`` and ``policy_rejected_logprobs``
[B], the summed log-probs of the chosen and the rejected completions under the policy;
``ref_chosen_logprobs`` and ``ref_rejected_logprobs`` [B], the same under the frozen reference;
``chosen_lengths`` and ``rejected_lengths`` [B], the completion tokens of each (> 0);
``label_smoothing`` eps in [0, 0.5), the probability that a preference label is flipped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def _metrics(chosen_rewards: Tensor, rejected_rewards: Tensor) -> dict[str, Tensor]:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
        "rewards/margins": chosen_rewards - rejected_rewards,
    }


def _logratios(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor,
               ref_rejected: Tensor) -> tuple[Tensor, Tensor]:
    """(policy - reference) log-ratios of the chosen and the rejected completions, float32 [B]."""
    return policy_chosen.float() - ref_chosen.float(), policy_rejected.float() - ref_rejected.float()


def _smoothed_sigmoid(logits: Tensor, label_smoothing: float) -> Tensor:
    """``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)``: the sigmoid loss of a label flipped
    with probability eps (cDPO; SimPO's smoothing)."""
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


def _check(beta: float, label_smoothing: float = 0.0, upper: float = 1.0) -> None:
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    if not 0.0 <= label_smoothing < upper:
        raise ValueError(f"label_smoothing must be in [0, {upper}), got {label_smoothing}")


def dpo_loss(
    policy_chosen_logprobs: Tensor,
    policy_rejected_logprobs: Tensor,
    ref_chosen_logprobs: Tensor,
    ref_rejected_logprobs: Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair sigmoid DPO loss; with ``label_smoothing`` eps > 0, conservative DPO (cDPO).

    With ``h = (pi_c - ref_c) - (pi_r - ref_r)`` (summed completion log-probs):
    ``loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``.

    Source: Rafailov et al. 2023, "Direct Preference Optimization", eq. 7 (eps = 0); cDPO,
    Mitchell 2023, "A note on DPO with noisy preferences" (eps the probability that a label is
    flipped). Checked against TRL: DPOTrainer ``loss_type="sigmoid"`` (eps = 0; TRL 1.x smooths
    no sigmoid label) and CPOTrainer's smoothed sigmoid (TRL 0.x's cDPO); the metrics follow TRL's names and definitions: ``rewards/chosen = beta * (pi_c - ref_c)``,
    likewise rejected, ``rewards/accuracies = (rewards/chosen > rewards/rejected)``,
    ``rewards/margins = rewards/chosen - rewards/rejected``.

    Args:
        beta: strength of the implicit KL constraint (> 0); the log-probs and ``label_smoothing``
            as the module docstring says.

    Returns:
        (losses [B], metrics): metrics are detached [B] tensors keyed ``rewards/chosen``,
        ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``.

    Raises:
        ValueError: ``beta`` not positive, ``label_smoothing`` outside [0, 0.5).

    Worked value: policy == reference gives ``log 2 = 0.6931`` per pair, whatever eps.
    """
    _check(beta, label_smoothing, 0.5)
    chosen_logratios, rejected_logratios = _logratios(
        policy_chosen_logprobs, policy_rejected_logprobs, ref_chosen_logprobs, ref_rejected_logprobs)
    losses = _smoothed_sigmoid(beta * (chosen_logratios - rejected_logratios), label_smoothing)
    return losses, _metrics(beta * chosen_logratios, beta * rejected_logratios)


def robust_dpo_loss(
    policy_chosen_logprobs: Tensor,
    policy_rejected_logprobs: Tensor,
    ref_chosen_logprobs: Tensor,
    ref_rejected_logprobs: Tensor,
    *,
    beta: float,
    label_smoothing: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair robust DPO loss: an unbiased estimate of the DPO loss under label noise eps.

    ``loss = ((1 - eps) (-log sigmoid(beta h)) - eps (-log sigmoid(-beta h))) / (1 - 2 eps)``,
    ``h`` as in :func:`dpo_loss`.

    Source: Chowdhury et al. 2024, "Provably Robust DPO: Aligning Language Models with Noisy
    Feedback", eq. 8 (rDPO); TRL ``loss_type="robust"``. Arguments, returns and metrics as
    :func:`dpo_loss`.

    Raises:
        ValueError: ``beta`` not positive, ``label_smoothing`` outside [0, 0.5).

    Worked value: eps = 0 is the sigmoid loss; policy == reference gives ``log 2`` whatever eps.
    """
    _check(beta, label_smoothing, 0.5)
    chosen_logratios, rejected_logratios = _logratios(
        policy_chosen_logprobs, policy_rejected_logprobs, ref_chosen_logprobs, ref_rejected_logprobs)
    logits = beta * (chosen_logratios - rejected_logratios)
    losses = (-F.logsigmoid(logits) * (1 - label_smoothing) + F.logsigmoid(-logits) * label_smoothing) / (
        1 - 2 * label_smoothing)
    return losses, _metrics(beta * chosen_logratios, beta * rejected_logratios)


def hinge_loss(
    policy_chosen_logprobs: Tensor,
    policy_rejected_logprobs: Tensor,
    ref_chosen_logprobs: Tensor,
    ref_rejected_logprobs: Tensor,
    *,
    beta: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair hinge loss on the reference-normalised margin: ``relu(1 - beta h)``.

    Source: Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration with Human Feedback",
    eq. 1 (the calibration loss with margin 1 / beta, normalised by the reference as in Liu et
    al. 2024, RSO); TRL ``loss_type="hinge"``. Arguments, returns and metrics as :func:`dpo_loss`.

    Raises:
        ValueError: ``beta`` not positive.

    Worked value: policy == reference gives 1 per pair.
    """
    _check(beta)
    chosen_logratios, rejected_logratios = _logratios(
        policy_chosen_logprobs, policy_rejected_logprobs, ref_chosen_logprobs, ref_rejected_logprobs)
    losses = torch.relu(1 - beta * (chosen_logratios - rejected_logratios))
    return losses, _metrics(beta * chosen_logratios, beta * rejected_logratios)


def ipo_loss(
    policy_chosen_logprobs: Tensor,
    policy_rejected_logprobs: Tensor,
    ref_chosen_logprobs: Tensor,
    ref_rejected_logprobs: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    *,
    beta: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair IPO loss: ``(h - 1 / (2 beta))^2`` on length-averaged log-probs.

    ``h = (pi_c - ref_c) / |c| - (pi_r - ref_r) / |r|``: the log-ratios averaged over each
    completion's tokens, as TRL averages them for IPO (the paper's ``h`` is written for whole
    sequences; TRL follows the authors' implementation). ``beta`` is the paper's tau: the
    regularisation toward the reference.

    Source: Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", eq. 17; TRL ``loss_type="ipo"``.

    Args:
        As :func:`dpo_loss`, with the completion lengths (the module docstring).

    Returns:
        As :func:`dpo_loss`, rewards ``beta`` times the averaged log-ratios.

    Raises:
        ValueError: ``beta`` not positive.

    Worked value: policy == reference gives ``1 / (4 beta^2)`` per pair (25 at beta 0.1).
    """
    _check(beta)
    chosen_summed, rejected_summed = _logratios(
        policy_chosen_logprobs, policy_rejected_logprobs, ref_chosen_logprobs, ref_rejected_logprobs)
    chosen_logratios, rejected_logratios = chosen_summed / chosen_lengths.float(), rejected_summed / rejected_lengths.float()
    losses = (chosen_logratios - rejected_logratios - 1 / (2 * beta)) ** 2
    return losses, _metrics(beta * chosen_logratios, beta * rejected_logratios)


def simpo_loss(
    policy_chosen_logprobs: Tensor,
    policy_rejected_logprobs: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    *,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair SimPO loss: reference-free, length-normalised, with a target margin ``gamma``.

    ``loss = -log sigmoid(beta pi_c / |c| - beta pi_r / |r| - gamma)`` (with ``label_smoothing``
    eps: ``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)`` of the same ``z``).

    Source: Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free
    Reward", eq. 6 (it takes beta far above DPO's, e.g. 2.0); TRL's CPOTrainer
    ``loss_type="simpo"`` with ``cpo_alpha=0`` (TRL's ``simpo_gamma`` is this ``gamma``).

    Args:
        beta: reward scale (> 0).
        gamma: target reward margin (>= 0).
        The policy's log-probs, the lengths and ``label_smoothing`` as the module docstring says.

    Returns:
        As :func:`dpo_loss`, with the implicit rewards ``beta * pi / |y|``.

    Raises:
        ValueError: ``beta`` not positive, ``gamma`` negative, ``label_smoothing`` outside [0, 0.5).

    Worked value: equal average log-probs give ``-log sigmoid(-gamma)`` (0.9741 at gamma 0.5).
    """
    _check(beta, label_smoothing, 0.5)
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    chosen_rewards = beta * policy_chosen_logprobs.float() / chosen_lengths.float()
    rejected_rewards = beta * policy_rejected_logprobs.float() / rejected_lengths.float()
    losses = _smoothed_sigmoid(chosen_rewards - rejected_rewards - gamma, label_smoothing)
    return losses, _metrics(chosen_rewards, rejected_rewards)


def orpo_loss(
    policy_chosen_logprobs: Tensor,
    policy_rejected_logprobs: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    *,
    beta: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair ORPO loss: the chosen completion's NLL plus ``beta`` times the odds-ratio term.

    With average log-probs ``a_c = pi_c / |c|``, ``a_r = pi_r / |r|`` and
    ``log odds(y) = a - log(1 - exp(a))``:
    ``loss = -a_c - beta log sigmoid(log odds(y_c) - log odds(y_r))``; no reference model.

    Source: Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference
    Model", eqs. 6-7 (``beta`` is the paper's lambda); TRL's ORPOTrainer (``odds_ratio_loss``,
    its rewards ``beta * a``). TRL averages the NLL over all chosen tokens of the batch; here it
    is averaged per sequence, then over pairs like every loss of the family (equal when the
    chosen completions have equal lengths).

    Args:
        As :func:`simpo_loss`; ``beta`` the weight of the odds-ratio term (> 0).

    Returns:
        As :func:`dpo_loss` (rewards ``beta * a``), plus ``nll_loss`` [B] (``-a_c``) and
        ``log_odds_ratio`` [B].

    Raises:
        ValueError: ``beta`` not positive.

    Worked value: ``a_c = log 0.5``, ``a_r = log 0.25``: odds 1 and 1/3, ``log sigmoid(log 3) =
    log 0.75``: loss ``log 2 - beta log 0.75`` (0.7219 at beta 0.1).
    """
    _check(beta)
    chosen = policy_chosen_logprobs.float() / chosen_lengths.float()
    rejected = policy_rejected_logprobs.float() / rejected_lengths.float()
    # log(1 - exp(a)) for a < 0, stable near 0 (torch.log1p(-exp(a)) loses precision there).
    log_odds = (chosen - rejected) - (torch.log(-torch.expm1(chosen)) - torch.log(-torch.expm1(rejected)))
    ratio = F.logsigmoid(log_odds)
    losses = -chosen - beta * ratio
    metrics = _metrics(beta * chosen, beta * rejected)
    metrics["nll_loss"] = (-chosen).detach()
    metrics["log_odds_ratio"] = ratio.detach()
    return losses, metrics


PREFERENCE_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "sigmoid": dpo_loss,
    "robust": robust_dpo_loss,
    "hinge": hinge_loss,
    "ipo": ipo_loss,
    "simpo": simpo_loss,
    "orpo": orpo_loss,
}
"""``dpo.loss_type`` -> loss function (``sigmoid`` with ``label_smoothing`` is cDPO)."""

REFERENCE_FREE = frozenset({"simpo", "orpo"})
"""Loss types that read no reference log-probs: the DPO stage loads no reference for them."""

LENGTH_NORMALISED = frozenset({"ipo", "simpo", "orpo"})
"""Loss types that take completion lengths."""


def preference_loss(
    loss_type: str,
    policy_chosen_logprobs: Tensor,
    policy_rejected_logprobs: Tensor,
    ref_chosen_logprobs: Tensor | None = None,
    ref_rejected_logprobs: Tensor | None = None,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The :data:`PREFERENCE_LOSSES` entry ``loss_type`` on these tensors, with the settings it takes.

    Args:
        loss_type: a key of :data:`PREFERENCE_LOSSES`.
        ref_chosen_logprobs, ref_rejected_logprobs: [B]; None for the :data:`REFERENCE_FREE` ones.
        chosen_lengths, rejected_lengths: [B]; needed by the :data:`LENGTH_NORMALISED` ones.
        beta: every loss's beta (ORPO's lambda).
        label_smoothing: sigmoid (cDPO), robust and SimPO.
        gamma: SimPO's target margin.

    Raises:
        ValueError: an unknown ``loss_type``, or a tensor it needs is None.
    """
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown preference loss_type {loss_type!r}; expected one of {sorted(PREFERENCE_LOSSES)}")
    policy = (policy_chosen_logprobs, policy_rejected_logprobs)
    reference = () if loss_type in REFERENCE_FREE else (ref_chosen_logprobs, ref_rejected_logprobs)
    lengths = (chosen_lengths, rejected_lengths) if loss_type in LENGTH_NORMALISED else ()
    if any(t is None for t in (*reference, *lengths)):
        raise ValueError(f"loss_type {loss_type!r} needs {'reference log-probs' if None in reference else 'lengths'}")
    settings: dict[str, float] = {"beta": beta}
    if loss_type in ("sigmoid", "robust", "simpo"):
        settings["label_smoothing"] = label_smoothing
    if loss_type == "simpo":
        settings["gamma"] = gamma
    return PREFERENCE_LOSSES[loss_type](*policy, *reference, *lengths, **settings)
