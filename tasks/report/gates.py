"""Quality gates: does a run's final policy meet ``evaluate.gates`` and so become the champion?

A gate compares one headline metric of the run (``tasks.report.summary.headline_metrics``: evaluate's
metrics under their own names, e.g. ``dpo/exact_match``) with a fixed threshold, with the
registered model's current champion's value of the same metric (less a tolerance), or both. A
metric the run did not produce fails its gate; a champion comparison passes when there is no
champion yet or the champion's run lacks the metric (nothing to fall below).

A gate with ``min_gain_se`` k on ``<policy>/exact_match`` (or a sampled ``<policy>/pass_at_<k>``
or ``<policy>/avg_at_<n>``, or a harness metric ``<policy>/lm_eval/<task>/<metric>``) also asks for
a paired gain over a baseline larger than k standard errors, on the same held-out problems
(:func:`~trainer_core.objectives.paired.paired_gain`, as evaluate computes it): over the
champion's policy with ``vs_champion`` (the two runs' evaluate sample tables, paired by problem:
the greedy verdicts, each sampled problem's estimate, or each task example's score), else
over this run's SFT (evaluate's ``<policy>_vs_sft/<metric>_gain`` and ``_gain_se``). A champion
registered without its sample table (``posttrain.eval_samples_uri``) gives nothing to compare:
that comparison passes, as for a champion without the metric.

A gate on a stage the run does not include (``grpo/exact_match`` in a run of prepare_data and
sft) is not judged: the run completes, but its version cannot become the champion
(``tasks/report/release.py`` registers it, as a candidate, only with ``tracking.registered_stage``).
"""

from __future__ import annotations

import math
import operator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from trainer_core.config.evaluation import QualityGate
from trainer_core.errors import EXIT_GATE_FAILED, PosttrainError
from trainer_core.objectives.paired import paired_gain, paired_verdicts, sample_column

if TYPE_CHECKING:  # the gates judge without MLflow
    from tasks.report.mlflow_models import Champion

_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
_NEGATED = {">=": "<", ">": "<=", "<=": ">", "<": ">="}


class QualityGateFailed(PosttrainError):
    """Every stage completed, but the final policy failed a quality gate: it was not made champion."""

    exit_code = EXIT_GATE_FAILED


@dataclass(frozen=True)
class GateResult:
    """One gate's verdict.

    Attributes:
        metric: The metric judged.
        op: The comparison the run's value had to satisfy.
        value: The run's value (None: the run did not produce the metric).
        bound: The bound it was compared with (threshold, or champion's value -/+ tolerance).
        against: ``threshold`` or ``champion v<N>``.
        passed: Whether the comparison held (True for a gate not judged).
        judged: False when the run does not include the stage the metric describes.
        note: Why there is no value, when the metric is there but the comparison is not
            (``min_gain_se`` against the champion); empty otherwise.
    """

    metric: str
    op: str
    value: float | None
    bound: float | None
    against: str
    passed: bool
    judged: bool = True
    note: str = ""

    def describe(self) -> str:
        """``dpo/exact_match 0.041 < champion v3 0.047`` (failed) or ``... >= ...`` (passed)."""
        if not self.judged:
            return f"{self.metric} not judged (its stage is not in this run)"
        if self.value is None:
            return f"{self.metric} {self.note or 'missing (the run did not produce it)'}"
        if self.bound is None:
            return f"{self.metric} {self.value:.4g} ({self.against})"
        op = self.op if self.passed else _NEGATED[self.op]
        return f"{self.metric} {self.value:.4g} {op} {self.against} {self.bound:.4g}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, with ``describe``'s text as ``result``."""
        return {**asdict(self), "result": self.describe()}


def _bound(gate: QualityGate, champion_value: float) -> float:
    """The champion's value loosened by the tolerance in the direction the gate allows."""
    return champion_value - gate.tolerance if gate.op in (">=", ">") else champion_value + gate.tolerance


def metric_stage(metric: str) -> str:
    """The stage a headline metric describes: ``dpo/exact_match`` and ``dpo_vs_sft/win_rate`` ->
    ``dpo``; ``base/exact_match`` -> ``evaluate`` (the base model is only ever evaluated)."""
    prefix = metric.split("/", 1)[0].removesuffix("_vs_sft")
    return "evaluate" if prefix == "base" else prefix


