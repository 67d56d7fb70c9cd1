"""Losses against values worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.objectives.dpo import PairLogprobs, dpo_loss
from trainer_core.objectives.logprobs import compute_logprobs, sequence_logprobs, shift_mask
from trainer_core.objectives.reward import bradley_terry_loss
from trainer_core.objectives.sft import sft_loss

LOG2 = math.log(2.0)


def test_compute_logprobs_matches_log_softmax_gather():
    """out[:, t] = log_softmax(logits[:, t])[labels[:, t+1]]."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:, None]).squeeze(-1)
    assert torch.allclose(compute_logprobs(logits, labels), expected, atol=1e-6)


def test_uniform_logits_cost_log_vocab_per_counted_token():
    """Uniform logits over V=8: each counted token costs log 8; 3 counted tokens -> 3 log 8."""
    logits = torch.zeros(1, 5, 8)
    input_ids = torch.tensor([[1, 2, 3, 4, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1]])
    loss_sum, count = sft_loss(compute_logprobs(logits, input_ids), shift_mask(loss_mask))
    assert count.item() == 3
    assert loss_sum.item() == pytest.approx(3 * math.log(8), rel=1e-6)


def test_sft_loss_ignores_prompt_and_padding_tokens():
    """Changing logits that predict prompt or padding tokens leaves the loss unchanged."""
    torch.manual_seed(1)
    logits = torch.randn(1, 6, 11)
    input_ids = torch.tensor([[5, 6, 7, 8, 0, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 0]])  # tokens 2, 3 are the completion

    def loss(lg):
        return sft_loss(compute_logprobs(lg, input_ids), shift_mask(loss_mask))

    base, count = loss(logits)
    perturbed = logits.clone()
    perturbed[0, 0, 6] += 100.0  # position 0 predicts token 1 (prompt)
    perturbed[0, 3:, 0] -= 50.0  # positions 3, 4 predict tokens 4, 5 (padding)
    assert loss(perturbed)[0].item() == pytest.approx(base.item(), rel=1e-6)
    assert count.item() == 2
    perturbed[0, 1, 7] += 3.0  # position 1 predicts token 2 (completion): must change the loss
    assert loss(perturbed)[0].item() != pytest.approx(base.item(), rel=1e-6)


def test_sequence_logprobs_sums_masked_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = shift_mask(torch.tensor([[0, 0, 1, 1]]))
    assert sequence_logprobs(logprobs, mask).item() == pytest.approx(-5.0)


def test_dpo_loss_is_log2_when_policy_equals_reference():
    lp = torch.tensor([-3.0, -10.0, -0.5])
    losses, m = dpo_loss(PairLogprobs(lp, lp - 1.0, lp, lp - 1.0), beta=0.1)
    assert torch.allclose(losses, torch.full((3,), LOG2))
    assert torch.all(m["rewards/accuracies"] == 0)
    assert torch.allclose(m["rewards/margins"], torch.zeros(3))


def test_dpo_loss_and_trl_metrics_by_hand():
    """beta=0.5; chosen log-ratio +2, rejected log-ratio -2 -> logits 4, loss = -log sigmoid(2)."""
    pairs = PairLogprobs(torch.tensor([-1.0]), torch.tensor([-7.0]), torch.tensor([-3.0]), torch.tensor([-5.0]))
    losses, m = dpo_loss(pairs, beta=0.5)
    assert losses.item() == pytest.approx(math.log1p(math.exp(-2.0)), rel=1e-6)
    assert m["rewards/chosen"].item() == pytest.approx(1.0)
    assert m["rewards/rejected"].item() == pytest.approx(-1.0)
    assert m["rewards/margins"].item() == pytest.approx(2.0)
    assert m["rewards/accuracies"].item() == 1.0


def test_dpo_rejects_non_positive_beta():
    x = torch.zeros(1)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(PairLogprobs(x, x, x, x), beta=0.0)


def test_bradley_terry_on_hand_made_batch():
    """Margins [0, 1, -1]: losses [log 2, log(1+e^-1), log(1+e)], accuracy 1/3."""
    chosen = torch.tensor([0.5, 2.0, 0.0])
    rejected = torch.tensor([0.5, 1.0, 1.0])
    losses, m = bradley_terry_loss(chosen, rejected)
    expected = [LOG2, math.log1p(math.exp(-1.0)), math.log1p(math.exp(1.0))]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert m["accuracies"].tolist() == [0.0, 1.0, 0.0]
    assert m["margins"].tolist() == pytest.approx([0.0, 1.0, -1.0])


def test_bradley_terry_gradient_pushes_chosen_up():
    chosen = torch.tensor([0.0], requires_grad=True)
    rejected = torch.tensor([0.0], requires_grad=True)
    losses, _ = bradley_terry_loss(chosen, rejected)
    losses.sum().backward()
    assert chosen.grad.item() == pytest.approx(-0.5)
    assert rejected.grad.item() == pytest.approx(0.5)
