"""Training-time batching: collation into padded and packed tensors (the samplers that choose each
micro-batch's rows are in :mod:`trainer_core.data.samplers`, re-exported here).

Shape legend: B batch (micro-batch size), T tokens (the longest row of the batch).
All collated tensors are ``torch.long``. ``attention_mask`` is 1 = real token, 0 = padding;
``loss_mask`` is 1 = counted in the loss, aligned with ``input_ids`` (shifting it for
next-token prediction is the loss function's job).

Rows are dicts of ``list[int]`` (or anything ``torch.as_tensor`` accepts) as stored by
``prepare_data``.

"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from trainer_core.data.samplers import (  # noqa: F401 - re-exported: the samplers were defined here first
    BatchList,
    BucketedBatchSampler,
    DataPosition,
    PackedBatchSampler,
    iterate_batches,
)


def pad_sequences(seqs: Sequence[Sequence[int]], length: int, value: int, left: bool = False) -> Tensor:
    """``[len(seqs), length]`` long tensor of ``seqs`` padded with ``value``."""
    out = torch.full((len(seqs), length), value, dtype=torch.long)
    for i, seq in enumerate(seqs):
        n = len(seq)
        if n:
            row = torch.as_tensor(seq, dtype=torch.long)
            if left:
                out[i, length - n :] = row
            else:
                out[i, :n] = row
    return out


def _check_rows(rows: Sequence[dict], ids_key: str, mask_key: str | None) -> None:
    if not rows:
        raise ValueError("cannot collate an empty batch")
    for i, row in enumerate(rows):
        if ids_key not in row:
            raise ValueError(f"batch row {i} has no '{ids_key}' (keys: {sorted(row)})")
        if mask_key is not None and mask_key in row and len(row[mask_key]) != len(row[ids_key]):
            raise ValueError(
                f"batch row {i}: '{mask_key}' has {len(row[mask_key])} entries but '{ids_key}' {len(row[ids_key])}"
            )
    if max(len(row[ids_key]) for row in rows) == 0:
        raise ValueError(f"every row of the batch has an empty '{ids_key}'")


def _causal(rows: Sequence[dict], pad_id: int, prefix: str, length: int) -> dict[str, Tensor]:
    ids = [row[f"{prefix}input_ids"] for row in rows]
    loss = [row.get(f"{prefix}loss_mask", [1] * len(row[f"{prefix}input_ids"])) for row in rows]
    return {
        f"{prefix}input_ids": pad_sequences(ids, length, pad_id),
        f"{prefix}attention_mask": pad_sequences([[1] * len(s) for s in ids], length, 0),
        f"{prefix}loss_mask": pad_sequences(loss, length, 0),
    }


def counted_index(loss_mask: Tensor) -> Tensor:
    """Flat positions, in ``loss_mask.flatten()`` order, of the tokens whose NEXT token is counted.

    The forward (:mod:`trainer_core.modeling.forwards.token`) selects the hidden states that predict counted
    tokens with it (``hidden.reshape(B * T, H).index_select(0, index)``, targets at ``index + 1``);
    computed on the host at collation, it spares the device a data-dependent selection (a host
    synchronisation on CUDA) in every step.

    Args:
        loss_mask: [B, T] long, 1 = counted.

    Returns:
        [N] long, ``b * T + t`` for every ``loss_mask[b, t + 1] == 1`` (N counted tokens).
    """
    num_rows, length = loss_mask.shape
    shifted = torch.zeros_like(loss_mask, dtype=torch.bool)
    shifted[:, :-1] = loss_mask[:, 1:].bool()
    return shifted.flatten().nonzero().squeeze(1)


def collate_causal(rows: Sequence[dict], pad_id: int) -> dict[str, Tensor]:
    """Right-pad causal-LM rows to the longest one.

    Args:
        rows: dicts with ``input_ids`` and ``loss_mask`` (absent: all 1) of equal length.
        pad_id: token id written in padded positions.

    Returns:
        ``input_ids [B,T]``, ``attention_mask [B,T]`` (1 = real token), ``loss_mask [B,T]``
        (1 = counted in the loss; 0 on padding) and ``counted_index [N]`` (:func:`counted_index`),
        all long.

    Raises:
        ValueError: empty batch, a row without ``input_ids``, mask/ids length mismatch, or all rows empty.
    """
    _check_rows(rows, "input_ids", "loss_mask")
    batch = _causal(rows, pad_id, "", max(len(row["input_ids"]) for row in rows))
    batch["counted_index"] = counted_index(batch["loss_mask"])
    return batch


def collate_pairs(rows: Sequence[dict], pad_id: int) -> dict[str, Tensor]:
    """Right-pad preference pairs to ONE common length, ready for a concatenated ``[2B,T]`` forward.

    Args:
        rows: dicts with ``chosen_input_ids``, ``chosen_loss_mask``, ``rejected_input_ids``,
            ``rejected_loss_mask``.
        pad_id: token id written in padded positions.

    Returns:
        ``chosen_input_ids``, ``chosen_attention_mask``, ``chosen_loss_mask``,
        ``rejected_input_ids``, ``rejected_attention_mask``, ``rejected_loss_mask``: each
        ``[B,T]`` long with T the longest chosen or rejected row; ``counted_index [N]`` of the
        chosen rows stacked over the rejected ones ([2B, T], :func:`counted_index`).

    Raises:
        ValueError: as :func:`collate_causal`, for either side.
    """
    _check_rows(rows, "chosen_input_ids", "chosen_loss_mask")
    _check_rows(rows, "rejected_input_ids", "rejected_loss_mask")
    length = max(len(row[k]) for row in rows for k in ("chosen_input_ids", "rejected_input_ids"))
    batch = {**_causal(rows, pad_id, "chosen_", length), **_causal(rows, pad_id, "rejected_", length)}
    batch["counted_index"] = counted_index(torch.cat([batch["chosen_loss_mask"], batch["rejected_loss_mask"]]))
    return batch


def collate_kto(rows: Sequence[dict], pad_id: int) -> dict[str, Tensor]:
    """Right-pad unpaired KTO examples and their mismatched KL sequences (two forwards).

    Args:
        rows: dicts with ``input_ids``, ``loss_mask``, ``kl_input_ids``, ``kl_loss_mask`` and
            ``label`` (True = desirable); optionally ``ref_logprobs`` and ``ref_kl_logprobs``.
        pad_id: token id written in padded positions.

    Returns:
        ``input_ids``, ``attention_mask``, ``loss_mask`` [B, T] and ``counted_index`` of the
        completions; ``kl_input_ids``, ``kl_attention_mask``, ``kl_loss_mask`` [B, T'] and
        ``kl_counted_index`` of the KL sequences (long); ``label`` [B] bool; and, when the rows
        carry them, ``ref_logprobs`` / ``ref_kl_logprobs`` [B] float32.

    Raises:
        ValueError: as :func:`collate_causal`, for either sequence, or a row without ``label``.
    """
    _check_rows(rows, "input_ids", "loss_mask")
    _check_rows(rows, "kl_input_ids", "kl_loss_mask")
    missing = [i for i, row in enumerate(rows) if "label" not in row]
    if missing:
        raise ValueError(f"batch row {missing[0]} has no 'label' (keys: {sorted(rows[missing[0]])})")
    batch = {
        **_causal(rows, pad_id, "", max(len(r["input_ids"]) for r in rows)),
        **_causal(rows, pad_id, "kl_", max(len(r["kl_input_ids"]) for r in rows)),
    }
    batch["counted_index"] = counted_index(batch["loss_mask"])
    batch["kl_counted_index"] = counted_index(batch["kl_loss_mask"])
    batch["label"] = torch.tensor([bool(r["label"]) for r in rows], dtype=torch.bool)
    for key in ("ref_logprobs", "ref_kl_logprobs"):
        if key in rows[0]:
            batch[key] = torch.tensor([r[key] for r in rows], dtype=torch.float32)
    return batch


def collate_prompts_left(rows: Sequence[dict], pad_id: int, key: str | None = None) -> dict[str, Tensor]:
    """Left-pad prompts for batched generation (the last column is every row's last token).

    Args:
        rows: dicts holding the prompt ids under ``key``.
        pad_id: token id written in padded positions.
        key: the ids field; None: ``input_ids`` if the first row has it, else ``prompt_input_ids``
            (the column of ``eval_problems.parquet``).

    Returns:
        ``input_ids [B,T]`` and ``attention_mask [B,T]`` (1 = real token), long.

    Raises:
        ValueError: empty batch, a row without the ids field, or all prompts empty.
    """
    if key is None:
        key = "input_ids" if rows and "input_ids" in rows[0] else "prompt_input_ids"
    _check_rows(rows, key, None)
    ids = [row[key] for row in rows]
    length = max(len(s) for s in ids)
    return {
        "input_ids": pad_sequences(ids, length, pad_id, left=True),
        "attention_mask": pad_sequences([[1] * len(s) for s in ids], length, 0, left=True),
    }


def _packed(seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], pad_id: int) -> dict[str, Tensor]:
    """One [1, S] row of ``seqs`` end to end, with restarting positions and per-token sequence index."""
    if min(len(s) for s in seqs) == 0:
        raise ValueError("a packed batch cannot hold an empty row")
    input_ids = torch.cat([torch.as_tensor(s, dtype=torch.long) for s in seqs])
    loss_mask = torch.cat([torch.as_tensor(m, dtype=torch.long) for m in masks])
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    starts = torch.cumsum(lengths, 0) - lengths
    loss_mask[starts] = 0  # a sequence's first token is never a prediction target (unpacked either)
    sequence_ids = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
    positions = torch.arange(len(input_ids))
    position_ids = positions - starts[sequence_ids]
    # The pooled position of a sequence classifier: the last token that is not ``pad_id`` (the
    # sequence's first when all are), as transformers' ``*ForSequenceClassification`` pools.
    last_token_index = starts.clone()
    real = input_ids != pad_id
    last_token_index.scatter_reduce_(0, sequence_ids[real], positions[real], reduce="amax")
    return {
        "input_ids": input_ids[None],
        "position_ids": position_ids[None],
        "loss_mask": loss_mask[None],
        "counted_index": counted_index(loss_mask[None]),
        "sequence_ids": sequence_ids[None],
        "last_token_index": last_token_index,
    }


def collate_causal_packed(rows: Sequence[dict], pad_id: int) -> dict[str, Tensor]:
    """Causal-LM rows end to end in one padding-free [1, S] micro-batch.

    Sequence boundaries are kept by ``position_ids``, which restart at 0 for every row:
    transformers' attention masks then let no token attend across rows (a block-diagonal causal
    mask for sdpa and eager, document masks for flex_attention, varlen for flash-attention),
    provided the model is called with ``position_ids`` and no ``attention_mask``.

    Args:
        rows: dicts with ``input_ids`` and ``loss_mask`` (absent: all 1) of equal length.
        pad_id: the padding token (no padding is written: it locates ``last_token_index``).

    Returns:
        ``input_ids [1,S]``, ``position_ids [1,S]``, ``loss_mask [1,S]`` (0 on each row's first
        token, which no position predicts), ``counted_index [N]`` (:func:`counted_index`),
        ``sequence_ids [1,S]`` (row of each token) and
        ``last_token_index [R]`` (position of each row's last token other than ``pad_id``, where
        a sequence classifier pools), all long; S = total tokens, R = rows.

    Raises:
        ValueError: as :func:`collate_causal`, or a row with no tokens.
    """
    _check_rows(rows, "input_ids", "loss_mask")
    ids = [row["input_ids"] for row in rows]
    return _packed(ids, [row.get("loss_mask", [1] * len(row["input_ids"])) for row in rows], pad_id)


def collate_pairs_packed(rows: Sequence[dict], pad_id: int) -> dict[str, Tensor]:
    """Preference pairs in one padding-free [1, S] micro-batch: the B chosen, then the B rejected.

    As :func:`collate_causal_packed`, with sequences ``0..B-1`` the chosen completions and
    ``B..2B-1`` the rejected ones (``sequence_ids``, ``last_token_index [2B]``).

    Raises:
        ValueError: as :func:`collate_pairs`, or an empty chosen or rejected row.
    """
    _check_rows(rows, "chosen_input_ids", "chosen_loss_mask")
    _check_rows(rows, "rejected_input_ids", "rejected_loss_mask")
    sides = ("chosen", "rejected")
    seqs = [row[f"{side}_input_ids"] for side in sides for row in rows]
    masks = [row.get(f"{side}_loss_mask", [1] * len(row[f"{side}_input_ids"])) for side in sides for row in rows]
    return _packed(seqs, masks, pad_id)


def is_packed(batch: dict[str, Tensor]) -> bool:
    """True for a batch of :func:`collate_causal_packed` / :func:`collate_pairs_packed`."""
    return "sequence_ids" in batch


def num_pairs(batch: dict[str, Tensor]) -> int:
    """Preference pairs in a host or device batch, padded or packed (its shapes only: no sync)."""
    return batch["last_token_index"].shape[0] // 2 if is_packed(batch) else batch["chosen_input_ids"].shape[0]
