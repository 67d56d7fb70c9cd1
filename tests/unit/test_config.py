"""Pipeline config: validation errors name the field path; every shipped config loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainer_core.config import load_config, parse_override
from trainer_core.registry import STAGE_ORDER
from trainer_core.errors import ConfigError

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    config = load_config(str(path))
    assert config.stages == [s for s in STAGE_ORDER if s in config.stages]


def test_shipped_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"demo.yaml", "gsm8k-hh.yaml", "qwen2.5-0.5b-gpu.yaml"} <= names


def test_invalid_value_names_field_path():
    with pytest.raises(ConfigError, match=r"dpo\.beta"):
        load_config(overrides={"dpo.beta": -1})


def test_unknown_stage_is_named():
    with pytest.raises(ConfigError, match="ppo_typo"):
        load_config(overrides=["stages=prepare_data,ppo_typo"])


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"sft\.learning_rat"):
        load_config(overrides={"sft.learning_rat": 0.1})


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"grpo.generation.engine": "vllm", "grpo.generation.vllm.gpu_util": 0.5}, r"grpo\.generation\.vllm\.gpu_util"),
        ({"grpo.generation.vllm.kv_cache_gib": 0}, r"grpo\.generation\.vllm\.kv_cache_gib"),
        ({"score.generation.engine": "vllm"}, r"score\.generation\.engine: Input should be 'hf' or 'static'"),
        (
            {"grpo.generation.engine": "vllm", "grpo.environment.name": "calculator"},
            r"generation\.engine='vllm' with an environment",
        ),
    ],
    ids=["unknown-option", "bad-value", "score-engine", "tools"],
)
def test_the_vllm_engines_bad_settings_are_refused_at_load_naming_the_field(overrides, named):
    """An unknown or bad option of the vllm section, the engine where only the RL rollouts have it
    (score, evaluate), and a tool environment (the vllm engine samples single-turn rollouts)."""
    with pytest.raises(ConfigError, match=named):
        load_config(overrides=overrides)


def test_the_vllm_engine_serves_a_sharded_policy():
    """Unlike 'static', 'vllm' takes FSDP2 (its server gets the gathered weights)."""
    config = load_config(
        overrides={"grpo.generation.engine": "vllm", "backend.name": "fsdp2", "backend.nproc_per_node": 2}
    )
    assert config.grpo.generation.engine == "vllm"


@pytest.mark.parametrize("stage", ["ppo", "grpo", "distill"])
def test_an_rl_section_refuses_the_supervised_loops_fields_naming_them(stage):
    """The RL sections do not have the supervised loop's fields (the RL loop reads none of them):
    setting one fails at load naming the section and the field; the supervised sections keep them."""
    from trainer_core.config import OptimizerStageConfig, RLStageConfig, TrainStageConfig
    from trainer_core.config.stages import SUPERVISED_LOOP_FIELDS

    assert set(SUPERVISED_LOOP_FIELDS) == {
        "moe",
        "micro_batch_size",
        "grad_accum_steps",
        "global_batch_size",
        "eval_every",
        "eval_max_batches",
        "keep_best_metric",
        "early_stopping_patience",
        "log_every",
    }
    assert not set(SUPERVISED_LOOP_FIELDS) & set(RLStageConfig.model_fields)
    assert set(TrainStageConfig.model_fields) == set(OptimizerStageConfig.model_fields) | set(SUPERVISED_LOOP_FIELDS)
    for name, value in [("micro_batch_size", 4), ("eval_every", 5), ("log_every", 1), ("moe.aux_loss_coef", 0.01)]:
        field = name.split(".")[0]
        with pytest.raises(ConfigError, match=rf"(?s){stage}: .*{field}: a setting of the supervised loop"):
            load_config(overrides={f"{stage}.{name}": value})
    assert load_config(overrides={"sft.log_every": 3, "dpo.eval_every": 5}).sft.log_every == 3


def test_stages_are_put_in_pipeline_order_from_a_comma_string():
    config = load_config(overrides=["stages=dpo, sft,prepare_data"])
    assert config.stages == ["prepare_data", "sft", "dpo"]


def test_override_values_are_typed():
    assert parse_override("sft.max_steps=12") == ("sft.max_steps", 12)
    assert parse_override("model.name_or_path=null") == ("model.name_or_path", None)
    with pytest.raises(ConfigError, match="key.path=value"):
        parse_override("sft.max_steps")


def test_model_needs_exactly_one_source():
    with pytest.raises(ConfigError, match="exactly one"):
        load_config(overrides={"model.name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "model.init.hidden_size": 64})


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("team/policy", "cannot contain '/' or ':'"),
        ("models:/policy", "cannot contain '/' or ':'"),
        ("   ", "must not be blank"),
        ("..", "would read it as the path"),
    ],
)
def test_an_illegal_registered_model_name_is_refused_when_the_config_is_read(name, why):
    """Issue 35, item 13: refused by ``validate`` (and before any stage runs), not by MLflow at the release."""
    with pytest.raises(ConfigError, match=rf"tracking.registered_model_name: .*{re.escape(why)}"):
        load_config(overrides={"tracking.registered_model_name": name})
    assert load_config(overrides={"tracking.registered_model_name": "posttrain-policy.v2"})
