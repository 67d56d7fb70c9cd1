"""``trainer_core.objectives.paired``: ``paired_gain`` (a policy's exact match against SFT's on the
same problems, with the standard error of the paired difference) and ``verdict_auc`` (how well a
reward ranks right answers above wrong ones) and ``pass_at_k`` (Chen et al. 2021's unbiased
estimator), against hand-worked values."""

from __future__ import annotations

import json
import math

import pytest

from trainer_core.objectives.paired import mean_and_se, paired_gain, paired_verdicts, pass_at_k, verdict_auc


def test_paired_gain_hand_worked():
    # d = [0, -1, 1, 1]: mean 0.25; squared deviations 0.0625 + 1.5625 + 0.5625 + 0.5625 = 2.75.
    gain, se = paired_gain([True, True, False, False], [True, False, True, True])
    assert gain == pytest.approx(0.25)
    assert se == pytest.approx(math.sqrt(2.75 / 3) / 2)  # 0.4787


def test_paired_gain_counts_only_discordant_problems():
    # 1000 problems: 75 solved by the baseline only, 95 by the other only, the rest alike.
    baseline = [True] * 75 + [False] * 95 + [True] * 200 + [False] * 630
    other = [False] * 75 + [True] * 95 + [True] * 200 + [False] * 630
    gain, se = paired_gain(baseline, other)
    assert gain == pytest.approx(0.02)
    # sum (d - 0.02)^2 = 95 * 0.98^2 + 75 * 1.02^2 + 830 * 0.02^2 = 169.6
    assert se == pytest.approx(math.sqrt(169.6 / 999 / 1000))  # 0.0130
    assert paired_gain(other, baseline) == pytest.approx((-0.02, se))


def test_paired_gain_of_identical_verdicts_is_exactly_zero():
    assert paired_gain([True, False, True], [True, False, True]) == (0.0, 0.0)
    assert paired_gain([True], [False]) == (-1.0, 0.0)  # one problem: no error estimate


@pytest.mark.parametrize("baseline, other", [([], []), ([True], [True, False])])
def test_paired_gain_refuses_unpaired_verdicts(baseline, other):
    with pytest.raises(ValueError, match="equally long, non-empty"):
        paired_gain(baseline, other)


def test_paired_verdicts_match_problems_by_prompt():
    baseline = [{"prompt": "a", "sft_correct": True}, {"prompt": "b", "sft_correct": False}, {"prompt": "c"}]
    rows = [
        {"prompt": "c", "grpo_correct": True},
        {"prompt": "b", "grpo_correct": True},
        {"prompt": "a", "grpo_correct": False},
        {"prompt": "d", "grpo_correct": True},
    ]
    assert paired_verdicts(baseline, "sft_correct", rows, "grpo_correct") == ([False, True], [True, False])
    assert paired_verdicts(baseline, "dpo_correct", rows, "grpo_correct") == ([], [])


def test_verdict_auc_hand_worked():
    # correct 3 and 2 against wrong 1 and 2: 3 > 1, 3 > 2, 2 > 1 win; 2 = 2 counts half: 3.5 / 4.
    assert verdict_auc([3.0, 1.0, 2.0, 2.0], [True, False, True, False]) == 0.875
    assert verdict_auc([1.0, 2.0, 3.0], [False, True, True]) == 1.0
    assert verdict_auc([1.0, 2.0, 3.0], [True, True, False]) == 0.0
    assert verdict_auc([5.0, 5.0], [True, False]) == 0.5


def test_verdict_auc_is_undefined_without_both_verdicts_and_refuses_unpaired_lists():
    assert verdict_auc([1.0, 2.0], [True, True]) is None and verdict_auc([], []) is None
    with pytest.raises(ValueError, match="one verdict per score"):
        verdict_auc([1.0], [True, False])


def test_pass_at_k_hand_worked():
    """n = 5, c = 2: 1 - C(3, k) / C(5, k) = 1 - 3/5, 1 - 3/10, 1 - 1/10, then 1 (fewer than k wrong)."""
    assert [pass_at_k(5, 2, k) for k in range(1, 6)] == pytest.approx([0.4, 0.7, 0.9, 1.0, 1.0])
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(200, 13, 10) == pytest.approx(1 - math.comb(187, 10) / math.comb(200, 10), rel=1e-12)
    for n, c, k in [(5, 6, 1), (5, 2, 0), (5, 2, 6), (5, -1, 1)]:
        with pytest.raises(ValueError, match="pass_at_k needs"):
            pass_at_k(n, c, k)


