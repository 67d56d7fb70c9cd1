"""MLflow as a model lifecycle, end to end through ``posttrain run``: the final policy becomes a
version of a registered model that ``mlflow.transformers.load_model`` loads, gated by
``evaluate.gates``; a run that fails a gate keeps the champion alias where it was and ends in the
``GateFailed`` state (exit code 4); evaluate logs its sample generations as an MLflow table, and
every training stage's run carries a PNG of its curves.
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
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

from tests.e2e.stack import TINY_DEMO
from trainer_core.errors import EXIT_GATE_FAILED

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MODEL = "posttrain-demo-policy"
STAGES = "prepare_data,sft,reward_model,dpo,evaluate"
TINY = {
    **TINY_DEMO,  # the demo at tiny sizes, its first five stages only
    "stages": STAGES,
    "sft.log_every": 1,
    "reward_model.log_every": 1,
    "dpo.log_every": 1,
    "evaluate.num_problems": 3,
    "tracking.registered_model_name": MODEL,
}


def posttrain_run(prefect_api: str, tmp_path: Path, run_id: str, gates: list[dict]) -> subprocess.CompletedProcess:
    args = [str(REPO / "configs" / "demo.yaml"), "--run-id", run_id, "--set", f"storage.root={tmp_path / 'out'}",
            "--set", f"evaluate.gates={json.dumps(gates)}"]
    for key, value in TINY.items():
        args += ["--set", f"{key}={value}"]
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, "-m", "posttrain", "run", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def flow_run_named(prefect_api: str, name: str):
    """The one flow run called ``name`` (the flow renames its run to the pipeline run id)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_api}), get_client(sync_client=True) as api:
        [flow_run] = api.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
        return flow_run


def test_registered_champion_gates_tables_and_curves(prefect_api, tmp_path):
    import mlflow.transformers

    passing = [{"metric": "dpo/exact_match", "op": ">=", "threshold": 0.0, "vs_champion": True, "tolerance": 1.0}]
    first = posttrain_run(prefect_api, tmp_path, "life-1", passing)
    assert first.returncode == 0, first.stderr[-5000:]
    summary = json.loads((tmp_path / "out" / "runs" / "life-1" / "summary.json").read_text())
    assert summary["status"] == "completed"
    release = summary["release"]
    assert release["passed"] and [g["against"] for g in release["gates"]] == ["threshold", "no champion yet"]
    registered = release["registered_model"]
    assert (registered["name"], registered["version"], registered["alias"], registered["stage"]) == (MODEL, "1", "champion", "dpo")

    tracking_uri = summary["mlflow"]["tracking_uri"]
    client = MlflowClient(tracking_uri)
    version = client.get_model_version_by_alias(MODEL, "champion")
    assert str(version.version) == "1" and version.tags["posttrain.run_id"] == "life-1"
    assert {"posttrain.config_hash", "posttrain.data_fingerprint", "posttrain.fingerprint"} <= set(version.tags)
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    try:
        policy = mlflow.transformers.load_model(f"models:/{MODEL}@champion")
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI")
    assert policy.tokenizer is not None and policy.model.config.num_hidden_layers == 1

    parent = client.get_run(summary["mlflow"]["parent_run_id"])
    assert {"dpo/exact_match", "sft/eval_loss", "reward_model/eval_accuracy"} <= set(parent.data.metrics)
    assert parent.data.tags["prefect.flow_run_url"].endswith(f"/flow-runs/flow-run/{flow_run_named(prefect_api, 'life-1').id}")
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags.get("mlflow.experimentKind")
    runs = {r.data.tags["posttrain.stage"]: r for r in client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")}
    for stage in ("sft", "reward_model", "dpo"):
        assert "plots/curves.png" in [a.path for a in client.list_artifacts(runs[stage].info.run_id, "plots")], stage
        assert not [m for m in runs[stage].data.metrics if m.startswith("final/")], stage
        assert "prefect.flow_run_url" in runs[stage].data.tags
    table = json.loads(Path(client.download_artifacts(runs["evaluate"].info.run_id, "eval/samples.json",
                                                      str(tmp_path))).read_text())
    assert {"prompt", "answer", "sft", "dpo", "dpo_correct", "dpo_reward"} <= set(table["columns"])
    assert len(table["data"]) == 3

    failing = [{"metric": "dpo/exact_match", "threshold": 2.0}]  # exact match is at most 1
    second = posttrain_run(prefect_api, tmp_path, "life-2", failing)
    assert second.returncode == EXIT_GATE_FAILED, second.stderr[-5000:]
    assert "gate: dpo/exact_match" in second.stderr and "< threshold 2" in second.stderr
    summary = json.loads((tmp_path / "out" / "runs" / "life-2" / "summary.json").read_text())
    assert summary["status"] == "gate_failed" and not summary["release"]["passed"]
    assert summary["release"]["registered_model"]["alias"] == "candidate"
    assert str(client.get_model_version_by_alias(MODEL, "champion").version) == "1"
    assert str(client.get_model_version_by_alias(MODEL, "candidate").version) == "2"
    state = flow_run_named(prefect_api, "life-2").state
    assert state.type.value == "FAILED" and state.name == "GateFailed"
    assert state.message.startswith("gate: dpo/exact_match")
