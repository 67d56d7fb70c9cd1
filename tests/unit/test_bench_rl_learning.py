"""``bench/rl_learning.py``'s learning criterion against hand-worked values, and its errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "rl_learning.py"


def _module():
    spec = importlib.util.spec_from_file_location("rl_learning", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _window_gain():
    return _module().window_gain


def test_policy_gains_hold_within_one_standard_error():
    metrics = {
        "dpo_vs_sft/exact_match_gain": -0.012,
        "dpo_vs_sft/exact_match_gain_se": 0.013,
        "ppo_vs_sft/exact_match_gain": -0.03,
        "ppo_vs_sft/exact_match_gain_se": 0.015,
        "grpo_vs_sft/exact_match_gain": 0.031,
        "grpo_vs_sft/exact_match_gain_se": 0.013,
        "sft/exact_match": 0.409,
    }
    got = _module().policy_gains(metrics)
    assert set(got) == {"dpo", "ppo", "grpo"}
    assert got["dpo"]["holds"] and got["grpo"]["holds"] and not got["ppo"]["holds"]
    assert got["ppo"] == {"gain": -0.03, "se": 0.015, "holds": False}


def test_window_gain_hand_worked():
    # first [1, 2, 3]: mean 2, var 1; last [4, 6, 8]: mean 6, var 4; se = sqrt(1/3 + 4/3) = 1.2910
    got = _window_gain()([1.0, 2.0, 3.0, 0.0, 4.0, 6.0, 8.0], 3)
    assert got["first"] == pytest.approx(2.0) and got["last"] == pytest.approx(6.0)
    assert got["gain"] == pytest.approx(4.0)
    assert got["se"] == pytest.approx((5 / 3) ** 0.5)
    assert got["learns"] is True  # 4 > 2.582


def test_window_gain_noise_is_not_learning():
    # first [0, 1]: mean 0.5, var 0.5; last [0, 2]: mean 1, var 2; se = sqrt(0.25 + 1) = 1.118: 0.5 < 2.236
    got = _window_gain()([0.0, 1.0, 0.0, 2.0], 2)
    assert got["gain"] == pytest.approx(0.5) and got["se"] == pytest.approx(1.25**0.5)
    assert got["learns"] is False


def test_window_gain_falling_reward_is_not_learning():
    assert _window_gain()([5.0, 5.1, 4.9, 1.0, 1.1, 0.9], 3)["learns"] is False


@pytest.mark.parametrize(("values", "window"), [([1.0, 2.0, 3.0], 2), ([1.0, 2.0, 3.0, 4.0], 1)])
def test_window_gain_refuses_too_few_values(values, window):
    with pytest.raises(ValueError, match="need window >= 2"):
        _window_gain()(values, window)
