"""Collation shapes and padding; the bucketed sampler's determinism and exact resume."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from trainer_core.data.batching import (
    BucketedBatchSampler,
    DataPosition,
    collate_causal,
    collate_pairs,
    collate_prompts_left,
    iterate_batches,
)

PAD = 9


def test_collate_causal_right_pads_to_longest():
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4], "loss_mask": [1]}]
    batch = collate_causal(rows, PAD)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, PAD, PAD]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    # hidden states at (0, 0) and (0, 1) predict the counted tokens (0, 1) and (0, 2); row 1's first
    # token is never a target
    assert batch.pop("counted_index").tolist() == [0, 1]
    assert all(t.dtype == torch.long and t.shape == (2, 3) for t in batch.values())


def test_collate_causal_without_loss_mask_counts_every_token():
    batch = collate_causal([{"input_ids": [5, 6]}, {"input_ids": [7]}], 0)
    assert batch["loss_mask"].tolist() == [[1, 1], [1, 0]]


@pytest.mark.parametrize(
    ("rows", "pattern"),
    [
        ([], "empty batch"),
        ([{"ids": [1]}], "no 'input_ids'"),
        ([{"input_ids": [1, 2], "loss_mask": [1]}], "'loss_mask' has 1 entries"),
        ([{"input_ids": []}], "empty 'input_ids'"),
    ],
)
def test_collate_causal_errors(rows, pattern):
    with pytest.raises(ValueError, match=pattern):
        collate_causal(rows, PAD)


def test_collate_pairs_share_one_length():
    rows = [
        {
            "chosen_input_ids": [1, 2],
            "chosen_loss_mask": [0, 1],
            "rejected_input_ids": [1, 3, 4, 5],
            "rejected_loss_mask": [0, 1, 1, 1],
            "extra": "ignored",
        },
        {
            "chosen_input_ids": [1, 2, 3],
            "chosen_loss_mask": [0, 0, 1],
            "rejected_input_ids": [1],
            "rejected_loss_mask": [1],
        },
    ]
    batch = collate_pairs(rows, PAD)
    # [chosen; rejected] as [4, 4]: targets (0, 1), (1, 2), (2, 1), (2, 2), (2, 3) <- hidden 0, 5, 8, 9, 10
    assert batch.pop("counted_index").tolist() == [0, 5, 8, 9, 10]
    assert set(batch) == {
        f"{s}_{k}" for s in ("chosen", "rejected") for k in ("input_ids", "attention_mask", "loss_mask")
    }
    assert all(t.shape == (2, 4) and t.dtype == torch.long for t in batch.values())
    assert batch["chosen_input_ids"].tolist() == [[1, 2, PAD, PAD], [1, 2, 3, PAD]]
    assert batch["rejected_attention_mask"].tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert batch["chosen_loss_mask"].tolist() == [[0, 1, 0, 0], [0, 0, 1, 0]]
    both = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])  # the [2B,T] forward
    assert both.shape == (4, 4)


def test_collate_prompts_left_pads_on_the_left():
    batch = collate_prompts_left([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}], PAD)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [PAD, PAD, 4]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    eval_rows = [{"prompt_input_ids": [7, 8], "answer": "3"}, {"prompt_input_ids": [6]}]
    assert collate_prompts_left(eval_rows, 0)["input_ids"].tolist() == [[7, 8], [0, 6]]
    with pytest.raises(ValueError, match="no 'x'"):
        collate_prompts_left(eval_rows, 0, key="x")


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 100) for _ in range(n)]


def test_sampler_partition_sizes_and_len():
    sampler = BucketedBatchSampler(_lengths(103), micro_batch_size=8, seed=1, bucket_size_multiplier=3)
    batches = sampler.batches(0)
    assert len(batches) == len(sampler) == 13
    assert sorted(i for b in batches for i in b) == list(range(103))
    assert sorted(len(b) for b in batches) == [7] + [8] * 12


def test_sampler_buckets_reduce_padding():
    lengths = _lengths(400)
    sampler = BucketedBatchSampler(lengths, micro_batch_size=8, seed=0, bucket_size_multiplier=50)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in sampler.batches(0))
    plain = BucketedBatchSampler(lengths, micro_batch_size=8, seed=0, bucket_size_multiplier=1)
    padded_plain = sum(len(b) * max(lengths[i] for i in b) for b in plain.batches(0))
    assert padded < 0.75 * padded_plain
    for b in sampler.batches(0):  # each micro-batch is a run of one sorted chunk
        assert max(lengths[i] for i in b) - min(lengths[i] for i in b) <= 10


def test_sampler_is_a_function_of_seed_and_epoch():
    lengths = _lengths(50)
    a = BucketedBatchSampler(lengths, 4, seed=7, bucket_size_multiplier=2)
    b = BucketedBatchSampler(lengths, 4, seed=7, bucket_size_multiplier=2)
    assert a.batches(3) == b.batches(3) == a.batches(3)
    assert a.batches(0) != a.batches(1)
    assert a.batches(0) != BucketedBatchSampler(lengths, 4, seed=8, bucket_size_multiplier=2).batches(0)


def test_sampler_without_shuffle_is_sorted_chunks():
    lengths = [5, 1, 4, 2, 3, 0]
    sampler = BucketedBatchSampler(lengths, 2, seed=0, shuffle=False, bucket_size_multiplier=2)
    assert sampler.batches(0) == [[1, 3], [2, 0], [5, 4]] == sampler.batches(5)


def test_sampler_drop_last_drops_a_random_remainder():
    lengths = list(range(10))
    sampler = BucketedBatchSampler(lengths, 4, seed=0, drop_last=True)
    assert len(sampler) == 2
    dropped = set()
    for epoch in range(20):
        batches = sampler.batches(epoch)
        assert [len(b) for b in batches] == [4, 4]
        dropped |= set(range(10)) - {i for b in batches for i in b}
    assert len(dropped) > 4  # not always the longest rows


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"lengths": [], "micro_batch_size": 2}, "no micro-batch"),
        ({"lengths": [1, 2], "micro_batch_size": 3, "drop_last": True}, "no micro-batch"),
        ({"lengths": [1], "micro_batch_size": 0}, "must be >= 1"),
    ],
)
def test_sampler_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        BucketedBatchSampler(seed=0, **kwargs)


def test_iterate_batches_positions_cross_epochs():
    sampler = BucketedBatchSampler(_lengths(10), 4, seed=3)
    got = list(itertools.islice(iterate_batches(sampler, DataPosition()), 7))
    assert [p for _, p in got] == [
        DataPosition(0, 1),
        DataPosition(0, 2),
        DataPosition(1, 0),
        DataPosition(1, 1),
        DataPosition(1, 2),
        DataPosition(2, 0),
        DataPosition(2, 1),
    ]
    assert [b for b, _ in got[:3]] == sampler.batches(0) and [b for b, _ in got[3:6]] == sampler.batches(1)


@pytest.mark.parametrize("stop", [0, 1, 5, 9, 13])
def test_resume_from_a_mid_position_replays_the_tail(stop):
    """Stopping after ``stop`` micro-batches and resuming from the saved position equals not stopping."""
    sampler = BucketedBatchSampler(_lengths(37), 5, seed=11, bucket_size_multiplier=2)
    full = list(itertools.islice(iterate_batches(sampler, DataPosition()), 30))
    saved = full[stop - 1][1] if stop else DataPosition()
    restored = DataPosition.from_dict(saved.to_dict())
    fresh_sampler = BucketedBatchSampler(_lengths(37), 5, seed=11, bucket_size_multiplier=2)
    resumed = list(itertools.islice(iterate_batches(fresh_sampler, restored), 30 - stop))
    assert resumed == full[stop:]


def test_iterate_from_end_of_epoch_index_and_bad_position():
    sampler = BucketedBatchSampler(_lengths(8), 4, seed=0)
    first, _ = next(iterate_batches(sampler, DataPosition(0, 2)))
    assert first == sampler.batches(1)[0]
    with pytest.raises(ValueError, match="outside an epoch"):
        next(iterate_batches(sampler, DataPosition(0, 3)))


def test_data_position_dict_round_trip_and_validation():
    assert DataPosition(2, 5).to_dict() == {"epoch": 2, "batch_index": 5}
    assert DataPosition.from_dict({"epoch": 2, "batch_index": 5}) == DataPosition(2, 5)
    for bad in ({"epoch": 1}, {"epoch": -1, "batch_index": 0}, {"epoch": 1.5, "batch_index": 0}, None):
        with pytest.raises(ValueError):
            DataPosition.from_dict(bad)
