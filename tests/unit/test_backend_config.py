"""Backend configuration: validation, per-stage overrides, global batch size, DeepSpeed config."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainer_core.backends.deepspeed_zero import build_ds_config, deep_merge
from trainer_core.config import BackendConfig, PipelineConfig, TrainStageConfig, load_config
from trainer_core.registry import TRAINING_STAGES
from trainer_core.errors import ConfigError

FSDP2_X2 = {"backend.name": "fsdp2", "backend.nproc_per_node": 2, "backend.device": "cpu"}


def test_defaults_are_one_process():
    backend = BackendConfig()
    assert (backend.name, backend.world_size, backend.launcher) == ("single", 1, "torchrun")
    assert backend.validate_replicas


def test_world_size_is_nodes_times_processes():
    backend = BackendConfig(name="ddp", nnodes=3, nproc_per_node=4, node_rank=2, rdzv_endpoint="node0:29500")
    assert backend.world_size == 12


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": "single", "nproc_per_node": 2}, "backend.name=single runs one process"),
        ({"name": "single", "nnodes": 2, "rdzv_endpoint": "h:1"}, "backend.name=single runs one process"),
        ({"name": "ddp", "nnodes": 2}, r"backend.rdzv_endpoint \(host:port of node 0\) is required"),
        (
            {"name": "ddp", "nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"},
            "node_rank=2 must be < backend.nnodes=2",
        ),
        ({"name": "deepspeed", "zero_stage": 2, "offload_params": True}, "offload_params needs backend.zero_stage=3"),
        ({"name": "horovod"}, "name"),
        ({"name": "deepspeed", "zero_stage": 4}, "zero_stage"),
        ({"name": "ddp", "nproc_per_node": 0}, "nproc_per_node"),
    ],
)
def test_invalid_backend_is_rejected(fields, message):
    with pytest.raises(ValidationError, match=message):
        BackendConfig(**fields)


def test_valid_combinations():
    BackendConfig(name="deepspeed", zero_stage=3, offload_params=True, offload_optimizer=True)
    BackendConfig(name="fsdp2", nnodes=2, nproc_per_node=8, rdzv_endpoint="sft-0.sft:29500")


def test_invalid_pipeline_backend_names_its_path():
    with pytest.raises(ConfigError, match=r"backend\.nproc_per_node"):
        load_config(overrides={"backend.nproc_per_node": 0})
    with pytest.raises(ConfigError, match="backend.name=single runs one process"):
        load_config(overrides={"backend.nproc_per_node": 2})


def test_stage_override_is_merged_over_the_pipeline_backend():
    overrides = {**FSDP2_X2, "sft.backend": {"name": "ddp"}, "dpo.backend": {"zero_stage": 3, "name": "deepspeed"}}
    config = load_config(overrides=overrides)
    sft, dpo, rm = (config.backend_for(s) for s in ("sft", "dpo", "reward_model"))
    assert (sft.name, sft.nproc_per_node, sft.device) == ("ddp", 2, "cpu")  # the rest from the pipeline
    assert (dpo.name, dpo.zero_stage, dpo.world_size) == ("deepspeed", 3, 2)
    assert rm == config.backend  # no override: the pipeline's
    assert config.backend.name == "fsdp2"  # the pipeline's own is untouched


@pytest.mark.parametrize("stage", ["prepare_data", "score", "evaluate"])
def test_stages_without_an_optimizer_run_single(stage):
    config = load_config(overrides=FSDP2_X2)
    backend = config.backend_for(stage)
    assert (backend.name, backend.world_size, backend.device) == ("single", 1, "cpu")


def test_every_training_stage_gets_the_pipeline_backend():
    config = load_config(overrides=FSDP2_X2)
    assert all(config.backend_for(s) == config.backend for s in TRAINING_STAGES)


def test_invalid_stage_override_names_the_stage():
    with pytest.raises(ConfigError, match=r"(?s)sft\.backend: .*backend.name=single runs one process"):
        load_config(overrides={**FSDP2_X2, "sft.backend": {"name": "single"}})
    with pytest.raises(ConfigError, match=r"(?s)dpo\.backend: .*offload_params needs backend.zero_stage=3"):
        load_config(overrides={"dpo.backend": {"name": "deepspeed", "offload_params": True}})


def test_a_misspelt_stage_override_key_fails_at_load_naming_its_path():
    """A stage's ``backend`` and ``lora`` are typed partial sections: an unknown key, or a bad
    value of a known one, fails when the config loads, named by its full path."""
    cases = [
        ({"grpo.backend": {"nprocs": 2}}, r"grpo\.backend\.nprocs: Extra inputs are not permitted"),
        ({"sft.backend.zero_stag": 3}, r"sft\.backend\.zero_stag: Extra inputs are not permitted"),
        (
            {"sft.backend.nproc_per_node": 0},
            r"sft\.backend\.nproc_per_node: Input should be greater than or equal to 1",
        ),
        ({"dpo.lora.rnak": 8}, r"dpo\.lora\.rnak: Extra inputs are not permitted"),
        ({"dpo.lora.quantize": "8bit"}, r"dpo\.lora\.quantize: Input should be '4bit'"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=overrides)


def test_a_stage_override_sets_exactly_its_keys_and_dumps_only_them():
    """Unset fields inherit; a field set to null sets None where None is a value (as the mapping
    did); a dump holds only the set fields, and loads back to the same merged sections."""
    config = load_config(
        overrides={
            "lora": {"enabled": True, "quantize": "4bit"},
            "sft.lora.quantize": None,
            "sft.lora.rank": 4,
            "backend.rdzv_id": "job",
            "dpo.backend.rdzv_id": None,
        }
    )
    assert (config.lora_for("sft").quantize, config.lora_for("sft").rank, config.lora_for("sft").enabled) == (
        None,
        4,
        True,
    )
    assert config.lora_for("dpo") == config.lora  # nothing set: the pipeline's own object
    assert (config.backend_for("dpo").rdzv_id, config.backend_for("sft").rdzv_id) == (None, "job")
    dumped = config.model_dump(mode="json")
    assert dumped["sft"]["lora"] == {"quantize": None, "rank": 4} and dumped["sft"]["backend"] == {}
    assert dumped["dpo"]["backend"] == {"rdzv_id": None}
    again = PipelineConfig.model_validate(dumped)
    assert all(
        again.lora_for(s) == config.lora_for(s) and again.backend_for(s) == config.backend_for(s)
        for s in TRAINING_STAGES
    )


@pytest.mark.parametrize("stage", ["ppo", "grpo", "distill"])
def test_padding_free_rl_on_deepspeed_is_refused_at_load(stage):
    """Refused when the config loads, not after the trainer has loaded both models."""
    zero3 = {"name": "deepspeed", "zero_stage": 3, "nproc_per_node": 2}
    with pytest.raises(ConfigError, match=rf"{stage}\.padding_free is not supported with backend.name=deepspeed"):
        load_config(overrides={f"{stage}.padding_free": True, f"{stage}.backend": zero3})
    load_config(overrides={f"{stage}.padding_free": True, f"{stage}.backend": {"name": "fsdp2", "nproc_per_node": 2}})


def test_the_rl_loops_refusals_come_at_load_for_the_stages_the_run_trains():
    """Unequal prompt shares, more mini-batches than sequences, greedy rollouts and a non-``hf``
    engine under FSDP2 or ZeRO-3 are refused when the config loads (each naming its field), not
    once the stage has loaded its models; a stage the run does not train is not judged."""
    ddp2 = {"name": "ddp", "nproc_per_node": 2}
    cases = [
        (
            {"grpo.prompts_per_rollout": 3, "grpo.backend": ddp2},
            r"grpo\.prompts_per_rollout=3 must be a multiple of the world size \(2\)",
        ),
        (
            {"grpo.prompts_per_rollout": 2, "grpo.group_size": 2, "grpo.num_mini_batches": 5},
            r"grpo\.num_mini_batches=5 exceeds the rollout batch's number of sequences \(4 =",
        ),
        (
            {
                "distill.teacher_from": "/t",
                "distill.prompts_per_rollout": 2,
                "distill.samples_per_prompt": 2,
                "distill.num_mini_batches": 5,
            },
            r"distill\.num_mini_batches=5 exceeds .* \(4 =",
        ),
        ({"ppo.generation.temperature": 0.0}, r"ppo\.generation\.temperature must be > 0"),
        (
            {
                "grpo.generation.engine": "static",
                "grpo.backend": {"name": "deepspeed", "zero_stage": 3, "nproc_per_node": 2},
            },
            r"grpo\.generation\.engine='static' needs an unsharded policy .* with deepspeed",
        ),
    ]
    stages = "prepare_data,sft,reward_model,ppo,grpo,distill,evaluate"
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides={"stages": stages, **overrides})
        load_config(overrides={"stages": "prepare_data,sft,evaluate", **overrides})  # not trained: not judged
    load_config(
        overrides={
            "stages": stages,
            "distill.teacher_from": "/t",
            "grpo.generation.engine": "static",
            "grpo.backend": {"name": "deepspeed", "zero_stage": 2, "nproc_per_node": 2},
        }
    )


def test_backend_for_raises_for_an_override_set_after_validation():
    config = load_config(overrides=FSDP2_X2)
    config.ppo.backend = {"name": "single"}  # assignment validates the field, not the merged backend
    with pytest.raises(ValueError, match=r"ppo\.backend: "):
        config.backend_for("ppo")


def test_accum_steps_from_global_batch_size():
    """global_batch_size 16 of micro-batches of 4: 4 per step on 1 rank, 2 on 2, 1 on 4;
    grad_accum_steps is ignored once global_batch_size is set."""
    cfg = TrainStageConfig(micro_batch_size=4, grad_accum_steps=7, global_batch_size=16)
    assert [cfg.accum_steps(w) for w in (1, 2, 4)] == [4, 2, 1]
    assert TrainStageConfig(micro_batch_size=4, grad_accum_steps=3).accum_steps(8) == 3
    with pytest.raises(ConfigError, match=r"global_batch_size=16 is not a multiple of .* = 4 x 3"):
        cfg.accum_steps(3)


def test_global_batch_size_not_divisible_names_the_stage():
    with pytest.raises(ConfigError, match=r"dpo: global_batch_size=12 is not a multiple of .* = 4 x 2"):
        load_config(overrides={**FSDP2_X2, "dpo.micro_batch_size": 4, "dpo.global_batch_size": 12})
    # the world size is the stage's own: 8 = 4 x 2 on the pipeline's 2 ranks, not on the override's 4
    overrides = {**FSDP2_X2, "sft.micro_batch_size": 4, "sft.global_batch_size": 8}
    assert load_config(overrides=overrides).sft.accum_steps(2) == 1
    with pytest.raises(ConfigError, match=r"sft: global_batch_size=8 is not a multiple of .* = 4 x 4"):
        load_config(overrides={**overrides, "sft.backend": {"nproc_per_node": 4}})


def _stage(**fields) -> TrainStageConfig:
    return TrainStageConfig(micro_batch_size=2, grad_accum_steps=3, **fields)


def test_ds_config_from_the_stage_config():
    """train_batch_size = micro_batch_size x grad_accum_steps x world_size = 2 x 3 x 4 = 24."""
    config = build_ds_config(BackendConfig(name="deepspeed", zero_stage=2), _stage(max_grad_norm=0.5), 4, "fp32")
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 24
    assert config["gradient_clipping"] == 0.5
    assert config["zero_optimization"] == {"stage": 2}
    assert config["bf16"] == {"enabled": False}
    assert config["zero_allow_untested_optimizer"] is True


def test_ds_config_follows_global_batch_size_and_no_clipping():
    cfg = TrainStageConfig(micro_batch_size=2, global_batch_size=16, max_grad_norm=None)
    config = build_ds_config(BackendConfig(name="deepspeed"), cfg, 2, "bf16-mixed")
    assert (config["gradient_accumulation_steps"], config["train_batch_size"]) == (4, 16)
    assert config["gradient_clipping"] == 0.0  # DeepSpeed's "off"
    assert config["bf16"] == {"enabled": True}


def test_ds_config_offload_sections():
    backend = BackendConfig(name="deepspeed", zero_stage=3, offload_optimizer=True, offload_params=True)
    config = build_ds_config(backend, _stage(), 1, "fp32")
    assert config["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    }
    only_optimizer = BackendConfig(name="deepspeed", zero_stage=1, offload_optimizer=True)
    assert build_ds_config(only_optimizer, _stage(), 1, "fp32")["zero_optimization"] == {
        "stage": 1,
        "offload_optimizer": {"device": "cpu"},
    }


def test_raw_ds_config_is_deep_merged_over_the_generated_one():
    raw = {
        "zero_optimization": {"offload_param": {"pin_memory": True}, "stage3_max_live_parameters": 1000},
        "gradient_clipping": 2.0,
        "bf16": {"enabled": False},
        "communication_data_type": "fp32",
    }
    backend = BackendConfig(name="deepspeed", zero_stage=3, offload_params=True, ds_config=raw)
    config = build_ds_config(backend, _stage(), 2, "bf16-mixed")
    assert config["zero_optimization"] == {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "stage3_max_live_parameters": 1000,
    }
    assert (config["gradient_clipping"], config["communication_data_type"]) == (2.0, "fp32")
    assert config["bf16"] == {"enabled": False}
    assert config["train_batch_size"] == 12  # what the override leaves alone stays generated
    assert backend.ds_config == raw and "device" not in raw["zero_optimization"]["offload_param"]  # not mutated


def test_deep_merge_replaces_non_dicts():
    base = {"a": {"b": 1, "c": [1]}, "d": 1}
    merged = deep_merge(base, {"a": {"c": [2], "e": {}}, "d": {"x": 1}})
    assert merged == {"a": {"b": 1, "c": [2], "e": {}}, "d": {"x": 1}}
    assert base == {"a": {"b": 1, "c": [1]}, "d": 1}


def test_pipeline_config_round_trips_with_a_backend():
    config = load_config(overrides={**FSDP2_X2, "sft.backend": {"name": "deepspeed", "zero_stage": 3}})
    again = PipelineConfig.model_validate(config.model_dump(mode="json"))
    assert again.backend_for("sft") == config.backend_for("sft")


# --- precision, activation checkpointing, compile -------------------------------------------------


def test_memory_features_default_off_and_precision_auto_resolves_per_device():
    """auto = bf16-mixed on CUDA, fp32 on CPU (a ``torch.device`` needs no GPU to exist)."""
    import torch

    from trainer_core.backends.memory import resolve_precision

    backend = BackendConfig()
    assert (backend.precision, backend.activation_checkpointing, backend.compile) == ("auto", False, False)
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16-mixed"
    assert [resolve_precision(p, torch.device("cuda", 0)) for p in ("fp32", "bf16", "bf16-mixed")] == [
        "fp32",
        "bf16",
        "bf16-mixed",
    ]


@pytest.mark.parametrize(("old", "new"), [("auto", "auto"), ("fp32", "fp32"), ("bf16", "bf16-mixed")])
def test_deprecated_mixed_precision_is_read_as_precision(old, new):
    """The old field's bf16 (FSDP2's bf16 compute over fp32 shards) is bf16-mixed; it warns."""
    with pytest.warns(FutureWarning, match=f"mixed_precision is deprecated: read as backend.precision={new}"):
        backend = BackendConfig(name="fsdp2", mixed_precision=old)
    assert backend.precision == new
    assert (
        "mixed_precision" not in backend.model_dump()
        and "mixed_precision" not in BackendConfig.model_json_schema()["properties"]
    )


def test_deprecated_mixed_precision_in_a_stage_override_wins_and_bad_values_fail():
    with pytest.warns(FutureWarning):  # once, when the override loads
        config = load_config(overrides={"backend.precision": "bf16", "sft.backend": {"mixed_precision": "fp32"}})
    sft = config.backend_for("sft")
    assert sft.precision == "fp32"
    assert config.backend.precision == config.backend_for("dpo").precision == "bf16"
    with pytest.raises(ValidationError, match=r"mixed_precision \(deprecated, use backend.precision\): 'fp16'"):
        BackendConfig(mixed_precision="fp16")
    with pytest.raises(ValidationError, match="precision"):
        BackendConfig(precision="fp16")


def test_stage_override_sets_memory_features_for_that_stage_only():
    overrides = {**FSDP2_X2, "sft.backend": {"activation_checkpointing": True, "compile": True, "precision": "bf16"}}
    config = load_config(overrides=overrides)
    sft, dpo = config.backend_for("sft"), config.backend_for("dpo")
    assert (sft.activation_checkpointing, sft.compile, sft.precision, sft.name) == (True, True, "bf16", "fsdp2")
    assert (dpo.activation_checkpointing, dpo.compile, dpo.precision) == (False, False, "auto")


def test_memory_features_do_not_change_stage_fingerprints():
    """The backend (pipeline-wide or a stage's override) is not hashed: a checkpoint resumes
    with checkpointing, compile or another precision."""
    from trainer_core.fingerprint import stage_fingerprint

    inputs = {"data": "memory://no-manifest/data", "model": "init"}
    plain = load_config()
    tuned = load_config(
        overrides={
            "backend.precision": "bf16",
            "backend.activation_checkpointing": True,
            "backend.compile": True,
            "sft.backend": {"precision": "fp32", "compile": False},
        }
    )
    assert stage_fingerprint(plain, "sft", inputs) == stage_fingerprint(tuned, "sft", inputs)


def test_deepspeed_pure_bf16_needs_a_zero_stage():
    """No fp32 master copy (``bf16_master_weights_and_grads``) exists in DeepSpeed without ZeRO."""
    with pytest.raises(ValidationError, match="precision=bf16 .* needs backend.zero_stage 1-3"):
        BackendConfig(name="deepspeed", zero_stage=0, precision="bf16")
    BackendConfig(name="deepspeed", zero_stage=1, precision="bf16")
    BackendConfig(name="fsdp2", zero_stage=0, precision="bf16")  # zero_stage is DeepSpeed's only


@pytest.mark.parametrize(
    ("precision", "section"),
    [
        ("fp32", {"enabled": False}),
        ("bf16-mixed", {"enabled": True}),
        ("bf16", {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}),
    ],
)
def test_ds_config_precision_sections(precision, section):
    assert build_ds_config(BackendConfig(name="deepspeed"), _stage(), 2, precision)["bf16"] == section
