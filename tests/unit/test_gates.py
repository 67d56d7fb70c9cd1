"""Quality gates (``tasks/report/gates.py``): thresholds, the champion comparison with its tolerance,
missing metrics, and the message a failed gate ends the flow with."""

from __future__ import annotations

import pytest

from tasks.report.gates import check_gates, gate_failure_message
from tasks.report.mlflow_models import Champion
from tasks.report.release import release, release_kind, release_markdown
from tasks.results import PipelineRun
from trainer_core.config import load_config
from trainer_core.config.evaluation import QualityGate
from trainer_core.errors import ConfigError


def gate(**fields) -> QualityGate:
    return QualityGate(metric="dpo/exact_match", **fields)


def test_threshold_gates():
    [ok] = check_gates([gate(threshold=0.04)], {"dpo/exact_match": 0.047}, None)
    assert ok.passed and ok.describe() == "dpo/exact_match 0.047 >= threshold 0.04"
    [low] = check_gates([gate(threshold=0.05)], {"dpo/exact_match": 0.047}, None)
    assert not low.passed
    assert gate_failure_message([ok, low]) == "gate: dpo/exact_match 0.047 < threshold 0.05"
    [loss] = check_gates([QualityGate(metric="sft/eval_loss", op="<=", threshold=0.5)], {"sft/eval_loss": 0.6}, None)
    assert loss.describe() == "sft/eval_loss 0.6 > threshold 0.5"


def test_champion_gates_with_tolerance():
    champion = Champion("3", {"dpo/exact_match": 0.047}, {})
    [worse] = check_gates([gate(vs_champion=True)], {"dpo/exact_match": 0.041}, champion)
    assert gate_failure_message([worse]) == "gate: dpo/exact_match 0.041 < champion v3 0.047"
    [within] = check_gates([gate(vs_champion=True, tolerance=0.01)], {"dpo/exact_match": 0.041}, champion)
    assert within.passed and within.bound == pytest.approx(0.037)
    lower_better = QualityGate(metric="sft/eval_loss", op="<=", vs_champion=True, tolerance=0.1)
    [loss] = check_gates([lower_better], {"sft/eval_loss": 0.65}, Champion("1", {"sft/eval_loss": 0.6}, {}))
    assert loss.passed and loss.bound == pytest.approx(0.7)


def test_first_version_and_missing_metrics():
    # No champion yet: nothing to fall below; a threshold still applies.
    results = check_gates([gate(vs_champion=True, threshold=0.01)], {"dpo/exact_match": 0.02}, None)
    assert [r.against for r in results] == ["threshold", "no champion yet"] and all(r.passed for r in results)
    assert results[1].describe() == "dpo/exact_match 0.02 (no champion yet)"
    # A metric the run did not produce (or a NaN) fails its gate, naming it.
    for metrics in ({}, {"dpo/exact_match": float("nan")}):
        [missing] = check_gates([gate(threshold=0.0)], metrics, None)
        assert not missing.passed and "missing" in gate_failure_message([missing])
    assert gate_failure_message([]) is None


def test_gate_config_is_validated():
    with pytest.raises(ValueError, match="threshold, vs_champion"):
        QualityGate(metric="dpo/exact_match")
    with pytest.raises(ConfigError, match="registered_model_name"):
        load_config(overrides={"evaluate.gates": [{"metric": "dpo/exact_match", "vs_champion": True}]})
    with pytest.raises(ConfigError, match=r"evaluate.gates\[0\].metric='dpoo/exact_match': names no stage"):
        load_config(overrides={"evaluate.gates": [{"metric": "dpoo/exact_match", "threshold": 0.1}]})
    with pytest.raises(ConfigError, match="names no stage"):
        load_config(overrides={"evaluate.gates": [{"metric": "exact_match", "threshold": 0.1}]})
    with pytest.raises(ConfigError, match="registered_stage"):
        load_config(overrides={"stages": "prepare_data,sft", "tracking.registered_stage": "dpo"})
    sft_loss = [{"metric": "sft/eval/loss", "op": "<=", "threshold": 2.0}]
    with pytest.raises(ConfigError, match=r"gates\[0\].metric='sft/eval/loss': .* is 'sft/eval_loss'"):
        load_config(overrides={"evaluate.gates": sft_loss})  # evaluate in the run: one name per quantity
    assert load_config(overrides={"stages": "prepare_data,sft", "evaluate.gates": sft_loss}).evaluate.gates
    config = load_config(
        overrides={
            "tracking.registered_model_name": "m",
            "evaluate.gates": [{"metric": "dpo/exact_match", "vs_champion": True}],
        }
    )
    assert config.evaluate.gates[0].op == ">="


