"""``posttrain sweep`` end to end (tiny config, CPU, the session's Prefect API, MLflow on SQLite).

One module fixture runs, under one storage root: sweep ``sw-a``, a 2 x 2 grid over ``dpo.beta``
and ``grpo.learning_rate``, uninterrupted; sweep ``sw-b``, one point of that grid (the first beta
and learning rate), killed (SIGTERM to the CLI's group) once its DPO committed, then run again
with the same id; and ``sw-a`` again with a third beta.
The tests read what they left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterName,
)
from prefect.settings import PREFECT_API_URL, temporary_settings

from tests.tiny import REPO, as_sets, tiny_demo

MODEL = "sweep-policy"
SETS = tiny_demo(
    **{
        "stages": "prepare_data,sft,dpo,grpo,evaluate",
        "evaluate.lm_eval": "null",
        "evaluate.pass_at_k": "null",
        "tracking.registered_model_name": MODEL,
    }
)
GRID = ["--grid", "dpo.beta=0.1,0.5", "--grid", "grpo.learning_rate=1e-5,3e-5"]
COMMITTED = re.compile(r"Task run '(\w+)' - stage \w+ committed: global_step")
"""A stage whose trainer ran and committed (an adopted or reused stage logs no such line)."""


@dataclass(frozen=True)
class Sweep:
    """One finished ``posttrain sweep``: its console log, its summary and each point's pipeline
    summary by its grid values (as JSON), as they were when it ended."""

    log: str
    summary: dict
    points: dict[str, dict]


@dataclass(frozen=True)
class Sweeps:
    root: Path
    first: Sweep  # sw-a, 2 x 2
    killed: str  # sw-b's output up to the kill
    killed_rc: int
    resumed: Sweep  # sw-b again
    grown: Sweep  # sw-a with a third beta


HALF = ["--grid", "dpo.beta=0.1", "--set", "grpo.learning_rate=1e-5"]
"""sw-b's one point: the config of sw-a's point with the first beta and learning rate."""


def _command(root: Path, sweep_id: str, *grid: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "posttrain",
        "sweep",
        str(REPO / "configs" / "demo.yaml"),
        "--sweep-id",
        sweep_id,
        "--set",
        f"storage.root={root}",
        *as_sets(SETS),
        *(grid or GRID),
    ]


def _sweep(root: Path, env: dict, sweep_id: str, *grid: str) -> Sweep:
    result = subprocess.run(
        _command(root, sweep_id, *grid),
        cwd=root.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    summary = json.loads(Path(result.stdout.strip().splitlines()[-1]).read_text())
    points = {
        json.dumps(p["values"], sort_keys=True): json.loads((root / "runs" / p["run_id"] / "summary.json").read_text())
        for p in summary["points"]
    }
    return Sweep(result.stderr, summary, points)


def _kill_after_first_dpo(root: Path, env: dict) -> tuple[str, int]:
    """sw-b until its DPO committed, then SIGTERM to its process group; (output, exit code)."""
    log = root.parent / "sw-b.log"
    with log.open("w") as out:
        cli = subprocess.Popen(
            _command(root, "sw-b", *HALF),
            cwd=root.parent,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 300
            while "Task run 'dpo' - stage dpo committed" not in log.read_text() and time.monotonic() < deadline:
                assert cli.poll() is None, log.read_text()[-3000:]
                time.sleep(0.2)
            os.killpg(cli.pid, signal.SIGTERM)
            cli.wait(timeout=90)
        finally:
            if cli.poll() is None:
                os.killpg(cli.pid, signal.SIGKILL)
    return log.read_text(), cli.returncode


@pytest.fixture(scope="module")
def sweeps(prefect_api, tmp_path_factory) -> Sweeps:
    root = tmp_path_factory.mktemp("sweep") / "out"
    root.mkdir()
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    first = _sweep(root, env, "sw-a")
    killed, killed_rc = _kill_after_first_dpo(root, env)
    resumed = _sweep(root, env, "sw-b", *HALF)
    grown = _sweep(root, env, "sw-a", "--grid", "dpo.beta=0.1,0.5,1.0", "--grid", "grpo.learning_rate=1e-5,3e-5")
    return Sweeps(root, first, killed, killed_rc, resumed, grown)


def test_shared_stages_run_once_and_each_point_is_a_whole_run(sweeps):
    summary = sweeps.first.summary
    assert summary["status"] == "completed" and len(summary["points"]) == 4
    assert Counter(COMMITTED.findall(sweeps.first.log)) == {
        "prepare_data": 1,
        "sft": 1,
        "dpo": 2,
        "grpo": 2,
        "evaluate": 4,
    }
    points = sweeps.first.points
    for point in points.values():
        assert point["status"] == "completed" and "release" not in point  # the sweep releases, not its points
        for stage, entry in point["stages"].items():
            assert (Path(entry["output_uri"]) / "manifest.json").is_file()
            assert f"/runs/{point['run_id']}/stages/{stage}/final" in entry["output_uri"]
    sft = {p["stages"]["sft"]["fingerprint"] for p in points.values()}
    grpo = {p["stages"]["grpo"]["fingerprint"] for p in points.values()}
    assert len(sft) == 1 and len(grpo) == 2


def test_the_comparison_is_in_both_uis_and_the_best_point_is_registered(sweeps, prefect_api):
    summary = sweeps.first.summary
    comparison = summary["comparison"]
    assert comparison["metric"] == "grpo/exact_match" and comparison["best"] in {p["run_id"] for p in summary["points"]}
    assert len(comparison["rows"]) == 4 and comparison["runner_up"] is not None and comparison["gain_se"] is not None
    best = summary["release"][comparison["best"]]["registered_model"]
    assert best["alias"] == "champion" and set(summary["release"]) == {comparison["best"]}
    client = MlflowClient(f"sqlite:///{sweeps.root / 'mlflow.db'}")
    version = client.get_model_version(MODEL, best["version"])
    assert version.tags["posttrain.run_id"] == comparison["best"]
    sweep_run = client.get_run(summary["mlflow_run_id"])
    assert sweep_run.data.tags["posttrain.sweep.best"] == comparison["best"]
    assert {a.path for a in client.list_artifacts(sweep_run.info.run_id, "sweep")} == {
        "sweep/comparison.json",
        "sweep/comparison.png",
    }
    children = client.search_runs(
        [sweep_run.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{sweep_run.info.run_id}'"
    )
    assert {r.data.tags["posttrain.run_id"] for r in children} >= {p["run_id"] for p in summary["points"]}
    with temporary_settings(updates={PREFECT_API_URL: prefect_api}), get_client(sync_client=True) as api:
        [flow_run] = api.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["sw-a"])), limit=1)
        artifacts = api.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["sweep-comparison"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]),
            )
        )
    shown = artifacts[0].data
    assert "best `grpo/exact_match`" in shown and "data:image/png;base64," in shown
    assert all(f"`{p['run_id']}`" in shown for p in summary["points"])


def test_a_killed_sweep_resumed_reaches_the_uninterrupted_result(sweeps):
    assert sweeps.killed_rc == 128 + signal.SIGTERM, sweeps.killed[-3000:]
    assert (
        "error: sweep interrupted by SIGTERM; resume it with: posttrain sweep CONFIG --sweep-id sw-b" in sweeps.killed
    )
    assert sweeps.resumed.summary["status"] == "completed"
    # prepare_data, SFT and DPO committed before the kill: reused, only what follows DPO runs
    assert Counter(COMMITTED.findall(sweeps.resumed.log)) == {"grpo": 1, "evaluate": 1}
    first, again = sweeps.first.points, sweeps.resumed.points
    assert len(again) == 1
    for values, point in again.items():  # the same config as sw-a's point with that beta and 1e-5
        twin = first[json.dumps({**json.loads(values), "grpo.learning_rate": 1e-05}, sort_keys=True)]
        assert point["headline"] == twin["headline"], values
        assert {s: e["fingerprint"] for s, e in point["stages"].items()} == {
            s: e["fingerprint"] for s, e in twin["stages"].items()
        }


def test_a_third_beta_runs_only_its_dpo_and_what_reads_it(sweeps):
    grown = sweeps.grown.summary
    assert grown["status"] == "completed" and len(grown["points"]) == 6
    assert Counter(COMMITTED.findall(sweeps.grown.log)) == {"dpo": 1, "evaluate": 2}
    old = {p["run_id"] for p in sweeps.first.summary["points"]}
    assert old < {p["run_id"] for p in grown["points"]}  # the old points keep their ids (and outputs)
