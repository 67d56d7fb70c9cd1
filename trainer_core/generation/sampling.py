"""Token sampling for the generation engines (:mod:`trainer_core.generation.engines`): the draws of the RL
stages' sampling loop before the engines (``torch.multinomial`` on the temperature-scaled,
top-p-filtered softmax), and the same draws as plain tensor maths that compile into a decode step
(:func:`sample_with_noise`, fed Exp(1) noise by :func:`exponential_noise`). The log-prob of each
drawn token is :func:`~trainer_core.objectives.logprobs.token_logprobs`.

Shapes: N rows, V vocabulary; logits any float dtype (computed in float32), tokens ``torch.long``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer_core.config import GenerationConfig
from trainer_core.objectives.logprobs import token_logprobs


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """[N, V] logits with tokens outside the top-p nucleus set to -inf (the top token always stays)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sampling_probs(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """[N, V] float32 probabilities the tokens are drawn from: softmax of the temperature-scaled,
    top-p-filtered logits (``temperature`` > 0). One function for both samplers below, so that
    they draw from the same bits."""
    return torch.softmax(top_p_filter(logits.float() / temperature, top_p), dim=-1)


def next_tokens(logits: Tensor, gen: GenerationConfig, generator: torch.Generator) -> Tensor:
    """[N] tokens drawn from [N, V] last-position logits (greedy when temperature is 0)."""
    if gen.temperature <= 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, gen.temperature, gen.top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def exponential_noise(noise: Tensor, generator: torch.Generator) -> Tensor:
    """Fill [N, V] float32 ``noise`` with Exp(1) draws from ``generator``, in place, and return it."""
    return noise.exponential_(1.0, generator=generator)


def sample_with_noise(logits: Tensor, noise: Tensor | None, temperature: float, top_p: float) -> tuple[Tensor, Tensor]:
    """[N] tokens sampled from [N, V] logits, with their [N] float32 log-probs (as
    :func:`~trainer_core.objectives.logprobs.token_logprobs`), given [N, V] float32 Exp(1) ``noise`` (None when greedy).

    ``torch.multinomial(probs, 1)`` draws exactly this way: ``q = empty_like(probs).exponential_()``,
    then ``argmax(probs / q)`` (the exponential race, i.e. the Gumbel-max trick; ATen's
    ``multinomial_out`` fast path for one sample). Drawn by :func:`exponential_noise` from the same
    generator, the tokens are :func:`next_tokens`'s to the bit (a CPU test checks it), without
    multinomial's input checks, whose host reads would stall a CUDA graph's pipeline every step,
    and as plain tensor maths it compiles into the decode step. Invalid probabilities (NaN or
    infinite logits) show as NaN log-probs, caught after the call
    (:meth:`trainer_core.generation.engines.StaticCacheEngine.generate`).
    """
    if temperature <= 0:
        token = logits.argmax(dim=-1)
    else:
        token = (sampling_probs(logits, temperature, top_p) / noise).argmax(dim=-1)
    return token, token_logprobs(logits, token, temperature)
