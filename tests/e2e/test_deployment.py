"""Deployments end to end: a real ``prefect server start`` (SQLite, its own PREFECT_HOME), a real
``mlflow server``, ``posttrain deploy`` against them, a process worker in its own process group,
and flow runs created through the API as the UI's Run button does
(``create_flow_run_from_deployment`` with parameters and job variables).

Two good runs of the tiny demo take the same one-slot GPU concurrency limit and must not hold it
at the same time; a run with a bad override fails before any stage starts, naming the field; a
run with a bad typed ``settings`` value is refused by the API, naming the field. (The UI's own
Custom run form is driven by a browser in ``test_ui_form.py``, on the same servers.)
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.exceptions import PrefectHTTPStatusError

from flows.settings import override_items
from tests.e2e.demo_overrides import tiny_demo
from tests.e2e.stack import PROJECT_DIR, client, posttrain, start_worker, stop
from trainer_core.config import PipelineConfig

pytestmark = pytest.mark.slow

DEPLOYMENT = "post-training-pipeline/demo"
GPU_LIMIT = "posttrain-gpu-local"
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def deployed(stack) -> str:
    return posttrain(stack, "deploy")


def test_deploy_registers_typed_deployments(stack, deployed):
    assert f"deployment {DEPLOYMENT}:" in deployed
    with client(stack) as api:
        demo = api.read_deployment_by_name(DEPLOYMENT)
        nightly = api.read_deployment_by_name("post-training-pipeline/qwen2.5-0.5b-1gpu")
        sweep = api.read_deployment_by_name("post-training-sweep/demo-sweep")
        assert api.read_work_pool("posttrain-local").type == "process"
        assert api.read_work_pool("posttrain-gpu").type == "kubernetes"
        assert api.read_global_concurrency_limit_by_name(GPU_LIMIT).limit == 1
    assert demo.work_pool_name == "posttrain-local" and demo.entrypoint == "flows.pipeline.post_training_pipeline"
    assert demo.job_variables == {
        "working_dir": str(PROJECT_DIR),
        "env": {"POSTTRAIN_MLFLOW_UI_URL": "http://127.0.0.1:5000"},
    }
    assert demo.enforce_parameter_schema and {"posttrain", "demo"} <= set(demo.tags)
    # The Custom run form: config_uri, the short typed settings opened on demo.yaml's values, an
    # overrides example, run_id; the whole-config parameter is for Python callers only.
    demo_yaml = yaml.safe_load((PROJECT_DIR / "configs" / "demo.yaml").read_text())
    assert set(demo.parameters) == {"config_uri", "settings", "overrides"}
    assert demo.parameters["config_uri"] == "configs/demo.yaml"
    settings = demo.parameters["settings"]
    assert settings["sft"]["max_steps"] == demo_yaml["sft"]["max_steps"] == 900
    assert settings["sft"]["learning_rate"] == demo_yaml["sft"]["learning_rate"]
    assert settings["stages"] == demo_yaml["stages"]
    schema = demo.parameter_openapi_schema
    assert list(schema["properties"]) == ["config_uri", "settings", "overrides", "run_id"]
    # overrides: key.path=value items, which the default (V2) form edits one by one
    assert schema["properties"]["overrides"]["type"] == "array"
    assert schema["properties"]["overrides"]["items"] == {"type": "string"}
    [example] = demo.parameters["overrides"]
    assert example.startswith("evaluate.generation.max_new_tokens=")
    settings_ref = schema["properties"]["settings"]["anyOf"][0]["$ref"].rsplit("/", 1)[-1]
    sft_ref = schema["definitions"][settings_ref]["properties"]["sft"]["$ref"].rsplit("/", 1)[-1]
    sft_form = schema["definitions"][sft_ref]
    assert sft_form["title"] == "SFT" and sft_form["properties"]["max_steps"]["title"] == "Max steps"
    learning_rate = sft_form["properties"]["learning_rate"]
    sft_fields = PipelineConfig.model_fields["sft"].annotation.model_fields
    assert learning_rate["description"] == sft_fields["learning_rate"].description
    assert learning_rate["exclusiveMinimum"] == 0
    assert not any("PipelineConfig" in name or name.endswith("Config") for name in schema["definitions"])
    # The sweep's form: the same config, settings and overrides, its grid, and a sweep id.
    assert sweep.parameters["grid"] == {"dpo.beta": [0.05, 0.1, 0.2]}
    assert list(sweep.parameter_openapi_schema["properties"]) == [
        "config_uri",
        "grid",
        "settings",
        "overrides",
        "sweep_id",
    ]
    [schedule] = nightly.schedules
    assert schedule.schedule.cron == "0 2 * * *" and schedule.active is False


def wait_final(api: SyncPrefectClient, ids: list, worker_log: Path) -> dict:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        runs = {r.id: r for r in api.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))}
        if all(runs[i].state.is_final() for i in ids):
            return runs
        time.sleep(1)
    raise AssertionError(f"flow runs not final after {RUN_TIMEOUT_S} s; worker log:\n{worker_log.read_text()[-5000:]}")


def slot_intervals(api: SyncPrefectClient, flow_run_id) -> list[tuple[float, float]]:
    """(holding, releasing) timestamps of the GPU slot, from the flow run's logs (which may reach
    the API a moment after the run's final state)."""
    deadline, of_run = time.monotonic() + 30, LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    while True:
        logs, page = [], None
        while page is None or len(page) == 200:
            page = api.read_logs(of_run, limit=200, offset=len(logs))
            logs += page
        marks = {
            kind: [log.timestamp.timestamp() for log in logs if f"{kind} 1 slot(s) of concurrency" in log.message]
            for kind in ("holding", "releasing")
        }
        if (marks["holding"] and len(marks["holding"]) == len(marks["releasing"])) or time.monotonic() > deadline:
            return list(zip(marks["holding"], marks["releasing"], strict=True))
        time.sleep(1)


