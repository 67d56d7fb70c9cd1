"""Rollouts for online RL: batched sampling from the policy and per-token log-probs of what it wrote.

Shape legend: N sequences in the rollout batch (prompts x samples per prompt), P prompt tokens
(left-padded to the longest prompt), T completion tokens (right-padded after each completion's
end), L = P + T, H hidden size. Token ids are ``torch.long``; masks are float, 1 = a real token.

Sampling is the generation engines' job (:mod:`trainer_core.generation.engines`). The log-probs used by
the losses are recomputed here by one forward over ``[prompt | completion]``, of the
temperature-scaled logits without the top-p cut, as in TRL's PPO and GRPO trainers:
:func:`completion_forward` (a causal LM: the frozen reference) and :func:`policy_forward` (the
trainable :class:`PolicyAndValue`), both of a :class:`Completions`, with a chunked LM head (no
[N, T, V] logits) or, with ``full_logits``, from the full logits (the reference path). Each
forward first cuts its rows to their own longest prompt and completion
(:meth:`Completions.trimmed`); with ``padding_free`` it runs on their real tokens only, end to end
(:func:`~trainer_core.modeling.forward.padding_free_outputs`).

The trainable model of the RL stages is :class:`PolicyAndValue`: the policy and (PPO) a value
head on its last hidden state, one module for a backend to wrap; :func:`policy_forward` gives
the log-probs, entropies and values of completions from one forward of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Any, Self

import torch
from torch import Tensor, nn

from trainer_core.modeling.forward import (
    forward_replaced, head_parts, padding_free_index, padding_free_outputs, unwrap_causal_lm,
)
from trainer_core.objectives.chunked import (
    CHUNK_SIZE_TOKENS,
    chunked_linear_logprobs_entropy,
)
from trainer_core.objectives.distill import chunked_generalized_jsd
from trainer_core.objectives.logprobs import compute_logprobs


@dataclass
class Completions:
    """Prompts and their completions: what every log-prob forward of the RL stages reads.

    Attributes:
        prompt_ids: [N, P] long, left-padded prompt token ids.
        prompt_mask: [N, P] float or long, 1 = real prompt token.
        completion_ids: [N, T] long, pad after each completion's end.
        completion_mask: [N, T] float or long, 1 = a completion token the loss counts (the
            policy's own).
        observation_mask: [N, T] float, 1 = an environment's token (a tool's output): attended
            to, never counted (no log-prob, loss, KL or advantage); None: there are none.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    observation_mask: Tensor | None = field(default=None, kw_only=True)

    def real_completion_mask(self) -> Tensor:
        """[N, T] 1 = a real completion token: the policy's (``completion_mask``) or an environment's."""
        return self.completion_mask if self.observation_mask is None else self.completion_mask + self.observation_mask

    def row_lengths(self) -> Tensor:
        """[N] real tokens of each row, prompt and completion (an environment's tokens included)."""
        return self.prompt_mask.sum(1) + self.real_completion_mask().sum(1)

    def select(self, rows: Tensor) -> Self:
        """The rows ``rows`` ([M] long indices) of every tensor field (a :class:`RolloutBatch`'s
        too): a micro- or mini-batch."""
        picked = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v[rows] if isinstance(v, Tensor) else v for k, v in picked.items()})

    def trimmed(self) -> Completions:
        """These rows without the prompt columns that are padding in every row (on the left) and
        the completion columns that are padding in every row (on the right), keeping one of each:
        a micro-batch cut from a wider batch forwards its own longest row, not the batch's. Every
        completion token keeps its column, so outputs [N, T'] widen back by zero columns on the right."""
        real = self.real_completion_mask()
        prompt_cols, completion_cols = (self.prompt_mask.sum(0) > 0).nonzero(), (real.sum(0) > 0).nonzero()
        first = int(prompt_cols[0]) if len(prompt_cols) else self.prompt_ids.shape[1] - 1
        width = int(completion_cols[-1]) + 1 if len(completion_cols) else 1
        cut = lambda x: None if x is None else x[:, :width]  # noqa: E731
        return Completions(self.prompt_ids[:, first:], self.prompt_mask[:, first:], self.completion_ids[:, :width],
                           self.completion_mask[:, :width], observation_mask=cut(self.observation_mask))


