"""GRPO advantages and loss against values worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.objectives.grpo import STD_EPS, group_advantages, grpo_loss


def test_group_advantages_by_hand():
    """Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> +-0.5 / 0.57745 = +-0.86587.
    Group [2, 2, 2, 2]: all advantages 0 (no signal from a group that agrees)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = 0.5 / (math.sqrt(1 / 3) + STD_EPS)
    assert group_advantages(rewards, 4).tolist() == pytest.approx([a, -a, -a, a, 0, 0, 0, 0], rel=1e-5)


def test_group_advantages_without_std_division_and_2d_input():
    """Dr. GRPO: [[1, 0, 0, 1], [3, 1, 1, 1]] -> means 0.5, 1.5 -> [[.5, -.5, -.5, .5], [1.5, -.5, -.5, -.5]]."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 1.0, 1.0]])
    out = group_advantages(rewards, 4, scale=False)
    assert out.shape == (2, 4)
    assert torch.allclose(out, torch.tensor([[0.5, -0.5, -0.5, 0.5], [1.5, -0.5, -0.5, -0.5]]), atol=1e-5)


def test_group_advantages_validate_shapes():
    with pytest.raises(ValueError, match="groups"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), 1)


def test_grpo_loss_equals_minus_advantage_at_ratio_one():
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    losses, m = grpo_loss(lp, lp, torch.tensor([0.5, -1.0]), lp, clip_eps=0.2, kl_coef=0.1)
    assert torch.allclose(losses, torch.tensor([[-0.5, -0.5], [1.0, 1.0]]), atol=1e-5)
    assert m["kl"].abs().sum() == 0 and m["clipped"].sum() == 0


def test_grpo_loss_clips_and_adds_k3_kl():
    """One token: ratio 1.5 (logp = ln 1.5, old 0), A = 1, eps 0.2 -> surrogate -1.2 (clipped).
    ref = 0: k3 = exp(-ln 1.5) + ln 1.5 - 1 = 0.66667 + 0.40547 - 1 = 0.07213; beta 0.5 -> +0.03607."""
    lp = torch.tensor([[math.log(1.5)]])
    losses, m = grpo_loss(lp, torch.zeros(1, 1), torch.ones(1), torch.zeros(1, 1), clip_eps=0.2, kl_coef=0.5)
    k3 = 1 / 1.5 + math.log(1.5) - 1
    assert m["kl"].item() == pytest.approx(k3, rel=1e-5)
    assert losses.item() == pytest.approx(-1.2 + 0.5 * k3, rel=1e-5)
    assert m["clipped"].item() == 1.0


def test_grpo_loss_without_kl_needs_no_reference():
    lp = torch.zeros(1, 2)
    losses, m = grpo_loss(lp, lp, torch.ones(1), None, clip_eps=0.2, kl_coef=0.0)
    assert "kl" not in m and torch.allclose(losses, torch.tensor([[-1.0, -1.0]]), atol=1e-5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, lp, torch.ones(1), None, clip_eps=0.2, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_estimator"):
        grpo_loss(lp, lp, torch.ones(1), lp, clip_eps=0.2, kl_coef=0.1, kl_estimator="k2")
