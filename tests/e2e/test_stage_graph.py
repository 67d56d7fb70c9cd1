"""The pipeline as a graph under a real Prefect API: independent stages (DPO and GRPO, both after
SFT) run side by side when the GPU concurrency limit has two slots and one after the other with
one; a failed stage skips only the stages that read its output.

CPU stages hold slots here: ``backend.device`` is ``auto``, not ``cpu``. The two runs share one
run id, so the second reuses prepare_data and SFT and re-runs only what its overrides change; a
failed stage's entry in the summary keeps when its trainer ran.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

from flows.pipeline import post_training_pipeline
from tests.integration.helpers import DEMO_CONFIG, tiny_overrides
from trainer_core.config import load_config

STAGES = ["prepare_data", "sft", "dpo", "grpo", "evaluate"]


def graph_config(root, limit: str, **extra):
    overrides = {
        **tiny_overrides(),
        "storage.root": str(root),
        "stages": STAGES,
        "launch.retries": 0,
        "launch.timeout_s": 300,
        "launch.gpu_concurrency_limit": limit,
        "grpo.max_steps": 4,
        "grpo.save_every": 2,
        "grpo.prompts_per_rollout": 4,
        "grpo.generation.max_new_tokens": 8,
        "evaluate.num_problems": 4,
        "evaluate.num_winrate_prompts": 4,
        "evaluate.generation.max_new_tokens": 8,
        **extra,
    }
    return load_config(str(DEMO_CONFIG), overrides=overrides)


def concurrency_limit(slots: int) -> str:
    name = f"graph-gpus-{slots}-{uuid.uuid4().hex[:6]}"
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
    return name


def interval(entry: dict) -> tuple[datetime, datetime]:
    return datetime.fromisoformat(entry["started_at"]), datetime.fromisoformat(entry["ended_at"])


def overlap_s(a: dict, b: dict) -> float:
    """Seconds during which both stages' trainers ran (negative: the gap between them)."""
    (a0, a1), (b0, b1) = interval(a), interval(b)
    return (min(a1, b1) - max(a0, b0)).total_seconds()


@pytest.mark.slow
def test_independent_stages_overlap_with_two_slots_and_a_failure_skips_only_its_dependents(
    prefect_api, tmp_path, monkeypatch
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    root, run_id = tmp_path / "out", "graph"

    two = post_training_pipeline(config=graph_config(root, concurrency_limit(2)), run_id=run_id)
    stages = two["stages"]
    assert two["status"] == "completed", stages
    print(f"2 slots: dpo/grpo overlap {overlap_s(stages['dpo'], stages['grpo']):.1f}s")
    assert overlap_s(stages["dpo"], stages["grpo"]) > 0
    for upstream, downstream in [
        ("prepare_data", "sft"),
        ("sft", "dpo"),
        ("sft", "grpo"),
        ("dpo", "evaluate"),
        ("grpo", "evaluate"),
    ]:
        assert interval(stages[upstream])[1] <= interval(stages[downstream])[0], (upstream, downstream)

    # One slot, and a reference that passes the pre-flight check (its config.json exists) and fails
    # to load in DPO: the two independent stages run one after the other (DPO's failed trainer ran
    # for its imports' seconds, so a slot not held shows as overlap), GRPO still completes, and
    # only evaluate, which reads DPO, is skipped.
    (tmp_path / "broken-model").mkdir()
    (tmp_path / "broken-model" / "config.json").write_text("{}")
    broken = {"dpo.reference_from": str(tmp_path / "broken-model"), "grpo.learning_rate": 1e-4}
    state = post_training_pipeline(
        config=graph_config(root, concurrency_limit(1), **broken), run_id=run_id, return_state=True
    )
    assert state.is_failed()
    stages = json.loads((root / "runs" / run_id / "summary.json").read_text())["stages"]
    assert {s for s, e in stages.items() if e["reused"]} == {"prepare_data", "sft"}
    assert stages["dpo"]["status"] == "failed" and "broken-model" in stages["dpo"]["error"]
    assert stages["grpo"]["status"] == "completed" and not stages["grpo"]["reused"]
    print(f"1 slot: dpo/grpo overlap {overlap_s(stages['dpo'], stages['grpo']):.1f}s")
    assert overlap_s(stages["dpo"], stages["grpo"]) <= 0
    assert stages["evaluate"]["status"] == "skipped" and stages["evaluate"]["skipped_because"] == "dpo"
    assert stages["evaluate"]["started_at"] is None
