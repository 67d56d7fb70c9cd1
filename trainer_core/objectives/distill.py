"""Distillation losses: the generalised Jensen-Shannon divergence between a student's and a
teacher's next-token distributions over the whole vocabulary, per token.

``generalized_jsd`` takes logits. Its chunked form from the two models' final hidden states
and output projections (heads), which never holds more than ``chunk_size`` tokens' [C, V] logits
of either model, is an LM head kernel:
:func:`~trainer_core.modeling.forwards.kernels.chunked_generalized_jsd`.

Shape legend: V vocabulary.

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
        raise ValueError(
            f"generalized_jsd: student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ (the two models must share a vocabulary)"
        )
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
