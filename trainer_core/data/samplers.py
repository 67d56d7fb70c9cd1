"""Resumable samplers: which rows make each micro-batch of an epoch.

A sampler's order is a pure function of ``(seed, epoch)``, so a run resumed at a
:class:`DataPosition` reads exactly the micro-batches it would have read without stopping.
Samplers take the row lengths as a list, a numpy array or an Arrow column (e.g. the prepared
``num_tokens`` column) and hold them, and an epoch's micro-batches, as int64 arrays: no
per-row Python objects, whatever the number of rows.

Re-exported by :mod:`trainer_core.data.batching`, where they were first defined.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import numpy as np
import pyarrow as pa


class BatchList(Sequence):
    """The micro-batches of one epoch: micro-batch ``k`` is ``flat[bounds[p]:bounds[p + 1]]`` with
    ``p = order[k]``, returned as a ``list[int]`` of row indices.

    Held as three int64 arrays (about 8 bytes a row) instead of a list of lists of Python ints;
    compares equal to a list of lists with the same micro-batches.

    Args:
        flat: ``[rows]`` row indices, micro-batch after micro-batch.
        bounds: ``[num_batches + 1]`` offsets of the micro-batches in ``flat``.
        order: ``[num_batches]`` the epoch's order of the micro-batches (None: as stored).
    """

    def __init__(self, flat: np.ndarray, bounds: np.ndarray, order: np.ndarray | None = None) -> None:
        self.flat, self.bounds, self.order = flat, bounds, order

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(f"micro-batch {k} of {len(self)}")
        p = k if self.order is None else int(self.order[k])
        return self.flat[self.bounds[p] : self.bounds[p + 1]].tolist()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BatchList({list(self)!r})"


def _lengths_array(lengths: Any) -> np.ndarray:
    """``[rows]`` int64 of a list, numpy array or Arrow array of row lengths."""
    if isinstance(lengths, (pa.Array, pa.ChunkedArray)):
        lengths = lengths.to_numpy()
    return np.asarray(lengths, dtype=np.int64).reshape(-1)


def _epoch_order(num_rows: int, rng: random.Random, shuffle: bool) -> np.ndarray:
    """``[num_rows]`` int64: ``range(num_rows)`` shuffled by ``rng`` (the permutation
    ``rng.shuffle`` applies to any list of that length), or in order."""
    order = array("q", range(num_rows))
    if shuffle:
        rng.shuffle(order)
    return np.frombuffer(order, dtype=np.int64)


class BucketedBatchSampler:
    """Deterministic length-bucketed micro-batches of row indices.

    For epoch ``e``: shuffle all indices with ``random.Random(seed + e)``, cut them into
    chunks of ``micro_batch_size * bucket_size_multiplier``, sort each chunk by length (so a
    micro-batch holds rows of similar length: little padding), split it into micro-batches
    and shuffle the micro-batch order with the same RNG. With ``drop_last`` the
    ``len(lengths) % micro_batch_size`` indices at the end of the shuffled order are left out
    (a random set, not the longest rows). With ``shuffle=False`` nothing is shuffled.

    ``lengths`` may be a list, a numpy array or an Arrow array (e.g. the ``num_tokens`` column, or
    :meth:`~trainer_core.data.prepared.PreparedRows.list_lengths`); it is held as int64 and an
    epoch's micro-batches as a :class:`BatchList`, about 24 bytes a row in all.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray | pa.Array,
        micro_batch_size: int,
        seed: int,
        shuffle: bool = True,
        bucket_size_multiplier: int = 50,
        drop_last: bool = False,
    ) -> None:
        """Store and validate.

        Raises:
            ValueError: ``micro_batch_size`` or ``bucket_size_multiplier`` below 1, or an epoch
                would have no micro-batch (no rows, or fewer than one full batch with ``drop_last``).
        """
        if micro_batch_size < 1 or bucket_size_multiplier < 1:
            raise ValueError(
                f"micro_batch_size and bucket_size_multiplier must be >= 1, got {micro_batch_size}, "
                f"{bucket_size_multiplier}"
            )
        self.lengths = _lengths_array(lengths)
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.bucket_size_multiplier = bucket_size_multiplier
        self.drop_last = drop_last
        if len(self) == 0:
            raise ValueError(
                f"{len(self.lengths)} rows give no micro-batch of {micro_batch_size} (drop_last={drop_last})"
            )

    def __len__(self) -> int:
        """Micro-batches per epoch."""
        n = len(self.lengths)
        return n // self.micro_batch_size if self.drop_last else math.ceil(n / self.micro_batch_size)

    def batches(self, epoch: int) -> BatchList:
        """The micro-batches (lists of row indices) of ``epoch``, a function of ``(seed, epoch)`` only."""
        rng = random.Random(self.seed + epoch)
        order = _epoch_order(len(self.lengths), rng, self.shuffle)
        if self.drop_last:
            order = order[: len(order) - len(order) % self.micro_batch_size]
        chunk, size = self.micro_batch_size * self.bucket_size_multiplier, self.micro_batch_size
        flat = np.empty_like(order)
        bounds = [0]
        for start in range(0, len(order), chunk):
            bucket = order[start : start + chunk]
            flat[start : start + len(bucket)] = bucket[np.argsort(self.lengths[bucket], kind="stable")]
            bounds.extend(range(start + size, start + len(bucket), size))
            bounds.append(start + len(bucket))
        bounds_array = np.asarray(bounds, dtype=np.int64)
        batch_order = _epoch_order(len(bounds_array) - 1, rng, self.shuffle) if self.shuffle else None
        return BatchList(flat, bounds_array, batch_order)


