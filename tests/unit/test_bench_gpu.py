"""CPU smoke test of ``bench/bench_gpu.py`` against TRL: its ``--tiny`` run writes both sides' numbers.

The benchmark itself needs a GPU (``bench/GPU.md``); here a 2-layer, hidden-64 Qwen2 trains a
few steps of every case on the CPU, on the synthetic task, as a subprocess (the way it is run),
and the JSON it writes is read back. Not a speed check: only that each case ran on the project
side and on TRL's and reported throughput and MFU. The project alone (``--no-trl``, as where TRL
is not installed) is the acceptance run's smoke test, ``tests/unit/test_gpu_acceptance.py``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "bench" / "bench_gpu.py"
HAVE_TRL = importlib.util.find_spec("trl") is not None
SMOKE = ["--device", "cpu", "--tiny", "--synthetic", "--steps", "2", "--warmup", "1"]


def run_bench(tmp_path: Path, *flags: str) -> dict:
    """Run the benchmark with ``flags`` writing into ``tmp_path``; returns its ``gpu.json``."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *SMOKE, "--results-dir", str(tmp_path), *flags],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads((tmp_path / "gpu.json").read_text())


def check_side(result: dict, key: str) -> None:
    """Positive throughput and MFU over the 2 timed steps; no CUDA, so no peak memory."""
    assert result[key] > 0 and result["tokens"] > 0
    assert result["timed_steps"] == 2
    assert 0 < result["mfu"] < 1 and result["model_flops_per_s"] > 0
    assert result["peak_memory_bytes"] is None


@pytest.mark.skipif(not HAVE_TRL, reason="TRL (the bench extra) is not installed")
def test_every_case_runs_on_both_sides(tmp_path):
    """SFT at micro-batch 16 and 64 and packed under a token budget, DPO at 8 pairs: each case
    has the project's and TRL's tokens/s (pairs/s) and MFU, and a ratio row per target."""
    payload = run_bench(tmp_path)
    assert set(payload["cases"]) == {"sft_mb16", "sft_mb64", "sft_budget", "dpo_mb8"}
    for name, case in payload["cases"].items():
        key = "examples_per_s" if name.startswith("dpo") else "tokens_per_s"
        check_side(case["project"], key)
        check_side(case["trl"], key)
    assert payload["cases"]["sft_mb16"]["trl"]["same_token_ids_as_project"] is True
    budget = payload["cases"]["sft_budget"]
    assert budget["settings"]["max_tokens_per_micro_batch"] == 1024
    assert budget["project"]["padding_share"] == 0.0  # packed: no padding computed
    assert budget["project"]["tokens"] <= 2 * 1024
    assert payload["cases"]["dpo_mb8"]["project"]["reference_pairs"] > 0
    metrics = [r["metric"] for r in payload["rows"]]
    assert any("MFU" in m for m in metrics) and any("pairs/s" in m for m in metrics)
    assert all(r["ratio"] > 0 for r in payload["rows"])

