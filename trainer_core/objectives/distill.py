"""Distillation losses: the generalised Jensen-Shannon divergence between a student's and a
teacher's next-token distributions over the whole vocabulary, per token.

``generalized_jsd`` takes logits; ``chunked_generalized_jsd`` takes the two models' final
hidden states and output projections (heads) and never holds more than ``chunk_size`` tokens'
[C, V] logits of either model: each chunk is projected, compared and reduced to its [C]
divergences, and the backward recomputes the chunk (activation checkpointing) instead of
keeping its logits. Student and teacher may differ in hidden size; they share the vocabulary.

Shape legend: N tokens (the counted positions, flattened), H hidden (Hs the student's, Ht the
teacher's), V vocabulary, C chunk.

Source: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD), eq. 1; checked against TRL 1.16's
``GKDTrainer.generalized_jsd_loss`` (``trl/experimental/gkd/gkd_trainer.py``), whose convention
this follows: ``beta`` 0 is the forward KL ``KL(teacher || student)``, 1 the reverse KL
``KL(student || teacher)``, and between them ``beta KL(teacher || M) + (1 - beta) KL(student || M)``
with the mixture ``M = beta teacher + (1 - beta) student``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from trainer_core.objectives.chunked import CHUNK_SIZE_TOKENS


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, beta: float, temperature: float = 1.0) -> Tensor:
    """Per-token generalised JSD between the two next-token distributions (see the module docstring).

    Args:
        student_logits: [..., V] (any float dtype; computed in float32).
        teacher_logits: [..., V], the same shape.
        beta: in [0, 1]: 0 forward KL(teacher || student), 1 reverse KL(student || teacher).
        temperature: both logits are divided by it first (> 0).

    Returns:
        [...] float32 divergences, >= 0 (0 where the distributions agree).

    Raises:
        ValueError: ``beta`` outside [0, 1], ``temperature`` <= 0, or shapes that differ.

    Worked values (V = 2): student logits [0, 0] (p = [1/2, 1/2]), teacher logits [0, ln 3]
    (q = [1/4, 3/4]): beta 0: KL(q || p) = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.130812; beta 1:
    KL(p || q) = 1/2 ln 2 + 1/2 ln(2/3) = 0.143841; beta 0.5: M = [3/8, 5/8],
    0.5 KL(q || M) + 0.5 KL(p || M) = 0.033822.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"generalized_jsd: temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"generalized_jsd: student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ (the two models must share a vocabulary)")
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0.0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if beta == 1.0:
        return (student.exp() * (student - teacher)).sum(-1)
    mixture = torch.logsumexp(torch.stack([student + math.log1p(-beta), teacher + math.log(beta)]), dim=0)
    kl_teacher = (teacher.exp() * (teacher - mixture)).sum(-1)
    kl_student = (student.exp() * (student - mixture)).sum(-1)
    return beta * kl_teacher + (1.0 - beta) * kl_student


def _chunk_jsd(student_hidden: Tensor, student_weight: Tensor, student_bias: Tensor | None, teacher_hidden: Tensor,
               teacher_weight: Tensor, teacher_bias: Tensor | None, beta: float, temperature: float) -> Tensor:
    """[C] divergences of one chunk: both heads applied, then :func:`generalized_jsd`."""
    student_logits = F.linear(student_hidden.to(student_weight.dtype), student_weight, student_bias)
    with torch.no_grad():
        teacher_logits = F.linear(teacher_hidden.to(teacher_weight.dtype), teacher_weight, teacher_bias)
    return generalized_jsd(student_logits, teacher_logits, beta, temperature)


def chunked_generalized_jsd(
    student_hidden: Tensor,
    student_weight: Tensor,
    student_bias: Tensor | None,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    teacher_bias: Tensor | None,
    beta: float,
    temperature: float = 1.0,
    chunk_size: int = CHUNK_SIZE_TOKENS,
) -> Tensor:
    """:func:`generalized_jsd` of ``student_hidden @ student_weight.T (+ bias)`` against the teacher's
    logits, ``chunk_size`` tokens at a time; gradients reach the student's hidden states and head,
    never the teacher's (its logits are computed without gradients).

    Args:
        student_hidden: [N, Hs] the student's final hidden states at the counted positions.
        student_weight: [V, Hs] its output projection (``lm_head.weight``); ``student_bias`` [V] or None.
        teacher_hidden: [N, Ht] the teacher's, at the same positions (no gradient needed).
        teacher_weight: [V, Ht] its output projection; ``teacher_bias`` [V] or None.
        beta: the mixing coefficient (0 forward KL, 1 reverse KL).
        temperature: divides both logits.
        chunk_size: tokens per chunk (>= 1).

    Returns:
        [N] float32 divergences, equal to ``generalized_jsd`` of the full [N, V] logits (within
        float32 rounding).

    Raises:
        ValueError: the two sides' token counts or vocabularies differ, or ``chunk_size`` < 1
            (and :func:`generalized_jsd`'s errors).
    """
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(f"chunked_generalized_jsd: {student_hidden.shape[0]} student positions against "
                         f"{teacher_hidden.shape[0]} teacher positions")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"chunked_generalized_jsd: the student's vocabulary has {student_weight.shape[0]} words, "
                         f"the teacher's {teacher_weight.shape[0]} (they must share a tokenizer)")
    if chunk_size < 1:
        raise ValueError(f"chunked_generalized_jsd: chunk_size must be >= 1, got {chunk_size}")
    teacher_hidden = teacher_hidden.detach()
    chunks = []
    for start in range(0, student_hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        args = (student_hidden[rows], student_weight, student_bias, teacher_hidden[rows], teacher_weight.detach(),
                None if teacher_bias is None else teacher_bias.detach(), beta, temperature)
        needs_grad = torch.is_grad_enabled() and (student_hidden.requires_grad or student_weight.requires_grad)
        chunks.append(checkpoint(_chunk_jsd, *args, use_reentrant=False) if needs_grad else _chunk_jsd(*args))
    if not chunks:
        return student_hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(chunks)
