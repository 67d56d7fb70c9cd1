"""prepare_data's working copy of each data set: canonical examples staged on local disk.

A data set is read once, as a stream (:func:`~trainer_core.data.sources.iter_records`); each
record is adapted to its canonical example (:mod:`trainer_core.data.formats`) and appended to an
:class:`ExampleStore`, an uncompressed Arrow IPC file in a local temporary directory. The
held-out split, the decontamination and the tokenisation then address examples by their index
in input order: :func:`split_order` gives the same rows, in the same order, as shuffling the
whole list with ``random.Random(seed)`` did, without holding the list.

Reading a store never holds it in memory: :meth:`ExampleStore.take` maps the file for one call
(only the pages of the rows taken are read) and :meth:`ExampleStore.scan` reads it a batch at a
time. Worker processes open the same file by its path.

Columns of a store (``kind``): ``sft``: prompt, completion, answer (str|null), messages_json;
``preference``: messages_json, chosen, rejected; ``kto``: messages_json, completion, label
(bool, True = desirable); ``text``: text. ``messages_json`` is the prompt messages as JSON, as
the prepared splits store it.
"""

from __future__ import annotations

import json
import logging
import mmap
import random
from array import array
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainer_core.data.formats import DialogueParseError
from trainer_core.errors import DataError

logger = logging.getLogger(__name__)

MAX_INVALID_FRACTION = 0.05
"""Largest fraction of a data set's records that may fail to parse (and be skipped)."""

STAGE_BATCH_ROWS = 4096
"""Examples per record batch of a store file."""

RELEASE_EVERY_BATCHES = 8
"""Record batches :meth:`ExampleStore.take` reads between two releases of its mapping's pages."""

STORE_SCHEMAS: dict[str, pa.Schema] = {
    "sft": pa.schema(
        [
            ("prompt", pa.string()),
            ("completion", pa.string()),
            ("answer", pa.string()),
            ("messages_json", pa.string()),
            ("tools_json", pa.string()),
        ]
    ),
    "preference": pa.schema([("messages_json", pa.string()), ("chosen", pa.string()), ("rejected", pa.string())]),
    "kto": pa.schema([("messages_json", pa.string()), ("completion", pa.string()), ("label", pa.bool_())]),
    "text": pa.schema([("text", pa.string())]),
}
"""Columns of a store per kind of canonical example."""


def messages_json(messages: list[dict[str, str]]) -> str:
    """Prompt messages as the JSON string the prepared splits store (``ensure_ascii=False``)."""
    return json.dumps(messages, ensure_ascii=False)


def _store_row(kind: str, example: dict) -> dict[str, Any]:
    """The store columns of one canonical example."""
    if kind == "text":
        return {"text": example["text"]}
    row = {name: example[name] for name in STORE_SCHEMAS[kind].names if not name.endswith("_json")}
    row["messages_json"] = messages_json(example["messages"])
    if kind == "sft":  # the declared tools (a conversation's), or null
        row["tools_json"] = json.dumps(example["tools"], ensure_ascii=False) if example.get("tools") else None
    return row


