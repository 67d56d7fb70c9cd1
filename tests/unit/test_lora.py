"""LoRA (``trainer_core.modeling.lora``): injection, the disabled adapter, the merge, checkpoints, config."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

from trainer_core.backends.single import load_full_state, put_full_state, saved_state_dict
from trainer_core.checkpoint.components import Sharing
from trainer_core.config import LoraConfig, load_config
from trainer_core.errors import ConfigError
from trainer_core.fingerprint import stage_fingerprint
from trainer_core.modeling.lora import adapter_disabled, apply_lora, default_target_modules, has_lora, merged_state_dict

LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
)
PROJECTIONS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def tiny_lm(tie: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA, tie_word_embeddings=tie))


def randomise_b(model: torch.nn.Module) -> None:
    """What training does to a fresh adapter: B (zero at init) becomes non-zero."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def test_default_targets_are_every_projection_of_the_blocks():
    assert default_target_modules(tiny_lm()) == PROJECTIONS


def test_fresh_adapter_keeps_outputs_and_only_adapters_train():
    model, base = tiny_lm(), tiny_lm()
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8), seed=0)
    assert has_lora(model) and not has_lora(base)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * len(PROJECTIONS) * 2 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    x = torch.randint(1, 64, (2, 9))
    assert torch.equal(model(x).logits, base(x).logits)  # B = 0: the update is zero


def test_disabled_adapter_is_the_base_model_and_restores_training():
    model, base = tiny_lm(), tiny_lm()
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8), seed=0)
    randomise_b(model)
    x = torch.randint(1, 64, (2, 9))
    assert not torch.allclose(model(x).logits, base(x).logits)
    with adapter_disabled(model):
        assert torch.equal(model(x).logits, base(x).logits)
    assert not torch.allclose(model(x).logits, base(x).logits)
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)


