"""Does online RL learn? The demo pipeline run for several seeds, its PPO and GRPO curves judged.

For each seed, ``posttrain run CONFIG --set seed=S --set storage.root=WORK/seed-S`` (skipped with
``--reuse`` when that root already holds a finished run), then from the run's MLflow store:

- GRPO: the mean verifier reward (``reward_mean``) of the first and of the last ``--window``
  iterations;
- PPO: its mean reward (``objective/scores``) likewise;
- each part of a weighted reward (``reward/<name>``, e.g. the reward model's own score beside the
  verifier's in the demo's PPO) likewise, as ``<stage> reward/<name>``;
- evaluate: exact match of every policy (``summary.json``), and each one's paired gain over SFT
  on the same held-out problems with its standard error (``<policy>_vs_sft/exact_match_gain``,
  ``..._gain_se``): a policy "holds" when its gain is at least minus one standard error;
- the reward model's held-out pair accuracy and DPO's held-out preference accuracy (before its
  first step and after its last); how well the reward model tells right answers from wrong ones
  among each policy's own (evaluate's ``<policy>/reward_auc``).

A stage "learns" when ``mean(last) - mean(first)`` exceeds twice its standard error,
``sqrt(var(first) / w + var(last) / w)`` (sample variances of the ``w`` per-iteration values).
Prints one table row per seed and writes ``WORK/rl_learning.json``. Exit status 0 whether or not
the criteria hold (it measures, it does not gate); 1 when a run fails.

    .venv/bin/python bench/rl_learning.py --seeds 0 1 2 --work-dir .bench/rl-learning
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CURVES = {"grpo": "reward_mean", "ppo": "objective/scores"}
"""Stage -> the per-iteration metric judged."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--work-dir", default=str(REPO / ".bench" / "rl-learning"))
    parser.add_argument("--window", type=int, default=5, help="iterations in the first and last windows")
    parser.add_argument("--reuse", action="store_true", help="judge an existing finished run of a seed")
    parser.add_argument(
        "--judge",
        nargs="+",
        choices=sorted(CURVES),
        default=list(CURVES),
        help="the RL stages to judge (e.g. grpo alone, with --set 'stages=[prepare_data,sft,grpo,evaluate]')",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override (repeatable)",
    )
    return parser.parse_args(argv)


def window_gain(values: list[float], window: int) -> dict[str, float | bool]:
    """First- and last-window means of ``values``, their difference, its standard error and
    whether the difference exceeds twice the standard error.

    Raises:
        ValueError: fewer than ``2 * window`` values, or ``window`` < 2.
    """
    if window < 2 or len(values) < 2 * window:
        raise ValueError(f"need window >= 2 and at least {2 * window} values, got window {window}, {len(values)}")
    first, last = values[:window], values[-window:]
    gain = statistics.fmean(last) - statistics.fmean(first)
    se = math.sqrt(statistics.variance(first) / window + statistics.variance(last) / window)
    return {
        "first": statistics.fmean(first),
        "last": statistics.fmean(last),
        "gain": gain,
        "se": se,
        "learns": gain > 2 * se,
    }


def _summary_path(root: Path) -> Path | None:
    found = sorted(root.glob("runs/*/summary.json"))
    return found[-1] if found else None


def _run_demo(config: str, seed: int, root: Path, overrides: list[str]) -> tuple[Path, float]:
    """Run the pipeline for ``seed`` under ``root``; (summary.json path, wall seconds)."""
    root.mkdir(parents=True, exist_ok=True)
    command = [
        str(Path(sys.executable).parent / "posttrain"),
        "run",
        config,
        "--set",
        f"seed={seed}",
        "--set",
        f"storage.root={root}",
    ]
    for item in overrides:
        command += ["--set", item]
    start = time.perf_counter()
    with open(root / "posttrain.log", "w") as log:
        done = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - start
    summary = _summary_path(root)
    if done.returncode not in (0, 4) or summary is None:  # 4: a quality gate failed, every stage ran
        raise RuntimeError(f"seed {seed}: posttrain exited {done.returncode}; see {root / 'posttrain.log'}")
    return summary, seconds