class ExampleStore:
    """Canonical examples of one data set in a local Arrow IPC file, in input order.

    Args:
        path: the IPC file (written by :func:`stage_examples`).
        kind: ``sft``, ``preference``, ``kto`` or ``text`` (:data:`STORE_SCHEMAS`).
        num_rows: examples in the file.
        group_starts: for ``kto``, ``[num_groups + 1]`` int64 index of each record's first
            example (a preference pair gives two examples, a kto record one); None otherwise.
    """

    def __init__(self, path: str, kind: str, num_rows: int, group_starts: np.ndarray | None = None) -> None:
        self.path = path
        self.kind = kind
        self.num_rows = num_rows
        self.group_starts = group_starts

    def __len__(self) -> int:
        return self.num_rows

    def take(self, indices: Iterable[int]) -> list[dict]:
        """The examples at ``indices`` (any order, repeats allowed) as dicts of the store's columns
        plus ``messages`` (decoded from ``messages_json``, except for ``text``).

        The file is mapped for this call only, and the mapping's resident pages are released
        every :data:`RELEASE_EVERY_BATCHES` record batches read (a few rows of a batch map most
        of its pages), so a process's resident memory holds a few batches, not the file.
        """
        index = np.asarray(indices, dtype=np.int64)
        if len(index) and (index.min() < 0 or index.max() >= self.num_rows):
            raise IndexError(f"store {self.path} has {self.num_rows} rows; asked for {index.min()}..{index.max()}")
        order = np.argsort(index // STAGE_BATCH_ROWS, kind="stable")  # group the takes by record batch
        batch_of = index[order] // STAGE_BATCH_ROWS
        firsts = np.flatnonzero(np.diff(batch_of, prepend=-1))
        parts = []
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
            reader = pa.ipc.open_file(pa.BufferReader(pa.py_buffer(mapping)))
            for n, (a, b) in enumerate(zip(firsts, [*firsts[1:], len(index)]), start=1):
                rows_at = pa.array(index[order[a:b]] % STAGE_BATCH_ROWS)
                parts.append(pa.Table.from_batches([reader.get_batch(int(batch_of[a])).take(rows_at)]).to_pylist())
                if n % RELEASE_EVERY_BATCHES == 0:
                    mapping.madvise(mmap.MADV_DONTNEED)
            del reader  # its buffers point into the mapping, which closes here
        taken = [row for part in parts for row in part]
        rows: list[dict] = [{}] * len(index)
        for position, row in zip(order.tolist(), taken):
            rows[position] = row
        if self.kind != "text":
            for row in rows:
                row["messages"] = json.loads(row["messages_json"])
        return rows

    def scan(self, columns: list[str]) -> Iterator[pa.RecordBatch]:
        """The store's ``columns`` in input order, one record batch (:data:`STAGE_BATCH_ROWS` rows)
        read at a time."""
        with pa.OSFile(self.path, "rb") as source:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i).select(columns)


def stage_examples(
    records: Iterable[dict],
    fmt: str,
    adapter: Callable[[dict, str], Any],
    name: str,
    kind: str,
    path: str,
    metrics: dict[str, float],
    resolve_format: Callable[[dict], str] | None = None,
) -> ExampleStore:
    """Adapt every record and append its example(s) to a new store at ``path``; skip (and count)
    unparsable dialogues up to :data:`MAX_INVALID_FRACTION` of the records.

    Args:
        records: the data set's records, streamed (each with ``"_source"`` when read from a file).
        fmt: the record format; ``"auto"`` is resolved from the first record by
            ``resolve_format`` (default :func:`~trainer_core.data.formats.detect_format`).
        adapter: record, format -> canonical example (a list of them for ``kto``).
        name: the data set's name in metrics and errors (``sft``, ``preference``, ...).
        kind: the store kind (:data:`STORE_SCHEMAS`).
        path: the local file to write.
        metrics: gets ``num_<name>_invalid``.

    Returns:
        The store, ``len`` = examples written.

    Raises:
        DataError: a record the adapter rejects (naming its ``file:line``), more than
            :data:`MAX_INVALID_FRACTION` of the records unparsable, or no records.
    """
    from trainer_core.data.formats import detect_format

    schema = STORE_SCHEMAS[kind]
    num_records, invalid, buffer = 0, [], []
    group_starts = array("q", [0]) if kind == "kto" else None
    num_rows = 0
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for record in records:
            if num_records == 0 and fmt == "auto":
                fmt = (resolve_format or detect_format)(record)
            num_records += 1
            try:
                adapted = adapter(record, fmt)
            except DialogueParseError as e:
                invalid.append(str(e))
                continue
            examples = adapted if kind == "kto" else [adapted]
            buffer.extend(_store_row(kind, ex) for ex in examples)
            num_rows += len(examples)
            if group_starts is not None:
                group_starts.append(num_rows)
            while len(buffer) >= STAGE_BATCH_ROWS:  # exactly STAGE_BATCH_ROWS a batch: take() indexes by it
                writer.write_batch(pa.RecordBatch.from_pylist(buffer[:STAGE_BATCH_ROWS], schema=schema))
                buffer = buffer[STAGE_BATCH_ROWS:]
        if buffer:
            writer.write_batch(pa.RecordBatch.from_pylist(buffer, schema=schema))
    _check_invalid(name, fmt, num_records, invalid, metrics)
    starts = None if group_starts is None else np.frombuffer(group_starts, dtype=np.int64)
    return ExampleStore(path, kind, num_rows, starts)


