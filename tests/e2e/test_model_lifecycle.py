"""MLflow as a model lifecycle, end to end through ``posttrain run`` and ``posttrain resume`` on the
session's finished tiny demo run (``demo_run``): the final policy became a version of a registered
model that ``mlflow.transformers.load_model`` loads, gated by ``evaluate.gates``; evaluate logged
its sample generations as an MLflow table, and every training stage's run carries a PNG of its
curves. Then the run is resumed: with nothing changed it trains nothing; with ``dpo.beta`` changed
it re-runs DPO and evaluate only; with a gate it fails it keeps the champion alias where it was,
registers a candidate and ends in Prefect's ``Failed`` state tagged ``gate-failed`` (exit code 4).
Each release is shown in both UIs: the Prefect artifact ``release`` and event
``posttrain.release.<kind>``, the MLflow parent run's and model version's tags and description.

The resumes change the shared run, so they come after every test that reads it as it finished
(this module is collected after ``test_demo_cli.py``; the read-only test comes first here).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from typer.testing import CliRunner

from posttrain.cli import app
from trainer_core.checkpoint.manifest import MANIFEST_NAME
from trainer_core.errors import EXIT_GATE_FAILED
from trainer_core.modeling.forwards.rewards import IMPLICIT_REWARD_KEY
from trainer_core.storage import RunLayout

pytestmark = pytest.mark.slow

MODEL = "posttrain-demo-policy"
STAGES = ("prepare_data", "sft", "reward_model", "score", "dpo", "ppo", "grpo", "evaluate")


def flow_run_named(prefect_api: str, name: str):
    """The newest flow run called ``name`` (the flow renames its run to the pipeline run id)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_api}), get_client(sync_client=True) as api:
        runs = api.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
    return max(runs, key=lambda r: r.created)


