"""Preference losses: DPO (sigmoid) and its family, chosen by ``dpo.loss_type``.

Each loss is a pure function of a batch of pairs' summed completion log-probs (and, for the
length-normalised ones, completion lengths), held in one :class:`PairLogprobs`, returning
per-pair losses [B] and TRL-named reward metrics. :data:`PREFERENCE_LOSSES` maps ``loss_type`` to the function; :data:`REFERENCE_FREE`
names the ones that need no reference model (SimPO, ORPO).

Shape legend: B batch (pairs). Log-probs are float32 sums over a completion's tokens; lengths
are the number of completion tokens summed (float32 or long).

``label_smoothing``, where a loss takes it, is eps in [0, 0.5): the probability that a
preference label is flipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class PairLogprobs:
    """A batch of preference pairs as the losses read it.

    Attributes:
        policy_chosen_logprobs: [B] float, the chosen completions' summed log-probs under the policy.
        policy_rejected_logprobs: [B] float, the same for the rejected completions.
        ref_chosen_logprobs: [B] float, the chosen completions' under the frozen reference; None
            for the :data:`REFERENCE_FREE` losses.
        ref_rejected_logprobs: [B] float, the same for the rejected completions, or None.
        chosen_lengths: [B] float or long, completion tokens of each chosen completion (> 0);
            needed by the :data:`LENGTH_NORMALISED` losses, else None.
        rejected_lengths: [B], the same for the rejected completions, or None.
    """

    policy_chosen_logprobs: Tensor
    policy_rejected_logprobs: Tensor
    ref_chosen_logprobs: Tensor | None = None
    ref_rejected_logprobs: Tensor | None = None
    chosen_lengths: Tensor | None = None
    rejected_lengths: Tensor | None = None

    def logratios(self) -> tuple[Tensor, Tensor]:
        """(policy - reference) summed log-ratios of the chosen and the rejected completions,
        float32 [B] each.

        Raises:
            ValueError: a reference log-prob field is None.
        """
        if self.ref_chosen_logprobs is None or self.ref_rejected_logprobs is None:
            raise ValueError("this loss needs ref_chosen_logprobs and ref_rejected_logprobs (got None)")
        return (
            self.policy_chosen_logprobs.float() - self.ref_chosen_logprobs.float(),
            self.policy_rejected_logprobs.float() - self.ref_rejected_logprobs.float(),
        )

    def per_token(self, chosen: Tensor, rejected: Tensor) -> tuple[Tensor, Tensor]:
        """``chosen / chosen_lengths`` and ``rejected / rejected_lengths``, float32 [B] each: sums
        over a completion's tokens made averages.

        Raises:
            ValueError: a length field is None.
        """
        if self.chosen_lengths is None or self.rejected_lengths is None:
            raise ValueError("this loss needs chosen_lengths and rejected_lengths (got None)")
        return chosen.float() / self.chosen_lengths.float(), rejected.float() / self.rejected_lengths.float()


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
    pairs: PairLogprobs,
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
        pairs: the policy's and the reference's log-probs.
        beta: strength of the implicit KL constraint (> 0).
        label_smoothing: eps (the module docstring).

    Returns:
        (losses [B], metrics): metrics are detached [B] tensors keyed ``rewards/chosen``,
        ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``.

    Raises:
        ValueError: ``beta`` not positive, ``label_smoothing`` outside [0, 0.5).

    Worked value: policy == reference gives ``log 2 = 0.6931`` per pair, whatever eps.
    """
    _check(beta, label_smoothing, 0.5)
    chosen_logratios, rejected_logratios = pairs.logratios()
    losses = _smoothed_sigmoid(beta * (chosen_logratios - rejected_logratios), label_smoothing)
    return losses, _metrics(beta * chosen_logratios, beta * rejected_logratios)


def robust_dpo_loss(
    pairs: PairLogprobs,
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
    chosen_logratios, rejected_logratios = pairs.logratios()
    logits = beta * (chosen_logratios - rejected_logratios)
    losses = (-F.logsigmoid(logits) * (1 - label_smoothing) + F.logsigmoid(-logits) * label_smoothing) / (
        1 - 2 * label_smoothing
    )
    return losses, _metrics(beta * chosen_logratios, beta * rejected_logratios)


def hinge_loss(
    pairs: PairLogprobs,
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
    chosen_logratios, rejected_logratios = pairs.logratios()
    losses = torch.relu(1 - beta * (chosen_logratios - rejected_logratios))
    return losses, _metrics(beta * chosen_logratios, beta * rejected_logratios)


def ipo_loss(
    pairs: PairLogprobs,
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
        As :func:`dpo_loss`; ``pairs`` with the completion lengths.

    Returns:
        As :func:`dpo_loss`, rewards ``beta`` times the averaged log-ratios.

    Raises:
        ValueError: ``beta`` not positive.

    Worked value: policy == reference gives ``1 / (4 beta^2)`` per pair (25 at beta 0.1).
    """
    _check(beta)
    chosen_logratios, rejected_logratios = pairs.per_token(*pairs.logratios())
    losses = (chosen_logratios - rejected_logratios - 1 / (2 * beta)) ** 2
    return losses, _metrics(beta * chosen_logratios, beta * rejected_logratios)


def simpo_loss(
    pairs: PairLogprobs,
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
        pairs: the policy's log-probs and the completion lengths (no reference).
        label_smoothing: eps (the module docstring).

    Returns:
        As :func:`dpo_loss`, with the implicit rewards ``beta * pi / |y|``.

    Raises:
        ValueError: ``beta`` not positive, ``gamma`` negative, ``label_smoothing`` outside [0, 0.5).

    Worked value: equal average log-probs give ``-log sigmoid(-gamma)`` (0.9741 at gamma 0.5).
    """
    _check(beta, label_smoothing, 0.5)
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    chosen_rewards, rejected_rewards = pairs.per_token(
        beta * pairs.policy_chosen_logprobs.float(), beta * pairs.policy_rejected_logprobs.float()
    )
    losses = _smoothed_sigmoid(chosen_rewards - rejected_rewards - gamma, label_smoothing)
    return losses, _metrics(chosen_rewards, rejected_rewards)


def orpo_loss(
    pairs: PairLogprobs,
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
    chosen, rejected = pairs.per_token(pairs.policy_chosen_logprobs, pairs.policy_rejected_logprobs)
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
    pairs: PairLogprobs,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The :data:`PREFERENCE_LOSSES` entry ``loss_type`` on ``pairs``, with the settings it takes.

    Args:
        loss_type: a key of :data:`PREFERENCE_LOSSES`.
        pairs: the log-probs (reference ones None for the :data:`REFERENCE_FREE` losses; lengths
            needed by the :data:`LENGTH_NORMALISED` ones).
        beta: every loss's beta (ORPO's lambda).
        label_smoothing: sigmoid (cDPO), robust and SimPO.
        gamma: SimPO's target margin.

    Raises:
        ValueError: an unknown ``loss_type``, or a field of ``pairs`` it needs is None.
    """
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown preference loss_type {loss_type!r}; expected one of {sorted(PREFERENCE_LOSSES)}")
    settings: dict[str, float] = {"beta": beta}
    if loss_type in ("sigmoid", "robust", "simpo"):
        settings["label_smoothing"] = label_smoothing
    if loss_type == "simpo":
        settings["gamma"] = gamma
    try:
        return PREFERENCE_LOSSES[loss_type](pairs, **settings)
    except ValueError as e:
        raise ValueError(f"loss_type {loss_type!r}: {e}") from None