def _check_invalid(name: str, fmt: str, num_records: int, invalid: list[str], metrics: dict[str, float]) -> None:
    metrics[f"num_{name}_invalid"] = len(invalid)
    if invalid:
        logger.warning("%s: skipped %d unparsable records, e.g. %s", name, len(invalid), invalid[:3])
    if len(invalid) > MAX_INVALID_FRACTION * num_records:
        raise DataError(
            f"{name}: {len(invalid)} of {num_records} records do not parse as format {fmt!r} "
            f"(more than {MAX_INVALID_FRACTION:.0%}); first: {invalid[0]}"
        )


def shuffled(n: int, seed: int | str) -> np.ndarray:
    """``[n]`` int64: ``range(n)`` shuffled by ``random.Random(seed).shuffle``, the same permutation
    that shuffling any list of ``n`` items with that RNG applies (8 bytes an item, no list)."""
    order = array("q", range(n))
    random.Random(seed).shuffle(order)
    return np.frombuffer(order, dtype=np.int64)


def split_order(
    n: int, seed: int, eval_fraction: float, max_eval_rows: int, name: str = "data"
) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the train and eval splits of ``n`` examples: shuffle ``range(n)`` with
    ``random.Random(seed)``; the first ``round(n * eval_fraction)`` (at least 1, at most
    ``max_eval_rows`` and ``n - 1``) are the eval split, the rest the train split, both in that
    shuffled order.

    Returns:
        ``(train [n - num_eval], eval [num_eval])``, int64.

    Raises:
        DataError: fewer than 2 examples.
    """
    if n < 2:
        raise DataError(f"{name}: {n} usable record(s); need at least 2 to hold out an eval split")
    order = shuffled(n, seed)
    num_eval = min(max_eval_rows, max(1, round(n * eval_fraction)), n - 1)
    return order[num_eval:], order[:num_eval]


def group_examples(store: ExampleStore, groups: np.ndarray) -> np.ndarray:
    """``[sum of group sizes]`` int64: the example indices of ``groups`` (a kto store's records), group
    by group in the given order, each group's examples in input order."""
    starts = store.group_starts
    if starts is None:
        raise ValueError(f"store {store.path} has no groups (kind {store.kind})")
    begin, sizes = starts[groups], starts[groups + 1] - starts[groups]
    offsets = np.repeat(begin - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
    return offsets + np.arange(int(sizes.sum()), dtype=np.int64)


def mask_in(store: ExampleStore, column: str, values: set[str]) -> np.ndarray:
    """``[len(store)]`` bool: True where ``column`` is one of ``values`` (read batch by batch)."""
    value_set = pa.array(sorted(values), type=pa.string())
    parts = [
        pc.is_in(batch.column(0), value_set=value_set).to_numpy(zero_copy_only=False) for batch in store.scan([column])
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


def mask_containing(store: ExampleStore, column: str, needles: set[str]) -> np.ndarray:
    """``[len(store)]`` bool: True where ``column`` contains any of ``needles`` as a substring."""
    parts = [
        np.fromiter((any(q in text for q in needles) for text in batch.column(0).to_pylist()), dtype=bool)
        for batch in store.scan([column])
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
