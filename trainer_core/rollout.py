"""Rollouts for online RL: batched sampling from the policy and per-token log-probs of what it wrote.

Shape legend: N sequences in the rollout batch (prompts x samples per prompt), P prompt tokens
(left-padded to the longest prompt), T completion tokens (right-padded after each completion's
end), L = P + T, H hidden size. Token ids are ``torch.long``; masks are float, 1 = a real token.

Sampling is a plain KV-cached loop (not ``generate``) so that it draws from one
``torch.Generator`` that the stage checkpoints: a resumed run samples the same tokens.
Temperature divides the logits, top-p keeps the smallest set of tokens whose probability
reaches ``top_p``; a row stops after its EOS token. With a sharded policy (FSDP2, ZeRO-3: every
forward is a collective) the loop runs in lockstep across ranks until every rank's rows are
done, as ``generate(synced_gpus=True)`` does: a rank whose rows have all ended keeps feeding
padding (masked out, trimmed from what it returns) while another still samples. The log-probs
used by the losses are recomputed by one full forward (:func:`forward_completions`), of the
temperature-scaled logits without the top-p cut, as in TRL's PPO and GRPO trainers.

The trainable model of the RL stages is :class:`PolicyAndValue`: the policy and (PPO) a value
head on its last hidden state, one module for a backend to wrap; :func:`policy_forward` gives
the log-probs, entropies and values of completions from one forward of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

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


def masked_row(batch: RolloutBatch) -> RolloutBatch:
    """A one-row mini-batch that counts nothing: ``batch``'s first row with its completion mask
    and every per-token input of the losses zeroed (ratio 1, KL 0: finite losses times a zero
    mask). A rank with no row in a mini-batch forwards it, so that it still takes part in the
    step's collectives (gradient all-reduce, sharded forwards) with zero loss and gradient."""
    row = batch.select(torch.zeros(1, dtype=torch.long, device=batch.completion_mask.device))
    zeroed = ("completion_mask", "logprobs", "ref_logprobs", "values", "advantages", "returns")
    for name in zeroed:
        value = getattr(row, name)
        if value is not None:
            setattr(row, name, torch.zeros_like(value))
    return row


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
    sync: Callable[[Tensor], Tensor] | None = None,
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
        sync: for a sharded ``model``, a sum over ranks (``Backend.all_reduce_sum``): the loop
            then stops only once no rank has an unfinished row, so every rank runs the same
            number of forwards (one all-reduce of a scalar per decoding step). None: stop when
            this process's rows are done.

    Returns:
        (completion_ids [N, T] long, completion_mask [N, T] float) with T <= max_new_tokens the
        longest of these rows (the same with or without ``sync``).
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
        if len(tokens) == gen.max_new_tokens or _all_finished(finished, sync):
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        out = model(
            input_ids=token[:, None], attention_mask=attention, position_ids=next_position,
            past_key_values=out.past_key_values, use_cache=True,
        )
        next_position = next_position + 1
    completion_ids, completion_mask = torch.stack(tokens, dim=1), torch.stack(masks, dim=1).float()
    length = int(completion_mask.sum(1).max())  # >= 1: every row's first token is real
    return completion_ids[:, :length], completion_mask[:, :length]


def _all_finished(finished: Tensor, sync: Callable[[Tensor], Tensor] | None) -> bool:
    """Whether every row (of every rank, with ``sync``) has ended; ``finished`` [N] bool."""
    if sync is None:
        return bool(finished.all())
    unfinished = (~finished).sum().to(torch.float32)
    return float(sync(unfinished)) == 0.0


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
    inputs = completion_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
    out = model(**inputs, output_hidden_states=with_hidden)
    start = completion_start(prompt_ids)
    logprobs, entropies = completion_logprobs(out.logits, inputs["input_ids"], completion_mask, start, temperature)
    hidden = out.hidden_states[-1][:, start:-1, :] if with_hidden else None
    return logprobs, entropies, hidden


