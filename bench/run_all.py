"""Run the SFT and DPO speed benchmarks against TRL in one process, one after the other.

``make bench`` calls this (``ARGS="--steps 10"`` passes arguments). Prints each benchmark's
table, then a summary of the targets; writes ``.bench/sft.json``, ``.bench/dpo.json`` and
``.bench/results.json``. Exit status 0 whether or not the targets are met (it measures, it does
not gate); 1 when a benchmark fails to run.
"""

from __future__ import annotations

import argparse
import sys

import bench_dpo
import bench_sft
from common import environment, print_table, write_result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_sft.add_arguments(parser)
    bench_sft.add_sft_arguments(parser)
    bench_dpo.add_dpo_arguments(parser)
    parser.add_argument("--only", choices=["sft", "dpo"], help="run one benchmark only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    benches = {"sft": bench_sft.run, "dpo": bench_dpo.run}
    results = {name: run(args) for name, run in benches.items() if args.only in (None, name)}
    targets = [row for r in results.values() for row in r["rows"] if row["target"] is not None]
    print_table("Targets (project / TRL >= 2x)", targets)
    path = write_result(
        "results",
        {
            "args": vars(args),
            "targets": targets,
            "environment": environment(),
            **{name: r for name, r in results.items()},
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
