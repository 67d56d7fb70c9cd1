"""Forwards of the offline preference stages: summed completion log-probs of preference pairs
(DPO), of KTO's completions and KL sequences, the reward of each side of a pair (the reward
model), and the frozen reference's log-probs of a whole split, row by row.

Shape legend: B pairs (or KTO examples), T tokens, S packed tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from trainer_core.data.batching import collate_kto, collate_pairs, is_packed, num_pairs
from trainer_core.modeling.forwards.kernels import CHUNK_SIZE_TOKENS
from trainer_core.modeling.forwards.rewards import implicit_reward_beta, packed_sequence_scores, sequence_rewards
from trainer_core.modeling.forwards.token import masked_token_logprobs, padded_sequence_logprobs


def concat_pairs(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Stack chosen over rejected for one forward pass.

    Args:
        batch: ``chosen_*`` and ``rejected_*`` tensors, each [B, T] with a common T.

    Returns:
        (input_ids, attention_mask, loss_mask), each [2B, T]; rows [:B] are chosen.
    """
    return tuple(
        torch.cat([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]) for k in ("input_ids", "attention_mask", "loss_mask")
    )


def pair_logprobs(
    model: nn.Module, batch: dict[str, Tensor], chunk_size: int = CHUNK_SIZE_TOKENS
) -> tuple[Tensor, Tensor]:
    """Summed completion log-probs of chosen and rejected, each [B] float32, from one forward of the
    concatenated [2B, T] pairs or of a packed [1, S] batch (summed per sequence by ``sequence_ids``).

    ``model`` is an HF causal LM, plain or wrapped by a backend; its LM head runs on completion
    positions only, ``chunk_size`` tokens at a time
    (:func:`~trainer_core.modeling.forwards.token.masked_token_logprobs`).
    """
    pairs = num_pairs(batch)
    if is_packed(batch):
        loss_mask = batch["loss_mask"]
        token_logprobs = masked_token_logprobs(
            model,
            batch["input_ids"],
            None,
            loss_mask,
            chunk_size=chunk_size,
            position_ids=batch["position_ids"],
            counted_index=batch.get("counted_index"),
        )  # [1, S - 1], 0 where not counted (each sequence's first token included)
        logprobs = torch.zeros(2 * pairs, dtype=token_logprobs.dtype, device=token_logprobs.device)
        logprobs = logprobs.index_add(0, batch["sequence_ids"][0, 1:], token_logprobs[0])
    else:
        logprobs = padded_sequence_logprobs(model, *concat_pairs(batch), batch.get("counted_index"), chunk_size)
    return logprobs[:pairs], logprobs[pairs:]


def pair_rewards(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Rewards of chosen and rejected completions, each [B] float32, from one forward of the
    concatenated [2B, T] pairs or of a packed [1, S] batch, in the model's parameterisation
    (:func:`~trainer_core.modeling.forwards.rewards.sequence_rewards`: a scalar head, or the implicit
    reward ``beta / |y| * log pi(y | x)``)."""
    pairs = num_pairs(batch)
    beta = implicit_reward_beta(model)
    if not is_packed(batch):
        input_ids, attention_mask, loss_mask = concat_pairs(batch)
        rewards = sequence_rewards(model, input_ids, attention_mask, loss_mask, batch.get("counted_index"))
    elif beta is None:
        rewards = packed_sequence_scores(model, batch["input_ids"], batch["position_ids"], batch["last_token_index"])
    else:
        chosen, rejected = pair_logprobs(model, batch)
        counted = batch["loss_mask"][0, 1:].float()  # as pair_logprobs sums: each sequence's tokens after its first
        lengths = torch.zeros(2 * pairs, device=counted.device).index_add(0, batch["sequence_ids"][0, 1:], counted)
        rewards = beta * torch.cat([chosen, rejected]) / lengths.clamp(min=1)
    return rewards[:pairs], rewards[pairs:]


def kto_inputs(batch: dict[str, Tensor], prefix: str = "") -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The arguments of :func:`~trainer_core.modeling.forwards.token.padded_sequence_logprobs` for one
    side of a :func:`~trainer_core.data.batching.collate_kto` batch: its ``<prefix>input_ids``,
    ``<prefix>attention_mask``, ``<prefix>loss_mask`` ([B, T] each) and ``<prefix>counted_index``
    (or None); ``prefix`` is ``""`` for the completions, ``"kl_"`` for the KL sequences."""
    keys = ("input_ids", "attention_mask", "loss_mask")
    return (*(batch[f"{prefix}{k}"] for k in keys), batch.get(f"{prefix}counted_index"))


def kto_logprobs(
    model: nn.Module, batch: dict[str, Tensor], chunk_size: int = CHUNK_SIZE_TOKENS
) -> tuple[Tensor, Tensor]:
    """Summed log-probs of a :func:`~trainer_core.data.batching.collate_kto` batch's completions
    and of its KL sequences' completions, each [B] float32 (two forwards)."""
    return (
        padded_sequence_logprobs(model, *kto_inputs(batch, ""), chunk_size),
        padded_sequence_logprobs(model, *kto_inputs(batch, "kl_"), chunk_size),
    )


def _pair_length(row: dict) -> int:
    return len(row["chosen_input_ids"]) + len(row["rejected_input_ids"])


def _kto_length(row: dict) -> int:
    return len(row["input_ids"]) + len(row["kl_input_ids"])


@torch.no_grad()
def reference_logprobs(
    model: nn.Module,
    rows: list[dict],
    pad_id: int,
    batch_size: int,
    device,
    chunk_size: int = CHUNK_SIZE_TOKENS,
    *,
    kind: str = "pairs",
) -> list[list[float]]:
    """Summed completion log-probs under ``model`` for each row, in row order: [chosen, rejected]
    of preference pairs (``kind="pairs"``, :func:`pair_logprobs`) or [completion, KL completion]
    of KTO examples (``kind="kto"``, :func:`kto_logprobs`).

    ``model`` is the frozen reference, plain or as ``Backend.prepare_frozen`` placed it (an
    FSDP2 module, a ZeRO-3 engine); its LM head runs on completion positions only, in chunks
    of ``chunk_size`` tokens. Rows are batched in length order to limit padding; results are
    put back in row order.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in ("pairs", "kto"):
        raise ValueError(f"unknown reference log-prob kind {kind!r} (pairs or kto)")
    collate, forward, length = (
        (collate_pairs, pair_logprobs, _pair_length) if kind == "pairs" else (collate_kto, kto_logprobs, _kto_length)
    )
    order = sorted(range(len(rows)), key=lambda i: length(rows[i]))
    out: list[list[float]] = [[0.0, 0.0] for _ in rows]
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = {k: v.to(device) for k, v in collate([rows[i] for i in idx], pad_id).items()}
        first, second = forward(model, batch, chunk_size)
        for i, a, b in zip(idx, first.tolist(), second.tolist()):
            out[i] = [a, b]
    return out