def release_shown(prefect_api: str, flow_run_id, run_id: str, kind: str) -> str:
    """The flow run's ``release`` artifact (Markdown), once the event ``posttrain.release.<kind>``
    of the run is stored (the server writes events a moment after they are sent)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
    from prefect.settings import PREFECT_API_URL, temporary_settings

    wanted = EventFilter(
        event=EventNameFilter(name=[f"posttrain.release.{kind}"]),
        resource=EventResourceFilter(id=[f"posttrain.run.{run_id}"]),
    )
    with temporary_settings(updates={PREFECT_API_URL: prefect_api}), get_client(sync_client=True) as api:
        deadline = time.monotonic() + 30
        while not api.read_events(wanted, limit=50).events:  # this kind only: the run's resumes emit their own
            assert time.monotonic() < deadline, f"no posttrain.release.{kind} event of run {run_id}"
            time.sleep(0.5)
        artifacts = api.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["release"]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
            )
        )
    assert len(artifacts) == 1, artifacts
    return artifacts[0].data


def test_registered_champion_gates_tables_and_curves(prefect_api, demo_run, tmp_path):
    import mlflow.transformers

    summary = demo_run.summary
    release = summary["release"]
    assert release["passed"] and [g["against"] for g in release["gates"]] == ["threshold", "no champion yet"]
    registered = release["registered_model"]
    assert (registered["name"], registered["version"], registered["alias"], registered["stage"]) == (
        MODEL,
        "1",
        "champion",
        "grpo",
    )

    tracking_uri = summary["mlflow"]["tracking_uri"]
    client = MlflowClient(tracking_uri)
    version = client.get_model_version_by_alias(MODEL, "champion")
    assert str(version.version) == "1" and version.tags["posttrain.run_id"] == demo_run.run_id
    assert {"posttrain.config_hash", "posttrain.data_fingerprint", "posttrain.fingerprint"} <= set(version.tags)
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    try:
        policy = mlflow.transformers.load_model(f"models:/{MODEL}@champion")
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI")
    assert policy.tokenizer is not None and policy.model.config.num_hidden_layers == 1

    parent = client.get_run(summary["mlflow"]["parent_run_id"])
    assert {"grpo/exact_match", "dpo/exact_match", "sft/eval_loss", "reward_model/eval_accuracy"} <= set(
        parent.data.metrics
    )
    flow_run = flow_run_named(prefect_api, demo_run.run_id)
    assert parent.data.tags["prefect.flow_run_url"].endswith(f"/flow-runs/flow-run/{flow_run.id}")
    # The release, shown in both UIs: version 1 became the first champion, both gates passed.
    shown = release_shown(prefect_api, flow_run.id, demo_run.run_id, "champion")
    assert shown.startswith(f"**Champion**: `{MODEL}` version 1 (grpo of run `{demo_run.run_id}`) is now `@champion`")
    assert "| grpo/exact_match |" in shown and "| threshold | passed |" in shown and "no champion yet" in shown
    assert (parent.data.tags["posttrain.release"], parent.data.tags["posttrain.gates"]) == ("champion", "passed")
    assert shown in parent.data.tags["mlflow.note.content"] and version.description == shown
    assert version.tags["posttrain.gates"] == "passed"
    samples = version.tags["posttrain.eval_samples_uri"]  # the verdicts a min_gain_se gate pairs with
    assert (
        samples == str(Path(summary["stages"]["evaluate"]["output_uri"]) / "samples.jsonl") and Path(samples).is_file()
    )
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags.get("mlflow.experimentKind")
    runs = {
        r.data.tags["posttrain.stage"]: r
        for r in client.search_runs(
            [parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
        )
    }
    assert set(runs) == set(STAGES)
    logged = client.search_logged_models([parent.info.experiment_id])
    models = {(m.name, m.source_run_id) for m in logged}
    assert {
        (f"{s}-{'reward' if s == 'reward_model' else 'policy'}", runs[s].info.run_id)
        for s in ("sft", "reward_model", "dpo", "ppo", "grpo")
    } <= models  # named by stage and role
    # configs/demo.yaml's reward model is implicit: a causal LM marked as one, logged as text generation.
    rm_dir = Path(summary["stages"]["reward_model"]["output_uri"])
    assert json.loads((rm_dir / "config.json").read_text())[IMPLICIT_REWARD_KEY] == {"beta": 2.0}
    assert {m.model_type for m in logged if m.name == "reward_model-reward"} == {"text-generation"}
    for stage in ("sft", "reward_model", "dpo", "ppo", "grpo"):
        assert "plots/curves.png" in [a.path for a in client.list_artifacts(runs[stage].info.run_id, "plots")], stage
        assert not [m for m in runs[stage].data.metrics if m.startswith("final/")], stage
        assert "prefect.flow_run_url" in runs[stage].data.tags
    table = json.loads(
        Path(client.download_artifacts(runs["evaluate"].info.run_id, "eval/samples.json", str(tmp_path))).read_text()
    )
    assert {"prompt", "answer", "sft", "dpo", "dpo_correct", "dpo_reward", "grpo"} <= set(table["columns"])
    assert len(table["data"]) == 2  # tests.tiny.TINY_DEMO: evaluate.num_problems
    # lm-eval's results JSON of every policy, an artifact of the evaluate run
    harness = {a.path for a in client.list_artifacts(runs["evaluate"].info.run_id, "lm_eval")}
    assert harness == {f"lm_eval/{p}.json" for p in ("sft", "dpo", "ppo", "grpo")}


def _final_manifests(root: Path, run_id: str) -> dict[str, int]:
    """Stage -> mtime (ns) of its committed ``final/manifest.json``."""
    return {s: (Path(RunLayout(str(root), run_id).stage(s).final) / MANIFEST_NAME).stat().st_mtime_ns for s in STAGES}


def _files_under(root: Path, sub: str) -> dict[str, int]:
    """Relative path -> mtime (ns) of every file under ``<root>/<sub>``."""
    base = root / sub
    return {str(p.relative_to(base)): p.stat().st_mtime_ns for p in base.rglob("*") if p.is_file()}


def _resume(run_id: str, root: Path, *overrides: str, exit_code: int = 0):
    """``posttrain resume RUN_ID --root ROOT [--set ...]`` in this process (the session's Prefect
    API): (summary, stdout lines, stderr, wall s)."""
    args = ["resume", run_id, "--root", str(root)]
    for item in overrides:
        args += ["--set", item]
    t0 = time.monotonic()
    result = CliRunner().invoke(app, args)
    wall_s = time.monotonic() - t0
    assert result.exit_code == exit_code, result.output
    lines = result.stdout.strip().splitlines()
    uri = root / "runs" / run_id / "summary.json"
    assert exit_code != 0 or lines[-1] == str(uri), lines[-3:]
    return json.loads(uri.read_text()), lines, result.stderr, wall_s


def test_resumes_reuse_what_is_unchanged_and_a_failed_gate_keeps_the_champion(prefect_api, demo_run, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    root, run_id = demo_run.root, demo_run.run_id
    run_dir = root / "runs" / run_id
    finals, specs = _final_manifests(root, run_id), _files_under(run_dir, "specs")
    checkpoints = _files_under(run_dir, "stages")

    # Nothing changed: every stage reused, nothing written under stages/ or specs/.
    summary, lines, _, wall_s = _resume(run_id, root)
    print(f"resume, nothing to do: {wall_s:.1f}s")
    assert summary["status"] == "completed"
    assert {s: (e["status"], e.get("reused"), e["wall_s"]) for s, e in summary["stages"].items()} == {
        s: ("completed", True, 0.0) for s in STAGES
    }
    assert all(f"{s}: completed (unchanged, not re-run) -> " in "\n".join(lines) for s in STAGES)
    assert _final_manifests(root, run_id) == finals
    assert _files_under(run_dir, "stages") == checkpoints, "a reused run wrote checkpoints or outputs"
    assert _files_under(run_dir, "specs") == specs, "a reused run launched a trainer"
    assert wall_s < 60, f"a resume that trains nothing took {wall_s:.0f}s"

    # dpo.beta changed: DPO and evaluate (which reads DPO's policy) re-run, nothing else.
    summary, _, _, wall_s = _resume(run_id, root, "dpo.beta=0.5")
    print(f"resume with dpo.beta=0.5: {wall_s:.1f}s")
    assert summary["status"] == "completed"
    rerun = {"dpo", "evaluate"}
    assert {s for s, e in summary["stages"].items() if not e.get("reused")} == rerun
    assert all(e["status"] == "completed" for e in summary["stages"].values())
    now = _final_manifests(root, run_id)
    assert {s for s in STAGES if now[s] != finals[s]} == rerun
    assert json.loads((run_dir / "config.json").read_text())["dpo"]["beta"] == 0.5
    dpo_manifest = json.loads((Path(summary["stages"]["dpo"]["output_uri"]) / MANIFEST_NAME).read_text())
    assert dpo_manifest["global_step"] == 2 and dpo_manifest["metrics"]["resumed"] == 0.0
    changed = {p for p, m in _files_under(run_dir, "stages").items() if checkpoints.get(p) != m}
    assert changed and all(p.split("/")[0] in rerun for p in changed), sorted(changed)
    client = MlflowClient(summary["mlflow"]["tracking_uri"])
    champion = str(client.get_model_version_by_alias(MODEL, "champion").version)
    assert summary["release"]["passed"] and champion == summary["release"]["registered_model"]["version"]

    # Gates the run fails: exact match is at most 1; and its gain over the champion (the same
    # policy's verdicts, paired by problem from the champion's sample table) is inside the noise.
    # Nothing re-runs (gates are judged after the stages, never hashed), the version is registered
    # as a candidate and the champion stays.
    # The same for a sampled metric: each sampled problem's pass@4, paired with the champion's table;
    # and for a harness metric: each example's score, paired with the champion's harness table.
    failing = json.dumps(
        [
            {"metric": "grpo/exact_match", "threshold": 2.0},
            {"metric": "grpo/exact_match", "vs_champion": True, "tolerance": 1.0, "min_gain_se": 1.0},
            {"metric": "grpo/pass_at_4", "vs_champion": True, "tolerance": 1.0, "min_gain_se": 1.0},
            {
                "metric": "grpo/lm_eval/posttrain_heldout/exact_match_flexible_extract",
                "threshold": 1.5,
                "vs_champion": True,
                "tolerance": 1.0,
                "min_gain_se": 1.0,
            },
        ]
    )
    summary, _, stderr, _ = _resume(run_id, root, f"evaluate.gates={failing}", exit_code=EXIT_GATE_FAILED)
    assert "gate: grpo/exact_match" in stderr and "< threshold 2" in stderr
    assert "grpo/lm_eval/posttrain_heldout/exact_match_flexible_extract" in stderr and "< threshold 1.5" in stderr
    for metric in ("exact_match", "pass_at_4", "lm_eval/posttrain_heldout/exact_match_flexible_extract"):
        noise = [g for g in summary["release"]["gates"] if g["metric"] == f"grpo_vs_champion/{metric}_gain"]
        assert [(g["value"], g["bound"], g["passed"]) for g in noise] == [(0.0, 0.0, False)], noise
    assert f"grpo_vs_champion/exact_match_gain 0 <= 1 SE (champion v{champion}) 0" in stderr
    assert not [s for s, e in summary["stages"].items() if not e.get("reused")]
    assert summary["status"] == "gate_failed" and not summary["release"]["passed"]
    candidate = summary["release"]["registered_model"]
    assert candidate["alias"] == "candidate" and int(candidate["version"]) == int(champion) + 1
    assert str(client.get_model_version_by_alias(MODEL, "champion").version) == champion
    assert str(client.get_model_version_by_alias(MODEL, "candidate").version) == candidate["version"]
    flow_run = flow_run_named(prefect_api, run_id)
    state = flow_run.state
    assert state.type.value == "FAILED" and state.name == "Failed" and "gate-failed" in flow_run.tags
    assert state.message.startswith("gate: grpo/exact_match")
    shown = release_shown(prefect_api, flow_run.id, run_id, "gate-failed")
    assert shown.startswith(f"**Gate failed**: `{MODEL}` version {candidate['version']} ")
    assert f"registered as `@candidate`; the champion stays version {champion}." in shown
    assert f"Why: {summary['release']['failure']}" in shown and "| **failed** |" in shown
    parent = client.get_run(summary["mlflow"]["parent_run_id"]).data.tags
    assert (parent["posttrain.release"], parent["posttrain.gates"]) == ("gate-failed", "failed")
    assert parent["posttrain.gate_failure"] == summary["release"]["failure"]
    version = client.get_model_version(MODEL, candidate["version"])
    assert version.description == shown and version.tags["posttrain.gate_failure"] == summary["release"]["failure"]
