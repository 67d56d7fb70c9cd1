"""The ptx term of online RL: a supervised (SFT) loss mixed into every optimizer step.

InstructGPT's PPO-ptx (Ouyang et al. 2022, eq. 2) adds ``gamma * E_x~D_pretrain[log pi(x)]`` to the
RL objective so that the policy keeps what it learnt outside the RL prompts; OpenRLHF exposes it
as ``--ptx_coef`` with a supervised dataset. Here the data is the prepared ``sft/train`` split
(demonstrations: the loss covers their ``loss_mask`` tokens, the completion) and the term is
``ptx_coef`` times their token-mean negative log-likelihood at temperature 1.

Why the demo needs it: GRPO on a small pool of prompts teaches the SFT policy what those prompts
exercise and costs it what only SFT's other data carried (the measurement: ``bench/README.md``, "The demo's RL, 2026-11-26 to 2026-11-29").

The rows of each optimizer step are drawn from ``(seed, global_step, step index, rank)`` alone, so
a resumed run draws the rows an uninterrupted one draws without any saved state.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from trainer_core.backends.base import Backend
from trainer_core.data.batching import collate_prompts_left, pad_sequences
from trainer_core.errors import ConfigError
from trainer_core.modeling.forwards.completion import Completions, completion_forward


@dataclass
class PtxBatch(Completions):
    """Demonstrations cut at their first loss token into a prompt and a completion.

    Attributes:
        prompt_ids: [N, P] long, left-padded; prompt_mask: [N, P] long, 1 = real token.
        completion_ids: [N, T] long, right-padded; completion_mask: [N, T] long, 1 = a token the
            loss covers (the row's ``loss_mask`` after its prompt).
        observation_mask: [N, T] long, 1 = a real completion token the loss does not cover (a
            conversation's user or tool turn between assistant turns: attended to, never
            counted), or None when there is none.
    """


def split_demonstration(row: dict) -> tuple[list[int], list[int], list[int]]:
    """A prepared SFT row as (prompt ids, completion ids, completion loss mask).

    The prompt is every token before the first one the loss covers; at least one prompt token is
    kept (the first) so that the completion has a token to be predicted from.

    Raises:
        ConfigError: the row has no token with ``loss_mask`` 1 after its first token.
    """
    ids, mask = list(row["input_ids"]), list(row["loss_mask"])
    start = next((i for i, m in enumerate(mask) if m and i > 0), None)
    if start is None:
        raise ConfigError(
            "ptx_coef: an sft/train row has no loss token after its first token (input_ids "
            f"{ids[:8]}...); the ptx loss needs demonstrations with a completion"
        )
    return ids[:start], ids[start:], [int(bool(m)) for m in mask[start:]]


def collate_demonstrations(rows: Sequence[dict], pad_id: int, device: torch.device | str) -> PtxBatch:
    """Batch prepared SFT rows for :func:`~trainer_core.modeling.forwards.completion.completion_forward`
    (see :class:`PtxBatch`).

    Raises:
        ConfigError: a row without a completion (:func:`split_demonstration`).
        ValueError: ``rows`` is empty.
    """
    if not rows:
        raise ValueError("collate_demonstrations needs at least one row")
    prompt_ids, completion_ids, completion_mask = zip(*(split_demonstration(r) for r in rows))
    prompts = collate_prompts_left([{"input_ids": p} for p in prompt_ids], pad_id)
    length = max(len(c) for c in completion_ids)
    counted = pad_sequences(completion_mask, length, 0)
    observed = pad_sequences([[1] * len(c) for c in completion_ids], length, 0) - counted
    return PtxBatch(
        prompts["input_ids"].to(device),
        prompts["attention_mask"].to(device),
        pad_sequences(completion_ids, length, pad_id).to(device),
        counted.to(device),
        observation_mask=observed.to(device) if bool(observed.any()) else None,
    )


def ptx_row_indices(
    num_rows: int, rows_per_step: int, seed: int, global_step: int, step_index: int, rank: int
) -> list[int]:
    """The demonstration rows of one rank for one optimizer step: ``rows_per_step`` distinct rows
    (all of them when there are fewer), drawn from a generator seeded with the arguments alone.

    Raises:
        ValueError: ``num_rows`` or ``rows_per_step`` < 1.
    """
    if num_rows < 1 or rows_per_step < 1:
        raise ValueError(f"ptx_row_indices needs num_rows >= 1 and rows_per_step >= 1, got {num_rows}, {rows_per_step}")
    rng = random.Random(f"ptx:{seed}:{global_step}:{step_index}:{rank}")
    return sorted(rng.sample(range(num_rows), min(rows_per_step, num_rows)))


def ptx_nll(logprobs: Tensor, completion_mask: Tensor, num_ranks: int) -> Tensor:
    """The ptx loss of one rank: the token-mean negative log-likelihood of its rows, divided by the
    number of ranks (each backend scales a backward by the world size to undo gradient averaging,
    so the ranks' gradients add up to the mean over ranks).

    Args:
        logprobs: [N, T] float32 log-probs of the completion tokens at temperature 1.
        completion_mask: [N, T] 1 = a token the loss covers.
        num_ranks: the world size.

    Returns:
        Scalar float32. Worked value: logprobs [[-1, -3], [-2, 0]], mask [[1, 1], [1, 0]], one rank:
        (1 + 3 + 2) / 3 = 2.0.
    """
    mask = completion_mask.to(logprobs.dtype)
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1.0) / num_ranks


def check_demonstrations(stage: str, ptx_coef: float, demonstrations: Sequence[dict] | None) -> None:
    """Refuse a ptx term without data, instead of training without it.

    Raises:
        ConfigError: ``ptx_coef`` > 0 and ``demonstrations`` is None or empty (the stages pass the
            prepared ``sft/train`` rows; a library caller must pass them too).
    """
    if ptx_coef > 0 and not demonstrations:
        got = "none" if demonstrations is None else "an empty split"
        raise ConfigError(
            f"{stage}.ptx_coef={ptx_coef} needs demonstrations (the prepared sft/train rows) and got "
            f"{got}: prepare SFT data with rows (library: RLTrainer(demonstrations=...)), or set "
            "ptx_coef to 0"
        )


def ptx_batch(
    rows: Sequence[dict],
    rows_per_step: int,
    seed: int,
    global_step: int,
    step_index: int,
    rank: int,
    pad_token_id: int,
    device: torch.device,
) -> PtxBatch:
    """This rank's demonstrations for the optimizer step ``step_index`` of the iteration after
    ``global_step`` (:func:`ptx_row_indices`), collated on ``device``."""
    picked = ptx_row_indices(len(rows), rows_per_step, seed, global_step, step_index, rank)
    return collate_demonstrations([rows[i] for i in picked], pad_token_id, device)


def ptx_backward(
    model: nn.Module, backend: Backend, batch: PtxBatch, ptx_coef: float, padding_free: bool = False
) -> Tensor:
    """Forward and backward of ``ptx_coef`` x the ptx loss of ``batch`` (:func:`ptx_batch`) as the
    optimizer step's last micro-batch (its backward synchronises gradients). Collective under every
    backend: each rank runs one forward of the same number of rows.

    A policy with a value head (PPO) runs it too, its values entering the loss times 0: DDP
    reduces the gradients of every parameter at this synchronising backward and fails on one
    that took no part (the value head's gradient stays what the PPO micro-batches made it).
    ``padding_free``: the forward runs on the real tokens only (the RL stage's ``padding_free``).

    Returns:
        Scalar float32: this rank's :func:`ptx_nll` (over the world size, as it went backward),
        detached.
    """
    with_values = backend.unwrap(model).value_head is not None
    with backend.grad_sync(model, is_last_micro_batch=True):
        with backend.autocast():
            out = completion_forward(model, batch, temperature=1.0, with_values=with_values, padding_free=padding_free)
            loss = ptx_nll(out.logprobs, batch.completion_mask, backend.world_size)
            objective = ptx_coef * loss + (0.0 * out.values.sum() if with_values else 0.0)
        backend.backward(model, objective)
    return loss.detach().float()
