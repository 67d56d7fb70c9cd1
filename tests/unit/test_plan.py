"""The stage graph of a run (``tasks/plan.py``): inputs from the registry, edges from the inputs."""

from __future__ import annotations

import pytest

from tasks.plan import plan_run
from trainer_core.checkpoint.manifest import ArtifactWriter
from trainer_core.config import load_config
from trainer_core.errors import ConfigError
from trainer_core.storage import RunLayout


def _layout(tmp_path) -> RunLayout:
    return RunLayout(str(tmp_path), "r1")


def test_the_demo_graph(tmp_path):
    """prepare_data -> sft -> {reward_model, dpo, grpo}; reward_model -> {score, ppo}; evaluate last."""
    config = load_config("configs/demo.yaml", overrides={"storage.root": str(tmp_path)})
    plan = plan_run(config, _layout(tmp_path))
    assert list(plan) == config.stages
    assert {s: p.depends_on for s, p in plan.items()} == {
        "prepare_data": (),
        "sft": ("prepare_data",),
        "reward_model": ("prepare_data", "sft"),
        "score": ("prepare_data", "sft", "reward_model"),
        "dpo": ("prepare_data", "sft"),
        "ppo": ("prepare_data", "sft", "reward_model"),
        "grpo": ("prepare_data", "sft"),
        "evaluate": ("prepare_data", "sft", "reward_model", "dpo", "ppo", "grpo"),
    }
    layout = _layout(tmp_path)
    assert plan["ppo"].inputs == {
        "data": layout.final("prepare_data"),
        "model": layout.final("sft"),
        "reference": layout.final("sft"),
        "reward_model": layout.final("reward_model"),
    }


def test_a_stage_started_from_elsewhere_does_not_wait_for_sft(tmp_path):
    config = load_config(
        overrides={
            "storage.root": str(tmp_path),
            "stages": "prepare_data,sft,dpo",
            "dpo.init_from": "s3://models/m",
            "dpo.reference_from": "s3://models/ref",
        }
    )
    assert plan_run(config, _layout(tmp_path))["dpo"].depends_on == ("prepare_data",)


def test_committed_outputs_of_earlier_runs_are_inputs_not_dependencies(tmp_path):
    layout = _layout(tmp_path)
    for stage in ("prepare_data", "sft"):
        ArtifactWriter(layout.final(stage)).commit(kind="final", stage=stage, run_id="r1")
    config = load_config(overrides={"storage.root": str(tmp_path), "stages": "dpo,evaluate"})
    plan = plan_run(config, layout)
    assert plan["dpo"].depends_on == () and plan["dpo"].inputs["model"] == layout.final("sft")
    assert plan["evaluate"].depends_on == ("dpo",)
    assert plan["evaluate"].inputs["sft_model"] == layout.final("sft")


def test_no_prepared_data_is_a_config_error_naming_the_stage(tmp_path):
    config = load_config(overrides={"storage.root": str(tmp_path), "stages": "sft"})
    with pytest.raises(ConfigError, match="stage 'sft' needs the output of 'prepare_data'"):
        plan_run(config, _layout(tmp_path))
