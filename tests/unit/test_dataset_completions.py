"""GKD's lambda (trainer_core.training.rl.dataset_completions): the per-iteration draw and the
dataset's completions shaped as a sampling round."""

from __future__ import annotations

import pytest
import torch

from trainer_core.errors import ConfigError
from trainer_core.training.rl.dataset_completions import check_dataset_rows, dataset_round, on_policy_iteration
from trainer_core.training.rl.rewards import PromptItem

PAD = 0


def test_the_draw_depends_on_seed_and_step_alone_with_probability_lambda():
    draws = [on_policy_iteration(0.5, 3, step) for step in range(400)]
    assert draws == [on_policy_iteration(0.5, 3, step) for step in range(400)]  # what every rank and a resume draw
    assert 0.43 < sum(draws) / 400 < 0.57
    assert draws != [on_policy_iteration(0.5, 4, step) for step in range(400)]
    assert all(on_policy_iteration(1.0, 3, step) for step in range(100))
    assert not any(on_policy_iteration(0.0, 3, step) for step in range(100))


def test_a_dataset_round_is_each_prompts_own_row_cut_at_its_first_loss_token():
    rows = [
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
        {"input_ids": [5, 9, 7, 8, 4, 3], "loss_mask": [0, 1, 0, 0, 1, 1]},
    ]  # a tool turn inside
    items = [PromptItem([], [5, 9], "1", row=1), PromptItem([], [5, 6], "2", row=0)]
    sample = dataset_round(items, rows, PAD, torch.device("cpu"))
    assert sample.items == items and sample.prompt_ids.tolist() == [[PAD, 5], [5, 6]]
    assert sample.prompt_mask.dtype == torch.float32 and sample.prompt_mask.tolist() == [[0, 1], [1, 1]]
    g = sample.generated
    assert g.completion_ids.tolist() == [[9, 7, 8, 4, 3], [7, 8, PAD, PAD, PAD]]
    assert g.completion_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]  # real tokens
    assert g.observation_mask.tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert g.policy_mask.tolist() == [[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]]  # what the loss counts
    assert not g.logprobs.any() and not sample.scores.any() and sample.texts == ["", ""]


def test_dataset_completions_need_the_rows():
    with pytest.raises(ValueError, match="prompt 0 has none"):
        dataset_round(
            [PromptItem([], [5], None)], [{"input_ids": [5, 6], "loss_mask": [0, 1]}], PAD, torch.device("cpu")
        )
    with pytest.raises(ConfigError, match=r"distill.lmbda=0.5 .*no sft/train rows"):
        check_dataset_rows("distill", 0.5, None)
    check_dataset_rows("distill", 1.0, None)
