"""The implicit reward model (``reward_model.parameterization: implicit``).

Its reward is SimPO's reference-free implicit reward, ``beta / |y| * log pi(y | x)`` (Meng et al.
2024, eq. 4), read from a causal LM whose config carries the marker. Checked here: the reward
against a hand computation from the full logits; packed pairs against padded ones (values and
gradients); the Bradley-Terry loss on it against the project's SimPO loss with no margin (the
same objective, so the stage trains what the paper trains); and the marker's round trip through
a saved directory (loaded back as a causal LM, logged to MLflow as text generation).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.tiny import LLAMA_2X32
from trainer_core.config import ModelConfig
from trainer_core.data.batching import collate_pairs, collate_pairs_packed
from trainer_core.mlflow_model import _directory_task
from trainer_core.modeling.forwards.pairs import pair_logprobs, pair_rewards
from trainer_core.modeling.forwards.rewards import (
    IMPLICIT_REWARD_KEY,
    implicit_reward_beta,
    mark_implicit_reward,
    sequence_rewards,
)
from trainer_core.modeling.models import load_reward_model
from trainer_core.objectives.dpo import PairLogprobs, simpo_loss
from trainer_core.training.supervised import RewardObjective, collate_with_reference

PAD, VOCAB, BETA = 0, 64, 2.0


def _pairs(num: int) -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    pairs = []
    for i in range(num):
        prompt = 3 + i
        sides = {}
        for side, extra in (("chosen", 4 + 2 * i), ("rejected", 7 - i)):
            ids = torch.randint(1, VOCAB, (prompt + extra,), generator=gen).tolist()
            sides[f"{side}_input_ids"], sides[f"{side}_loss_mask"] = ids, [0] * prompt + [1] * extra
        pairs.append(sides)
    return pairs


def _implicit_lm() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        **LLAMA_2X32,
        max_position_embeddings=128,
        pad_token_id=PAD,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mark_implicit_reward(model, BETA)
    return model


def test_the_reward_is_beta_times_the_mean_completion_logprob():
    model = _implicit_lm()
    batch = collate_pairs(_pairs(3), PAD)
    ids, attention, loss_mask = batch["chosen_input_ids"], batch["chosen_attention_mask"], batch["chosen_loss_mask"]
    with torch.no_grad():
        got = sequence_rewards(model, ids, attention, loss_mask)
        logits = model(input_ids=ids, attention_mask=attention).logits
    token = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    counted = loss_mask[:, 1:].double()
    want = BETA * (token * counted).sum(-1) / counted.sum(-1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert implicit_reward_beta(torch.nn.Sequential(model)) is None  # no .module: a plain container is not unwrapped
    assert implicit_reward_beta(model) == BETA


def test_packed_pairs_score_and_train_as_padded_ones():
    model = _implicit_lm()
    pairs = _pairs(4)
    padded, packed = collate_pairs(pairs, PAD), collate_pairs_packed(pairs, PAD)
    with torch.no_grad():
        for got, want in zip(pair_rewards(model, packed), pair_rewards(model, padded), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grads = []
    for batch in (padded, packed):
        model.zero_grad()
        RewardObjective(None, 1).step(model, batch).loss_sum.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for g, h in zip(*grads, strict=True):
        torch.testing.assert_close(h, g, rtol=1e-5, atol=1e-5)


def test_bradley_terry_on_the_implicit_reward_is_simpo_without_margin():
    model = _implicit_lm()
    batch = collate_with_reference(_pairs(4), PAD)
    loss = RewardObjective(None, 1).step(model, batch).loss_sum
    chosen, rejected = pair_logprobs(model, batch)
    pairs = PairLogprobs(
        chosen, rejected, chosen_lengths=batch["chosen_lengths"], rejected_lengths=batch["rejected_lengths"]
    )
    simpo, _ = simpo_loss(pairs, beta=BETA, gamma=0.0)
    torch.testing.assert_close(loss, simpo.sum(), rtol=1e-6, atol=1e-6)


def test_the_marker_survives_a_saved_directory(tmp_path):
    model = _implicit_lm()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())[IMPLICIT_REWARD_KEY] == {"beta": BETA}
    loaded = load_reward_model(
        str(tmp_path), ModelConfig(name_or_path=str(tmp_path)), None, seed=0
    )  # the tokenizer sizes "init" only
    assert type(loaded).__name__ == "LlamaForCausalLM" and implicit_reward_beta(loaded) == BETA
    for a, b in zip(loaded.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert _directory_task(str(tmp_path), "text-classification") == "text-generation"
    delattr(model.config, IMPLICIT_REWARD_KEY)
    model.config.save_pretrained(tmp_path)
    assert _directory_task(str(tmp_path), "text-classification") == "text-classification"


def test_beta_must_be_positive():
    with pytest.raises(ValueError, match="beta must be > 0"):
        mark_implicit_reward(_implicit_lm(), 0.0)


def test_an_implicit_reward_model_with_lora_is_refused_at_load():
    """Refused when the config loads (the pipeline's lora or the stage's), for a run that trains
    the reward model; not for one that does not."""
    from trainer_core.config import load_config
    from trainer_core.errors import ConfigError

    implicit = {"reward_model.parameterization": "implicit"}
    for lora in ({"lora.enabled": True}, {"reward_model.lora.enabled": True}):
        with pytest.raises(ConfigError, match=r"reward_model.parameterization='implicit' does not take LoRA"):
            load_config(overrides={**implicit, **lora})
    load_config(overrides={**implicit, "lora.enabled": True, "reward_model.lora.enabled": False})
    load_config(overrides={**implicit, "lora.enabled": True, "stages": "prepare_data,sft,dpo,evaluate"})
