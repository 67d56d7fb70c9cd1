"""The preference-loss family (``trainer_core.objectives.dpo``): each loss against values worked
by hand from its paper's equation, on two pairs whose numbers are easy to follow.

Pair 0: policy chosen -4 over 4 tokens, rejected -9 over 3; reference chosen -5, rejected -8.
Summed log-ratios: chosen +1, rejected -1, so h = 2 (sequence level). Averaged: chosen 1/4,
rejected -1/3, so h_avg = 7/12. Pair 1: policy == reference (chosen -6 over 2, rejected -6 over
6): h = 0, h_avg = 0.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.config import load_config
from trainer_core.objectives.dpo import (
    PREFERENCE_LOSSES,
    REFERENCE_FREE,
    PairLogprobs,
    dpo_loss,
    hinge_loss,
    ipo_loss,
    orpo_loss,
    preference_loss,
    robust_dpo_loss,
    simpo_loss,
)

PI_C, PI_R = torch.tensor([-4.0, -6.0]), torch.tensor([-9.0, -6.0])
REF_C, REF_R = torch.tensor([-5.0, -6.0]), torch.tensor([-8.0, -6.0])
LEN_C, LEN_R = torch.tensor([4.0, 2.0]), torch.tensor([3.0, 6.0])
BETA = 0.5
PAIRS = PairLogprobs(PI_C, PI_R, REF_C, REF_R, LEN_C, LEN_R)
POLICY = PairLogprobs(PI_C, PI_R, chosen_lengths=LEN_C, rejected_lengths=LEN_R)  # no reference


def softplus(x: float) -> float:
    """-log sigmoid(-x)."""
    return math.log1p(math.exp(x))


def close(actual: torch.Tensor, expected: list[float]) -> None:
    assert actual.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_sigmoid_and_conservative_dpo():
    # beta h = 1: -log sigmoid(1) = softplus(-1); cDPO eps 0.1 adds eps (softplus(1) - softplus(-1)).
    losses, m = dpo_loss(PAIRS, beta=BETA)
    close(losses, [softplus(-1.0), math.log(2)])
    close(m["rewards/chosen"], [0.5, 0.0])
    close(m["rewards/rejected"], [-0.5, 0.0])
    close(m["rewards/margins"], [1.0, 0.0])
    close(m["rewards/accuracies"], [1.0, 0.0])
    smoothed, _ = dpo_loss(PAIRS, beta=BETA, label_smoothing=0.1)
    close(smoothed, [0.9 * softplus(-1.0) + 0.1 * softplus(1.0), math.log(2)])


def test_robust_dpo():
    # ((1 - eps) softplus(-1) - eps softplus(1)) / (1 - 2 eps); at h = 0: (1 - 2 eps) log 2 / (1 - 2 eps).
    losses, _ = robust_dpo_loss(PAIRS, beta=BETA, label_smoothing=0.2)
    close(losses, [(0.8 * softplus(-1.0) - 0.2 * softplus(1.0)) / 0.6, math.log(2)])
    plain, _ = robust_dpo_loss(PAIRS, beta=BETA, label_smoothing=0.0)
    close(plain, dpo_loss(PAIRS, beta=BETA)[0].tolist())


def test_hinge():
    # relu(1 - beta h): 1 - 1 = 0 for pair 0, 1 for pair 1.
    losses, m = hinge_loss(PAIRS, beta=BETA)
    close(losses, [0.0, 1.0])
    close(m["rewards/margins"], [1.0, 0.0])
    losses, _ = hinge_loss(PAIRS, beta=0.25)
    close(losses, [0.5, 1.0])


def test_ipo_on_length_averaged_log_ratios():
    # (h_avg - 1 / (2 beta))^2 = (7/12 - 1)^2 = 25/144; pair 1: (0 - 1)^2.
    losses, m = ipo_loss(PAIRS, beta=BETA)
    close(losses, [25 / 144, 1.0])
    close(m["rewards/chosen"], [BETA * 0.25, 0.0])
    close(m["rewards/rejected"], [BETA * -1 / 3, 0.0])
    losses, _ = ipo_loss(PairLogprobs(PI_C, PI_C, REF_C, REF_C, LEN_C, LEN_C), beta=0.1)
    close(losses, [25.0, 25.0])  # policy == reference: 1 / (4 beta^2)


def test_simpo_is_reference_free_and_length_normalised():
    # beta = 2, gamma = 0.5: z = 2 (-1) - 2 (-3) - 0.5 = 3.5; pair 1: 2 (-3) - 2 (-1) - 0.5 = -4.5.
    losses, m = simpo_loss(POLICY, beta=2.0, gamma=0.5)
    close(losses, [softplus(-3.5), softplus(4.5)])
    close(m["rewards/chosen"], [-2.0, -6.0])
    close(m["rewards/rejected"], [-6.0, -2.0])
    close(m["rewards/accuracies"], [1.0, 0.0])
    equal, _ = simpo_loss(PairLogprobs(PI_C, PI_C, chosen_lengths=LEN_C, rejected_lengths=LEN_C), beta=2.0, gamma=0.5)
    close(equal, [softplus(0.5)] * 2)  # -log sigmoid(-gamma) = 0.9741
    assert softplus(0.5) == pytest.approx(0.9741, abs=1e-4)
    smoothed, _ = simpo_loss(POLICY, beta=2.0, gamma=0.5, label_smoothing=0.1)
    close(smoothed, [0.9 * softplus(-3.5) + 0.1 * softplus(3.5), 0.9 * softplus(4.5) + 0.1 * softplus(-4.5)])


def test_orpo_odds_ratio_by_hand():
    # Average log-probs log 0.5 (chosen) and log 0.25 (rejected): odds 1 and 1/3, log odds ratio
    # log 3, log sigmoid(log 3) = log 0.75: loss = log 2 - beta log 0.75.
    chosen, rejected = torch.tensor([2 * math.log(0.5)]), torch.tensor([3 * math.log(0.25)])
    pairs = PairLogprobs(chosen, rejected, chosen_lengths=torch.tensor([2.0]), rejected_lengths=torch.tensor([3.0]))
    losses, m = orpo_loss(pairs, beta=0.1)
    close(losses, [math.log(2) - 0.1 * math.log(0.75)])
    assert losses.item() == pytest.approx(0.7219, abs=1e-4)
    close(m["nll_loss"], [math.log(2)])
    close(m["log_odds_ratio"], [math.log(0.75)])
    close(m["rewards/chosen"], [0.1 * math.log(0.5)])
    close(m["rewards/rejected"], [0.1 * math.log(0.25)])


def test_orpo_is_finite_near_probability_one():
    """log(1 - exp(a)) for a -> 0^- (a nearly certain completion) stays finite."""
    one = torch.tensor([1.0])
    losses, _ = orpo_loss(
        PairLogprobs(torch.tensor([-1e-6]), torch.tensor([-3.0]), chosen_lengths=one, rejected_lengths=one), beta=1.0
    )
    assert torch.isfinite(losses).all()


def test_losses_have_gradients_toward_the_chosen():
    for loss_type in PREFERENCE_LOSSES:
        chosen, rejected = (-PI_C.abs()).clone().requires_grad_(), (-PI_R.abs()).clone().requires_grad_()
        losses, _ = preference_loss(loss_type, PairLogprobs(chosen, rejected, REF_C, REF_R, LEN_C, LEN_R), beta=BETA)
        losses[1].backward()  # pair 1: chosen and rejected equally likely: every loss pushes them apart
        assert chosen.grad[1] < 0 < rejected.grad[1], loss_type


def test_dispatch_passes_what_each_loss_takes():
    assert REFERENCE_FREE == {"simpo", "orpo"}
    for loss_type in PREFERENCE_LOSSES:
        losses, m = preference_loss(loss_type, PAIRS, beta=BETA, gamma=0.3)
        assert losses.shape == (2,) and torch.isfinite(losses).all() and "rewards/margins" in m, loss_type
    close(
        preference_loss("simpo", POLICY, beta=BETA, gamma=0.3)[0], simpo_loss(POLICY, beta=BETA, gamma=0.3)[0].tolist()
    )
    with pytest.raises(ValueError, match="unknown preference loss_type 'kto'"):
        preference_loss("kto", PAIRS, beta=BETA)
    with pytest.raises(ValueError, match="loss_type 'ipo': .*needs chosen_lengths and rejected_lengths"):
        preference_loss("ipo", PairLogprobs(PI_C, PI_R, REF_C, REF_R), beta=BETA)  # no lengths
    with pytest.raises(ValueError, match="loss_type 'hinge': .*needs ref_chosen_logprobs"):
        preference_loss("hinge", PairLogprobs(PI_C, PI_R), beta=BETA)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(PAIRS, beta=BETA, label_smoothing=0.5)


def test_config_refuses_label_smoothing_where_the_loss_has_none():
    assert load_config(overrides={"dpo.loss_type": "robust", "dpo.label_smoothing": 0.1}).dpo.label_smoothing == 0.1
    with pytest.raises(Exception, match="loss_type 'hinge' has no label smoothing"):
        load_config(overrides={"dpo.loss_type": "hinge", "dpo.label_smoothing": 0.1})
    with pytest.raises(Exception, match="loss_type"):
        load_config(overrides={"dpo.loss_type": "kto"})


def test_agrees_with_trl_on_the_same_tensors():
    """TRL's own loss code on the same tensors (runs where ``trl``, the bench extra, is installed).

    TRL 1.16 computes the DPO losses inside ``DPOTrainer._compute_loss`` (a model forward), so
    the margin functions are checked through ``CPOTrainer.cpo_loss``, which applies the same
    sigmoid (with label smoothing), hinge, IPO and SimPO formulas to a reference-free margin:
    with zero reference log-probs ours must give the same losses. IPO and SimPO take average
    log-probs there (``average_log_prob``), as here. ORPO: ``ORPOTrainer.odds_ratio_loss``, whose
    losses are ``beta * log sigmoid(log odds ratio)`` (the NLL is added by its caller).
    """
    from types import SimpleNamespace

    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    zero = torch.zeros(2)
    avg_c, avg_r = PI_C / LEN_C, PI_R / LEN_R

    def cpo(loss_type: str, chosen, rejected, beta: float, label_smoothing: float = 0.0, gamma: float = 0.5):
        trainer = SimpleNamespace(
            alpha=0.0,
            loss_type=loss_type,
            beta=beta,
            label_smoothing=label_smoothing,
            simpo_gamma=gamma,
            accelerator=SimpleNamespace(device="cpu"),
        )
        return CPOTrainer.cpo_loss(trainer, chosen, rejected)

    ours = {
        ("sigmoid", 0.1): dpo_loss(PairLogprobs(PI_C, PI_R, zero, zero), beta=BETA, label_smoothing=0.1),
        ("hinge", 0.0): hinge_loss(PairLogprobs(PI_C, PI_R, zero, zero), beta=0.25),
        ("ipo", 0.0): ipo_loss(PairLogprobs(PI_C, PI_R, zero, zero, LEN_C, LEN_R), beta=BETA),
        ("simpo", 0.1): simpo_loss(POLICY, beta=2.0, gamma=0.5, label_smoothing=0.1),
    }
    theirs = {
        ("sigmoid", 0.1): cpo("sigmoid", PI_C, PI_R, BETA, 0.1),
        ("hinge", 0.0): cpo("hinge", PI_C, PI_R, 0.25),
        ("ipo", 0.0): cpo("ipo", avg_c, avg_r, BETA),
        ("simpo", 0.1): cpo("simpo", avg_c, avg_r, 2.0, 0.1, 0.5),
    }
    for key, (losses, metrics) in ours.items():
        trl_losses, trl_chosen, trl_rejected = theirs[key]
        close(losses, trl_losses.tolist())
        if key[0] == "simpo":  # TRL's CPO rewards are beta * the margin's log-probs: SimPO's are ours
            close(metrics["rewards/chosen"], trl_chosen.tolist())
            close(metrics["rewards/rejected"], trl_rejected.tolist())

    trainer = SimpleNamespace(beta=0.1, accelerator=SimpleNamespace(device="cpu"))
    trl_losses, trl_chosen, trl_rejected, *_ = ORPOTrainer.odds_ratio_loss(trainer, avg_c, avg_r)
    losses, metrics = orpo_loss(POLICY, beta=0.1)
    close(losses, (-avg_c - trl_losses).tolist())
    close(metrics["rewards/chosen"], trl_chosen.tolist())
    close(metrics["rewards/rejected"], trl_rejected.tolist())
