"""``bench/parity_grpo.py``'s curve comparison and its A/A control, on hand-made curves."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "parity_grpo.py"


@pytest.fixture(scope="module")
def parity():
    spec = importlib.util.spec_from_file_location("parity_grpo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["parity_grpo"] = module  # dataclasses resolve the module by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("parity_grpo", None)


def _curves(offset: float, seeds: int) -> list[list[float]]:
    """20-step curves: a rise of 0.01 a step, plus a level of its own for each seed (-0.04 to 0.04)."""
    return [[0.01 * step + offset + 0.02 * ((7 * seed) % 5 - 2) for step in range(20)] for seed in range(seeds)]


def test_compare_hand_worked(parity):
    # 2 seeds a side, 10 steps (one per tenth): tenth k is [k, k + 2] against [k + 1, k + 1]
    ours = [[float(k) for k in range(10)], [float(k + 2) for k in range(10)]]
    theirs = [[float(k + 1) for k in range(10)]] * 2
    rows = parity.compare(ours, theirs)
    # difference 0; s.e. sqrt(var([k, k+2]) / 2 + 0) = sqrt(2 / 2) = 1
    assert [r["diff"] for r in rows] == [0.0] * 10
    assert [r["se"] for r in rows] == pytest.approx([1.0] * 10)
    assert all(r["agree"] for r in rows)
    rows = parity.compare(ours, [[float(k + 4) for k in range(10)]] * 2)
    assert [r["diff"] for r in rows] == [-3.0] * 10 and not any(r["agree"] for r in rows)


def test_control_tells_a_shifted_curve_from_noise(parity):
    same = {"project": _curves(0.0, 8), "trl": _curves(0.0, 8)}
    got = parity.group_control(same, size=3, draws=200)
    # identical sides: the project against TRL is the project against itself, draw for draw
    assert got["project_vs_trl/all_10"] == got["project_vs_project/all_10"]
    assert got["project_vs_trl/mean"] == got["project_vs_project/mean"]
    shifted = {"project": _curves(0.0, 8), "trl": _curves(0.5, 8)}
    got = parity.group_control(shifted, size=3, draws=200)
    assert got["project_vs_trl/all_10"] == 0.0 and got["project_vs_trl/mean"] == 0.0
    assert got["trl_vs_trl/mean"] > 5 and got["project_vs_project/mean"] > 5


def test_control_needs_twice_the_group_size(parity):
    with pytest.raises(ValueError, match="draws 6 distinct seeds; got 5 and 8"):
        parity.group_control({"project": _curves(0.0, 5), "trl": _curves(0.0, 8)})
