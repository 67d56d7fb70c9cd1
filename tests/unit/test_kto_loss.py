"""The KTO loss against hand-worked values of Ethayarajh et al. 2024, eq. (7) (TRL 1.16's
``KTOTrainer._compute_loss`` with ``loss_type="kto"``), and its objective's per-label metrics."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.data.batching import collate_kto
from trainer_core.objectives.kto import kto_loss
from trainer_core.training.supervised import KTOObjective, evaluate_pairs
from trainer_core.training.loop import BatchSource


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_hand_worked_values():
    logps = torch.tensor([-1.0, -2.0, -4.0])
    ref_logps = torch.tensor([-1.5, -1.5, -3.0])
    kl_logps, ref_kl_logps = torch.tensor([-3.0, -3.0, -5.0]), torch.tensor([-3.2, -3.4, -5.0])
    labels = torch.tensor([True, False, True])
    losses, m = kto_loss(
        logps, ref_logps, kl_logps, ref_kl_logps, labels, beta=0.5, desirable_weight=1.5, undesirable_weight=0.8
    )
    z0 = (0.2 + 0.4 + 0.0) / 3  # mean of kl_logps - ref_kl_logps
    expected = [
        1.5 * (1 - sigmoid(0.5 * (0.5 - z0))),  # desirable, log-ratio +0.5
        0.8 * (1 - sigmoid(0.5 * (z0 + 0.5))),  # undesirable, log-ratio -0.5
        1.5 * (1 - sigmoid(0.5 * (-1.0 - z0))),
    ]  # desirable, log-ratio -1
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert m["kl"].tolist() == pytest.approx([z0] * 3, rel=1e-6)
    assert m["rewards/chosen"].tolist() == pytest.approx([0.25, 0.0, -0.5])
    assert m["rewards/rejected"].tolist() == pytest.approx([0.0, -0.25, 0.0])
    assert m["count/chosen"].tolist() == [1.0, 0.0, 1.0]


def test_policy_equal_to_reference_gives_one_half_per_example():
    logps = torch.tensor([-3.0, -7.0])
    losses, m = kto_loss(logps, logps.clone(), logps - 1, logps - 1, torch.tensor([True, False]), beta=0.1)
    assert losses.tolist() == [0.5, 0.5] and m["kl"].tolist() == [0.0, 0.0]


def test_reference_point_is_clamped_at_zero_and_detached():
    logps = torch.tensor([-1.0, -2.0], requires_grad=True)
    kl_logps = torch.tensor([-9.0, -9.0], requires_grad=True)
    labels = torch.tensor([True, False])
    losses, m = kto_loss(logps, torch.tensor([-1.0, -2.0]), kl_logps, torch.tensor([-5.0, -5.0]), labels, beta=1.0)
    assert m["kl"].tolist() == [0.0, 0.0]  # KL estimate -4 clamped: no reference point below zero
    losses.sum().backward()
    assert kl_logps.grad is None
    # d/dr (1 - sigmoid(r)) = -1/4 at 0: the desirable log-ratio is pushed up, the undesirable down
    assert logps.grad.tolist() == pytest.approx([-0.25, 0.25])


def test_objective_reports_per_label_means():
    rows = [
        {
            "input_ids": [1, 2, 3],
            "loss_mask": [0, 1, 1],
            "kl_input_ids": [1, 2, 4],
            "kl_loss_mask": [0, 1, 1],
            "label": label,
            "ref_logprobs": ref,
            "ref_kl_logprobs": -3.0,
        }
        for label, ref in ((True, -2.0), (True, -4.0), (False, -6.0))
    ]

    class Uniform(torch.nn.Module):
        """log p = -log 8 for every token: completion log-prob -2 log 8 whatever the row."""

        def forward(self, input_ids, attention_mask=None, **_):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 8)})()

    from trainer_core.data.batching import BucketedBatchSampler

    source = BatchSource(
        rows=rows,
        sampler=BucketedBatchSampler([3, 3, 3], 3, seed=0, shuffle=False),
        collate=lambda r: collate_kto(r, pad_id=0),
        device=torch.device("cpu"),
    )
    objective = KTOObjective(0.1, source, 1)
    metrics = evaluate_pairs(objective, Uniform(), source, 1)
    lp = -2 * math.log(8)
    assert metrics["rewards/chosen"] == pytest.approx(0.1 * ((lp + 2) + (lp + 4)) / 2, rel=1e-5)
    assert metrics["rewards/rejected"] == pytest.approx(0.1 * (lp + 6), rel=1e-5)
    assert metrics["count/chosen"] == pytest.approx(2 / 3)
    assert metrics["kl"] == pytest.approx(max(lp + 3, 0.0), abs=1e-6)


def test_reference_point_from_the_caller_replaces_the_micro_batch_one():
    logps = torch.tensor([-1.0, -2.0])
    labels = torch.tensor([True, False])
    local, _ = kto_loss(logps, logps - 0.5, logps, logps, labels, beta=1.0)  # own estimate: KL 0
    shared, m = kto_loss(logps, logps - 0.5, logps, logps, labels, beta=1.0, kl=torch.tensor(0.3))
    assert m["kl"].tolist() == pytest.approx([0.3, 0.3])
    assert local.tolist() == pytest.approx([1 - sigmoid(0.5), 1 - sigmoid(-0.5)])
    assert shared.tolist() == pytest.approx([1 - sigmoid(0.5 - 0.3), 1 - sigmoid(0.3 - 0.5)])