def test_runs_from_the_api(stack, deployed):
    tmp, worker_log = stack["tmp"], stack["tmp"] / "worker.log"
    worker = start_worker(stack, worker_log)
    gpu_env = {"env": {"POSTTRAIN_GPU_CONCURRENCY_LIMIT": GPU_LIMIT}}
    try:
        with client(stack) as api:
            demo = api.read_deployment_by_name(DEPLOYMENT)
            bad_settings = json.loads(json.dumps(demo.parameters["settings"]))
            bad_settings["sft"]["learning_rate"] = -1
            with pytest.raises(PrefectHTTPStatusError, match=r"settings\.sft\.learning_rate") as refused:
                api.create_flow_run_from_deployment(demo.id, parameters={"settings": bad_settings})
            assert refused.value.response.status_code == 409
            good = [
                api.create_flow_run_from_deployment(
                    demo.id,
                    parameters={"overrides": override_items(tiny_demo(tmp / name, stack["mlflow"]))},
                    job_variables=gpu_env,
                )
                for name in ("a", "b")
            ]
            bad = api.create_flow_run_from_deployment(
                demo.id, parameters={"overrides": [f"storage.root={tmp / 'bad'}", "sft.learning_rate=-1"]}
            )
            runs = wait_final(api, [r.id for r in (*good, bad)], worker_log)

            failed = runs[bad.id]
            assert failed.state.is_failed() and "sft.learning_rate" in failed.state.message, failed.state.message
            assert api.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[bad.id]))) == []
            assert not (tmp / "bad" / "runs").exists()

            for run, name in zip(good, ("a", "b"), strict=True):
                final = runs[run.id]
                assert final.state.is_completed(), f"{final.state.message}\n{worker_log.read_text()[-5000:]}"
                [summary_path] = (tmp / name / "runs").glob("*/summary.json")
                summary = json.loads(summary_path.read_text())
                # one id everywhere: the flow run is named by the pipeline run id storage and MLflow use
                assert re.fullmatch(r"demo-\d{8}-\d{6}-[0-9a-f]{6}", final.name) and final.name == summary["run_id"]
                assert summary["status"] == "completed" and list(summary["stages"]) == ["prepare_data", "sft"]
                tasks = api.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
                assert sorted(t.name for t in tasks) == ["prepare_data", "sft"]
                [artifact] = api.read_artifacts(
                    artifact_filter=ArtifactFilter(
                        key=ArtifactFilterKey(any_=["sft-metrics"]), flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])
                    )
                )
                mlflow_run_id = summary["stages"]["sft"]["mlflow_run_id"]
                assert re.search(
                    rf"\]\({re.escape(stack['mlflow'])}/#/experiments/\d+/runs/{mlflow_run_id}\)", artifact.data
                ), artifact.data

            (a_start, a_end), (b_start, b_end) = (slot_intervals(api, r.id)[0] for r in good)
            assert a_end <= b_start or b_end <= a_start, "two pipelines held the one GPU slot at once"
            assert api.read_global_concurrency_limit_by_name(GPU_LIMIT).active_slots == 0
    finally:
        stop(worker)


def test_enable_schedule(stack, deployed):
    out = posttrain(stack, "deploy", "--name", "qwen2.5-0.5b-1gpu", "--enable-schedule")
    assert "schedules active" in out
    with client(stack) as api:
        [schedule] = api.read_deployment_by_name("post-training-pipeline/qwen2.5-0.5b-1gpu").schedules
    assert schedule.active is True and schedule.schedule.cron == "0 2 * * *" and schedule.schedule.timezone == "UTC"
