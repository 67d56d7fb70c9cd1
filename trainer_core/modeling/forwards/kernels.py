"""The LM head's kernels: what an output projection gives the target tokens (log-probabilities,
entropies, the summed NLL, a distillation divergence), a chunk of tokens at a time.

The LM head maps N hidden states to [N, V] logits; at N = 2.5k tokens and V = 152k words those
logits and their log-softmax take ~1.5 GB each in float32. Here the projection and the
log-softmax run on at most ``chunk_size`` tokens at once, and the backward recomputes each
chunk's logits instead of keeping them: the extra memory of forward and backward is
O(chunk_size x V), and nothing larger than [N] float32 is saved for the backward (besides the
hidden states and the weight, which exist anyway).

Shape legend: N tokens (the counted positions of a batch, flattened), H hidden (Hs a student's,
Ht a teacher's), V vocabulary, C chunk (``chunk_size`` tokens or fewer).

Sources: torchtune's chunked output loss (``CEWithChunkedOutputLoss``, and
``LinearCrossEntropyLoss``, which also chunks the output projection) and Liger-Kernel's fused
linear cross-entropy (``liger_kernel/ops/fused_linear_cross_entropy.py``: the logits gradient
``softmax - onehot`` formed chunk by chunk and projected at once onto the hidden states and the
weight). Departures: torchtune keeps every chunk's log-softmax for the backward (O(N V) in
total); Liger's ``mean``/``sum`` path computes the gradients during the forward, so an
evaluation forward pays for them too. This one recomputes in the backward, as Liger's
``reduction="none"`` path does, so a forward under ``torch.no_grad`` costs one projection.
On CUDA with ``liger-kernel`` installed (the ``gpu`` extra), the summed NLL of SFT uses Liger's
Triton kernel instead (:data:`NLL_SUM_KERNELS`).

:func:`chunked_generalized_jsd` (on-policy distillation) projects a student's and a teacher's
hidden states through their two heads the same way, a chunk at a time, and compares the two
distributions with :func:`~trainer_core.objectives.distill.generalized_jsd`; its backward
recomputes each chunk (activation checkpointing). Student and teacher may differ in hidden size;
they share the vocabulary.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from trainer_core.objectives.distill import generalized_jsd


CHUNK_SIZE_TOKENS = 1024
"""Default chunk: at V = 152k its float32 logits take 0.62 GB (the backward holds about two such)."""


HeadFn = Callable[[Tensor, Tensor, "Tensor | None", Tensor, int], Tensor]
"""(hidden [N, H], weight [V, H], bias [V] | None, targets [N] long, chunk_size) -> a tensor."""


def _compute_dtype(weight: Tensor) -> torch.dtype:
    """The head's matmul dtype: autocast's where the caller enabled it (bf16-mixed), else the weight's."""
    device_type = weight.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """[C, V] float32 logits of [C, H] hidden states; the matmul in ``weight``'s dtype (the compute dtype)."""
    return F.linear(hidden.to(weight.dtype), weight, bias).float()


