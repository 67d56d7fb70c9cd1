"""The distillation divergence (``trainer_core/objectives/distill.py``): hand-worked values, TRL
1.16's ``generalized_jsd_loss`` as the oracle on the same logits (beta 0, 0.5, 1), and the
chunked form from hidden states and heads equal to the unchunked one, gradients included."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.modeling.forwards.kernels import chunked_generalized_jsd
from trainer_core.objectives.distill import generalized_jsd


def test_hand_worked_values():
    student, teacher = torch.tensor([0.0, 0.0]), torch.tensor([0.0, math.log(3.0)])
    expected = {
        0.0: 0.25 * math.log(0.5) + 0.75 * math.log(1.5),
        1.0: 0.5 * math.log(2.0) + 0.5 * math.log(2 / 3),
        0.5: 0.5 * (0.25 * math.log(0.25 / 0.375) + 0.75 * math.log(0.75 / 0.625))
        + 0.5 * (0.5 * math.log(0.5 / 0.375) + 0.5 * math.log(0.5 / 0.625)),
    }
    for beta, value in expected.items():
        assert generalized_jsd(student, teacher, beta).item() == pytest.approx(value, abs=1e-6)
    assert generalized_jsd(teacher, teacher, 0.5).item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(student, teacher, 1.5)
    with pytest.raises(ValueError, match="share a vocabulary"):
        generalized_jsd(student, torch.zeros(3), 0.5)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trl_generalized_jsd_loss_is_the_oracle(beta, temperature):
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer", reason="TRL (the dev extra) is not installed")
    torch.manual_seed(0)
    student, teacher = torch.randn(3, 5, 11) * 2, torch.randn(3, 5, 11) * 2
    labels = torch.randint(0, 11, (3, 5))
    labels[0, :2] = -100  # prompt positions: not counted
    ours = generalized_jsd(student, teacher, beta, temperature)[labels != -100]
    theirs = gkd.GKDTrainer.generalized_jsd_loss(
        student, teacher, labels=labels, beta=beta, temperature=temperature, reduction="batchmean"
    )
    assert ours.sum().item() / (labels != -100).sum().item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_chunked_divergence_equals_the_unchunked_one_with_its_gradients(beta):
    torch.manual_seed(1)
    tokens, vocab = 13, 37
    student_hidden = torch.randn(tokens, 8, requires_grad=True)
    student_head = torch.nn.Linear(8, vocab, bias=False)
    teacher_hidden, teacher_head = torch.randn(tokens, 16), torch.nn.Linear(16, vocab, bias=True)  # a wider teacher
    weights = torch.rand(tokens)
    full = generalized_jsd(student_head(student_hidden), teacher_head(teacher_hidden).detach(), beta)
    (full * weights).sum().backward()
    grads = student_hidden.grad.clone(), student_head.weight.grad.clone()
    student_hidden.grad, student_head.weight.grad = None, None
    chunked = chunked_generalized_jsd(
        student_hidden,
        student_head.weight,
        None,
        teacher_hidden,
        teacher_head.weight,
        teacher_head.bias,
        beta,
        chunk_size=4,
    )
    (chunked * weights).sum().backward()
    torch.testing.assert_close(chunked, full.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(student_hidden.grad, grads[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(student_head.weight.grad, grads[1], atol=1e-5, rtol=0)
    assert teacher_head.weight.grad is None  # the teacher is never trained


def test_the_chunked_divergence_names_a_vocabulary_mismatch():
    with pytest.raises(ValueError, match="must share a tokenizer"):
        chunked_generalized_jsd(
            torch.randn(2, 4), torch.randn(10, 4), None, torch.randn(2, 4), torch.randn(12, 4), None, 0.5
        )


def _tiny_llama(hidden: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=29,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
        )
    ).float()


def test_the_students_forward_gives_the_divergence_of_the_two_models_full_logits():
    """The update's forward (``completion_forward`` with a ``TeacherTarget``: the teacher's hidden
    states from ``completion_hidden``, its head from ``frozen_head``) equals ``generalized_jsd`` of
    the two models' full logits at the student's tokens (left-padded prompts, a padded completion,
    a tool observation not counted), 0 elsewhere; the gradient reaches the student only."""
    from trainer_core.modeling.forwards.completion import (
        Completions,
        PolicyAndValue,
        TeacherTarget,
        completion_forward,
        completion_hidden,
        completion_inputs,
        completion_start,
    )
    from trainer_core.modeling.forwards.heads import frozen_head

    student, teacher = PolicyAndValue(_tiny_llama(16, 0)), _tiny_llama(24, 1).requires_grad_(False)
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    completion_ids = torch.tensor([[3, 4, 11, 12, 0], [13, 14, 15, 16, 17]])
    completion_mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0, 1.0]])
    observation_mask = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0]])
    batch = Completions(prompt_ids, prompt_mask, completion_ids, completion_mask, observation_mask=observation_mask)
    for beta in (0.0, 0.5, 1.0):
        target = TeacherTarget(completion_hidden(teacher, batch), *frozen_head(teacher), beta=beta, temperature=0.7)
        out = completion_forward(student, batch, temperature=0.7, with_values=False, teacher=target)
        inputs, start = (
            completion_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask, observation_mask),
            completion_start(prompt_ids),
        )
        expected = (
            generalized_jsd(
                student.policy(**inputs).logits[:, start:-1], teacher(**inputs).logits[:, start:-1], beta, 0.7
            )
            * completion_mask
        )
        torch.testing.assert_close(out.divergences, expected, atol=1e-5, rtol=0)
        assert (out.divergences[completion_mask == 0] == 0).all() and (out.divergences[completion_mask > 0] > 0).all()
    out.divergences.sum().backward()
    assert student.policy.lm_head.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in teacher.parameters())