@dataclass
class RolloutBatch(Completions):
    """One rollout: prompts, sampled completions and everything the update needs about them.

    Attributes:
        prompt_ids, prompt_mask, completion_ids, completion_mask: the :class:`Completions`; the
            completions are sampled tokens (EOS included) and the mask is float.
        logprobs: [N, T] float32, log-probs of ``completion_ids`` under the policy at rollout
            time (``old_logprobs`` of the PPO ratio), 0 on padding.
        scores: [N] float32, the reward function's score of each completion.
        prompt_index: [N] long, index of each row's prompt in the rollout (groups for GRPO).
        ref_logprobs: [N, T] float32 under the frozen reference, or None (no KL term).
        values: [N, T] float32 value predictions V(s_t) at rollout time (PPO), or None.
        advantages: [N, T] (PPO) or [N] (GRPO) float32, set by the algorithm; None before.
        returns: [N, T] float32 GAE returns (PPO), or None.
        engine_logprobs: [N, T] float32 the generation engine's log-probs of the sampled tokens
            (0 on padding), or None.
        is_weights: [N, T] float32 truncated importance weights ``min(exp(logprobs -
            engine_logprobs), cap)`` (0 on padding) that multiply each token's policy loss, or
            None (no correction).
        sampled: True when the policy sampled the completions; False when they are the
            dataset's (distill's ``lmbda``), where a mean of ``logprobs - ref_logprobs`` or of
            ``-logprobs`` over them estimates no KL or entropy of the policy.
    """

    logprobs: Tensor
    scores: Tensor
    prompt_index: Tensor
    ref_logprobs: Tensor | None = None
    values: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    engine_logprobs: Tensor | None = None
    is_weights: Tensor | None = None
    sampled: bool = True

    @property
    def num_sequences(self) -> int:
        return self.completion_ids.shape[0]


def masked_row(batch: RolloutBatch) -> RolloutBatch:
    """A one-row mini-batch that counts nothing: ``batch``'s first row with its completion mask
    and every per-token input of the losses zeroed (ratio 1, KL 0: finite losses times a zero
    mask). A rank with no row in a mini-batch forwards it, so that it still takes part in the
    step's collectives (gradient all-reduce, sharded forwards) with zero loss and gradient."""
    row = batch.select(torch.zeros(1, dtype=torch.long, device=batch.completion_mask.device))
    zeroed = ("completion_mask", "observation_mask", "logprobs", "ref_logprobs", "values", "advantages", "returns",
              "engine_logprobs", "is_weights")
    for name in zeroed:
        value = getattr(row, name)
        if value is not None:
            setattr(row, name, torch.zeros_like(value))
    return row


def completion_inputs(
    prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
    observation_mask: Tensor | None = None, padding_free: bool = False,
) -> dict[str, Tensor]:
    """Model inputs of ``[prompt | completion]``: ``input_ids`` [N, P + T] long, ``attention_mask``
    [N, P + T] long (1 = real token: the prompt's, the policy's (``completion_mask``) and an
    environment's (``observation_mask``, [N, T] or None)), ``position_ids`` [N, P + T] that
    skip the left padding and, with ``padding_free``, ``pack_index`` [S] long: the forward runs on
    the S real tokens only (:func:`~trainer_core.modeling.forward.padding_free_outputs`)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    real = completion_mask if observation_mask is None else completion_mask + observation_mask
    attention = torch.cat([prompt_mask, real], dim=1).long()
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    inputs = {"input_ids": input_ids, "attention_mask": attention, "position_ids": positions}
    if padding_free:
        inputs["pack_index"] = padding_free_index(attention)
    return inputs


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
        logprobs: [N, T] float32 sampled-token log-probs (0 on padding).
        entropies: [N, T] float32 detached entropies of the next-token distribution (0 on padding).
        values: [N, T] float32 value predictions, or None without a value head.
        divergences: [N, T] float32 generalised JSD to a teacher per completion token (0 on
            padding), with gradients, when the forward was given a :class:`TeacherTarget`; else None.
    """

    logprobs: Tensor
    entropies: Tensor
    values: Tensor | None
    divergences: Tensor | None = None


