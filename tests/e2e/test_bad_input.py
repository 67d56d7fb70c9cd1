"""Bad input through the real CLI: ``python -m posttrain run`` (the ``posttrain`` entry point) in
a child process, against the session's Prefect API.

Bad data fails the ``prepare_data`` trainer with exit code 2: the CLI exits 2 too (bad input),
prints the trainer's error (``file:line`` and the field) on stderr, the stage is not retried
although ``launch.retries`` is 2, and no half-written output carries a ``manifest.json`` (a
malformed JSON line here; a missing field, a corrupt gzip stream and an empty file fail the same
stage process with their own messages in ``tests/integration/test_bad_data.py``). A bad config is
refused before anything runs: exit 2, the field named, nothing under ``storage.root``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "gsm8k-hh.yaml"

GOOD = {"question": "Ann has 2 apples and buys 3. How many now?", "answer": "2+3=<<2+3=5>>5\n#### 5"}


def posttrain_run(api_url: str, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """``posttrain run <args>`` in a child process talking to the test Prefect API."""
    env = {**os.environ, "PREFECT_API_URL": api_url, "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(
        [sys.executable, "-m", "posttrain", "run", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def task_runs_of(run_id: str) -> list[tuple[str, int]]:
    """(task run name, run count) of the flow run whose ``run_id`` parameter is ``run_id``."""
    with get_client(sync_client=True) as client:
        flow_runs = [f for f in client.read_flow_runs(limit=200) if f.parameters.get("run_id") == run_id]
        assert len(flow_runs) == 1, [f.parameters.get("run_id") for f in flow_runs]
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_runs[0].id])))
    return [(t.name, t.run_count) for t in task_runs]


def run_with_sft_file(api_url: str, root: Path, run_id: str, sft_file: Path) -> subprocess.CompletedProcess:
    """The shipped gsm8k-hh config with the SFT data replaced by ``sft_file`` (read first)."""
    return posttrain_run(
        api_url,
        str(CONFIG),
        "--run-id",
        run_id,
        "--set",
        f"storage.root={root}",
        "--set",
        f"data.sft.uri={sft_file}",
        "--set",
        "launch.retries=2",
        "--set",
        "launch.retry_delay_s=0",
    )


def assert_failed_once_with(result: subprocess.CompletedProcess, root: Path, run_id: str, *needles: str) -> dict:
    """Exit 2 (bad input), each needle in the CLI's failure message, one attempt, nothing committed."""
    assert result.returncode == 2, result.stderr[-3000:]
    run_dir = root / "runs" / run_id
    assert result.stdout.strip().splitlines()[-1] == str(run_dir / "summary.json")
    # The CLI's own message (not only the streamed Prefect log) carries the trainer's error.
    failure = result.stderr.split("pipeline failed:", 1)
    assert len(failure) == 2, result.stderr[-3000:]
    for needle in needles:
        assert needle in failure[1], (needle, failure[1])

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["stages"]["prepare_data"]["status"] == "failed"
    for needle in needles:
        assert needle in summary["stages"]["prepare_data"]["error"]
    assert {s["status"] for name, s in summary["stages"].items() if name != "prepare_data"} == {"skipped"}
    mlflow = MlflowClient(summary["mlflow"]["tracking_uri"])
    assert mlflow.get_run(summary["mlflow"]["parent_run_id"]).info.status == "FAILED"

    assert task_runs_of(run_id) == [("prepare_data", 1)]
    assert not list((run_dir / "stages" / "prepare_data").rglob("manifest.json"))
    assert not (run_dir / "stages" / "sft").exists()
    return summary


def test_malformed_json_line_names_file_and_line(prefect_api, tmp_path):
    sft = write_lines(tmp_path / "sft.jsonl", [json.dumps(GOOD), json.dumps(GOOD), '{"question": "q", "answer": oops}'])
    result = run_with_sft_file(prefect_api, tmp_path / "out", "bad-json", sft)
    assert_failed_once_with(result, tmp_path / "out", "bad-json", f"{sft}:3", "invalid JSON")


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("stages=prepare_data,bogus", ("bogus", "stages")),
        ("sft.learning_rate=-1", ("sft.learning_rate",)),
    ],
)
def test_bad_config_exits_2_before_anything_runs(prefect_api, tmp_path, override, needles):
    root = tmp_path / "out"
    result = posttrain_run(prefect_api, str(CONFIG), "--set", f"storage.root={root}", "--set", override)
    assert result.returncode == 2, result.stderr[-3000:]
    for needle in needles:
        assert needle in result.stderr, result.stderr
    assert "run id:" not in result.stdout
    assert not root.exists()
    assert not list(tmp_path.rglob("mlflow.db"))
