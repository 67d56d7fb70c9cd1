"""The sweep's planning and comparison, without running a stage (``tasks/sweep.py``,
``tasks/report/sweep_report.py``, the CLI's ``--grid``)."""

from __future__ import annotations

import json
import threading

import pytest

from posttrain.cli import parse_grid
from tasks.report.sweep_report import compare, comparison_figure, comparison_markdown
from tasks.results import StageResult
from tasks.sweep import SweepBoard, expand_grid, owners, point_config, point_run_id, stage_keys
from tests.tiny import TINY_DEMO
from trainer_core.config import load_config
from trainer_core.errors import ConfigError
from trainer_core.storage import RunLayout


@pytest.fixture(scope="module")
def base():
    return load_config(overrides={**TINY_DEMO, "stages": "prepare_data,sft,dpo,grpo,evaluate"})


def test_the_grid_expands_first_key_slowest_and_point_ids_ignore_key_order():
    grid = {"dpo.beta": [0.1, 0.5], "grpo.learning_rate": [1e-5, 3e-5]}
    assert expand_grid(grid) == [
        {"dpo.beta": 0.1, "grpo.learning_rate": 1e-5},
        {"dpo.beta": 0.1, "grpo.learning_rate": 3e-5},
        {"dpo.beta": 0.5, "grpo.learning_rate": 1e-5},
        {"dpo.beta": 0.5, "grpo.learning_rate": 3e-5},
    ]
    assert expand_grid({}) == [{}]
    a = point_run_id("sw", {"dpo.beta": 0.1, "grpo.learning_rate": 1e-5})
    assert (
        a == point_run_id("sw", {"grpo.learning_rate": 1e-5, "dpo.beta": 0.1}) and a.startswith("sw-") and len(a) == 11
    )
    assert a != point_run_id("sw", {"dpo.beta": 0.5, "grpo.learning_rate": 1e-5})


def test_grid_options_read_values_as_yaml():
    assert parse_grid(["dpo.beta=0.1,0.5", "grpo.learning_rate=[1.0e-5, 3.0e-5]", "sft.max_steps=4"]) == {
        "dpo.beta": [0.1, 0.5],
        "grpo.learning_rate": [1e-5, 3e-5],
        "sft.max_steps": [4],
    }
    for bad in ("dpo.beta", "=1,2", "dpo.beta="):
        with pytest.raises(ConfigError, match="expected key.path=value1,value2"):
            parse_grid([bad])


def test_fingerprints_computed_ahead_decide_what_the_points_share(base, tmp_path):
    grid = {"dpo.beta": [0.1, 0.5], "grpo.learning_rate": [1e-5, 3e-5]}
    points = expand_grid(grid)
    run_ids = [point_run_id("sw", v) for v in points]
    configs = [point_config(base, v) for v in points]
    keys = [stage_keys(c, RunLayout(str(tmp_path), r)) for c, r in zip(configs, run_ids)]
    assert len({k["sft"] for k in keys}) == 1 and len({k["dpo"] for k in keys}) == 2
    assert len({k["grpo"] for k in keys}) == 2 and len({k["evaluate"] for k in keys}) == 4
    shared = owners(run_ids, keys)
    assert shared[0] == {}
    assert shared[1] == {"prepare_data": run_ids[0], "sft": run_ids[0], "dpo": run_ids[0]}
    assert shared[2] == {"prepare_data": run_ids[0], "sft": run_ids[0], "grpo": run_ids[0]}
    assert shared[3] == {"prepare_data": run_ids[0], "sft": run_ids[0], "dpo": run_ids[2], "grpo": run_ids[1]}
    assert configs[3].dpo.beta == 0.5 and configs[3].grpo.learning_rate == 3e-5 and not configs[3].sweep.grid


def test_a_grid_key_that_is_no_config_field_is_named(base):
    with pytest.raises(ConfigError, match="dpo.betta"):
        point_config(base, {"dpo.betta": 0.1})
    with pytest.raises(ConfigError, match="sweep.grid.storage.root"):
        load_config(overrides={"sweep.grid": {"storage.root": ["/a", "/b"]}})


def test_the_board_hands_a_result_to_the_waiting_point_and_fails_an_abandoned_one():
    board, got = SweepBoard(), []
    waiter = threading.Thread(target=lambda: got.append(board.wait("p0", "sft", "group-x", poll_s=0.05)))
    waiter.start()
    board.record("p0", "sft", StageResult(stage="sft", status="completed", output_uri="/o", fingerprint="f"))
    waiter.join(5)
    assert got and got[0].output_uri == "/o"
    board.abandon("p1", ["prepare_data", "sft"], RuntimeError("refused"))
    assert board.wait("p1", "sft", "group-x").status == "failed"
    assert "refused" in board.wait("p1", "prepare_data", "group-x").error


def test_the_comparison_ranks_points_and_pairs_the_best_with_the_runner_up(tmp_path):
    def point(run_id, beta, verdicts):
        final = tmp_path / run_id
        final.mkdir()
        rows = [{"prompt": f"q{i}", "answer": "1", "grpo_correct": v} for i, v in enumerate(verdicts)]
        (final / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        headline = {"grpo/exact_match": sum(verdicts) / len(verdicts)}
        summary = {"status": "completed", "headline": headline, "stages": {"evaluate": {"output_uri": str(final)}}}
        return {"run_id": run_id, "values": {"dpo.beta": beta}, "summary": summary, "error": None}

    points = [
        point("a", 0.1, [1, 0, 0, 0]),
        point("b", 0.5, [1, 1, 1, 0]),
        point("c", 1.0, [1, 1, 0, 0]),
        {"run_id": "d", "values": {"dpo.beta": 2.0}, "summary": None, "error": "StageFailed: boom"},
    ]
    out = compare(points, "grpo/exact_match")
    assert (out["best"], out["runner_up"]) == ("b", "c")
    assert out["gain"] == pytest.approx(0.25) and out["gain_se"] == pytest.approx(0.25)  # d = [0, 0, 1, 0]
    assert [r["value"] for r in out["rows"]] == [0.25, 0.75, 0.5, None] and out["rows"][3]["status"] == "failed"
    shown = comparison_markdown("sw", out)
    assert shown.startswith(
        "Sweep `sw`: best `grpo/exact_match` at dpo.beta=0.5 (run `b`), +0.25 ± 0.25 (paired SE; "
        "within 2 SE) over run `c`."
    )
    assert "| 0.5 | `b` | completed | 0.75 **best** |" in shown and "| 2.0 | `d` | failed | - |" in shown
    assert comparison_figure(out) is not None
    assert compare(points[3:], "grpo/exact_match")["best"] is None