def test_gates_on_stages_the_run_does_not_include_are_not_judged():
    gates = [
        gate(vs_champion=True),
        QualityGate(metric="grpo_vs_sft/win_rate", threshold=0.5),
        QualityGate(metric="sft/eval_loss", op="<=", threshold=9.0),
    ]
    results = check_gates(
        gates, {"sft/eval_loss": 1.0}, Champion("1", {"dpo/exact_match": 0.5}, {}), ["prepare_data", "sft"]
    )
    assert [r.judged for r in results] == [False, False, True] and all(r.passed for r in results)
    assert gate_failure_message(results) is None
    assert results[0].describe() == "dpo/exact_match not judged (its stage is not in this run)"


def test_release_markdown_says_what_became_of_the_model():
    gates = check_gates(
        [QualityGate(metric="grpo/exact_match", threshold=0.5), gate(threshold=0.1)],
        {"sft/eval_loss": 1.0},
        None,
        ["prepare_data", "sft"],
    )
    outcome = {
        "gates": [g.as_dict() for g in gates],
        "failure": None,
        "judged": False,
        "registered_model": {
            "name": "m",
            "version": "4",
            "alias": "candidate",
            "stage": "sft",
            "previous_champion": "3",
        },
    }
    assert release_kind(outcome) == "candidate"
    shown = release_markdown("r1", outcome)
    assert shown.startswith(
        "**Candidate**: `m` version 4 (sft of run `r1`) is registered as `@candidate`; "
        "the champion stays version 3: a gate could not be judged"
    )
    assert shown.count("| not judged |") == 2
    unregistered = {"gates": [], "failure": None, "judged": True, "registered_model": None}
    assert release_kind(unregistered) == "unregistered"
    assert "No quality gates are configured" in release_markdown("r1", unregistered)
    failed = {**unregistered, "failure": "gate: sft/eval_loss 1 > threshold 0.5"}
    assert release_kind(failed) == "gate-failed"
    assert release_markdown("r1", failed).startswith("**Gate failed** (run `r1`); no model registered")


def test_a_run_that_leaves_out_a_gates_stage_registers_nothing(tmp_path):
    """An SFT-only run of a config gated on GRPO used to become a candidate version of the policy."""
    config = load_config(
        overrides={
            "stages": "prepare_data,sft",
            "tracking.registered_model_name": "policy",
            "evaluate.gates": [{"metric": "grpo/exact_match", "threshold": 0.1}],
        }
    )
    run = PipelineRun(
        run_id="r1", config=config, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", parent_mlflow_run_id="p"
    )
    outcome = release(run, {}, {"sft/eval_loss": 1.0})
    assert outcome["registered_model"] is None and outcome["failure"] is None and not outcome["judged"]
    assert outcome["not_registered"].startswith(
        "the run leaves out the stage of gate(s) grpo/exact_match, so its sft model could not become the champion"
    )
    assert release_kind(outcome) == "unregistered"
    assert release_markdown("r1", outcome).startswith("No model registered for run `r1` (the run leaves out")


def test_min_gain_se_over_sft_asks_for_a_gain_beyond_the_noise():
    """Without a champion the baseline is this run's SFT: evaluate's paired gain and its SE."""
    metrics = {
        "grpo/exact_match": 0.44,
        "grpo_vs_sft/exact_match_gain": 0.031,
        "grpo_vs_sft/exact_match_gain_se": 0.013,
    }
    noisy = QualityGate(metric="grpo/exact_match", min_gain_se=3.0)
    [refused] = check_gates([noisy], metrics, None)
    assert not refused.passed and refused.bound == pytest.approx(0.039)
    assert gate_failure_message([refused]) == "gate: grpo_vs_sft/exact_match_gain 0.031 <= 3 SE 0.039"
    [passed] = check_gates([noisy.model_copy(update={"min_gain_se": 2.0})], metrics, None)
    assert passed.passed and passed.describe() == "grpo_vs_sft/exact_match_gain 0.031 > 2 SE 0.026"
    # vs_champion with no champion yet: the first champion must beat SFT beyond the noise.
    results = check_gates([QualityGate(metric="grpo/exact_match", vs_champion=True, min_gain_se=3.0)], metrics, None)
    assert [r.against for r in results] == ["no champion yet", "3 SE"] and not results[1].passed
    # A run without SFT has no gain to judge: the gate fails, naming what is missing.
    [missing] = check_gates([noisy], {"grpo/exact_match": 0.44}, None)
    assert not missing.passed and "grpo_vs_sft/exact_match_gain missing" in gate_failure_message([missing])


