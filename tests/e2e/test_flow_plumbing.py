"""The pipeline flow's plumbing under a real Prefect API, a real MLflow sqlite store and real
trainer processes, with the cheap ``prepare_data`` stage only."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
from typer.testing import CliRunner

from flows.pipeline import post_training_pipeline
from posttrain.cli import app
from tasks.launch.process import BadStageInput
from tests.tiny import TINY_MODEL
from trainer_core.config import load_config
from trainer_core.errors import ConfigError
from trainer_core.registry import stage_inputs

SECRET = "hunter2-not-for-storage"


def small_config(root, **extra):
    """The built-in default config with the tiny model (``tests.tiny.TINY_MODEL``), a smaller
    synthetic task, prepare_data only, retries without delay, and a secret that must never be stored."""
    overrides = {
        **TINY_MODEL,
        "name": "plumb",
        "stages": ["prepare_data"],
        "storage.root": str(root),
        "storage.secret_access_key": SECRET,
        "data.synthetic.num_problems": 60,
        "data.synthetic.num_pairs": 40,
        "launch.retries": 2,
        "launch.retry_delay_s": 0,
        "launch.timeout_s": 300,
        **extra,
    }
    return load_config(overrides=overrides)


def flow_run_view(flow_run_id):
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return task_runs, {a.key: a for a in artifacts}


def test_prepare_data_only_run(prefect_api, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    state = post_training_pipeline(config=small_config(tmp_path / "out"), run_id="plumb-ok", return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    run_dir = tmp_path / "out" / "runs" / "plumb-ok"
    assert summary["summary_uri"] == str(run_dir / "summary.json")
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk == {k: v for k, v in summary.items() if k != "summary_uri"}
    stage = summary["stages"]["prepare_data"]
    assert summary["status"] == "completed" and stage["status"] == "completed"
    assert stage["output_uri"] == str(run_dir / "stages" / "prepare_data" / "final")
    assert os.path.exists(os.path.join(stage["output_uri"], "manifest.json"))
    assert stage["metrics"]["vocab_size"] > 0 and stage["wall_s"] > 0
    spec_text = (run_dir / "specs" / "prepare_data.json").read_text()
    assert SECRET not in spec_text and SECRET not in (run_dir / "summary.json").read_text()
    assert json.loads(spec_text)["mlflow_run_id"] == stage["mlflow_run_id"]

    mlflow = MlflowClient(summary["mlflow"]["tracking_uri"])
    assert summary["mlflow"]["tracking_uri"] == f"sqlite:///{tmp_path}/out/mlflow.db"
    parent = mlflow.get_run(summary["mlflow"]["parent_run_id"])
    child = mlflow.get_run(stage["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and child.info.status == "FINISHED"
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.data.params["data.synthetic.num_problems"] == "60"
    assert not [k for k in child.data.metrics if k.startswith("final/")]  # final numbers: summary, parent run
    assert child.data.metrics["vocab_size"] == stage["metrics"]["vocab_size"]  # no step history: its own numbers
    assert parent.data.metrics == summary["headline"]
    assert [a.path for a in mlflow.list_artifacts(child.info.run_id, "manifests")] == ["manifests/final.json"]

    task_runs, artifacts = flow_run_view(state.state_details.flow_run_id)
    assert [(t.name, t.run_count) for t in task_runs] == [("prepare_data", 1)]
    assert {"prepare-data-metrics", "pipeline-summary"} <= set(artifacts)


def test_bad_input_fails_once_and_writes_the_summary(prefect_api, tmp_path, monkeypatch):
    """A malformed data file is bad input (trainer exit 2): the task is not retried although
    launch.retries=2, the summary records the failure, MLflow runs are FAILED."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    missing = tmp_path / "malformed.jsonl"
    missing.write_text('{"prompt": "a", "completion": oops}\n')
    config = small_config(tmp_path / "out", stages=["prepare_data", "sft"], **{"data.sft.uri": str(missing)})
    state = post_training_pipeline(config=config, run_id="plumb-bad", return_state=True)
    assert state.is_failed()
    with pytest.raises(BadStageInput, match="malformed.jsonl:1"):
        state.result()
    summary = json.loads((tmp_path / "out" / "runs" / "plumb-bad" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["stages"]["prepare_data"]["status"] == "failed"
    assert "invalid JSON" in summary["stages"]["prepare_data"]["error"]
    assert summary["stages"]["sft"]["status"] == "skipped"
    mlflow = MlflowClient(summary["mlflow"]["tracking_uri"])
    assert mlflow.get_run(summary["mlflow"]["parent_run_id"]).info.status == "FAILED"
    task_runs, _ = flow_run_view(state.state_details.flow_run_id)
    assert [(t.name, t.run_count) for t in task_runs] == [("prepare_data", 1)]


def test_missing_prepared_data_is_a_config_error_before_any_stage(prefect_api, tmp_path):
    config = small_config(tmp_path / "out", stages=["sft"])
    with pytest.raises(ConfigError, match="prepare_data"):
        post_training_pipeline(config=config, run_id="plumb-nodata")
    assert not (tmp_path / "out" / "runs").exists()
    assert not (tmp_path / "out" / "mlflow.db").exists()


def test_cli_run_prints_summary_uri_last(prefect_api, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config_file = tmp_path / "c.yaml"
    config_file.write_text("name: cli\nstages: [prepare_data]\ndata: {synthetic: {num_problems: 40, num_pairs: 20}}\n")
    args = [
        "run",
        str(config_file),
        "--set",
        f"storage.root={tmp_path / 'out'}",
        "--run-id",
        "cli-1",
        "--set",
        "tokenizer.vocab_size=256",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "run id: cli-1"
    assert lines[-1] == str(tmp_path / "out" / "runs" / "cli-1" / "summary.json")
    assert json.loads(open(lines[-1]).read())["status"] == "completed"

    (tmp_path / "bad.jsonl").write_text("{not json\n")
    failed = CliRunner().invoke(app, [*args[:-2], "--run-id", "cli-2", "--set", f"data.sft.uri={tmp_path}/bad.jsonl"])
    assert failed.exit_code == 2  # bad input found by a stage: the run's summary is the last line
    assert failed.stdout.strip().splitlines()[-1] == str(tmp_path / "out" / "runs" / "cli-2" / "summary.json")
    refused = CliRunner().invoke(app, [*args[:-2], "--run-id", "cli-3", "--set", f"data.sft.uri={tmp_path}/nope.jsonl"])
    assert refused.exit_code == 2  # found before anything ran: nothing written, no summary line
    assert "summary.json" not in refused.stdout and not (tmp_path / "out" / "runs" / "cli-3").exists()


def test_stage_inputs_rules():
    cfg = load_config(overrides={"dpo.reference_from": "s3://b/ref"})
    out = {"prepare_data": "D", "sft": "S", "reward_model": "R"}
    assert stage_inputs(cfg, "prepare_data", out) == {}
    assert stage_inputs(cfg, "sft", out) == {"data": "D", "model": "init"}
    assert stage_inputs(cfg, "reward_model", out) == {"data": "D", "model": "S"}
    assert stage_inputs(cfg, "score", out) == {"data": "D", "model": "S", "reward_model": "R"}
    assert stage_inputs(cfg, "dpo", out) == {"data": "D", "model": "S", "reference": "s3://b/ref"}
    assert stage_inputs(cfg, "evaluate", {**out, "dpo": "P"}) == {
        "data": "D",
        "sft_model": "S",
        "reward_model": "R",
        "dpo_model": "P",
        "base_model": "init",
    }
    named = load_config(overrides={"model": {"name_or_path": "Qwen/Qwen2.5-0.5B"}, "reward_model.init_from": "X"})
    assert stage_inputs(named, "reward_model", {"prepare_data": "D"}) == {"data": "D", "model": "X"}
    assert stage_inputs(named, "score", {"prepare_data": "D"}) == {"data": "D", "model": "Qwen/Qwen2.5-0.5B"}
    assert stage_inputs(named, "dpo", {"prepare_data": "D"})["reference"] == "Qwen/Qwen2.5-0.5B"


def test_a_repeated_stage_attempt_logs_into_the_same_mlflow_run(prefect_api, tmp_path, monkeypatch):
    """What a Prefect retry does: run_stage again for the same run id and parent reuses the
    stage's MLflow run (found through the earlier spec); a new parent gets a new stage run.
    Resuming a run id reopens its parent instead of creating another. Each attempt finds no
    committed output (the one before is removed, as if that attempt died before its commit), so
    it launches the trainer rather than reusing the output."""
    from prefect import flow

    from tasks.report.tracking import start_pipeline_run
    from tasks.results import PipelineRun
    from tasks.stages import run_stage

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = small_config(tmp_path / "out")
    uri = f"sqlite:///{tmp_path}/out/mlflow.db"

    @flow
    def attempts(parents: list[str]) -> list[str]:
        out = []
        for parent in parents:
            run = PipelineRun(run_id="plumb-again", config=config, tracking_uri=uri, parent_mlflow_run_id=parent)
            shutil.rmtree(run.layout.final("prepare_data"), ignore_errors=True)
            result = run_stage(stage="prepare_data", run=run, inputs={})
            assert result.status == "completed" and not result.reused
            out.append(result.mlflow_run_id)
        return out

    first_parent = start_pipeline_run(config, "plumb-again", tracking_uri=uri)
    assert start_pipeline_run(config, "plumb-again", tracking_uri=uri) == first_parent
    second_parent = start_pipeline_run(config, "plumb-other", tracking_uri=uri)
    assert second_parent != first_parent
    a, b, c = attempts([first_parent, first_parent, second_parent])
    assert a == b and c != a
    mlflow = MlflowClient(uri)
    assert mlflow.get_run(a).info.status == "FINISHED"
    assert mlflow.get_run(c).data.tags["mlflow.parentRunId"] == second_parent


def test_resolve_config_keeps_secrets_applies_overrides_and_validates(tmp_path):
    from flows.settings import resolve_config

    cfg = resolve_config(small_config("rel/out"), None, {"sft.max_steps": 5})
    assert cfg.sft.max_steps == 5 and cfg.storage.secret_access_key.get_secret_value() == SECRET
    assert cfg.storage.root == os.path.abspath("rel/out")
    with pytest.raises(ConfigError, match="sft.max_steps"):
        resolve_config(small_config(tmp_path), None, {"sft.max_steps": 0})
    path = tmp_path / "c.yaml"
    path.write_text("name: fromfile\n")
    assert resolve_config(None, str(path), {"seed": 3}).model_dump(include={"name", "seed"}) == {
        "name": "fromfile",
        "seed": 3,
    }
