"""CPU smoke test of ``bench/bench_generation.py``: its ``--device cpu --tiny`` run, in process.

Not a speed check: every side ran, generated every row to full length (4 prompts x 8 tokens),
and reported a positive rate; the ratios are there; no CUDA, so no peak memory.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "bench" / "bench_generation.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_generation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_reports_every_side(tmp_path, capsys):
    bench = _load_bench()
    payload = bench.main(["--device", "cpu", "--tiny", "--results-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert json.loads((tmp_path / "generation.json").read_text()) == json.loads(json.dumps(payload))
    assert set(payload["engines"]) == {"hf", "static", "generate"}
    for name, side in payload["engines"].items():
        assert side["tokens"] == 4 * 8 and side["tokens_per_s"] > 0 and side["wall_s"] > 0
        assert len(side["rounds_tokens_per_s"]) == 1 and side["peak_memory_bytes"] is None
        assert f"  {name} " in printed
    assert set(payload["ratios"]) == {"static/hf", "static/generate"}
    assert all(r > 0 for r in payload["ratios"].values())
    assert "ratio static/hf" in printed and "ratio static/generate" in printed
    assert payload["model"]["num_hidden_layers"] == 2 and payload["prompt_tokens"] >= 4 * 4