def test_same_seed_same_adapter():
    a, b = tiny_lm(), tiny_lm()
    for m in (a, b):
        apply_lora(m, LoraConfig(enabled=True, rank=4), seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize(("rslora", "tie"), [(False, False), (True, True)])
def test_merged_weights_are_base_plus_scaled_b_times_a(rslora, tie):
    """W' = W + (alpha / r) B A (Hu et al. 2021, eq. 3); alpha / sqrt(r) with rsLoRA. Tied
    embeddings keep one name; the merged model computes what the adapted one does."""
    rank, alpha = 4, 8.0
    model = tiny_lm(tie)
    apply_lora(model, LoraConfig(enabled=True, rank=rank, alpha=alpha, use_rslora=rslora), seed=0)
    randomise_b(model)
    state = model.state_dict()
    merged = merged_state_dict(model, state, copy=True)
    plain = dict(tiny_lm(tie).named_parameters())
    assert sorted(merged) == sorted(plain)
    scale = alpha / (math.sqrt(rank) if rslora else rank)
    for name in plain:
        prefix = name.removesuffix(".weight")
        if f"{prefix}.lora_A.default.weight" in state:
            a, b = state[f"{prefix}.lora_A.default.weight"], state[f"{prefix}.lora_B.default.weight"]
            expected = state[f"{prefix}.base_layer.weight"] + scale * (b @ a)
        else:
            expected = state[name]
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name
    # copy=True: the live model was not merged into
    assert torch.equal(
        state["model.layers.0.self_attn.q_proj.base_layer.weight"],
        tiny_lm(tie).state_dict()["model.layers.0.self_attn.q_proj.weight"],
    )
    reloaded = tiny_lm(tie)
    reloaded.load_state_dict(merged, strict=False)
    x = torch.randint(1, 64, (2, 9))
    assert torch.allclose(reloaded(x).logits, model(x).logits, atol=1e-5)


def test_reward_model_trains_its_score_head_too():
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_config(LlamaConfig(**LLAMA, num_labels=1))
    apply_lora(rm, LoraConfig(enabled=True, rank=2), seed=0)
    trainable = {n for n, p in rm.named_parameters() if p.requires_grad}
    assert "score.weight" in trainable and {n for n in trainable if ".lora_" not in n} == {"score.weight"}
    assert "score.weight" in merged_state_dict(rm, rm.state_dict(), copy=True)


def test_unknown_target_module_is_a_config_error():
    with pytest.raises(ConfigError, match="lora.target_modules"):
        apply_lora(tiny_lm(), LoraConfig(enabled=True, target_modules=["qkv_fused"]), seed=0)


class Out:
    """A ``StagedWriter`` stand-in that keeps what it is given and reads it back by name."""

    def __init__(self):
        self.files: dict[str, bytes] = {}

    def put(self, name, sharing, data, checksum):
        assert sharing is Sharing.REPLICATED
        self.files[name] = data


def test_checkpoint_of_a_lora_model_holds_trainable_weights_and_reloads_exactly(tmp_path):
    model = tiny_lm(tie=True)
    apply_lora(model, LoraConfig(enabled=True, rank=4), seed=0)
    randomise_b(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.randint(1, 64, (2, 9))).logits.sum().backward()
    optimizer.step()
    keys = set(saved_state_dict(model))
    assert keys == {n for n, p in model.named_parameters() if p.requires_grad}
    out = Out()
    put_full_state(out, model, optimizer)
    for name, data in out.files.items():
        (tmp_path / name).write_bytes(data)
    fresh = tiny_lm(tie=True)
    apply_lora(fresh, LoraConfig(enabled=True, rank=4), seed=0)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    load_full_state(fresh, fresh_opt, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    full = tiny_lm(tie=True)
    with pytest.raises(RuntimeError, match="does not match the model"):
        load_full_state(full, torch.optim.AdamW(full.parameters()), str(tmp_path))


def test_a_full_model_checkpoint_is_unchanged():
    model = tiny_lm(tie=True)
    assert saved_state_dict(model).keys() == model.state_dict().keys()


def test_stage_override_merges_over_the_pipeline_lora_and_changes_the_fingerprint():
    base = {"lora.enabled": True, "lora.rank": 8, "reward_model.lora.enabled": False}  # the demo's RM is implicit
    config = load_config(
        "configs/demo.yaml", overrides={**base, "sft.lora": {"enabled": False}, "dpo.lora": {"rank": 4}}
    )
    assert not config.lora_for("sft").enabled
    assert (config.lora_for("dpo").enabled, config.lora_for("dpo").rank) == (True, 4)
    assert (config.lora_for("grpo").rank, config.lora_for("evaluate").enabled) == (8, False)
    inputs = {"data": "d", "model": "m", "reference": "m"}
    plain = load_config("configs/demo.yaml")
    fp = lambda c, s: stage_fingerprint(c, s, inputs)
    assert fp(config, "sft") == fp(plain, "sft")  # off for SFT: the fingerprint of a run without LoRA
    assert fp(config, "dpo") != fp(plain, "dpo")
    assert fp(config, "dpo") != fp(load_config("configs/demo.yaml", overrides=base), "dpo")


def test_qlora_is_refused_off_the_single_backend_naming_the_stage():
    with pytest.raises(ConfigError, match=r"sft.lora.quantize=4bit.*single backend.*'fsdp2'"):
        load_config(
            "configs/demo.yaml", overrides={"sft.lora": {"enabled": True, "quantize": "4bit"}, "backend.name": "fsdp2"}
        )
    with pytest.raises(ConfigError, match=r"dpo\.lora\.rank: Input should be greater than or equal to 1"):
        load_config("configs/demo.yaml", overrides={"dpo.lora": {"rank": 0}})


def write_adapter(model: torch.nn.Module, path, base: str) -> None:
    from trainer_core.modeling.lora import adapter_files

    path.mkdir(parents=True, exist_ok=True)
    for name, data in adapter_files(model, model.state_dict(), base).items():
        (path / name).write_bytes(data)


@pytest.mark.parametrize("tie", [False, True])
def test_committed_adapter_loads_in_peft_and_merges_in_posttrain(tmp_path, tie):
    """The adapter files are PEFT's: ``PeftModel.from_pretrained`` over the saved base computes
    the live LoRA model's logits; posttrain's loader merges them into the same model, trainable."""
    from peft import PeftModel

    from trainer_core.config import ModelConfig
    from trainer_core.modeling.lora import base_state_dict, is_adapter_dir
    from trainer_core.modeling.models import adapter_source, load_causal_lm

    model = tiny_lm(tie)
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8), seed=0)
    randomise_b(model)
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    base = tiny_lm(tie)
    base.save_pretrained(base_dir, state_dict=base_state_dict(model.state_dict()))
    assert sorted(base_state_dict(model.state_dict())) == sorted(n for n, _ in base.named_parameters())
    write_adapter(model, adapter_dir, str(base_dir))
    assert is_adapter_dir(str(adapter_dir)) and not is_adapter_dir(str(base_dir))
    assert adapter_source(str(adapter_dir)) == str(adapter_dir) and adapter_source(str(base_dir)) is None

    x = torch.randint(1, 64, (2, 9))
    expected = model(x).logits
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    assert torch.allclose(peft_model(x).logits, expected, atol=1e-5)
    merged = load_causal_lm(str(adapter_dir), ModelConfig(name_or_path=str(adapter_dir)), None, seed=0)
    assert not has_lora(merged)
    assert torch.allclose(merged(x).logits, expected, atol=1e-5)
    # trainable as a loaded plain model is (peft's injection froze the base): a full-weight stage
    # after an adapter commit trains it
    assert all(p.requires_grad for p in merged.parameters())


