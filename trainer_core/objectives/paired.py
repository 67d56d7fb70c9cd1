"""Paired comparisons of two policies' verdicts on the same held-out problems.

Evaluate reports each policy's exact-match gain over SFT with :func:`paired_gain`; a quality
gate with ``min_gain_se`` (``tasks/report/gates.py``) asks the same question of a run's policy
against the registered champion's, pairing the two runs' sample tables by problem
(:func:`paired_verdicts`). Pure Python: the flow process imports it without torch.
"""

from __future__ import annotations

import bisect

from trainer_core.config.generation import per_problem_metric

SAMPLES_FILE = "samples.jsonl"
"""Evaluate's sample table in its final directory (JSON lines, one row per held-out problem:
``prompt``, ``answer``, and per policy its completion and ``<policy>_correct`` verdict)."""

HARNESS_SAMPLES_FILE = "lm_eval_samples.jsonl"
"""Evaluate's per-example harness scores beside :data:`SAMPLES_FILE` (with ``evaluate.lm_eval``;
JSON lines, one row per task example: ``prompt`` ``lm_eval/<task>/<doc_id>/<doc_hash>``, the
example's key, and per policy ``<policy>_lm_eval/<task>/<metric>`` its score). Its rows pair as
the sample table's do (:func:`paired_verdicts`)."""


def paired_gain(baseline: list[bool] | list[float], other: list[bool] | list[float]) -> tuple[float, float]:
    """Mean of ``other - baseline`` over the same problems, and its standard error.

    With verdicts the per-problem differences ``d_i`` are -1, 0 or 1; the error is ``std(d) /
    sqrt(n)`` with the sample standard deviation (n - 1), the paired-difference standard error
    (McNemar's setting: only problems that one policy solves and the other does not move it).
    Per-problem estimates in [0, 1] (a problem's pass@k or avg@n from its n samples) pair the
    same way.

    Args:
        baseline: the baseline policy's verdict (or estimate) per problem.
        other: the other policy's on the same problems, in the same order.

    Returns:
        (gain, standard error); the error is 0.0 for fewer than 2 problems.

    Raises:
        ValueError: the lists differ in length or are empty.

    Worked values: baseline [1, 1, 0, 0], other [1, 0, 1, 1]: d = [0, -1, 1, 1], gain 0.25,
    sample variance 2.75 / 3, standard error sqrt(2.75 / 3) / 2 = 0.4787.
    """
    if len(baseline) != len(other) or not baseline:
        raise ValueError(
            f"paired_gain needs two equally long, non-empty verdict lists, got {len(baseline)} and {len(other)}"
        )
    diffs = [float(b) - float(a) for a, b in zip(baseline, other)]
    n = len(diffs)
    gain = sum(diffs) / n
    if n < 2:
        return gain, 0.0
    variance = sum((d - gain) ** 2 for d in diffs) / (n - 1)
    return gain, (variance / n) ** 0.5


def sample_column(metric: str) -> str:
    """The column of evaluate's sample tables that holds a per-problem value of ``metric`` (a
    headline metric without its policy): ``exact_match`` -> ``correct`` (the greedy verdict),
    ``pass_at_<k>`` and ``avg_at_<n>`` -> themselves (each problem's estimate from its samples;
    only the problems evaluate sampled have one), a harness metric ``lm_eval/<task>/<metric>`` ->
    itself (each example's score, in :data:`HARNESS_SAMPLES_FILE`).

    Raises:
        ValueError: a metric with no per-problem value.
    """
    if metric == "exact_match":
        return "correct"
    if per_problem_metric(metric):
        return metric
    raise ValueError(
        f"{metric!r} has no per-problem value in evaluate's sample tables "
        "(exact_match, pass_at_<k>, avg_at_<n> and lm_eval/<task>/<metric> do)"
    )


def paired_verdicts(
    baseline_rows: list[dict], baseline_column: str, rows: list[dict], column: str
) -> tuple[list[float], list[float]]:
    """The per-problem values of two sample tables (evaluate's :data:`SAMPLES_FILE` and
    :data:`HARNESS_SAMPLES_FILE` rows) on the problems both hold, matched by their ``prompt``, in
    ``rows``' order.

    Args:
        baseline_rows: the baseline's rows; ``baseline_column`` its column (``<policy>_correct``,
            a verdict, or ``<policy>_pass_at_<k>``, an estimate: :func:`sample_column`).
        rows: the other policy's rows; ``column`` its column.

    Returns:
        (baseline values, other values) as floats (a verdict 1.0 or 0.0), equally long; empty when
        no problem is in both or a table lacks its column.
    """
    baseline = {
        row["prompt"]: float(row[baseline_column]) for row in baseline_rows if row.get(baseline_column) is not None
    }
    matched = [
        (baseline[row["prompt"]], float(row[column]))
        for row in rows
        if row.get(column) is not None and row.get("prompt") in baseline
    ]
    return [b for b, _ in matched], [o for _, o in matched]


def verdict_auc(scores: list[float], verdicts: list[bool]) -> float | None:
    """How well ``scores`` rank correct answers above wrong ones: the ROC AUC, the probability that
    a correct answer's score exceeds a wrong one's (ties count half; the Mann-Whitney U statistic
    over ``n_correct * n_wrong``).

    Evaluate reads it as ``<policy>/reward_auc``: the reward model's scores of a policy's own
    answers against the verifier's verdicts on them, which says whether the reward tracks
    correctness where RL samples, not only on the held-out preference pairs.

    Args:
        scores: one score per answer.
        verdicts: whether each answer is correct, in the same order.

    Returns:
        The AUC in [0, 1] (0.5: no better than chance); None when every verdict is the same.

    Raises:
        ValueError: the lists differ in length.

    Worked values: scores [3, 1, 2, 2], verdicts [1, 0, 1, 0]: pairs (3, 1) (3, 2) (2, 1) (2, 2)
    win 1, 1, 1, 0.5: AUC 3.5 / 4 = 0.875.
    """
    if len(scores) != len(verdicts):
        raise ValueError(
            f"verdict_auc needs one verdict per score, got {len(scores)} scores and {len(verdicts)} verdicts"
        )
    correct = [s for s, v in zip(scores, verdicts) if v]
    wrong = [s for s, v in zip(scores, verdicts) if not v]
    if not correct or not wrong:
        return None
    wrong.sort()
    wins = sum(
        bisect.bisect_left(wrong, c) + 0.5 * (bisect.bisect_right(wrong, c) - bisect.bisect_left(wrong, c))
        for c in correct
    )
    return wins / (len(correct) * len(wrong))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k for one problem from ``n`` samples of which ``c`` are
    correct: ``1 - C(n - c, k) / C(n, k)``, the chance that k of the n samples drawn without
    replacement hold a correct one (Chen et al. 2021, "Evaluating Large Language Models Trained
    on Code", eq. 1), as the product of their numerically stable form (figure 3).

    Raises:
        ValueError: not ``0 <= c <= n`` or not ``1 <= k <= n``.

    Worked values: n = 5, c = 2: k = 1 0.4 (= c / n), k = 2 1 - 3/10 = 0.7, k = 3 1 - 1/10 = 0.9,
    k = 4 and 5 1.0 (fewer than k wrong samples).
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    remaining = 1.0
    for i in range(n - c + 1, n + 1):
        remaining *= 1.0 - k / i
    return 1.0 - remaining


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """Mean of ``values`` over problems and its standard error (sample standard deviation over
    sqrt(count); 0.0 for fewer than 2 values).

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("mean_and_se needs at least one value")
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5