def test_min_gain_se_over_the_champion_pairs_the_two_sample_tables():
    """Against the champion, the verdicts of both runs' sample tables are paired by prompt and
    judged by evaluate's paired_gain; problems only one table holds are left out."""
    from tasks.report.gates import ChampionSamples
    from trainer_core.objectives.paired import paired_gain

    champion_rows = [{"prompt": f"q{i}", "dpo_correct": i < 4} for i in range(10)]
    rows = [{"prompt": f"q{i}", "grpo_correct": i < 7} for i in range(1, 12)]  # q10, q11: not in the champion's
    gate = QualityGate(metric="grpo/exact_match", vs_champion=True, min_gain_se=1.0)
    champion = Champion("3", {"grpo/exact_match": 0.4}, {})
    results = check_gates(
        [gate],
        {"grpo/exact_match": 0.6},
        champion,
        samples=rows,
        champion_samples=ChampionSamples("dpo", champion_rows),
    )
    gain, se = paired_gain([i < 4 for i in range(1, 10)], [i < 7 for i in range(1, 10)])
    assert gain == pytest.approx(3 / 9)
    assert results[1].metric == "grpo_vs_champion/exact_match_gain" and results[1].value == pytest.approx(gain)
    assert results[1].bound == pytest.approx(se) and results[1].passed == (gain > se)
    strict = gate.model_copy(update={"min_gain_se": 3.0})
    [_, refused] = check_gates(
        [strict],
        {"grpo/exact_match": 0.6},
        champion,
        samples=rows,
        champion_samples=ChampionSamples("dpo", champion_rows),
    )
    assert not refused.passed and refused.describe().startswith(
        "grpo_vs_champion/exact_match_gain 0.3333 <= 3 SE (champion v3)"
    )
    # A champion registered without a sample table: nothing to pair with, as for a missing metric.
    [_, unpaired] = check_gates([gate], {"grpo/exact_match": 0.6}, champion, samples=rows, champion_samples=None)
    assert unpaired.passed and "registered without its sample table" in unpaired.describe()
    # No problem in common: the gate cannot be judged and fails.
    [_, disjoint] = check_gates(
        [gate],
        {"grpo/exact_match": 0.6},
        champion,
        samples=rows[-2:],
        champion_samples=ChampionSamples("dpo", champion_rows),
    )
    assert not disjoint.passed and "no held-out problem" in disjoint.describe()


def test_min_gain_se_needs_a_rising_exact_match():
    with pytest.raises(ValueError, match="min_gain_se needs a <policy>/exact_match"):
        QualityGate(metric="sft/eval_loss", op="<=", min_gain_se=2.0)
    with pytest.raises(ValueError, match="min_gain_se needs"):
        QualityGate(metric="grpo/exact_match", op="<=", min_gain_se=2.0)
    assert QualityGate(metric="grpo/exact_match", min_gain_se=2.0).threshold is None
    for metric in ("grpo/pass_at_4", "grpo/avg_at_4", "dpo/pass_at_1", "grpo/lm_eval/gsm8k/exact_match_strict_match"):
        assert QualityGate(metric=metric, min_gain_se=2.0).min_gain_se == 2.0
    for metric in (
        "grpo/pass_at_0",
        "grpo/pass_at_k",
        "grpo/exact_match_gain",
        "grpo/pass_at_4_se",
        "grpo/lm_eval/gsm8k/exact_match_stderr_strict_match",
        "grpo/lm_eval/exact_match",
    ):
        with pytest.raises(ValueError, match="<policy>/avg_at_<n> or <policy>/lm_eval/<task>/<metric>"):
            QualityGate(metric=metric, min_gain_se=2.0)