def _add_matmul_(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` where ``out`` may be wider than ``a`` and ``b`` (the fp32 weight gradient of
    bf16 matmuls under autocast: then a [V, H] bf16 product is added per chunk)."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    else:
        out.add_(a @ b)


class _ChunkedLinearLogprobs(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T + bias)[i, targets[i]]`` chunk by chunk; see the module docstring.

    Under autocast (bf16-mixed) the matmuls run in the autocast dtype in the forward and in the
    backward alike (the backward runs outside the caller's autocast region, so the dtype is
    kept on ``ctx``); softmax and log-sum-exp are float32.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int) -> Tensor:
        return _ChunkedLinearLogprobs._chunks(ctx, hidden, weight, bias, targets, chunk_size, entropies=None)

    @staticmethod
    def _chunks(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        chunk_size: int,
        entropies: Tensor | None,
    ) -> Tensor:
        """The forward's loop; also fills ``entropies`` [N] float32 (of each row's distribution) when given."""
        ctx.compute_dtype = _compute_dtype(weight)
        ctx.chunk_size = chunk_size
        num_tokens = hidden.shape[0]
        logprobs = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)  # log-sum-exp per token
        with torch.autocast(weight.device.type, enabled=False):
            weight_c, bias_c = _cast(weight, bias, ctx.compute_dtype)
            for start in range(0, num_tokens, chunk_size):
                rows = slice(start, start + chunk_size)
                logits = _chunk_logits(hidden[rows], weight_c, bias_c)  # [C, V]
                lse[rows] = torch.logsumexp(logits, dim=-1)
                logprobs[rows] = logits.gather(1, targets[rows, None]).squeeze(1) - lse[rows]
                if entropies is not None:  # H = lse - sum_v p_v * logit_v
                    entropies[rows] = lse[rows] - (torch.softmax(logits, dim=-1) * logits).sum(-1)
                del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        return logprobs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs: Tensor):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(weight) if needs_weight else None
        grad_bias = torch.zeros_like(bias) if needs_bias else None
        grad_logprobs = grad_logprobs.float()
        weight_c, bias_c = _cast(weight, bias, ctx.compute_dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            g = grad_logprobs[rows, None]  # [C, 1]
            # d logprob / d logits = onehot(target) - softmax(logits), built in place in one [C, V] buffer.
            grad_logits = _chunk_logits(hidden[rows], weight_c, bias_c).sub_(lse[rows, None]).exp_().mul_(-g)
            grad_logits.scatter_add_(1, targets[rows, None], g)
            if needs_bias:
                grad_bias += grad_logits.sum(dim=0)
            grad_logits = grad_logits.to(weight_c.dtype)
            if needs_hidden:
                grad_hidden[rows] = grad_logits @ weight_c
            if needs_weight:
                _add_matmul_(grad_weight, grad_logits.t(), hidden[rows].to(weight_c.dtype))
            del grad_logits
        return grad_hidden, grad_weight, grad_bias, None, None


class _ChunkedLinearLogprobsEntropy(torch.autograd.Function):
    """:class:`_ChunkedLinearLogprobs` that also returns each row's entropy (not differentiable),
    from the same chunk logits: one projection per chunk gives both."""

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int
    ) -> tuple[Tensor, Tensor]:
        entropies = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        logprobs = _ChunkedLinearLogprobs._chunks(ctx, hidden, weight, bias, targets, chunk_size, entropies)
        ctx.mark_non_differentiable(entropies)
        return logprobs, entropies

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs: Tensor, grad_entropies: Tensor | None):
        return _ChunkedLinearLogprobs.backward.__wrapped__(ctx, grad_logprobs)


def _cast(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``weight`` and ``bias`` in ``dtype`` (no copy when they already are)."""
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _check_head_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int) -> None:
    """Raises ValueError unless ``chunk_size`` > 0 and the shapes are hidden [N, H], weight [V, H], targets [N]."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if hidden.ndim != 2 or targets.shape != hidden.shape[:1] or weight.shape[1:] != hidden.shape[1:]:
        raise ValueError(
            f"expected hidden [N, H], weight [V, H], targets [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(targets.shape)}"
        )


def chunked_linear_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int = CHUNK_SIZE_TOKENS
) -> Tensor:
    """Log-probability of each target under a linear head, never holding more than [C, V] logits.

    Equal (up to float rounding) to
    ``torch.log_softmax((hidden @ weight.T + bias).float(), -1).gather(1, targets[:, None])[:, 0]``;
    differentiable in ``hidden``, ``weight`` and ``bias`` (once: no double backward).

    Args:
        hidden: [N, H] float, the decoder's hidden states at the scored positions.
        weight: [V, H] the head's weight; the matmuls run in its dtype, or in autocast's where
            the caller enabled autocast (bf16-mixed: fp32 weight, bf16 matmuls, fp32 gradient).
        bias: [V] the head's bias, or None.
        targets: [N] long, the token scored at each position.
        chunk_size: tokens per chunk (> 0); the extra memory is O(chunk_size x V).

    Returns:
        [N] float32 log-probabilities.

    Raises:
        ValueError: ``chunk_size`` is not positive, or the shapes disagree.
    """
    _check_head_inputs(hidden, weight, targets, chunk_size)
    return _ChunkedLinearLogprobs.apply(hidden, weight, bias, targets, chunk_size)


class _ChunkedLinearNLLSum(torch.autograd.Function):
    """``-sum(log_softmax(hidden @ weight.T + bias)[i, targets[i]])`` chunk by chunk, its gradients
    formed in the forward (the loss is a sum, so they are known up to the scalar upstream gradient,
    which the backward applies): one projection per chunk instead of a forward one and a
    recomputed one, as Liger-Kernel's fused linear cross-entropy does for ``reduction="sum"``.
    Without ``with_grad`` (evaluation) the forward is the projection and the log-sum-exp only.
    """

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int, with_grad: bool
    ) -> Tensor:
        compute_dtype = _compute_dtype(weight)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        grad_weight = torch.zeros_like(weight) if with_grad else None
        grad_bias = torch.zeros_like(bias) if with_grad and bias is not None else None
        with torch.autocast(weight.device.type, enabled=False):
            weight_c, bias_c = _cast(weight, bias, compute_dtype)
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                logits = _chunk_logits(hidden[rows], weight_c, bias_c)  # [C, V] float32
                lse = torch.logsumexp(logits, dim=-1)
                total += (lse - logits.gather(1, targets[rows, None]).squeeze(1)).sum()
                if not with_grad:
                    continue
                # d nll / d logits = softmax(logits) - onehot(target), in place in the logits' buffer.
                grad_logits = logits.sub_(lse[:, None]).exp_()
                grad_logits.scatter_add_(1, targets[rows, None], torch.full_like(lse[:, None], -1.0))
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(dim=0)
                grad_logits = grad_logits.to(weight_c.dtype)
                grad_hidden[rows] = grad_logits @ weight_c
                _add_matmul_(grad_weight, grad_logits.t(), hidden[rows].to(weight_c.dtype))
                del logits, grad_logits
        if with_grad:
            ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total: Tensor):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        scale = grad_total.float()
        return (
            grad_hidden.mul_(scale.to(grad_hidden.dtype)) if needs_hidden else None,
            grad_weight.mul_(scale.to(grad_weight.dtype)) if needs_weight else None,
            grad_bias.mul_(scale.to(grad_bias.dtype)) if needs_bias and grad_bias is not None else None,
            None,
            None,
            None,
        )


def chunked_linear_logprobs_entropy(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int = CHUNK_SIZE_TOKENS
) -> tuple[Tensor, Tensor]:
    """:func:`chunked_linear_logprobs` and the entropy of each row's distribution, from one projection.

    The online RL stages need both for the completion tokens of a rollout batch; a full
    ``log_softmax`` over [N, T, V] would not fit at a real vocabulary (152k words: N x T x V x 4
    bytes, 18.5 GiB in float32 for 16 x 8 completions of 256 tokens).

    Args:
        hidden, weight, bias, targets, chunk_size: as :func:`chunked_linear_logprobs`
            (temperature scaling: divide ``hidden`` and ``bias`` by it first).

    Returns:
        (logprobs [N] float32, differentiable once; entropies [N] float32, ``-sum_v p_v log p_v``
        in nats, without gradient).

    Raises:
        ValueError: as :func:`chunked_linear_logprobs`.
    """
    _check_head_inputs(hidden, weight, targets, chunk_size)
    return _ChunkedLinearLogprobsEntropy.apply(hidden, weight, bias, targets, chunk_size)


def chunked_nll_sum(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int) -> Tensor:
    """Scalar float32 ``-sum(chunked_linear_logprobs(...))``: the SFT loss sum (shapes as there).

    The gradients are formed in the forward (:class:`_ChunkedLinearNLLSum`) when grad mode is on
    and an input requires them: the backward then costs no projection. Differentiable once.

    Raises:
        ValueError: as :func:`chunked_linear_logprobs`.
    """
    _check_head_inputs(hidden, weight, targets, chunk_size)
    with_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _ChunkedLinearNLLSum.apply(hidden, weight, bias, targets, chunk_size, with_grad)


def liger_nll_sum(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int) -> Tensor:
    """Scalar float32 summed NLL from Liger-Kernel's fused linear cross-entropy (CUDA, Triton).

    ``liger_kernel.transformers.functional.liger_fused_linear_cross_entropy`` with
    ``reduction="sum"``: it sizes its own chunks (``chunk_size`` is not used) so that a chunk's
    logits take about as much memory as ``hidden``, and computes the gradients in the forward
    (when ``hidden`` requires grad). Shapes as :func:`chunked_linear_logprobs`.
    """
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(hidden, weight, targets, bias=bias, reduction="sum").float()


NLL_SUM_KERNELS: dict[str, HeadFn] = {"torch": chunked_nll_sum, "liger": liger_nll_sum}
"""Implementations of the summed next-token NLL through the LM head, by name (:func:`nll_sum_kernel`)."""


@cache
def liger_available() -> bool:
    """True when ``liger_kernel`` (the ``gpu`` extra) is importable."""
    return importlib.util.find_spec("liger_kernel") is not None


def nll_sum_kernel(device: torch.device) -> str:
    """The :data:`NLL_SUM_KERNELS` entry for ``device``: ``liger`` on CUDA when installed, else ``torch``."""
    return "liger" if device.type == "cuda" and liger_available() else "torch"


def _chunk_jsd(
    student_hidden: Tensor,
    student_weight: Tensor,
    student_bias: Tensor | None,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    teacher_bias: Tensor | None,
    beta: float,
    temperature: float,
) -> Tensor:
    """[C] divergences of one chunk: both heads applied, then
    :func:`~trainer_core.objectives.distill.generalized_jsd`."""
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
    """:func:`~trainer_core.objectives.distill.generalized_jsd` of ``student_hidden @ student_weight.T
    (+ bias)`` against the teacher's logits, ``chunk_size`` tokens at a time; gradients reach the student's hidden states and head,
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
            (and :func:`~trainer_core.objectives.distill.generalized_jsd`'s errors).
    """
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(
            f"chunked_generalized_jsd: {student_hidden.shape[0]} student positions against "
            f"{teacher_hidden.shape[0]} teacher positions"
        )
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"chunked_generalized_jsd: the student's vocabulary has {student_weight.shape[0]} words, "
            f"the teacher's {teacher_weight.shape[0]} (they must share a tokenizer)"
        )
    if chunk_size < 1:
        raise ValueError(f"chunked_generalized_jsd: chunk_size must be >= 1, got {chunk_size}")
    teacher_hidden = teacher_hidden.detach()
    chunks = []
    for start in range(0, student_hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        args = (
            student_hidden[rows],
            student_weight,
            student_bias,
            teacher_hidden[rows],
            teacher_weight.detach(),
            None if teacher_bias is None else teacher_bias.detach(),
            beta,
            temperature,
        )
        needs_grad = torch.is_grad_enabled() and (student_hidden.requires_grad or student_weight.requires_grad)
        chunks.append(checkpoint(_chunk_jsd, *args, use_reentrant=False) if needs_grad else _chunk_jsd(*args))
    if not chunks:
        return student_hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(chunks)
