"""Reward functions: the verifier by hand, weighted sums, and the reward model read at the last real token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig

from trainer_core.config import DataConfig, RewardConfig
from trainer_core.data.tokenizer import render_chat, train_tokenizer
from trainer_core.errors import ConfigError
from trainer_core.rewards import (
    PromptItem,
    RewardModelReward,
    VerifierReward,
    WeightedReward,
    build_reward,
    has_answer_line,
    is_correct,
)

MESSAGES = [{"role": "user", "content": "Tom has 3 apples. He buys 5 more. How many apples does Tom have now?"}]


def _prompt(answer: str | None = "8") -> PromptItem:
    return PromptItem(messages=MESSAGES, input_ids=[1, 2, 3], answer=answer)


def test_verifier_worked_values():
    """Answer 8, bonus 0.1: right + line -> 1.1; wrong + line -> 0.1; right without line -> 1.0; none -> 0."""
    completions = ["Tom has 3+5=<<3+5=8>>8 apples.\n#### 8", "Tom has 3+5=9 apples.\n#### 9", "it is 8", "no idea"]
    scores = VerifierReward(0.1)([_prompt()] * 4, completions)
    assert scores.dtype == torch.float32
    assert scores.tolist() == pytest.approx([1.1, 0.1, 1.0, 0.0])


def test_verifier_normalises_numbers_and_needs_answers():
    assert is_correct("#### 1,072", "1072") and is_correct("#### 72.0", "72")
    assert not is_correct("#### 72", None)
    assert has_answer_line("a\n#### 42\n") and not has_answer_line("#### forty-two")
    with pytest.raises(ValueError, match="known answers"):
        VerifierReward()([_prompt(None)], ["#### 1"])


def test_weighted_reward_sums_parts():
    """0.5 x verifier (1.1, 0.0) + 2 x constant 1 -> (2.55, 2.0)."""
    constant = lambda prompts, completions: torch.ones(len(completions))  # noqa: E731
    fn = WeightedReward([(0.5, VerifierReward(0.1)), (2.0, constant)])
    assert fn([_prompt()] * 2, ["#### 8", "?"]).tolist() == pytest.approx([2.55, 2.0])
    with pytest.raises(ValueError):
        WeightedReward([])


def test_build_reward_picks_the_configured_kind():
    assert isinstance(build_reward(RewardConfig(kind="verifier"), None), VerifierReward)
    with pytest.raises(ConfigError, match="reward model"):
        build_reward(RewardConfig(kind="reward_model"), None)
    constant = lambda prompts, completions: torch.full((len(completions),), 3.0)  # noqa: E731
    assert build_reward(RewardConfig(kind="reward_model"), lambda: constant) is constant
    weighted = build_reward(RewardConfig(kind="weighted", reward_model_weight=0.5, verifier_weight=1.0), lambda: constant)
    assert weighted([_prompt()], ["#### 8"]).tolist() == pytest.approx([1.5 + 1.1])


@pytest.fixture(scope="module")
def tiny_rm():
    texts = [render_chat(MESSAGES + [{"role": "assistant", "content": f"#### {i}"}]) for i in range(20)]
    tok = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, pad_token_id=tok.pad_token_id, num_labels=1,
    )
    model = AutoModelForSequenceClassification.from_config(config).eval()
    return model, tok


def test_reward_model_scores_last_real_token_independent_of_batching(tiny_rm):
    """A short and a long completion scored together (the short one right-padded) equal each scored
    alone, and equal the score head read at the last token of an unpadded forward."""
    model, tok = tiny_rm
    data = DataConfig(max_length_tokens=96, max_prompt_length_tokens=64)
    fn = RewardModelReward(model, tok, data, batch_size=2, device=torch.device("cpu"))
    completions = ["#### 1", "Tom has 3+5=<<3+5=8>>8 apples. Then more words.\n#### 8"]
    together = fn([_prompt()] * 2, completions)
    alone = torch.cat([fn([_prompt()], [c]) for c in completions])
    assert torch.allclose(together, alone, atol=1e-5)
    ids = tok(render_chat(MESSAGES + [{"role": "assistant", "content": completions[0]}]), add_special_tokens=False)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids["input_ids"]])).last_hidden_state
        direct = model.score(hidden[0, -1]).item()
    assert together[0].item() == pytest.approx(direct, abs=1e-5)
