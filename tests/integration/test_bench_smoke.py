"""``make bench`` as CI runs it: ``bench/run_all.py`` (SFT and DPO against TRL 1.16) with the
smallest settings, through the project's public API, writing both sides' numbers.

It measures nothing here (two timed steps on a busy 2-core machine); it fails when either
benchmark no longer runs, as DPO's half once did unnoticed after a function it patched moved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.helpers import REPO_ROOT

pytest.importorskip("trl", reason="TRL (the bench extra) is not installed")

SMOKE_ARGS = [
    "--steps",
    "2",
    "--warmup",
    "1",
    "--rounds",
    "1",
    "--quiet-wait-s",
    "0",
    "--sft-examples",
    "64",
    "--dpo-pairs",
    "48",
]


def test_make_bench_runs_both_benchmarks_against_trl(tmp_path):
    env = {**os.environ, "POSTTRAIN_BENCH_RESULTS_DIR": str(tmp_path), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    done = subprocess.run(
        [sys.executable, "bench/run_all.py", *SMOKE_ARGS],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    targets = {row["metric"]: row for row in results["targets"]}
    assert any(m.startswith("SFT train tokens/s") for m in targets) and any(
        m.startswith("DPO pairs/s") for m in targets
    )
    for row in targets.values():
        assert row["project"] > 0 and row["trl"] > 0, row
    assert {"sft", "dpo"} <= set(results)
