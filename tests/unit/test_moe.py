"""Mixture-of-experts pieces on their own: config checks, router discovery on a tiny Mixtral,
the load-balancing loss against transformers' own, the expert-usage metrics by hand, and the
fingerprint of configs that do not use them."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from trainer_core.config import load_config
from trainer_core.data.batching import collate_causal
from trainer_core.data.tokenizer import train_tokenizer
from trainer_core.errors import ConfigError
from trainer_core.fingerprint import stage_fingerprint
from trainer_core.modeling.models import load_causal_lm
from trainer_core.training.moe import MoEObjective, with_moe
from trainer_core.training.supervised import SFTObjective

MIXTRAL = {
    "model.init.architecture": "mixtral",
    "model.init.hidden_size": 32,
    "model.init.intermediate_size": 32,
    "model.init.num_hidden_layers": 2,
    "model.init.num_local_experts": 4,
    "model.init.num_experts_per_tok": 2,
}


def test_config_checks():
    with pytest.raises(ConfigError, match=r"\['num_local_experts'\] apply to a mixture of experts"):
        load_config(overrides={"model.init.num_local_experts": 4})
    with pytest.raises(ConfigError, match="num_experts_per_tok=5 exceeds num_local_experts=4"):
        load_config(overrides={**MIXTRAL, "model.init.num_experts_per_tok": 5})
    with pytest.raises(ConfigError, match="grpo: .*moe: a setting of the supervised loop.*no router loss"):
        load_config(overrides={"grpo.moe.aux_loss_coef": 0.01})
    init = load_config(overrides={"model.init.architecture": "mixtral"}).model.init
    assert (init.experts, init.experts_per_token) == (4, 2)


def test_fingerprints_change_only_when_moe_is_used():
    base = stage_fingerprint(load_config(), "sft", {"data": "d", "model": "init"})
    explicit = load_config(overrides={"sft.moe.aux_loss_coef": 0.0, "model.init.architecture": "llama"})
    assert stage_fingerprint(explicit, "sft", {"data": "d", "model": "init"}) == base  # neutral values: not hashed
    assert (
        stage_fingerprint(load_config(overrides={"sft.moe.aux_loss_coef": 0.02}), "sft", {"data": "d", "model": "init"})
        != base
    )
    assert stage_fingerprint(load_config(overrides=MIXTRAL), "sft", {"data": "d", "model": "init"}) != base


def test_a_moe_section_hashes_as_before_the_router_temperature():
    """A stage committed with a router loss before ``moe.router_temperature`` existed keeps its
    fingerprint: the section hashed is ``{"aux_loss_coef": 0.02}``, without the new field."""
    from trainer_core.fingerprint import _not_hashed

    section = load_config(overrides={"sft.moe.aux_loss_coef": 0.02}).sft
    assert section.model_dump(mode="json", exclude=_not_hashed(section))["moe"] == {"aux_loss_coef": 0.02}


@pytest.fixture(scope="module")
def mixtral():
    tokenizer = train_tokenizer(["one two three four five six seven eight nine ten"] * 20, 64, 1)
    config = load_config(overrides=MIXTRAL)
    return load_causal_lm("init", config.model, tokenizer, 0)


def test_routers_that_do_not_say_their_experts_get_no_statistics(mixtral, monkeypatch):
    router = type(next(m for m in mixtral.modules() if type(m).__name__ == "MixtralTopKRouter"))
    monkeypatch.delattr(router, "top_k", raising=False)
    for module in mixtral.modules():
        if isinstance(module, router):
            monkeypatch.delattr(module, "top_k")
    objective = SFTObjective(None, 0)
    assert with_moe(mixtral, objective, 0.0, "sft") is objective
    with pytest.raises(ConfigError, match=r"do not say their experts and top-k"):
        with_moe(mixtral, objective, 0.02, "sft")


def test_dense_model_keeps_its_objective_and_refuses_a_router_loss():
    tokenizer = train_tokenizer(["one two three"] * 20, 64, 1)
    dense = load_causal_lm("init", load_config().model, tokenizer, 0)
    objective = SFTObjective(None, 0)
    assert with_moe(dense, objective, 0.0, "sft") is objective
    with pytest.raises(ConfigError, match=r"sft.moe.aux_loss_coef=0.01: the model has no mixture-of-experts routers"):
        with_moe(dense, objective, 0.01, "sft")


def test_router_loss_and_counts_of_one_micro_batch(mixtral):
    objective = with_moe(mixtral, SFTObjective(None, 0), 0.1, "sft")
    assert isinstance(objective, MoEObjective) and (objective.num_layers, objective.num_experts) == (2, 4)
    batch = collate_causal(
        [
            {"input_ids": [3, 5, 6, 7, 8], "loss_mask": [0, 1, 1, 1, 1]},
            {"input_ids": [3, 5, 6], "loss_mask": [0, 1, 1]},
        ],
        pad_id=0,
    )
    out = objective.step(mixtral, batch)
    # transformers' own loss from a plain forward with output_router_logits, padding masked
    with torch.no_grad():
        ref = mixtral(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    expected = load_balancing_loss_func(ref.router_logits, 4, 2, batch["attention_mask"])
    assert float(out.aux_loss.detach()) == pytest.approx(0.1 * float(expected), rel=1e-5)
    assert out.metric_sums["moe/expert_tokens"].shape == (2, 4)
    for layer in range(2):  # 8 real tokens, 2 experts each; the 2 padding positions are not counted
        counts = out.metric_sums["moe/expert_tokens"][layer].tolist()
        assert sum(counts) == 16
        chosen = torch.topk(ref.router_logits[layer], 2, dim=-1).indices[batch["attention_mask"].reshape(-1).bool()]
        assert counts == [float((chosen == e).sum()) for e in range(4)]
    with torch.no_grad():  # forwards without gradient are not captured
        assert objective.step(mixtral, batch).aux_loss is None


def test_finalize_metrics_by_hand(mixtral):
    objective = with_moe(mixtral, SFTObjective(None, 0), 0.0, "sft")
    sums = {"moe/aux_loss": torch.tensor(4.4), "moe/micro_batches": torch.tensor(2.0), "loss_part": torch.tensor(1.0)}
    sums["moe/expert_tokens"] = torch.tensor([[4.0, 4.0, 4.0, 4.0], [8.0, 0.0, 6.0, 2.0]])
    out = objective.finalize_metrics(sums)
    assert sums == {"loss_part": torch.tensor(1.0)}  # what it read is gone; the rest is the loop's to divide
    assert float(out["moe/aux_loss"]) == pytest.approx(2.2)
    assert float(out["moe/layer0/entropy"]) == pytest.approx(math.log(4))
    shares = [0.5, 0.0, 0.375, 0.125]
    assert [float(out[f"moe/layer1/expert{e}_share"]) for e in range(4)] == pytest.approx(shares)
    assert (float(out["moe/layer1/min_share"]), float(out["moe/layer1/max_share"])) == (0.0, 0.5)
    entropy = -sum(p * math.log(p) for p in shares if p)
    assert float(out["moe/layer1/entropy"]) == pytest.approx(entropy, rel=1e-6)
    assert float(out["moe/entropy"]) == pytest.approx((math.log(4) + entropy) / 2, rel=1e-6)


def test_router_temperature_schedule_by_hand():
    from trainer_core.config import RouterTemperatureConfig
    from trainer_core.training.moe import router_temperature

    schedule = RouterTemperatureConfig(start=3.0, end=1.0, steps=4)
    assert [router_temperature(schedule, done) for done in range(7)] == [3.0, 2.5, 2.0, 1.5, 1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="grpo: .*moe: a setting of the supervised loop.*no router loss"):
        load_config(overrides={"grpo.moe.router_temperature": {"start": 2.0, "steps": 10}})
    with pytest.raises(ConfigError, match="steps"):
        load_config(overrides={"sft.moe.router_temperature": {"start": 2.0}})
    base = stage_fingerprint(load_config(overrides=MIXTRAL), "sft", {"data": "d", "model": "init"})
    tempered = load_config(overrides={**MIXTRAL, "sft.moe.router_temperature": {"start": 2.0, "steps": 10}})
    assert stage_fingerprint(tempered, "sft", {"data": "d", "model": "init"}) != base


def test_router_temperature_divides_the_training_router_logits(mixtral):
    from trainer_core.config import RouterTemperatureConfig

    schedule = RouterTemperatureConfig(start=4.0, end=1.0, steps=2)
    objective = with_moe(mixtral, SFTObjective(None, 0), 0.0, "sft", schedule)
    batch = collate_causal([{"input_ids": [3, 5, 6, 7, 8], "loss_mask": [0, 1, 1, 1, 1]}], pad_id=0)
    try:
        with torch.no_grad():
            plain = mixtral(input_ids=batch["input_ids"], output_router_logits=True).router_logits
        for done, temperature in [(0, 4.0), (1, 2.5), (2, 1.0)]:
            objective.begin_step(done)
            mixtral(input_ids=batch["input_ids"])  # gradient enabled: tempered, and recorded
            logits, _ = objective.recorder.take()
            # block 0 sees the same input: its logits are divided by T (block 1's input follows
            # block 0's tempered routing)
            assert torch.allclose(logits[0], plain[0] / temperature, atol=1e-6)
            assert len(logits) == 2
            metrics = objective.finalize_metrics(
                {
                    "moe/aux_loss": torch.tensor(2.0),
                    "moe/micro_batches": torch.tensor(1.0),
                    "moe/expert_tokens": torch.ones(2, 4),
                }
            )
            assert float(metrics["moe/router_temperature"]) == temperature
        objective.begin_step(0)
        with torch.no_grad():  # evaluation and reference passes route at temperature 1
            again = mixtral(input_ids=batch["input_ids"], output_router_logits=True).router_logits
        assert all(torch.equal(a, b) for a, b in zip(again, plain))
    finally:
        objective.remove_hooks()
    mixtral(input_ids=batch["input_ids"])  # hooks gone: the committed model routes as it is
    assert objective.recorder.take() == ([], [])


def test_router_temperature_refused_for_dense_models_and_biased_routers(mixtral, monkeypatch):
    from trainer_core.config import RouterTemperatureConfig

    schedule = RouterTemperatureConfig(start=2.0, steps=5)
    tokenizer = train_tokenizer(["one two three"] * 20, 64, 1)
    dense = load_causal_lm("init", load_config().model, tokenizer, 0)
    with pytest.raises(ConfigError, match=r"sft.moe.router_temperature: the model has no mixture-of-experts routers"):
        with_moe(dense, SFTObjective(None, 0), 0.0, "sft", schedule)
    router = next(m for m in mixtral.modules() if type(m).__name__ == "MixtralTopKRouter")
    monkeypatch.setattr(router, "bias", torch.nn.Parameter(torch.zeros(4)), raising=False)
    with pytest.raises(
        ConfigError,
        match=r"dpo.moe.router_temperature: the router MixtralTopKRouter is not a "
        "bias-free linear map",
    ):
        with_moe(mixtral, SFTObjective(None, 0), 0.0, "dpo", schedule)