def completion_inputs(
    prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor
) -> dict[str, Tensor]:
    """Model inputs of ``[prompt | completion]``: ``input_ids`` [N, P + T] long, ``attention_mask``
    [N, P + T] long (1 = real token) and ``position_ids`` [N, P + T] that skip the left padding."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, completion_mask], dim=1).long()
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention, "position_ids": positions}


def completion_start(prompt_ids: Tensor) -> int:
    """Index in ``[prompt | completion]`` of the position that predicts the first completion token."""
    return prompt_ids.shape[1] - 1


def completion_logprobs(
    logits: Tensor, input_ids: Tensor, completion_mask: Tensor, start: int, temperature: float
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of the completion tokens from a forward over ``[prompt | completion]``.

    Args:
        logits: [N, P + T, V] the model's logits over ``input_ids``.
        input_ids: [N, P + T] long, from :func:`completion_inputs`.
        completion_mask: [N, T] 1 = real completion token.
        start: :func:`completion_start` of the prompts.
        temperature: logits are divided by it (0 counts as 1).

    Returns:
        (logprobs [N, T] float32 zeroed on padding, entropies [N, T] float32 detached).
    """
    scale = temperature if temperature > 0 else 1.0
    logits = logits[:, start:, :].float() / scale  # [N, T + 1, V]; position t predicts token t
    logprobs = compute_logprobs(logits, input_ids[:, start:]) * completion_mask
    with torch.no_grad():
        log_p = torch.log_softmax(logits[:, :-1], dim=-1)
        entropies = -(log_p.exp() * log_p).sum(-1) * completion_mask
    return logprobs, entropies


@dataclass
class PolicyForward:
    """The policy's outputs on a mini-batch, with gradients.

    Attributes:
        logprobs: [N, T] sampled-token log-probs (0 on padding).
        entropies: [N, T] detached entropies of the next-token distribution.
        values: [N, T] value predictions, or None without a value head.
    """

    logprobs: Tensor
    entropies: Tensor
    values: Tensor | None



class PolicyAndValue(nn.Module):
    """The trainable parts of an RL stage as one module: the policy and (PPO) its value head.

    One module, so that a backend wraps (DDP), shards (FSDP2) or runs in one engine (DeepSpeed)
    every trainable parameter, with one optimizer over both (TRL's ``PolicyAndValueWrapper``).
    Its forward is the policy's; with ``values_from`` the value head runs inside the same forward
    (where FSDP2 and ZeRO-3 have gathered its parameters).

    Args:
        policy: an HF causal LM.
        value_head: ``Linear(H, 1)`` on the policy's last hidden state, or None (GRPO).
    """

    def __init__(self, policy: nn.Module, value_head: nn.Module | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.value_head = value_head
        # FSDP2 shards each of these blocks, then this module (``transformer_blocks``).
        self._no_split_modules = getattr(policy, "_no_split_modules", None)

    def forward(self, *, values_from: int | None = None, **kwargs: Any) -> Any:
        """The policy's output on ``kwargs``; with ``values_from``, (that output, values).

        Args:
            values_from: first position whose value is returned: values [N, L - 1 - values_from]
                float32 read from the last hidden state at positions ``values_from .. L - 2``
                (those predicting the completion tokens, for ``completion_start``).
            **kwargs: the policy's forward arguments (``input_ids`` [N, L] ...).

        Raises:
            ValueError: ``values_from`` without a value head.
        """
        if values_from is None:
            return self.policy(**kwargs)
        if self.value_head is None:
            raise ValueError("values_from needs a value head")
        out = self.policy(**kwargs, output_hidden_states=True)
        hidden = out.hidden_states[-1][:, values_from:-1, :]
        values = self.value_head(hidden).squeeze(-1).to(torch.float32, copy=True)
        # No views among the outputs (FSDP2 warns of them: the squeeze above, and the
        # embedding output among the hidden states, which nothing reads past this point).
        out.hidden_states = None
        return out, values


def value_head_for(policy: nn.Module) -> nn.Linear:
    """A zero-initialised ``Linear(H, 1)`` on the policy's last hidden state (shared trunk).

    Shared trunk rather than a separate critic initialised from the reward model (TRL,
    OpenRLHF): one forward gives log-probs and values, and one model fewer sits in memory,
    which is what a CPU run can afford. Zero init makes every initial value 0.
    """
    head = nn.Linear(policy.config.hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


def policy_forward(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float,
    with_values: bool,
) -> PolicyForward:
    """Log-probs, entropies and (``with_values``) values of completions from one forward.

    Args:
        model: a :class:`PolicyAndValue`, plain or as a backend wrapped it (DDP, a DeepSpeed
            engine: the backend's hooks run on the wrapper's forward).
        prompt_ids: [N, P] long, left-padded; prompt_mask: [N, P] 1 = real token.
        completion_ids: [N, T] long; completion_mask: [N, T] 1 = real token.
        temperature: the sampling temperature (logits are divided by it; 0 counts as 1).
        with_values: also run the value head (``model`` must have one).

    Returns:
        The :class:`PolicyForward` (values unmasked; None without ``with_values``).
    """
    inputs = completion_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
    start = completion_start(prompt_ids)
    values = None
    if with_values:
        out, values = model(**inputs, values_from=start)
    else:
        out = model(**inputs)
    logprobs, entropies = completion_logprobs(out.logits, inputs["input_ids"], completion_mask, start, temperature)
    return PolicyForward(logprobs, entropies, values)