def test_min_gain_se_on_a_sampled_metric():
    """pass@k and avg@n pair as exact match does: over SFT from evaluate's gain and SE, over the
    champion from both sample tables' per-problem estimates (only the sampled problems hold one)."""
    from tasks.report.gates import ChampionSamples
    from trainer_core.objectives.paired import paired_gain

    metrics = {"grpo/pass_at_4": 0.56, "grpo_vs_sft/pass_at_4_gain": 0.05, "grpo_vs_sft/pass_at_4_gain_se": 0.02}
    gate = QualityGate(metric="grpo/pass_at_4", min_gain_se=2.0)
    [passed] = check_gates([gate], metrics, None)
    assert passed.passed and passed.describe() == "grpo_vs_sft/pass_at_4_gain 0.05 > 2 SE 0.04"
    [refused] = check_gates([gate.model_copy(update={"min_gain_se": 3.0})], metrics, None)
    assert not refused.passed
    # The champion's table: its GRPO's pass@4 on the first 6 problems (evaluate sampled those alone).
    champion_rows = [
        {"prompt": f"q{i}", "grpo_correct": True, **({"grpo_pass_at_4": 0.25} if i < 6 else {})} for i in range(10)
    ]
    rows = [
        {"prompt": f"q{i}", "grpo_correct": False, **({"grpo_pass_at_4": 1.0 if i % 2 else 0.5} if i < 6 else {})}
        for i in range(10)
    ]
    champion = Champion("2", {"grpo/pass_at_4": 0.25}, {})
    paired = QualityGate(metric="grpo/pass_at_4", vs_champion=True, min_gain_se=1.0)
    [_, result] = check_gates(
        [paired],
        {"grpo/pass_at_4": 0.75},
        champion,
        samples=rows,
        champion_samples=ChampionSamples("grpo", champion_rows),
    )
    gain, se = paired_gain([0.25] * 6, [0.5, 1.0] * 3)
    assert gain == pytest.approx(0.5) and se > 0
    assert result.metric == "grpo_vs_champion/pass_at_4_gain" and result.value == pytest.approx(gain)
    assert result.bound == pytest.approx(se) and result.passed  # the greedy verdicts (all worse) are not read


def test_min_gain_se_on_a_harness_metric_pairs_the_examples_both_runs_scored():
    """A harness metric pairs by task example: over the champion from both runs' harness sample
    tables (rows keyed by the example; a key only one run holds is not read)."""
    from tasks.report.gates import ChampionSamples
    from trainer_core.objectives.paired import paired_gain

    metric = "lm_eval/gsm8k/exact_match_flexible_extract"
    champion_rows = [{"prompt": "q0", "grpo_correct": True}] + [
        {"prompt": f"lm_eval/gsm8k/{i}/h{i}", f"grpo_{metric}": float(i % 3 == 0)} for i in range(9)
    ]
    rows = [{"prompt": "q0", "grpo_correct": False}] + [
        {"prompt": f"lm_eval/gsm8k/{i}/h{i}", f"grpo_{metric}": float(i % 3 != 2)} for i in range(1, 12)
    ]
    champion = Champion("3", {f"grpo/{metric}": 0.33}, {})
    gate = QualityGate(metric=f"grpo/{metric}", vs_champion=True, min_gain_se=1.0)
    [_, result] = check_gates(
        [gate], {f"grpo/{metric}": 0.6}, champion, samples=rows, champion_samples=ChampionSamples("grpo", champion_rows)
    )
    baseline = [float(i % 3 == 0) for i in range(1, 9)]  # examples 1..8: in both tables
    gain, se = paired_gain(baseline, [float(i % 3 != 2) for i in range(1, 9)])
    assert gain == pytest.approx(3 / 8) and se > 0
    assert result.metric == f"grpo_vs_champion/{metric}_gain"
    assert (result.value, result.bound) == (pytest.approx(gain), pytest.approx(se)) and result.passed
    over_sft = {f"grpo_vs_sft/{metric}_gain": 0.01, f"grpo_vs_sft/{metric}_gain_se": 0.02}
    [noise] = check_gates([QualityGate(metric=f"grpo/{metric}", min_gain_se=1.0)], over_sft, None)
    assert not noise.passed and noise.describe() == f"grpo_vs_sft/{metric}_gain 0.01 <= 1 SE 0.02"
