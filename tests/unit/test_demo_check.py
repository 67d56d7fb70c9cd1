"""``bench/demo_check.py``: a demo run against the recorded seed-0 numbers, and the record against
``docs/benchmarks`` (the page shows the recorded numbers)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("demo_check", REPO / "bench" / "demo_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _module()
RECORD = json.loads(check.RECORD.read_text())


def _run(tmp_path: Path, exact_match: dict, *, seed: int = 0, name: str = "demo", status: str = "completed") -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"name": name, "seed": seed}))
    summary = tmp_path / "summary.json"
    summary.write_text(
        json.dumps({"status": status, "headline": {f"{p}/exact_match": v for p, v in exact_match.items()}})
    )
    return summary


def test_a_run_equal_to_the_record_passes_and_a_moved_one_names_what_moved(tmp_path):
    same = check.run_numbers(_run(tmp_path, RECORD["exact_match"]))
    assert check.compare(RECORD, same, RECORD["machine"])[0] == 0
    moved = check.run_numbers(_run(tmp_path, {**RECORD["exact_match"], "dpo": 0.123}))
    code, message = check.compare(RECORD, moved, RECORD["machine"])
    assert code == 1 and f"dpo: recorded {RECORD['exact_match']['dpo']}, now 0.123" in message
    assert "sft:" not in message and "bench/rl_learning.py" in message


def test_another_kind_of_machine_or_run_is_not_judged(tmp_path):
    moved = check.run_numbers(_run(tmp_path, {**RECORD["exact_match"], "sft": 0.5}))
    other_kernels = "AVX2" if RECORD["machine"]["cpu_capability"] != "AVX2" else "AVX512"  # not the record's
    other = {**RECORD["machine"], "cpu_capability": other_kernels}
    code, message = check.compare(RECORD, moved, other)
    assert code == 0 and "not the record's kind" in message
    seed1 = check.run_numbers(_run(tmp_path, RECORD["exact_match"], seed=1))
    assert check.compare(RECORD, seed1, RECORD["machine"]) == (
        0,
        "not the demo at seed 0 (name 'demo', seed 1): nothing to compare",
    )


def test_an_unfinished_or_missing_run_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="status is 'failed'"):
        check.run_numbers(_run(tmp_path, {}, status="failed"))
    assert check.main([str(tmp_path / "absent" / "summary.json")]) == 2


def test_the_benchmarks_page_shows_the_recorded_seed_0_numbers():
    page = (REPO / "docs" / "benchmarks" / "index.md").read_text()
    section = page.split("## The demo: what DPO, PPO and GRPO gain over SFT", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| 0 \| 0\.\d+, ", line)]
    shown = [[float(x) for x in row.split("|")[2].split(",")] for row in rows]  # a table per machine kind
    assert [RECORD["exact_match"][p] for p in check.POLICIES] in shown, (rows, RECORD)
    assert RECORD["commit"] in section  # the page names the commit the record was measured at