def test_mean_and_se_hand_worked():
    # [0.4, 0.7, 1.0]: mean 0.7, sample variance (0.09 + 0 + 0.09) / 2 = 0.09, SE 0.3 / sqrt(3)
    assert mean_and_se([0.4, 0.7, 1.0]) == pytest.approx((0.7, 0.3 / math.sqrt(3)))
    assert mean_and_se([0.5]) == (0.5, 0.0)
    with pytest.raises(ValueError):
        mean_and_se([])


def test_sample_column_names_the_per_problem_value():
    from trainer_core.objectives.paired import sample_column

    assert [sample_column(m) for m in ("exact_match", "pass_at_4", "avg_at_16")] == [
        "correct",
        "pass_at_4",
        "avg_at_16",
    ]
    assert sample_column("lm_eval/gsm8k/exact_match_strict_match") == "lm_eval/gsm8k/exact_match_strict_match"
    with pytest.raises(ValueError, match="'win_rate' has no per-problem value"):
        sample_column("win_rate")


def test_sampled_estimates_join_the_sample_table_and_pair_over_sft():
    from trainer_core.stages.evaluate import _paired_gains, sample_rows

    problems = [
        {"messages_json": json.dumps([{"role": "user", "content": f"q{i}"}]), "answer": str(i)} for i in range(3)
    ]
    verdicts = {"sft": [True, False, False], "grpo": [True, True, False]}
    estimates = {"sft": {"pass_at_2": [1.0, 0.0]}, "grpo": {"pass_at_2": [1.0, 0.5]}}  # 2 of 3 problems sampled
    rows = sample_rows(problems, {"sft": ["a", "b", "c"], "grpo": ["a", "d", "c"]}, verdicts, {}, estimates)
    assert [row.get("grpo_pass_at_2") for row in rows] == [1.0, 0.5, None]
    gains = _paired_gains(verdicts, estimates)
    assert gains["grpo_vs_sft/exact_match_gain"] == pytest.approx(1 / 3)
    assert gains["grpo_vs_sft/pass_at_2_gain"] == pytest.approx(0.25)
    assert gains["grpo_vs_sft/pass_at_2_gain_se"] == pytest.approx(paired_gain([1.0, 0.0], [1.0, 0.5])[1])
    assert not any(k.startswith("sft_vs") for k in gains)


def test_harness_scores_pair_by_example_and_fill_their_own_table():
    """The harness's per-example scores pair over SFT on the examples both hold (sorted by key) and
    make the harness sample table, one row per example; the held-out sample table ignores them."""
    from trainer_core.stages.evaluate import _paired_gains, harness_rows, sample_rows

    metric = "lm_eval/t/exact_match_flexible_extract"
    estimates = {
        "sft": {metric: {"lm_eval/t/0/a": 0.0, "lm_eval/t/1/b": 1.0, "lm_eval/t/2/c": 0.0}},
        "grpo": {metric: {"lm_eval/t/2/c": 1.0, "lm_eval/t/0/a": 1.0, "lm_eval/t/1/b": 1.0}},
    }
    verdicts = {"sft": [False], "grpo": [True]}
    gains = _paired_gains(verdicts, estimates)
    gain, se = paired_gain([0.0, 1.0, 0.0], [1.0, 1.0, 1.0])
    assert (gains[f"grpo_vs_sft/{metric}_gain"], gains[f"grpo_vs_sft/{metric}_gain_se"]) == (
        pytest.approx(gain),
        pytest.approx(se),
    ) and gain == pytest.approx(2 / 3)
    rows = harness_rows(estimates)
    assert [r["prompt"] for r in rows] == ["lm_eval/t/0/a", "lm_eval/t/1/b", "lm_eval/t/2/c"]
    assert [(r[f"sft_{metric}"], r[f"grpo_{metric}"]) for r in rows] == [(0.0, 1.0), (1.0, 1.0), (0.0, 1.0)]
    problems = [{"messages_json": json.dumps([{"role": "user", "content": "q"}]), "answer": "1"}]
    [row] = sample_rows(problems, {"sft": ["x"], "grpo": ["1"]}, verdicts, {}, estimates)
    assert not any(k.endswith(metric) for k in row)
    assert harness_rows({"sft": {"pass_at_2": [1.0]}}) == []
