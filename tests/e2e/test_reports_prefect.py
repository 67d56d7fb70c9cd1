"""The stage and pipeline reports under a real Prefect API and a real MLflow sqlite store: the
progress artifact a stage's output lines drive, the stage's markdown artifact with its curves
embedded, and the summary table."""

from __future__ import annotations

import json
import logging

from mlflow import MlflowClient
from mlflow.entities import Metric
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterId

from tasks.report.summary import TABLE_COLUMNS, write_summary
from tasks.report.views import CURVES_ARTIFACT, StageProgress
from tasks.results import PipelineRun
from tasks.stages import _report
from trainer_core.checkpoint.manifest import ArtifactWriter
from trainer_core.config import load_config


def artifacts_of(state) -> dict:
    """The flow run's artifacts by key, each key's latest version."""
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    latest: dict = {}
    for artifact in sorted(found, key=lambda a: a.created):
        latest[artifact.key] = artifact
    return latest


def test_progress_artifact_follows_the_steps_to_completion(prefect_api):
    seen: list[float] = []

    @flow
    def stage_like():
        progress = StageProgress("reward_model", 300, min_interval_s=0.0)
        progress.start()
        for step in (0, 1, 2, 150):
            progress.on_line(f"[reward_model] step {step}: train/loss=0.6 train/accuracy=0.7")
        seen.append(_progress(progress.artifact_id))
        progress.complete()

    state = stage_like(return_state=True)
    assert state.is_completed(), state.message
    assert seen == [50.0]
    artifact = artifacts_of(state)["reward-model-progress"]
    assert artifact.type == "progress" and artifact.data == 100.0
    assert artifact.description == "reward_model: global_step 150/300 (completed)"


def _progress(artifact_id) -> float:
    """The progress artifact's current value."""
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))
    return found[0].data


def test_stage_report_embeds_curves_and_links_the_run(prefect_api, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    config = load_config(
        overrides={
            "storage.root": str(tmp_path / "out"),
            "tracking.ui_url": "http://mlflow.local:5000",
            "tracking.log_models": False,
        }
    )  # the final directory here is no model
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("reports", artifact_location=str(tmp_path / "mlflow-artifacts"))
    parent = client.create_run(experiment_id).info.run_id
    stage_run = client.create_run(experiment_id).info.run_id
    history = [Metric("train/loss", 2.0 / s, 1000 + s, s) for s in range(1, 21)]
    history += [Metric("eval/loss", 2.2 / (1 + s), 2000 + s, s) for s in (0, 10, 20)]
    client.log_batch(stage_run, metrics=history)
    output = str(tmp_path / "out" / "runs" / "r1" / "stages" / "sft" / "final")
    writer = ArtifactWriter(output)
    writer.write_bytes("config.json", b"{}")
    writer.commit(
        kind="final", stage="sft", run_id="r1", global_step=20, metrics={"train/loss": 0.1, "eval/loss": 0.105}
    )
    run = PipelineRun(run_id="r1", config=config, tracking_uri=uri, parent_mlflow_run_id=parent)

    @flow
    def report():
        _report("sft", run, output, stage_run, logging.getLogger("test-report"), log_missing=lambda: None)

    state = report(return_state=True)
    assert state.is_completed(), state.message
    markdown = artifacts_of(state)["sft-metrics"].data
    assert "![sft curves](data:image/png;base64,iVBORw0KGgo" in markdown
    assert f"[`{stage_run}`](http://mlflow.local:5000/#/experiments/{experiment_id}/runs/{stage_run})" in markdown
    assert CURVES_ARTIFACT in [a.path for a in client.list_artifacts(stage_run, "plots")]
    assert client.get_run(stage_run).info.status == "FINISHED"


def test_summary_artifact_is_a_markdown_table_of_the_metric_columns(prefect_api, tmp_path):
    config = load_config(overrides={"storage.root": str(tmp_path / "out"), "stages": ["prepare_data", "sft"]})
    run = PipelineRun(
        run_id="r2", config=config, tracking_uri=f"sqlite:///{tmp_path}/unused.db", parent_mlflow_run_id="p"
    )
    summary = {
        "run_id": "r2",
        "status": "completed",
        "stages": {
            "prepare_data": {
                "status": "completed",
                "wall_s": 3.0,
                "metrics": {"vocab_size": 256.0},
                "mlflow_run_id": "a" * 32,
                "output_uri": "/out/prepare_data/final",
            },
            "sft": {
                "status": "completed",
                "wall_s": 30.0,
                "metrics": {"train/loss": 1.0, "eval/loss": 1.25},
                "mlflow_run_id": "b" * 32,
                "output_uri": "/out/sft/final",
            },
        },
    }

    @flow
    def summarise():
        write_summary(run, summary)

    state = summarise(return_state=True)
    assert state.is_completed(), state.message
    markdown = artifacts_of(state)["pipeline-summary"].data.splitlines()
    assert markdown[0] == "**Run `r2`: completed**"
    header = "| " + " | ".join(c.replace("_", " ") for c in TABLE_COLUMNS) + " |"
    assert (
        markdown[2] == header == "| stage | status | wall s | train loss | eval loss | accuracy | reward | kl | "
        "exact match | win rate vs sft | mlflow run | output uri |"
    )
    # a sqlite store without tracking.ui_url: a bare run id, no link
    assert markdown[5] == f"| sft | completed | 30.0 | 1.0 | 1.25 |  |  |  |  |  | {'b' * 32} | `/out/sft/final` |"
    assert json.loads((tmp_path / "out" / "runs" / "r2" / "summary.json").read_text()) == summary