@dataclass
class DataPosition:
    """Where the data stream stands: ``batch_index`` is the index of the NEXT micro-batch of ``epoch``."""

    epoch: int = 0
    batch_index: int = 0

    def to_dict(self) -> dict[str, int]:
        """``{"epoch", "batch_index"}`` (JSON-ready)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataPosition:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: a missing key, a non-integer or a negative value.
        """
        try:
            epoch, batch_index = data["epoch"], data["batch_index"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"data position needs 'epoch' and 'batch_index', got {data!r}") from e
        for name, value in (("epoch", epoch), ("batch_index", batch_index)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"data position {name} must be a non-negative int, got {value!r}")
        return cls(epoch=epoch, batch_index=batch_index)


def iterate_batches(sampler, position: DataPosition) -> Iterator[tuple[list[int], DataPosition]]:
    """Endless micro-batches of ``sampler`` (:class:`BucketedBatchSampler` or
    :class:`PackedBatchSampler`) from ``position`` on, each with the position AFTER it.

    After the last micro-batch of an epoch the position is ``(epoch + 1, 0)``.

    Raises:
        ValueError: ``position.batch_index`` beyond the epoch's micro-batches.
    """
    if position.epoch < 0:
        raise ValueError(f"data position {position} has a negative epoch")
    epoch, start = position.epoch, position.batch_index
    batches = sampler.batches(epoch)
    if not 0 <= start <= len(batches):
        raise ValueError(f"data position {position} is outside an epoch of {len(batches)} micro-batches")
    while True:
        num_batches = len(batches)
        for i in range(start, num_batches):
            after = DataPosition(epoch, i + 1) if i + 1 < num_batches else DataPosition(epoch + 1, 0)
            yield batches[i], after
        epoch, start = epoch + 1, 0
        batches = sampler.batches(epoch)


class PackedBatchSampler:
    """Deterministic micro-batches of row indices packed under a token budget (padding-free).

    For epoch ``e``: shuffle all indices with ``random.Random(seed + e)`` (none with
    ``shuffle=False``), cut them into chunks of ``chunk_rows``, pack each chunk first-fit
    decreasing (longest row first, into the first micro-batch with room, so bins fill up to the
    budget), then shuffle the micro-batch order with the same RNG. A micro-batch holds a varying
    number of rows and at most ``max_tokens`` tokens, with no
    padding. Duck-types :class:`BucketedBatchSampler` (``len``, ``batches``); the number of
    micro-batches depends on the order, so it may differ between epochs (``len`` is epoch 0's;
    :func:`iterate_batches` takes each epoch's own).

    Args:
        lengths: tokens of each row (for a preference pair: chosen + rejected); a list, numpy
            array or Arrow array, held as int64.
        max_tokens: the token budget of a micro-batch (``max_tokens_per_micro_batch``).
        seed: order seed.
        shuffle: shuffle the rows each epoch.
        chunk_rows: rows packed together (first-fit decreasing is quadratic in a chunk's bins).

    Raises:
        ValueError: no rows, ``max_tokens`` below 1, or a row longer than ``max_tokens`` (named
            by its index).
    """

    drop_last = False

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray | pa.Array,
        max_tokens: int,
        seed: int,
        shuffle: bool = True,
        chunk_rows: int = 4096,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
        lengths = _lengths_array(lengths)
        if len(lengths) == 0:
            raise ValueError("no rows to pack")
        longest = int(np.argmax(lengths))
        if lengths[longest] > max_tokens:
            raise ValueError(
                f"row {longest} has {lengths[longest]} tokens, more than max_tokens_per_micro_batch={max_tokens}: "
                "raise the budget or lower data.max_length_tokens"
            )
        self.lengths = lengths
        self.max_tokens = max_tokens
        self.seed = seed
        self.shuffle = shuffle
        self.chunk_rows = chunk_rows
        self._num_batches = len(self._pack(0))

    def _first_fit(self, chunk: np.ndarray) -> list[list[int]]:
        """Bins of ``chunk``'s rows, first-fit decreasing (ties in input order)."""
        chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
        bins: list[list[int]] = []
        room: list[int] = []
        for i, n in zip(chunk.tolist(), self.lengths[chunk].tolist()):
            slot = next((b for b, free in enumerate(room) if free >= n), None)
            if slot is None:
                bins.append([])
                room.append(self.max_tokens)
                slot = len(bins) - 1
            bins[slot].append(i)
            room[slot] -= n
        return bins

    def _pack(self, epoch: int) -> BatchList:
        rng = random.Random(self.seed + epoch)
        order = _epoch_order(len(self.lengths), rng, self.shuffle)
        flat, bounds = [], [0]
        for start in range(0, len(order), self.chunk_rows):
            for b in self._first_fit(order[start : start + self.chunk_rows]):
                flat.append(np.asarray(b, dtype=np.int64))
                bounds.append(bounds[-1] + len(b))
        batch_order = _epoch_order(len(bounds) - 1, rng, True) if self.shuffle else None
        return BatchList(np.concatenate(flat), np.asarray(bounds, dtype=np.int64), batch_order)

    def __len__(self) -> int:
        """Micro-batches of epoch 0 (another epoch may pack into a few more or fewer)."""
        return self._num_batches

    def batches(self, epoch: int) -> BatchList:
        """The micro-batches (lists of row indices) of ``epoch``, a function of ``(seed, epoch)`` only."""
        return self._pack(epoch)
