"""Acceptance: every stage of ``configs/gsm8k-hh.yaml`` on the real GSM8K and HH-RLHF files,
under a real Prefect API, a real MLflow sqlite store and real trainer processes.

Sizes are cut so the run takes about 2-3 minutes on 2 CPU cores: a 2-layer, 64-wide Llama, a
1024-token BPE vocabulary, 30 / 20 / 10 optimizer steps for SFT / reward model / DPO, and
8 prompts for scoring and each evaluation. HH-RLHF is read up to 240 pairs: DPO computes the
reference log-probs of every train pair before its first step (~0.25 s per 4 pairs here), so
the whole 2,000-pair file would add about 2 minutes without testing anything more.

The data folder is ``../shared/data`` from the repository root, or ``$POSTTRAIN_SHARED_DATA``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from flows.pipeline import post_training_pipeline
from tests.shared_data import GSM8K, HH, needs_shared_data
from trainer_core.config import load_config

REPO = Path(__file__).resolve().parents[2]

STAGES = ("prepare_data", "sft", "reward_model", "score", "dpo", "evaluate")
"""The stages configs/gsm8k-hh.yaml runs, in order."""
STEPS = {"sft": 30, "reward_model": 20, "dpo": 10}
TRAINED = ("sft", "reward_model", "dpo")

pytestmark = [
    pytest.mark.slow,
    needs_shared_data,
]


def small_overrides(tmp_path: Path) -> dict:
    """The shipped config's stages and data, cut to test size."""
    return {
        "storage.root": str(tmp_path / "out"),
        "tracking.tracking_uri": f"sqlite:///{tmp_path / 'tracking' / 'mlflow.db'}",
        "data.sft.uri": str(GSM8K),
        "data.preference.uri": str(HH),
        "data.preference.max_rows": 240,
        "data.max_length_tokens": 256,
        "data.max_prompt_length_tokens": 192,
        "data.max_eval_rows": 32,
        "tokenizer.vocab_size": 1024,
        "model.init.hidden_size": 64,
        "model.init.intermediate_size": 172,
        "model.init.num_hidden_layers": 2,
        "sft.max_steps": STEPS["sft"],
        "sft.eval_every": 10,
        "sft.save_every": 10,
        "reward_model.max_steps": STEPS["reward_model"],
        "reward_model.micro_batch_size": 4,
        "reward_model.eval_every": 10,
        "reward_model.save_every": 10,
        "dpo.max_steps": STEPS["dpo"],
        "dpo.eval_every": 5,
        "dpo.save_every": 10,
        "score.num_prompts": 8,
        "score.generation.max_new_tokens": 32,
        "evaluate.num_problems": 8,
        "evaluate.num_winrate_prompts": 8,
        "evaluate.generation.max_new_tokens": 32,
        # Fail fast: a stage that needs a retry here is a bug, not flakiness to hide.
        "launch.retries": 0,
        "launch.timeout_s": 300,
    }


def task_run_counts(flow_run_id) -> list[tuple[str, int]]:
    """(task run name, run count) of a flow run's task runs, in start order."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    runs.sort(key=lambda t: t.start_time or t.expected_start_time)
    return [(t.name, t.run_count) for t in runs]


def test_gsm8k_hh_pipeline_end_to_end(prefect_api, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = load_config(str(REPO / "configs" / "gsm8k-hh.yaml"), overrides=small_overrides(tmp_path))
    assert config.stages == list(STAGES)

    state = post_training_pipeline(config=config, run_id="gsm8k-e2e", return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()

    run_dir = tmp_path / "out" / "runs" / "gsm8k-e2e"
    assert summary["summary_uri"] == str(run_dir / "summary.json")
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert summary["status"] == "completed"
    stages = summary["stages"]
    assert set(stages) == set(STAGES)
    assert {name: s["status"] for name, s in stages.items()} == {name: "completed" for name in STAGES}
    assert task_run_counts(state.state_details.flow_run_id) == [(name, 1) for name in STAGES]

    # Every stage's final directory is committed: manifest.json written last, naming the stage.
    for name, stage in stages.items():
        assert stage["output_uri"] == str(run_dir / "stages" / name / "final")
        manifest = json.loads((Path(stage["output_uri"]) / "manifest.json").read_text())
        assert (manifest["kind"], manifest["stage"], manifest["run_id"]) == ("final", name, "gsm8k-e2e")
        assert manifest["metrics"] == pytest.approx(stage["metrics"], nan_ok=True)
        assert stage["wall_s"] > 0
        for entry in manifest["files"]:
            assert (Path(stage["output_uri"]) / entry["path"]).stat().st_size == entry["size_bytes"]
    for name in TRAINED:
        assert stages[name]["metrics"]["global_step"] == STEPS[name]

    data = stages["prepare_data"]["metrics"]
    # Held out: eval_fraction 0.05 of each data set, at most max_eval_rows (32).
    assert data["num_sft_eval"] == 32 and data["num_eval_problems"] == 32 and data["num_preference_eval"] == 12
    assert data["num_sft_train"] > 7000 and 200 < data["num_preference_train"] <= 228
    assert data["num_sft_invalid"] == 0 and data["vocab_size"] <= 1024

    sft = stages["sft"]["metrics"]
    assert sft["eval/loss"] < sft["first/eval/loss"], sft

    evaluation = stages["evaluate"]["metrics"]
    for key in (
        "reward_model/eval_accuracy",
        "dpo/eval_reward_accuracy",
        "sft/exact_match",
        "dpo/exact_match",
        "dpo_vs_sft/win_rate",
    ):
        assert 0.0 <= evaluation[key] <= 1.0, (key, evaluation)
    assert evaluation["sft/eval_loss"] == pytest.approx(sft["eval/loss"], rel=1e-4)
    score = stages["score"]["metrics"]
    assert score["num_scored"] == 8 + 8  # num_prompts from each held-out set: problems and preference prompts
    assert 0.0 <= score["verifier_accuracy"] <= 1.0 and "reward_mean" in score

    # MLflow: the parent run and exactly one nested, finished run per stage, each with metrics.
    assert summary["mlflow"]["tracking_uri"] == f"sqlite:///{tmp_path / 'tracking' / 'mlflow.db'}"
    mlflow = MlflowClient(summary["mlflow"]["tracking_uri"])
    parent = mlflow.get_run(summary["mlflow"]["parent_run_id"])
    assert parent.info.status == "FINISHED"
    children = mlflow.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert sorted(run.info.run_name for run in children) == sorted(STAGES)
    for run in children:
        name = run.data.tags["posttrain.stage"]
        assert run.info.run_name == name and run.info.run_id == stages[name]["mlflow_run_id"]
        assert run.info.status == "FINISHED"
        assert run.data.metrics, name
    by_stage = {run.data.tags["posttrain.stage"]: run.info.run_id for run in children}
    sft_curve = mlflow.get_metric_history(by_stage["sft"], "eval/loss")
    assert {m.step for m in sft_curve} >= {0, 10, 20, 30}
    for name in TRAINED:
        assert [a.path for a in mlflow.list_artifacts(by_stage[name], "manifests")] == ["manifests/final.json"]
