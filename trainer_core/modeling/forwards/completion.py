"""Forwards of online RL: per-token log-probs, entropies and values of completions under the
policy (a :class:`PolicyAndValue`) or a frozen causal LM (the reference), and a teacher's hidden
states for distillation.

Shape legend: N sequences (prompts x samples per prompt), P prompt tokens (left-padded to the
longest prompt), T completion tokens (right-padded after each completion's end), L = P + T, H
hidden size. Token ids are ``torch.long``; masks are float, 1 = a real token.

The log-probs used by the losses are recomputed here by one forward over ``[prompt |
completion]``, of the temperature-scaled logits without the top-p cut, as in TRL's PPO and GRPO
trainers: :func:`completion_forward` of a :class:`Completions` under the trainable
:class:`PolicyAndValue` (log-probs, entropies and, PPO, values from one forward) or under a causal
LM (the frozen reference), with a chunked LM head (no [N, T, V] logits) or, with ``full_logits``,
from the full logits (the reference path). Each forward first cuts its rows to their own longest
prompt and completion (:meth:`Completions.trimmed`); with ``padding_free`` it runs on their real
tokens only, end to end (:func:`~trainer_core.modeling.forwards.padding_free.padding_free_outputs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Any, Self

import torch
from torch import Tensor, nn

from trainer_core.modeling.forwards.heads import forward_replaced, head_parts, unwrap_causal_lm
from trainer_core.modeling.forwards.kernels import (
    CHUNK_SIZE_TOKENS,
    chunked_generalized_jsd,
    chunked_linear_logprobs_entropy,
)
from trainer_core.modeling.forwards.padding_free import padding_free_index, padding_free_outputs
from trainer_core.objectives.logprobs import completion_logprobs_entropies


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

    def model_inputs(self, padding_free: bool = False) -> dict[str, Tensor]:
        """:func:`completion_inputs` of these rows: the model inputs of ``[prompt | completion]``
        (``input_ids``, ``attention_mask``, ``position_ids`` [N, P + T] and, with ``padding_free``,
        ``pack_index``)."""
        return completion_inputs(
            self.prompt_ids,
            self.prompt_mask,
            self.completion_ids,
            self.completion_mask,
            self.observation_mask,
            padding_free,
        )

    def row_lengths(self) -> Tensor:
        """[N] real tokens of each row, prompt and completion (an environment's tokens included)."""
        return self.prompt_mask.sum(1) + self.real_completion_mask().sum(1)

    def select(self, rows: Tensor) -> Self:
        """The rows ``rows`` ([M] long indices) of every tensor field (a
        :class:`~trainer_core.training.rl.rollout.RolloutBatch`'s too): a micro- or mini-batch."""
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
        return Completions(
            self.prompt_ids[:, first:],
            self.prompt_mask[:, first:],
            self.completion_ids[:, :width],
            self.completion_mask[:, :width],
            observation_mask=cut(self.observation_mask),
        )


def completion_inputs(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    observation_mask: Tensor | None = None,
    padding_free: bool = False,
) -> dict[str, Tensor]:
    """Model inputs of ``[prompt | completion]``: ``input_ids`` [N, P + T] long, ``attention_mask``
    [N, P + T] long (1 = real token: the prompt's, the policy's (``completion_mask``) and an
    environment's (``observation_mask``, [N, T] or None)), ``position_ids`` [N, P + T] that
    skip the left padding and, with ``padding_free``, ``pack_index`` [S] long: the forward runs on
    the S real tokens only (:func:`~trainer_core.modeling.forwards.padding_free.padding_free_outputs`)."""
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
    distillation's generalised JSD, :func:`~trainer_core.modeling.forwards.kernels.chunked_generalized_jsd`).

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


def _completion_states(
    decoder: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    start: int,
    pack_index: Tensor | None = None,
) -> Tensor:
    """[N, T, H] the decoder's final hidden states (0 at padding with ``pack_index``); position t
    predicts completion token t."""
    run = lambda **kw: (decoder(**kw).last_hidden_state,)  # noqa: E731
    return padding_free_outputs(run, input_ids, attention_mask, position_ids, pack_index)[0][:, start:-1, :]


def _completion_head_forward(
    decoder: nn.Module,
    head: nn.Linear,
    value_head: nn.Module | None,
    temperature: float,
    chunk_size: int,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    completion_mask: Tensor,
    start: int,
    teacher: TeacherTarget | None = None,
    pack_index: Tensor | None = None,
) -> PolicyForward:
    """A causal LM's forward for one call, scoring completion tokens only: the decoder on
    ``[prompt | completion]``, then the LM head on the real completion positions a chunk at a
    time (:func:`~trainer_core.modeling.forwards.kernels.chunked_linear_logprobs_entropy`), and the
    value head (if any) on every completion position. Nothing [N, T, V] is formed.

    Args:
        decoder, head: the causal LM's decoder and LM head (:func:`~trainer_core.modeling.forwards.heads.head_parts`).
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
        divergences = _scatter_rows(
            chunked_generalized_jsd(
                selected,
                head.weight,
                head.bias,
                teacher.hidden,
                teacher.weight,
                teacher.bias,
                teacher.beta,
                teacher.temperature if teacher.temperature > 0 else 1.0,
                chunk_size,
            ),
            counted,
        )
    return _scatter_rows(logprobs, counted), _scatter_rows(entropies, counted), values, divergences


def completion_forward(
    model: nn.Module,
    batch: Completions,
    *,
    temperature: float,
    with_values: bool = False,
    teacher: TeacherTarget | None = None,
    chunk_size: int = CHUNK_SIZE_TOKENS,
    full_logits: bool = False,
    padding_free: bool = False,
) -> PolicyForward:
    """Log-probs, entropies and (``with_values``) values of ``batch``'s completion tokens from one
    forward of ``model``, without [N, T, V] logits: the trainable :class:`PolicyAndValue` (the
    rollout's old log-probs, the update's forward with gradients) or a causal LM (the frozen reference).

    The LM head runs inside one call of ``model`` (wrapped or not: DDP's, a DeepSpeed engine's or
    FSDP2's hooks fire as for a plain forward; see :mod:`trainer_core.modeling.forwards.heads`), on
    the real completion positions only, ``chunk_size`` tokens at a time: a :class:`PolicyAndValue`
    scores them in its own forward (:meth:`PolicyAndValue.forward`), a causal LM's forward is
    replaced for the call. Models whose logits are not a plain linear head (soft-capping, logit
    scaling), and ``full_logits``, take the full [N, P + T, V] logits
    (:func:`~trainer_core.objectives.logprobs.completion_logprobs_entropies`); both paths agree up
    to float rounding (tested within 1e-5 in fp32).

    Args:
        model: a :class:`PolicyAndValue` or an HF causal LM, plain or as a backend wrapped it (DDP,
            FSDP2, a DeepSpeed engine).
        batch: the prompts and completions ([N, P] and [N, T]).
        temperature: the sampling temperature (logits are divided by it; 0 counts as 1).
        with_values: also run the value head (a :class:`PolicyAndValue` with one).
        teacher: also the generalised JSD to this teacher (``divergences``; a :class:`PolicyAndValue`).
        chunk_size: tokens per chunk of the LM head (extra memory O(chunk_size x V)).
        full_logits: score from the full logits (the reference path).
        padding_free: run the model on the real tokens only (:func:`completion_inputs`).

    Returns:
        The :class:`PolicyForward` (values unmasked: whatever the value head gives at padding;
        None without ``with_values``).

    Raises:
        ValueError: ``with_values`` or ``teacher`` for a causal LM, and :meth:`PolicyAndValue.forward`'s errors.
    """
    inner = unwrap_causal_lm(model)
    width, batch = batch.completion_ids.shape[1], batch.trimmed()
    inputs = batch.model_inputs(padding_free)
    start = completion_start(batch.prompt_ids)
    if isinstance(inner, PolicyAndValue):
        out = model(
            **inputs,
            completion_mask=batch.completion_mask,
            start=start,
            temperature=temperature,
            with_values=with_values,
            chunk_size=chunk_size,
            full_logits=full_logits,
            teacher=teacher,
        )
    elif with_values or teacher is not None:
        raise ValueError(f"{type(inner).__name__}: values and a teacher's divergences come from a PolicyAndValue only")
    else:
        out = _causal_lm_forward(
            model, inner, inputs, batch.completion_mask, start, temperature, chunk_size, full_logits
        )
    return _widened(PolicyForward(*out), width)


def _causal_lm_forward(
    model: nn.Module,
    inner: nn.Module,
    inputs: dict[str, Tensor],
    completion_mask: Tensor,
    start: int,
    temperature: float,
    chunk_size: int,
    full_logits: bool,
) -> tuple[Tensor | None, ...]:
    """:func:`completion_forward`'s scores under a causal LM ``model`` (``inner``: it unwrapped):
    (logprobs, entropies, values None[, divergences None]), each [N, T'], from the chunked head
    inside one call of ``model``, or from its full logits (``full_logits``, or no plain linear head)."""
    parts = None if full_logits else head_parts(inner)
    if parts is None:
        logits = padding_free_outputs(lambda **kw: (model(**kw).logits,), **inputs)[0]
        return (*completion_logprobs_entropies(logits, inputs["input_ids"], completion_mask, start, temperature), None)
    forward = partial(_completion_head_forward, *parts, None, temperature, chunk_size)
    with forward_replaced(inner, forward):
        return model(**inputs, completion_mask=completion_mask, start=start)


def _counted_hidden(
    decoder: nn.Module,
    head: nn.Linear,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    completion_mask: Tensor,
    start: int,
    pack_index: Tensor | None = None,
) -> Tensor:
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
        raise ValueError(
            f"{type(inner).__name__}: its logits are not a plain linear head of the last hidden state "
            "(soft-capping, logit scaling), which the generalised JSD from hidden states needs"
        )
    batch = batch.trimmed()
    inputs = batch.model_inputs(padding_free)
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
        self,
        *,
        completion_mask: Tensor | None = None,
        start: int = 0,
        temperature: float = 1.0,
        with_values: bool = False,
        chunk_size: int = CHUNK_SIZE_TOKENS,
        full_logits: bool = False,
        teacher: TeacherTarget | None = None,
        **kwargs: Any,
    ) -> Any:
        """The policy's output on ``kwargs``; with ``completion_mask``, the tuple (logprobs,
        entropies, values) of :class:`PolicyForward` (:func:`completion_forward` builds it).

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
            return _completion_head_forward(
                *parts,
                value_head,
                temperature,
                chunk_size,
                **kwargs,
                completion_mask=completion_mask,
                start=start,
                teacher=teacher,
            )
        if teacher is not None:
            raise ValueError("the generalised JSD to a teacher needs a plain linear LM head and full_logits False")

        def run(**inputs: Any) -> tuple[Tensor, ...]:
            out = self.policy(**inputs, output_hidden_states=value_head is not None)
            return (out.logits,) if value_head is None else (out.logits, out.hidden_states[-1])

        outs = padding_free_outputs(run, **kwargs)
        logprobs, entropies = completion_logprobs_entropies(
            outs[0], kwargs["input_ids"], completion_mask, start, temperature
        )
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