def _widened(out: PolicyForward, width: int) -> PolicyForward:
    """``out``'s [N, T'] tensors (of :meth:`Completions.trimmed` rows) with zero columns up to ``width``."""
    pad = lambda x: None if x is None else torch.nn.functional.pad(x, (0, width - x.shape[1]))  # noqa: E731
    return PolicyForward(pad(out.logprobs), pad(out.entropies), pad(out.values), pad(out.divergences))


@dataclass
class TeacherTarget:
    """What a student's forward compares its next-token distributions with (on-policy
    distillation's generalised JSD, :func:`~trainer_core.objectives.distill.chunked_generalized_jsd`).

    Attributes:
        hidden: [M, Ht] the teacher's final hidden states at the positions predicting the
            batch's M counted completion tokens (row-major over [N, T]; :func:`completion_hidden`).
        weight: [V, Ht] the teacher's output projection (whole, not sharded); ``bias`` [V] or None.
        beta: the mixing coefficient (0 forward KL, 1 reverse KL).
        temperature: divides both models' logits (0 counts as 1).
    """

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None
    beta: float
    temperature: float


def _scatter_rows(values: Tensor, counted: Tensor) -> Tensor:
    """[N, T] float32 with ``values`` [M] at the ``counted`` [N, T] bool positions, 0 elsewhere."""
    out = torch.zeros(counted.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(counted, values)


def _completion_states(decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                       start: int, pack_index: Tensor | None = None) -> Tensor:
    """[N, T, H] the decoder's final hidden states (0 at padding with ``pack_index``); position t
    predicts completion token t."""
    run = lambda **kw: (decoder(**kw).last_hidden_state,)  # noqa: E731
    return padding_free_outputs(run, input_ids, attention_mask, position_ids, pack_index)[0][:, start:-1, :]


def _completion_head_forward(
    decoder: nn.Module, head: nn.Linear, value_head: nn.Module | None, temperature: float, chunk_size: int,
    input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, completion_mask: Tensor, start: int,
    teacher: TeacherTarget | None = None, pack_index: Tensor | None = None,
) -> PolicyForward:
    """A causal LM's forward for one call, scoring completion tokens only: the decoder on
    ``[prompt | completion]``, then the LM head on the real completion positions a chunk at a
    time (:func:`~trainer_core.objectives.chunked.chunked_linear_logprobs_entropy`), and the
    value head (if any) on every completion position. Nothing [N, T, V] is formed.

    Args:
        decoder, head: the causal LM's decoder and LM head (``forward.head_parts``).
        value_head: ``Linear(H, 1)`` or None.
        temperature: logits are divided by it (0 counts as 1): hidden states and bias are.
        chunk_size: tokens per chunk of the LM head.
        input_ids, attention_mask, position_ids: [N, L] from :func:`completion_inputs`.
        completion_mask: [N, T] 1 = real completion token; T = L - 1 - start.
        start: :func:`completion_start`.
        teacher: also the generalised JSD to this teacher per completion token, from the same
            hidden states and head, chunked (no [N, T, V] logits of either model).
        pack_index: the decoder runs on the real tokens only (:func:`completion_inputs`).

    Returns:
        (logprobs [N, T], entropies [N, T] detached, values [N, T] or None, divergences [N, T] or
        None), float32, as a tuple (a pytree: FSDP2 and DDP find the tensors of a wrapped
        forward's output).
    """
    hidden = _completion_states(decoder, input_ids, attention_mask, position_ids, start, pack_index)
    counted = completion_mask > 0
    scale = temperature if temperature > 0 else 1.0
    selected = hidden[counted]  # [M, H]
    targets = input_ids[:, start + 1 :][counted]  # [M]
    bias = None if head.bias is None else head.bias / scale
    logprobs, entropies = chunked_linear_logprobs_entropy(selected / scale, head.weight, bias, targets, chunk_size)
    values = None
    if value_head is not None:
        values = value_head(hidden).squeeze(-1).to(torch.float32, copy=True)  # [N, T]
    divergences = None
    if teacher is not None:
        divergences = _scatter_rows(chunked_generalized_jsd(
            selected, head.weight, head.bias, teacher.hidden, teacher.weight, teacher.bias, teacher.beta,
            teacher.temperature if teacher.temperature > 0 else 1.0, chunk_size), counted)
    return _scatter_rows(logprobs, counted), _scatter_rows(entropies, counted), values, divergences


def completion_forward(
    model: nn.Module,
    batch: Completions,
    *,
    temperature: float,
    chunk_size: int = CHUNK_SIZE_TOKENS,
    full_logits: bool = False,
    padding_free: bool = False,
) -> PolicyForward:
    """Log-probs and entropies of ``batch``'s completion tokens under a causal LM (the frozen
    reference), without [N, T, V] logits.

    The LM head runs inside one call of ``model`` (wrapped or not: a DeepSpeed engine's or
    FSDP2's hooks fire as for a plain forward; see :mod:`trainer_core.modeling.forward`), on the
    real completion positions only, ``chunk_size`` tokens at a time. Models whose logits are not
    a plain linear head (soft-capping, logit scaling), and ``full_logits``, take the full
    [N, P + T, V] logits (:func:`completion_logprobs`); both paths agree up to float rounding
    (tested within 1e-5 in fp32).

    Args:
        model: an HF causal LM, plain or as a backend wrapped it.
        batch: the prompts and completions ([N, P] and [N, T]).
        temperature: the sampling temperature (logits are divided by it; 0 counts as 1).
        chunk_size: tokens per chunk of the LM head (extra memory O(chunk_size x V)).
        full_logits: score from the full logits (the reference path).
        padding_free: run the model on the real tokens only (:func:`completion_inputs`).

    Returns:
        The :class:`PolicyForward` (values None).
    """
    inner = unwrap_causal_lm(model)
    parts = None if full_logits else head_parts(inner)
    width, batch = batch.completion_ids.shape[1], batch.trimmed()
    inputs = completion_inputs(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                               batch.observation_mask, padding_free)
    start = completion_start(batch.prompt_ids)
    if parts is None:
        logits = padding_free_outputs(lambda **kw: (model(**kw).logits,), **inputs)[0]
        logprobs, entropies = completion_logprobs(logits, inputs["input_ids"], batch.completion_mask, start, temperature)
        return _widened(PolicyForward(logprobs, entropies, None), width)
    forward = partial(_completion_head_forward, *parts, None, temperature, chunk_size)
    with forward_replaced(inner, forward):
        return _widened(PolicyForward(*model(**inputs, completion_mask=batch.completion_mask, start=start)), width)


def _counted_hidden(decoder: nn.Module, head: nn.Linear, input_ids: Tensor, attention_mask: Tensor,
                    position_ids: Tensor, completion_mask: Tensor, start: int, pack_index: Tensor | None = None) -> Tensor:
    """[M, H] the decoder's final hidden states at the positions predicting the counted completion tokens."""
    return _completion_states(decoder, input_ids, attention_mask, position_ids, start, pack_index)[completion_mask > 0]


@torch.no_grad()
def completion_hidden(model: nn.Module, batch: Completions, padding_free: bool = False) -> Tensor:
    """A frozen causal LM's (the teacher's) final hidden states at the positions that predict
    ``batch``'s counted completion tokens, from one call of ``model`` (a backend's wrapper's hooks
    fire as for a plain forward, as in :func:`completion_forward`); its LM head does not run.
    ``padding_free``: the model runs on the real tokens only (:func:`completion_inputs`).

    Returns:
        [M, H] in the model's dtype, M = ``batch.completion_mask.sum()``, rows in [N, T] row-major
        order (the order :class:`TeacherTarget` and the student's chunked head use).

    Raises:
        ValueError: the model's logits are not a plain linear head of its last hidden state.
    """
    inner = unwrap_causal_lm(model)
    parts = head_parts(inner)
    if parts is None:
        raise ValueError(f"{type(inner).__name__}: its logits are not a plain linear head of the last hidden state "
                         "(soft-capping, logit scaling), which the generalised JSD from hidden states needs")
    batch = batch.trimmed()
    inputs = completion_inputs(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                               batch.observation_mask, padding_free)
    with forward_replaced(inner, partial(_counted_hidden, *parts)):
        return model(**inputs, completion_mask=batch.completion_mask, start=completion_start(batch.prompt_ids))


class PolicyAndValue(nn.Module):
    """The trainable parts of an RL stage as one module: the policy and (PPO) its value head.

    One module, so that a backend wraps (DDP), shards (FSDP2) or runs in one engine (DeepSpeed)
    every trainable parameter, with one optimizer over both (TRL's ``PolicyAndValueWrapper``).
    Its forward is the policy's (sampling calls it so); with ``completion_mask`` it scores
    completions instead: the decoder, the chunked LM head on the completion tokens and the value
    head run inside this one forward (where FSDP2 and ZeRO-3 have gathered their parameters).

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

    def forward(
        self, *, completion_mask: Tensor | None = None, start: int = 0, temperature: float = 1.0,
        with_values: bool = False, chunk_size: int = CHUNK_SIZE_TOKENS, full_logits: bool = False,
        teacher: TeacherTarget | None = None, **kwargs: Any,
    ) -> Any:
        """The policy's output on ``kwargs``; with ``completion_mask``, the tuple (logprobs,
        entropies, values) of :class:`PolicyForward` (:func:`policy_forward` builds it).

        Args:
            completion_mask: [N, T] 1 = real completion token: score the completion tokens
                ``input_ids[:, start + 1:]`` (``kwargs`` from :func:`completion_inputs`).
            start: :func:`completion_start` of the prompts.
            temperature: the sampling temperature (0 counts as 1).
            with_values: also return values [N, T] float32 read from the last hidden state at
                the positions predicting the completion tokens.
            chunk_size: tokens per chunk of the LM head.
            full_logits: score from the policy's full [N, L, V] logits instead (the reference
                path, and the one of a policy whose logits are not a plain linear head).
            teacher: also the generalised JSD to this teacher per completion token (a plain
                linear head and ``full_logits`` False only).
            **kwargs: the policy's forward arguments (``input_ids`` [N, L] ...; with
                ``completion_mask``, :func:`completion_inputs`, ``pack_index`` included).

        Raises:
            ValueError: ``with_values`` without a value head; ``teacher`` with full logits.
        """
        if completion_mask is None:
            return self.policy(**kwargs)
        if with_values and self.value_head is None:
            raise ValueError("with_values needs a value head")
        value_head = self.value_head if with_values else None
        parts = None if full_logits else head_parts(self.policy)
        if parts is not None:
            return _completion_head_forward(*parts, value_head, temperature, chunk_size, **kwargs,
                                            completion_mask=completion_mask, start=start, teacher=teacher)
        if teacher is not None:
            raise ValueError("the generalised JSD to a teacher needs a plain linear LM head and full_logits False")

        def run(**inputs: Any) -> tuple[Tensor, ...]:
            out = self.policy(**inputs, output_hidden_states=value_head is not None)
            return (out.logits,) if value_head is None else (out.logits, out.hidden_states[-1])

        outs = padding_free_outputs(run, **kwargs)
        logprobs, entropies = completion_logprobs(outs[0], kwargs["input_ids"], completion_mask, start, temperature)
        values = None
        if value_head is not None:
            values = value_head(outs[1][:, start:-1, :]).squeeze(-1).to(torch.float32, copy=True)
        return logprobs, entropies, values, None


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
    model: nn.Module, batch: Completions, *, temperature: float, with_values: bool, full_logits: bool = False,
    teacher: TeacherTarget | None = None, padding_free: bool = False,
) -> PolicyForward:
    """Log-probs, entropies and (``with_values``) values of ``batch``'s completions from one
    forward of the trainable model.

    Args:
        model: a :class:`PolicyAndValue`, plain or as a backend wrapped it (DDP, a DeepSpeed
            engine: the backend's hooks run on the wrapper's forward).
        batch: the prompts and completions ([N, P] and [N, T]).
        temperature: the sampling temperature (logits are divided by it; 0 counts as 1).
        with_values: also run the value head (``model`` must have one).
        full_logits: score from the full logits (:meth:`PolicyAndValue.forward`).
        teacher: also the generalised JSD to this teacher (``divergences``).
        padding_free: run the model on the real tokens only (:func:`completion_inputs`).

    Returns:
        The :class:`PolicyForward` (values unmasked: whatever the value head gives at padding;
        None without ``with_values``).
    """
    width, batch = batch.completion_ids.shape[1], batch.trimmed()
    inputs = completion_inputs(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                               batch.observation_mask, padding_free)
    return _widened(PolicyForward(*model(
        **inputs, completion_mask=batch.completion_mask, start=completion_start(batch.prompt_ids),
        temperature=temperature, with_values=with_values, full_logits=full_logits, teacher=teacher,
    )), width)
