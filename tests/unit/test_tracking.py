"""MLflow tracking (tasks/report/tracking.py, trainer_core/tracking.py) against a real sqlite store."""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
from mlflow import MlflowClient

from tasks.report import tracking
from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import PipelineConfig, load_config
from trainer_core.tracking import MetricLogger, sanitize_metric_name


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module (creating its schema takes seconds)."""
    root = tmp_path_factory.mktemp("mlflow-root")
    return str(root), f"sqlite:///{root}/mlflow.db"


@pytest.fixture
def config(store, monkeypatch):
    root, uri = store
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return load_config(
        overrides={
            "storage.root": root,
            "tracking.tracking_uri": uri,
            "sft.learning_rate": 3e-4,
            "storage.secret_access_key": "do-not-log-me",
        }
    )


def test_sanitize_metric_name():
    assert sanitize_metric_name("eval/loss") == "eval/loss"
    assert sanitize_metric_name("reward margin-mean.x") == "reward margin-mean.x"
    assert sanitize_metric_name("acc@1(%)") == "acc_1___"
    assert sanitize_metric_name("") == "_"


def test_resolve_tracking_uri_order(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(overrides={"storage.root": str(tmp_path / "out")})
    assert tracking.resolve_tracking_uri(cfg) == f"sqlite:///{tmp_path}/out/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///from-env.db")
    assert tracking.resolve_tracking_uri(cfg) == "sqlite:///from-env.db"
    cfg.tracking.tracking_uri = "http://mlflow:5000"
    assert tracking.resolve_tracking_uri(cfg) == "http://mlflow:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    remote = load_config(overrides={"storage.root": "s3://bucket/prefix"})
    assert tracking.resolve_tracking_uri(remote) == f"sqlite:///{tmp_path}/mlruns.db"


def test_flatten_params_drops_secrets_and_truncates():
    cfg = PipelineConfig()
    cfg.storage.secret_access_key = "s3cr3t"
    params = tracking.flatten_params(cfg.storage, "storage")
    assert "storage.secret_access_key" not in params and "storage.root" in params
    assert tracking.flatten_params({"a": {"b": [1, 2]}, "c": "x" * 7000}, "p") == {
        "p.a.b": "[1, 2]",
        "p.c": "x" * tracking.MAX_PARAM_VALUE_CHARS,
    }


def test_parent_and_nested_stage_runs(config, store):
    _, uri = store
    client = MlflowClient(uri)
    parent_id = tracking.start_pipeline_run(config, "demo-run-1", tracking_uri=uri)
    parent = client.get_run(parent_id)
    assert parent.info.run_name == "demo-run-1"
    assert parent.data.tags["posttrain.run_id"] == "demo-run-1"
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.name == "posttrain"
    assert experiment.artifact_location.endswith(os.path.join(store[0], "mlflow-artifacts"))
    assert "do-not-log-me" not in json.dumps(parent.data.params)

    sft_id = tracking.start_stage_run(config, parent_id, "sft", tracking_uri=uri)
    sft = client.get_run(sft_id)
    assert sft.data.tags["mlflow.parentRunId"] == parent_id
    assert sft.data.tags["posttrain.run_id"] == "demo-run-1"
    assert sft.info.experiment_id == parent.info.experiment_id
    assert sft.data.params["sft.learning_rate"] == "0.0003"
    assert sft.data.params["sft.adam_betas"] == "[0.9, 0.95]"
    assert sft.data.params["sft.init_from"] == "None"
    data_run = client.get_run(tracking.start_stage_run(config, parent_id, "prepare_data", tracking_uri=uri))
    assert data_run.data.params["data.synthetic.num_problems"] == "3000"
    assert not any("secret" in k for k in {**sft.data.params, **data_run.data.params})


def test_finish_stage_run_logs_manifest_and_status(config, store, tmp_path):
    _, uri = store
    client = MlflowClient(uri)
    parent_id = tracking.start_pipeline_run(config, "demo-run-2", tracking_uri=uri)
    run_id = tracking.start_stage_run(config, parent_id, "sft", tracking_uri=uri)
    manifest = Manifest(
        kind="final",
        stage="sft",
        run_id="demo-run-2",
        global_step=7,
        files=[],
        metrics={"eval/loss": 1.25, "acc@1": 0.5},
    )
    model_dir = tmp_path / "final"
    tracking.finish_stage_run(run_id, manifest, str(model_dir), "completed", tracking_uri=uri)
    tracking.finish_pipeline_run(parent_id, "failed", tracking_uri=uri)

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["posttrain.output_uri"] == str(model_dir)
    assert run.data.metrics == {}  # the manifest's metrics are the trainer's step history, not copied
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert artifacts == {"manifests"}
    logged = json.loads(open(client.download_artifacts(run_id, "manifests/final.json")).read())
    assert logged["global_step"] == 7
    assert client.get_run(parent_id).info.status == "FAILED"
    with pytest.raises(ValueError, match="unknown MLflow run status"):
        tracking.finish_pipeline_run(parent_id, "exploded", tracking_uri=uri)


def test_metric_logger_logs_batches_with_steps(config, store, caplog):
    _, uri = store
    client = MlflowClient(uri)
    run_id = tracking.start_stage_run(
        config, tracking.start_pipeline_run(config, "demo-run-3", tracking_uri=uri), "dpo", tracking_uri=uri
    )
    metric_logger = MetricLogger(uri, run_id)
    assert metric_logger.enabled
    metric_logger.log({"train/loss": 0.7, "train/lr": 1e-3}, step=1)
    with caplog.at_level(logging.WARNING, logger="trainer_core.tracking"):
        logged = metric_logger.log({"train/loss": 0.5, "reward@chosen": 2, "bad": math.nan, "worse": math.inf}, step=2)
        metric_logger.log({"bad": math.nan}, step=3)
    assert logged == {"train/loss": 0.5, "reward_chosen": 2.0}
    assert len([r for r in caplog.records if "non-finite" in r.message]) == 1
    metric_logger.log_dict_artifact({"samples": ["a", "b"]}, "eval/samples.json")
    metric_logger.close()

    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(1, 0.7), (2, 0.5)]
    assert client.get_run(run_id).data.metrics["reward_chosen"] == 2.0
    assert "bad" not in client.get_run(run_id).data.metrics
    assert [a.path for a in client.list_artifacts(run_id, "eval")] == ["eval/samples.json"]


def test_metric_logger_without_tracking_is_a_noop():
    metric_logger = MetricLogger(None, None)
    assert not metric_logger.enabled
    assert metric_logger.log({"loss": 1.0, "x y!": 2}, step=0) == {"loss": 1.0, "x y_": 2.0}
    metric_logger.log_dict_artifact({"a": 1}, "a.json")
    metric_logger.close()
    with pytest.raises(ValueError):
        MetricLogger("sqlite:///x.db", None)


def test_metric_logger_survives_an_unreachable_store(caplog):
    metric_logger = MetricLogger("sqlite:////nonexistent-dir/sub/mlflow.db", "0" * 32)
    with caplog.at_level(logging.WARNING, logger="trainer_core.tracking"):
        metric_logger.log({"loss": 1.0}, step=1)
        metric_logger.log_dict_artifact({"a": 1}, "a.json")
    assert any("MLflow" in r.message for r in caplog.records)


def _open_store_at(tracking_uri: str, start_at: float, results) -> None:
    """In a spawned process: wait for ``start_at`` (epoch s), then open the store and use it."""
    import time

    from tasks.report.tracking import open_store

    while time.time() < start_at:
        time.sleep(0.001)
    try:
        client = open_store(tracking_uri)
        client.search_experiments()
        results.put("ok")
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put(f"{type(e).__name__}: {e}")


def test_two_processes_opening_a_new_sqlite_store_together_both_succeed(tmp_path):
    """Issue 35, item 11: two pipeline runs starting together on a fresh storage root. Without the
    lock one of them failed creating ``mlflow.db`` (``duplicate column name: step`` and others)."""
    import multiprocessing
    import time

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    uri = f"sqlite:///{tmp_path}/fresh/mlflow.db"
    start_at = time.time() + 8  # after both have imported MLflow
    procs = [ctx.Process(target=_open_store_at, args=(uri, start_at, results)) for _ in range(2)]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    assert outcomes == ["ok", "ok"]


def test_open_store_names_the_uri_it_cannot_open(tmp_path):
    (tmp_path / "not-a-db").write_text("this is not SQLite")
    uri = f"sqlite:///{tmp_path}/not-a-db"
    with pytest.raises(RuntimeError, match=rf"MLflow store {uri} \(tracking.tracking_uri\) could not be opened"):
        tracking.open_store(uri)