def test_committed_reward_adapter_carries_its_score_head(tmp_path):
    """A reward model's adapter holds its trained score head (peft's ``modules_to_save``); its
    base is a causal LM whose score head the loader draws fresh and the adapter replaces."""
    from peft import PeftModel

    from trainer_core.config import ModelConfig
    from trainer_core.modeling.models import load_reward_model

    lm_dir = tmp_path / "lm"
    tiny_lm().save_pretrained(lm_dir)
    config = ModelConfig(name_or_path=str(lm_dir))
    model = load_reward_model(str(lm_dir), config, None, seed=0)
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8), seed=0)
    randomise_b(model)
    with torch.no_grad():
        model.score.weight.mul_(3.0)  # trained: not what a fresh draw gives
    write_adapter(model, tmp_path / "rm", str(lm_dir))
    x = torch.randint(1, 64, (2, 9))
    expected = model(x).logits
    merged = load_reward_model(str(tmp_path / "rm"), config, None, seed=1)
    assert torch.allclose(merged(x).logits, expected, atol=1e-5)
    base = AutoModelForSequenceClassification.from_pretrained(lm_dir, num_labels=1, pad_token_id=0)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "rm")
    assert torch.allclose(peft_model(x).logits, expected, atol=1e-5)


def test_continued_adapter_trains_the_saved_weights_and_refuses_other_settings(tmp_path):
    from trainer_core.modeling.lora import attach_adapter, check_continued, peft_config

    model = tiny_lm()
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8), seed=0)
    randomise_b(model)
    write_adapter(model, tmp_path / "adapter", "unused")
    continued = tiny_lm()
    wanted = peft_config(LoraConfig(enabled=True, rank=4, alpha=8), continued)
    attach_adapter(continued, str(tmp_path / "adapter"), trainable=True)
    check_continued(wanted, continued.posttrain_lora, "adapter")
    trained = {n: p for n, p in continued.named_parameters() if p.requires_grad}
    live = dict(model.named_parameters())
    assert sorted(trained) == sorted(n for n, p in live.items() if p.requires_grad)
    assert all(torch.equal(p, live[n]) for n, p in trained.items())
    other = peft_config(LoraConfig(enabled=True, rank=8, alpha=8, target_modules=["q_proj"]), tiny_lm())
    with pytest.raises(ConfigError, match=r"rank: stage 8, adapter 4.*target_modules"):
        check_continued(other, continued.posttrain_lora, "adapter")


def test_adapter_that_does_not_fit_the_model_names_the_file(tmp_path):
    from trainer_core.modeling.lora import attach_adapter

    model = tiny_lm()
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8), seed=0)
    write_adapter(model, tmp_path / "adapter", "unused")
    smaller = AutoModelForCausalLM.from_config(LlamaConfig(**{**LLAMA, "hidden_size": 16}))
    with pytest.raises(ConfigError, match=r"adapter_model.safetensors: the adapter does not fit the model"):
        attach_adapter(smaller, str(tmp_path / "adapter"), trainable=True)
