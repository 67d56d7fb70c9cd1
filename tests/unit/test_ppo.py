"""PPO pieces against values worked by hand and against plain Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.objectives.ppo import (
    AdaptiveKLController,
    FixedKLController,
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    kl_k1,
    kl_k3,
    last_real_index,
    masked_mean,
    penalized_rewards,
    whiten,
)


def _gae_loop(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """Textbook GAE over one episode of len(rewards) steps; V after the last step is 0."""
    n = len(rewards)
    advantages = [0.0] * n
    last = 0.0
    for t in reversed(range(n)):
        next_value = values[t + 1] if t + 1 < n else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        advantages[t] = last
    return advantages, [a + v for a, v in zip(advantages, values)]


def test_gae_worked_value():
    """gamma = lam = 1: rewards [0, 1], values [0.5, 0.25] -> deltas [-0.25, 0.75], A [0.5, 0.75], R [1, 1]."""
    adv, ret = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.25]]), torch.ones(1, 2), 1.0, 1.0)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.75]]), atol=1e-5)
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0]]), atol=1e-5)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.5, 0.0)])
def test_gae_matches_plain_loop_with_padding(gamma, lam):
    """Rows of real lengths 5, 3 and 1 in a [3, 5] batch: each row equals the loop over its real
    steps; padded positions are 0 whatever their rewards and values hold."""
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    lengths = [5, 3, 1]
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for i, n in enumerate(lengths):
        want_adv, want_ret = _gae_loop(rewards[i, :n].tolist(), values[i, :n].tolist(), gamma, lam)
        assert adv[i, :n].tolist() == pytest.approx(want_adv, abs=1e-6)
        assert ret[i, :n].tolist() == pytest.approx(want_ret, abs=1e-6)
        assert adv[i, n:].abs().sum() == 0 and ret[i, n:].abs().sum() == 0


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_over_a_multi_turn_completion_skips_the_observation_tokens(gamma, lam):
    """A policy turn, an environment's observation (mask 0), a second turn, padding: the policy's
    tokens are the time steps (the loop over them alone), observation and padding positions 0."""
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1, 1, 0], [1.0, 1, 1, 1, 1, 0, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for i in range(2):
        steps = mask[i].nonzero().squeeze(1)
        want_adv, want_ret = _gae_loop(rewards[i, steps].tolist(), values[i, steps].tolist(), gamma, lam)
        assert adv[i, steps].tolist() == pytest.approx(want_adv, abs=1e-6)
        assert ret[i, steps].tolist() == pytest.approx(want_ret, abs=1e-6)
        assert (adv[i][mask[i] == 0] == 0).all() and (ret[i][mask[i] == 0] == 0).all()
    prefix = gae(rewards[1:], values[1:], mask[1:], gamma, lam)  # no gap: the plain recursion, to the bit
    assert torch.equal(adv[1:], prefix[0]) and torch.equal(ret[1:], prefix[1])


def test_the_score_goes_to_the_policys_last_token_after_an_observation():
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert last_real_index(mask).tolist() == [2, 1, 3]
    rewards, _ = penalized_rewards(torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3, 4), mask, 0.1)
    assert rewards[:2].tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]]


def test_kl_estimators_worked_values():
    """logp = -1, ref = -2: k1 = 1; k3 = exp(-1) - (-1) - 1 = 0.3679. Equal log-probs: both 0."""
    lp, ref = torch.tensor([[-1.0, -3.0]]), torch.tensor([[-2.0, -3.0]])
    assert torch.allclose(kl_k1(lp, ref), torch.tensor([[1.0, 0.0]]), atol=1e-5)
    assert torch.allclose(kl_k3(lp, ref), torch.tensor([[math.exp(-1.0), 0.0]]), atol=1e-5)


def test_k1_can_be_negative_k3_cannot():
    """logp = -2, ref = -1: k1 = -1; k3 = e - 1 - 1 = 0.7183."""
    lp, ref = torch.tensor([-2.0]), torch.tensor([-1.0])
    assert kl_k1(lp, ref).item() == pytest.approx(-1.0)
    assert kl_k3(lp, ref).item() == pytest.approx(math.e - 2.0, rel=1e-6)


def test_kl_estimators_are_unbiased_on_a_small_distribution():
    """p = [0.5, 0.25, 0.25], q = [0.25, 0.5, 0.25]: KL(p||q) = 0.5 ln 2 - 0.25 ln 2 = 0.25 ln 2;
    the p-weighted mean of both estimators equals it exactly."""
    p, q = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.25, 0.5, 0.25])
    for estimator in (kl_k1, kl_k3):
        assert (p * estimator(p.log(), q.log())).sum().item() == pytest.approx(0.25 * math.log(2), rel=1e-5)


def test_penalized_rewards_add_score_at_last_real_token():
    rewards, non_score = penalized_rewards(
        torch.tensor([1.0]), torch.tensor([[0.5, 0.5, 9.0]]), torch.tensor([[1.0, 1.0, 0.0]]), 0.1
    )
    assert torch.allclose(rewards, torch.tensor([[-0.05, 0.95, 0.0]]), atol=1e-5)
    assert torch.allclose(non_score, torch.tensor([[-0.05, -0.05, 0.0]]), atol=1e-5)


def test_whiten_worked_value_and_mask():
    """[1, 3] (pad 100): mean 2, unbiased var 2 -> [-0.7071, 0.7071], pad 0; without shift: [1.2929, 2.7071]."""
    x, mask = torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    s = 1 / math.sqrt(2)
    assert torch.allclose(whiten(x, mask), torch.tensor([[-s, s, 0.0]]), atol=1e-5)
    assert torch.allclose(whiten(x, mask, shift_mean=False), torch.tensor([[2 - s, 2 + s, 0.0]]), atol=1e-5)
    assert masked_mean(x, mask).item() == pytest.approx(2.0)


def _policy_loss(ratio: float, advantage: float, eps: float = 0.2):
    logprobs = torch.tensor([[math.log(ratio)]])
    return clipped_policy_loss(logprobs, torch.zeros(1, 1), torch.tensor([[advantage]]), eps)


@pytest.mark.parametrize(
    "ratio,advantage,loss,clipped",
    [
        (1.1, 1.0, -1.1, 0.0),  # inside the clip range: plain surrogate
        (0.9, -1.0, 0.9, 0.0),  # inside, negative advantage
        (1.5, 1.0, -1.2, 1.0),  # above 1 + eps with A > 0: clipped to 1.2, no gradient
        (0.5, -1.0, 0.8, 1.0),  # below 1 - eps with A < 0: clipped to 0.8
        (1.5, -1.0, 1.5, 0.0),  # above with A < 0: the unclipped (pessimistic) branch
        (0.5, 1.0, -0.5, 0.0),  # below with A > 0: unclipped
    ],
)
def test_clipped_policy_loss_inside_and_outside(ratio, advantage, loss, clipped):
    losses, m = _policy_loss(ratio, advantage)
    assert losses.item() == pytest.approx(loss, rel=1e-5)
    assert m["clipped"].item() == clipped
    assert m["ratio"].item() == pytest.approx(ratio, rel=1e-5)
    assert m["approxkl"].item() == pytest.approx(0.5 * math.log(ratio) ** 2, rel=1e-5)


def test_clipped_policy_loss_has_no_gradient_when_clipped():
    logprobs = torch.tensor([[math.log(1.5)]], requires_grad=True)
    losses, _ = clipped_policy_loss(logprobs, torch.zeros(1, 1), torch.ones(1, 1), 0.2)
    losses.sum().backward()
    assert logprobs.grad.item() == 0.0


def test_clipped_policy_loss_rejects_bad_eps():
    with pytest.raises(ValueError, match="clip_eps"):
        clipped_policy_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), 0.0)


@pytest.mark.parametrize("value,loss,clipped", [(0.1, 0.405, 0.0), (0.5, 0.32, 1.0), (-0.5, 1.125, 0.0)])
def test_clipped_value_loss(value, loss, clipped):
    """eps 0.2, V_old 0, R 1: V 0.1 inside -> 0.5 * 0.81; V 0.5 -> clipped 0.2: 0.5 * max(0.25, 0.64);
    V -0.5 -> clipped -0.2 is closer to R: 0.5 * max(2.25, 1.44) = 1.125, unclipped branch."""
    losses, m = clipped_value_loss(torch.tensor([value]), torch.zeros(1), torch.ones(1), 0.2)
    assert losses.item() == pytest.approx(loss, rel=1e-5)
    assert m["clipped"].item() == clipped


def test_adaptive_kl_controller_worked_value_and_state():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, 100)  # error 1.0 clipped to 0.2 -> 0.1 * (1 + 0.2 * 100 / 10000)
    assert ctl.value == pytest.approx(0.1002)
    ctl.update(3.0, 1000)  # error -0.5 clipped to -0.2 -> * (1 - 0.02)
    assert ctl.value == pytest.approx(0.1002 * 0.98)
    other = AdaptiveKLController(0.5, target=6.0, horizon=10000)
    other.load_state_dict(ctl.state_dict())
    assert other.value == ctl.value


def test_fixed_kl_controller_never_moves():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 64)
    assert ctl.value == 0.05 and ctl.state_dict() == {"value": 0.05}
