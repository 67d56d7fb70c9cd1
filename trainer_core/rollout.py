"""Rollouts for online RL: batched sampling from the policy and per-token log-probs of what it wrote.

Shape legend: N sequences in the rollout batch (prompts x samples per prompt), P prompt tokens
(left-padded to the longest prompt), T completion tokens (right-padded after each completion's
end), H hidden size. Token ids are ``torch.long``; masks are float, 1 = a real token.

Sampling is a plain KV-cached loop (not ``generate``) so that it draws from one
``torch.Generator`` that the stage checkpoints: a resumed run samples the same tokens.
Temperature divides the logits, top-p keeps the smallest set of tokens whose probability
reaches ``top_p``; a row stops after its EOS token. The log-probs used by the losses are
recomputed by one full forward (:func:`forward_completions`), of the temperature-scaled
logits without the top-p cut, as in TRL's PPO and GRPO trainers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor, nn

from trainer_core.config import GenerationConfig
from trainer_core.objectives.logprobs import compute_logprobs


@dataclass
class RolloutBatch:
    """One rollout: prompts, sampled completions and everything the update needs about them.

    Attributes:
        prompt_ids: [N, P] long, left-padded prompt token ids.
        prompt_mask: [N, P] float, 1 = real prompt token.
        completion_ids: [N, T] long, sampled tokens (EOS included), pad after the end.
        completion_mask: [N, T] float, 1 = real completion token (counted in the loss).
        logprobs: [N, T] float32, log-probs of ``completion_ids`` under the policy at rollout
            time (``old_logprobs`` of the PPO ratio), 0 on padding.
        scores: [N] float32, the reward function's score of each completion.
        prompt_index: [N] long, index of each row's prompt in the rollout (groups for GRPO).
        ref_logprobs: [N, T] float32 under the frozen reference, or None (no KL term).
        values: [N, T] float32 value predictions V(s_t) at rollout time (PPO), or None.
        advantages: [N, T] (PPO) or [N] (GRPO) float32, set by the algorithm; None before.
        returns: [N, T] float32 GAE returns (PPO), or None.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    logprobs: Tensor
    scores: Tensor
    prompt_index: Tensor
    ref_logprobs: Tensor | None = None
    values: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return self.completion_ids.shape[0]

    def select(self, rows: Tensor) -> RolloutBatch:
        """The rows ``rows`` ([M] long indices) of every tensor field: a mini-batch."""
        picked = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v[rows] if isinstance(v, Tensor) else v for k, v in picked.items()})


def _top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """[N, V] logits with tokens outside the top-p nucleus set to -inf (the top token always stays)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _next_tokens(logits: Tensor, gen: GenerationConfig, generator: torch.Generator) -> Tensor:
    """[N] tokens drawn from [N, V] last-position logits (greedy when temperature is 0)."""
    if gen.temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(_top_p_filter(logits.float() / gen.temperature, gen.top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def sample_completions(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    gen: GenerationConfig,
    *,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """Sample up to ``gen.max_new_tokens`` tokens after each left-padded prompt.

    Args:
        model: a causal LM (any mode; no dropout is assumed).
        prompt_ids: [N, P] long, left-padded.
        prompt_mask: [N, P] 1 = real token.
        gen: temperature, top_p and max_new_tokens (``batch_size`` is not used here).
        eos_id: a row ends after it samples this token.
        pad_id: written after a row's end.
        generator: the only source of randomness (on the model's device).

    Returns:
        (completion_ids [N, T] long, completion_mask [N, T] float) with T <= max_new_tokens.
    """
    attention = prompt_mask.long()
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=prompt_ids, attention_mask=attention, position_ids=positions, use_cache=True)
    next_position = positions[:, -1:] + 1
    finished = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    tokens, masks = [], []
    for _ in range(gen.max_new_tokens):
        token = _next_tokens(out.logits[:, -1, :], gen, generator)
        masks.append(~finished)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        tokens.append(token)
        finished = finished | (token == eos_id)
        if bool(finished.all()) or len(tokens) == gen.max_new_tokens:
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        out = model(
            input_ids=token[:, None], attention_mask=attention, position_ids=next_position,
            past_key_values=out.past_key_values, use_cache=True,
        )
        next_position = next_position + 1
    return torch.stack(tokens, dim=1), torch.stack(masks, dim=1).float()


def forward_completions(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float,
    with_hidden: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-token log-probs (and entropies, hidden states) of completions after their prompts.

    One forward over ``[prompt | completion]`` with position ids that skip the left padding.

    Args:
        model: a causal LM.
        prompt_ids: [N, P] long, left-padded; prompt_mask: [N, P] 1 = real token.
        completion_ids: [N, T] long; completion_mask: [N, T] 1 = real token.
        temperature: the sampling temperature (logits are divided by it; 0 counts as 1).
        with_hidden: also return the last hidden state at the positions that predict each
            completion token (the state V(s_t) is read from).

    Returns:
        (logprobs [N, T] float32 zeroed on padding, entropies [N, T] float32 detached of the
        temperature-scaled next-token distribution, hidden [N, T, H] or None).
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, completion_mask], dim=1).long()
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, output_hidden_states=with_hidden)
    start = prompt_ids.shape[1] - 1
    scale = temperature if temperature > 0 else 1.0
    logits = out.logits[:, start:, :].float() / scale  # [N, T + 1, V]; position t predicts token t
    logprobs = compute_logprobs(logits, input_ids[:, start:]) * completion_mask
    with torch.no_grad():
        log_p = torch.log_softmax(logits[:, :-1], dim=-1)
        entropies = -(log_p.exp() * log_p).sum(-1) * completion_mask
    hidden = out.hidden_states[-1][:, start:-1, :] if with_hidden else None
    return logprobs, entropies, hidden