@dataclass(frozen=True)
class ChampionSamples:
    """The champion's per-problem verdicts: its evaluate sample table and the policy registered.

    Attributes:
        stage: The registered policy stage (its verdicts are the ``<stage>_correct`` column, its
            sampled estimates ``<stage>_pass_at_<k>`` and ``<stage>_avg_at_<n>``).
        rows: The rows of its run's evaluate ``samples.jsonl``.
    """

    stage: str
    rows: list[dict]


def _without_gain(name: str, against: str, passed: bool, note: str = "") -> GateResult:
    """A ``min_gain_se`` verdict with no gain to compare (no value, no bound), ``passed`` as given,
    ``note`` saying why (empty: the run did not produce the gain)."""
    return GateResult(name, ">", None, None, against, passed, note=note)


def _gain_result(
    gate: QualityGate,
    metrics: dict[str, float],
    champion: Champion | None,
    samples: list[dict] | None,
    champion_samples: ChampionSamples | None,
) -> GateResult:
    """The ``min_gain_se`` comparison of ``gate`` (see the module docstring)."""
    (policy, metric), k = gate.metric.split("/", 1), gate.min_gain_se
    if gate.vs_champion and champion is not None:
        version = champion.version
        name, against = f"{policy}_vs_champion/{metric}_gain", f"{k:g} SE (champion v{version})"
        if champion_samples is None:
            return _without_gain(
                name, against, True, f"not compared (champion v{version} was registered without its sample table)"
            )
        column = sample_column(metric)
        baseline, other = paired_verdicts(
            champion_samples.rows, f"{champion_samples.stage}_{column}", samples or [], f"{policy}_{column}"
        )
        if not baseline:
            return _without_gain(
                name,
                against,
                False,
                f"missing (no held-out problem with a value in both this run and champion v{version})",
            )
        gain, se = paired_gain(baseline, other)
    else:
        name, against = f"{policy}_vs_sft/{metric}_gain", f"{k:g} SE"
        gain, se = metrics.get(name), metrics.get(f"{name}_se")
        if gain is None or se is None or not math.isfinite(gain) or not math.isfinite(se):
            return _without_gain(name, against, False)
    bound = k * se
    return GateResult(name, ">", gain, bound, against, gain > bound)


def check_gates(
    gates: list[QualityGate],
    metrics: dict[str, float],
    champion: Champion | None,
    stages: list[str] | None = None,
    samples: list[dict] | None = None,
    champion_samples: ChampionSamples | None = None,
) -> list[GateResult]:
    """Judge ``gates`` against a run's headline ``metrics``.

    Args:
        gates: ``evaluate.gates``.
        metrics: The run's headline metrics, ``{"dpo/exact_match": 0.047, ...}``.
        champion: The registered model's champion (its version and its run's metrics), or None.
        stages: The run's stages; a gate on a metric of another stage (:func:`metric_stage`) is
            not judged. None: every gate is judged.
        samples: The rows of this run's evaluate ``samples.jsonl`` (read for ``min_gain_se``
            against the champion).
        champion_samples: The champion's sample table, or None (none, or registered without one).

    Returns:
        One result per comparison: a gate with a threshold, ``vs_champion`` and ``min_gain_se``
        gives three.
    """
    results = []
    for gate in gates:
        if stages is not None and metric_stage(gate.metric) not in stages:
            results.append(GateResult(gate.metric, gate.op, None, None, "", True, judged=False))
            continue
        value = metrics.get(gate.metric)
        if value is not None and not math.isfinite(value):
            value = None
        compare = _OPS[gate.op]
        if gate.threshold is not None:
            passed = value is not None and compare(value, gate.threshold)
            results.append(GateResult(gate.metric, gate.op, value, gate.threshold, "threshold", passed))
        if gate.vs_champion and champion is not None and gate.metric in champion.metrics:
            bound = _bound(gate, champion.metrics[gate.metric])
            passed = value is not None and compare(value, bound)
            results.append(GateResult(gate.metric, gate.op, value, bound, f"champion v{champion.version}", passed))
        elif gate.vs_champion:  # no champion (or one without the metric): nothing to fall below
            results.append(GateResult(gate.metric, gate.op, value, None, "no champion yet", value is not None))
        if gate.min_gain_se is not None:
            results.append(_gain_result(gate, metrics, champion, samples, champion_samples))
    return results


def gate_failure_message(results: list[GateResult]) -> str | None:
    """``gate: <failed gate>; <failed gate>`` naming every failed gate, or None when all passed."""
    failed = [r.describe() for r in results if not r.passed]
    return f"gate: {'; '.join(failed)}" if failed else None