def _histories(root: Path, stages: list[str]) -> dict[str, list[float]]:
    """Per-iteration values of :data:`CURVES` for ``stages`` from the run's MLflow store, and of
    each part of a weighted reward (``reward/<name>``, unweighted) as ``<stage> reward/<name>``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiments = client.search_experiments()
    runs = client.search_runs([e.experiment_id for e in experiments])
    out = {}
    for stage in stages:
        matching = [r for r in runs if r.info.run_name == stage]
        if not matching:
            raise RuntimeError(f"no MLflow run named {stage!r} under {root}")
        run = matching[0]
        parts = sorted(k for k in run.data.metrics if k.startswith("reward/"))
        for key, metric in [(stage, CURVES[stage]), *((f"{stage} {k}", k) for k in parts)]:
            by_step = {m.step: m.value for m in client.get_metric_history(run.info.run_id, metric)}
            out[key] = [by_step[s] for s in sorted(by_step)]
    return out


def _exact_match(summary: dict) -> dict[str, float]:
    """Evaluate's exact match per policy from ``summary.json`` (``policy -> value``)."""
    metrics = summary.get("stages", {}).get("evaluate", {}).get("metrics", {})
    return {k.split("/")[0]: v for k, v in metrics.items() if k.endswith("/exact_match")}


def policy_gains(metrics: dict[str, float]) -> dict[str, dict[str, float | bool]]:
    """Each policy's paired exact-match gain over SFT from evaluate's ``metrics``:
    ``policy -> {gain, se, holds}``, ``holds`` when ``gain >= -se`` (no worse than SFT beyond one
    standard error)."""
    out = {}
    for key, gain in metrics.items():
        if key.endswith("_vs_sft/exact_match_gain"):
            policy = key.split("_vs_sft/")[0]
            se = metrics[f"{policy}_vs_sft/exact_match_gain_se"]
            out[policy] = {"gain": gain, "se": se, "holds": gain >= -se}
    return out


def _accuracies(summary: dict) -> dict[str, float]:
    """The reward model's held-out pair accuracy, DPO's held-out preference accuracy (first and
    last evaluation), where the run has those stages, and evaluate's ``<policy>/reward_auc`` (the
    reward against the verifier on each policy's own answers)."""
    stages = summary.get("stages", {})
    out = {k: v for k, v in stages.get("evaluate", {}).get("metrics", {}).items() if k.endswith("/reward_auc")}
    if "reward_model" in stages:
        out["reward_model"] = stages["reward_model"]["metrics"].get("eval/accuracy")
    if "dpo" in stages:
        dpo = stages["dpo"]["metrics"]
        out["dpo_first"], out["dpo"] = dpo.get("first/eval/rewards/accuracies"), dpo.get("eval/rewards/accuracies")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir).resolve()
    rows = []
    for seed in args.seeds:
        root = work / f"seed-{seed}"
        existing = _summary_path(root) if args.reuse else None
        if existing is not None:
            summary_path, seconds = existing, float("nan")
        else:
            summary_path, seconds = _run_demo(args.config, seed, root, args.overrides)
        summary = json.loads(summary_path.read_text())
        histories = _histories(root, args.judge)
        evaluate = summary.get("stages", {}).get("evaluate", {}).get("metrics", {})
        row = {
            "seed": seed,
            "wall_s": seconds,
            "exact_match": _exact_match(summary),
            "vs_sft": policy_gains(evaluate),
            "accuracy": _accuracies(summary),
        }
        for stage, values in histories.items():
            row[stage] = {**window_gain(values, args.window), "values": values}
        rows.append(row)
        em = row["exact_match"]
        print(
            f"seed {seed}: {seconds:.0f} s; "
            + "; ".join(
                f"{curve if curve not in CURVES else f'{curve} {CURVES[curve]}'} first {row[curve]['first']:.4f} "
                f"last {row[curve]['last']:.4f} gain {row[curve]['gain']:+.4f} (2 SE {2 * row[curve]['se']:.4f}: "
                f"{'learns' if row[curve]['learns'] else 'NOT shown'})"
                for curve in histories
            )
            + f"; exact match {json.dumps(em, sort_keys=True)}",
            flush=True,
        )
        print(
            f"seed {seed}: vs SFT "
            + "; ".join(
                f"{policy} {g['gain']:+.4f} (SE {g['se']:.4f}: {'holds' if g['holds'] else 'WORSE'})"
                for policy, g in sorted(row["vs_sft"].items())
            )
            + f"; accuracy {json.dumps(row['accuracy'], sort_keys=True)}",
            flush=True,
        )
    work.mkdir(parents=True, exist_ok=True)
    (work / "rl_learning.json").write_text(
        json.dumps({"config": args.config, "window": args.window, "overrides": args.overrides, "seeds": rows}, indent=2)
    )
    print(f"wrote {work / 'rl_learning.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
