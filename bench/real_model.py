"""The real-model run's table: ``configs/smollm2-gsm8k.yaml`` (SmolLM2-135M-Instruct) read back
from a finished run.

Prints, as the markdown ``docs/benchmarks`` shows: each stage's wall time; the held-out exact
match of the base model and of each policy with its standard error; SFT's paired gain over the
base model and each later policy's over SFT, with the standard error of the paired difference
(:func:`trainer_core.objectives.paired.paired_gain`), recomputed from evaluate's
``samples.jsonl`` (each policy's verdict per problem) so that a run made before evaluate
reported ``sft_vs_base`` reads the same way.

    posttrain run configs/smollm2-gsm8k.yaml        # its last stdout line is the summary's URI
    .venv/bin/python bench/real_model.py outputs/runs/<run_id>/summary.json

Exit status: 0; 1 when the summary has no completed evaluate stage or SFT does not beat the
base model by more than 2 SE (the issue's bar for the real model); 2 for a file that cannot be
read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainer_core.objectives.paired import mean_and_se, paired_gain

POLICIES = ("base", "sft", "dpo", "ppo", "grpo")


def read_run(summary_path: Path) -> tuple[dict, list[dict]]:
    """The run's summary and evaluate's sample rows (one per held-out problem)."""
    summary = json.loads(summary_path.read_text())
    evaluate = (summary.get("stages") or {}).get("evaluate") or {}
    if evaluate.get("status") != "completed":
        raise LookupError(f"{summary_path}: no completed evaluate stage")
    samples = Path(evaluate["output_uri"]) / "samples.jsonl"
    return summary, [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]


def table(summary: dict, rows: list[dict]) -> tuple[str, float, float]:
    """Markdown lines of the run, SFT's gain over the base model and its standard error."""
    stages = summary["stages"]
    lines = ["| stage | wall time (s) |", "| --- | ---: |"]
    lines += [f"| {name} | {entry.get('wall_s', 0.0):.0f} |" for name, entry in stages.items()]
    lines += [
        "",
        f"Held-out problems: {len(rows)}",
        "",
        "| policy | exact match (SE) | paired gain (SE) |",
        "| --- | ---: | ---: |",
    ]
    verdicts = {p: [bool(r[f"{p}_correct"]) for r in rows] for p in POLICIES if f"{p}_correct" in rows[0]}
    sft_gain, sft_se = float("nan"), float("nan")
    for name, hits in verdicts.items():
        mean, se = mean_and_se([float(h) for h in hits])
        baseline = "base" if name == "sft" else "sft"
        gain = ""
        if name != "base" and baseline in verdicts:
            g, g_se = paired_gain(verdicts[baseline], hits)
            gain = f"{g:+.3f} ({g_se:.3f}) vs {baseline}"
            if name == "sft":
                sft_gain, sft_se = g, g_se
        lines.append(f"| {name} | {mean:.3f} ({se:.3f}) | {gain} |")
    return "\n".join(lines), sft_gain, sft_se


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summary", type=Path, help="a finished run's summary.json")
    args = parser.parse_args(argv)
    try:
        summary, rows = read_run(args.summary)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {args.summary}: {e}", file=sys.stderr)
        return 2
    except LookupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text, gain, se = table(summary, rows)
    print(text)
    beats = gain > 2 * se
    print(f"\nSFT - base: {gain:+.3f}, SE {se:.3f}: {'above' if beats else 'NOT above'} 2 SE")
    return 0 if beats else 1


if __name__ == "__main__":
    sys.exit(main())
