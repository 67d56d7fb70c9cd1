"""The ptx term (trainer_core.training.rl.ptx): demonstrations cut and batched, rows drawn from the
step alone, and the loss equal to transformers' own causal-LM loss on the same tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.tiny import LLAMA_2X32
from trainer_core.errors import ConfigError
from trainer_core.modeling.forwards.completion import PolicyAndValue, completion_forward
from trainer_core.training.rl.ptx import (
    check_demonstrations,
    collate_demonstrations,
    ptx_nll,
    ptx_row_indices,
    split_demonstration,
)

PAD = 0


def test_ptx_nll_hand_worked():
    logprobs = torch.tensor([[-1.0, -3.0], [-2.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert ptx_nll(logprobs, mask, 1).item() == pytest.approx(2.0)
    # two ranks: each rank's backward is scaled by 2, so each contributes half
    assert ptx_nll(logprobs, mask, 2).item() == pytest.approx(1.0)


def test_split_demonstration_cuts_at_the_first_loss_token():
    row = {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 0]}
    assert split_demonstration(row) == ([5, 6], [7, 8, 9], [1, 1, 0])
    # a loss on the first token: one prompt token is kept to predict from
    assert split_demonstration({"input_ids": [5, 6], "loss_mask": [1, 1]}) == ([5], [6], [1])
    with pytest.raises(ConfigError, match="ptx_coef.*no loss token"):
        split_demonstration({"input_ids": [5, 6, 7], "loss_mask": [0, 0, 0]})


def test_collate_demonstrations_pads_prompts_left_and_completions_right():
    rows = [
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]},
        {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 0, 1, 1]},
    ]
    batch = collate_demonstrations(rows, PAD, "cpu")
    assert batch.prompt_ids.tolist() == [[PAD, PAD, 5], [5, 6, 7]]
    assert batch.prompt_mask.tolist() == [[0, 0, 1], [1, 1, 1]]
    assert batch.completion_ids.tolist() == [[6, 7, 8], [8, 9, PAD]]
    assert batch.completion_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch.observation_mask is None  # every completion token is counted
    with pytest.raises(ValueError):
        collate_demonstrations([], PAD, "cpu")


def test_a_conversations_uncounted_turns_are_observations_attended_to():
    """A user or tool turn between assistant turns (loss 0 inside the completion) is attended to
    and not counted: the forward sees the row's whole text, as SFT did."""
    rows = [
        {"input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 1, 0, 0, 1, 1]},
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
    ]
    batch = collate_demonstrations(rows, PAD, "cpu")
    assert batch.completion_ids.tolist() == [[6, 7, 8, 9, 10], [6, 7, PAD, PAD, PAD]]
    assert batch.completion_mask.tolist() == [[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.observation_mask.tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]


def test_ptx_rows_come_from_the_step_alone():
    rows = ptx_row_indices(100, 8, seed=3, global_step=5, step_index=2, rank=0)
    assert rows == ptx_row_indices(100, 8, seed=3, global_step=5, step_index=2, rank=0)  # what a resume draws
    assert len(set(rows)) == 8 and all(0 <= i < 100 for i in rows)
    others = [
        ptx_row_indices(100, 8, 3, 5, 2, 1),
        ptx_row_indices(100, 8, 3, 6, 2, 0),
        ptx_row_indices(100, 8, 3, 5, 3, 0),
        ptx_row_indices(100, 8, 4, 5, 2, 0),
    ]
    assert all(o != rows for o in others)
    assert ptx_row_indices(3, 8, 0, 0, 0, 0) == [0, 1, 2]
    with pytest.raises(ValueError):
        ptx_row_indices(0, 8, 0, 0, 0, 0)


def test_ptx_loss_equals_the_causal_lm_loss_on_the_same_tokens():
    """completion_forward at temperature 1 over the cut demonstrations gives, through ptx_nll, the mean
    cross-entropy transformers computes with labels -100 outside the loss mask."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=40,
            **LLAMA_2X32,
            max_position_embeddings=64,
        )
    )
    rows = [
        {"input_ids": [3, 11, 12, 13, 14, 15], "loss_mask": [0, 0, 1, 1, 1, 0]},
        {"input_ids": [3, 21, 22, 23], "loss_mask": [0, 1, 1, 1]},
    ]
    batch = collate_demonstrations(rows, PAD, "cpu")
    out = completion_forward(PolicyAndValue(model, None), batch, temperature=1.0, with_values=False)
    ours = ptx_nll(out.logprobs, batch.completion_mask, 1)
    nll_sum, count = 0.0, 0
    for row in rows:
        ids = torch.tensor([row["input_ids"]])
        labels = ids.masked_fill(torch.tensor([row["loss_mask"]]) == 0, -100)
        n = int((labels[:, 1:] != -100).sum())
        nll_sum, count = nll_sum + model(input_ids=ids, labels=labels).loss * n, count + n
    assert ours.item() == pytest.approx((nll_sum / count).item(), abs=1e-5)
    ours.backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_a_ptx_term_without_demonstrations_is_refused():
    row = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    for missing, got in ((None, "none"), ([], "an empty split")):
        with pytest.raises(ConfigError, match=rf"grpo.ptx_coef=0.5 needs demonstrations .* got {got}"):
            check_demonstrations("grpo", 0.5, missing)
    check_demonstrations("grpo", 0.5, [row])
    check_demonstrations("ppo", 0.0, None)
