"""Has the demo's seed-0 result moved? A finished run of ``configs/demo.yaml`` against the
numbers recorded with ``docs/benchmarks`` (``bench/demo_seed0.json``).

The demo repeats itself to the digit on one kind of machine, and only there: another CPU's float
kernels (``torch.backends.cpu.get_cpu_capability()``: AVX512 or AVX2, and the CPU model) or
another number of compute threads give other numbers from SFT on (``docs/benchmarks``, "The
demo"). So a run is compared with the record only when it ran on the record's kind of machine
with the record's threads; elsewhere it says so and judges nothing.

    .venv/bin/python bench/demo_check.py outputs/runs/<run_id>/summary.json
    .venv/bin/python bench/demo_check.py outputs/runs/<run_id>/summary.json --update   # re-record

Exit status: 0 when the numbers equal the record (or the machine is of another kind, or the run
is not the demo at seed 0); 1 when they moved on the record's kind of machine (re-measure the
three seeds, ``bench/rl_learning.py``, update ``docs/benchmarks`` and re-record with --update);
2 for a summary that cannot be read. ``make demo`` runs it after the demo and only prints.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORD = REPO / "bench" / "demo_seed0.json"
POLICIES = ("sft", "dpo", "ppo", "grpo")
"""The policies whose held-out exact match is recorded (``<policy>/exact_match`` in the summary)."""


SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512", "avx_vnni", "amx")
"""CPU flags (prefixes) that choose torch's and oneDNN's float kernels."""


def machine_kind() -> dict[str, str]:
    """What decides the demo's floats here: the CPU model and its vector instructions (a
    virtual machine's model name can be as plain as "AMD EPYC" across generations), torch's CPU
    kernel level, its compute threads (the stage processes inherit ``OMP_NUM_THREADS``; one
    thread and two give other sums) and torch."""
    import torch

    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    simd = " ".join(sorted(f for f in set(flags) if f.startswith(SIMD_FLAGS)))
    return {
        "cpu": cpu,
        "simd": simd,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
    }


def run_numbers(summary_path: Path) -> dict:
    """The seed, the config's name and each policy's exact match of a finished run.

    Raises:
        ValueError: the summary or the run's ``config.json`` beside it is missing or unreadable,
            or the run did not complete.
    """
    try:
        summary = json.loads(summary_path.read_text())
        config = json.loads((summary_path.parent / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{summary_path}: cannot read the run's summary.json and config.json: {e}") from None
    if summary.get("status") != "completed":
        raise ValueError(f"{summary_path}: the run's status is {summary.get('status')!r}, not 'completed'")
    headline = summary.get("headline", {})
    return {
        "name": config.get("name"),
        "seed": config.get("seed"),
        "exact_match": {p: headline[f"{p}/exact_match"] for p in POLICIES if f"{p}/exact_match" in headline},
    }


def compare(record: dict, numbers: dict, machine: dict[str, str]) -> tuple[int, str]:
    """(exit status, what to print) for a run's ``numbers`` against ``record`` on ``machine``."""
    if (numbers["name"], numbers["seed"]) != ("demo", 0):
        return 0, f"not the demo at seed 0 (name {numbers['name']!r}, seed {numbers['seed']}): nothing to compare"
    if machine != record["machine"]:
        return 0, (
            f"this machine ({machine}) is not the record's kind ({record['machine']}): its numbers differ "
            "from the record's by their float kernels, so nothing is judged"
        )
    rows = [
        f"{p}: recorded {record['exact_match'].get(p)}, now {numbers['exact_match'].get(p)}"
        for p in POLICIES
        if record["exact_match"].get(p) != numbers["exact_match"].get(p)
    ]
    if not rows:
        return 0, f"the demo's seed-0 exact match equals the record (commit {record['commit']}): " + ", ".join(
            f"{p} {numbers['exact_match'][p]}" for p in POLICIES if p in numbers["exact_match"]
        )
    return 1, (
        "the demo's seed-0 numbers moved from the record (commit "
        + record["commit"]
        + "): "
        + "; ".join(rows)
        + ". Re-measure the three seeds (bench/rl_learning.py), update docs/benchmarks and re-record "
        "(bench/demo_check.py SUMMARY --update)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summary", type=Path, help="a finished run's summary.json")
    parser.add_argument("--record", type=Path, default=RECORD)
    parser.add_argument("--update", action="store_true", help="record this run's numbers, machine and commit")
    args = parser.parse_args(argv)
    try:
        numbers = run_numbers(args.summary)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.update:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
            ).stdout.strip()
            or "unknown"
        )
        record = {"commit": commit, "machine": machine_kind(), "exact_match": numbers["exact_match"]}
        args.record.write_text(json.dumps(record, indent=2) + "\n")
        print(f"recorded {args.record}: {record}")
        return 0
    code, message = compare(json.loads(args.record.read_text()), numbers, machine_kind())
    print(message)
    return code


if __name__ == "__main__":
    sys.exit(main())
