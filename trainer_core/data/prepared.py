"""Reading what prepare_data committed: tokenised splits, memory-mapped, and the tokenizer.

The writer is the ``prepare_data`` stage (``trainer_core/stages/prepare_data.py``, which
documents the columns); every other stage reads its output through this module.

A split is committed as Parquet (:mod:`trainer_core.data.shards`: shards, or one file in outputs
written before sharding). Parquet is compressed, so it cannot be mapped as it is: the first
reader on a machine converts each file, a row group at a time, into an uncompressed Arrow IPC
file in a local cache, ``<tempdir>/posttrain-cache/arrow/<sha256 of the Parquet file>.arrow``
(``TMPDIR`` moves it; a lock file lets one rank convert while the others wait), and every reader
maps that file. The cache is keyed by the content hash the manifest records, so it is reused by
every run with the same data and never stale; nothing removes it. Remote outputs (``s3://``,
``memory://``) are streamed into the same cache. A process then holds no row as a Python object
until it asks for it: :class:`PreparedRows` turns one row into a dict when it is indexed, and
only the pages of the last rows read stay resident (file-backed pages, shared by the ranks of a
machine: they count in a process's RSS while mapped, and are released every
:data:`RELEASE_EVERY_ROWS` rows).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from trainer_core import storage
from trainer_core.checkpoint.manifest import MANIFEST_NAME, FileEntry, read_manifest
from trainer_core.data.shards import split_files
from trainer_core.data.tokenizer import load_tokenizer
from trainer_core.errors import DataError
from trainer_core.storage import join_uri

SPLIT_NAMES = ("sft/train", "sft/eval", "preference/train", "preference/eval", "eval_problems")
"""Splits of every prepared-data directory, for :func:`load_split`."""

OPTIONAL_SPLIT_NAMES = ("kto/train", "kto/eval", "pretrain/train", "pretrain/eval")
"""Splits a prepared-data directory holds only when its config set their source
(``data.kto``, ``data.pretrain``)."""

CACHE_BATCH_ROWS = 8192
"""Rows per record batch of a cached Arrow file (what a Parquet file is decoded by at a time)."""

RELEASE_EVERY_ROWS = 16
"""Rows a :class:`PreparedRows` reads between two releases of its mappings' resident pages (each
row read maps a few hundred KiB of file pages on a kernel with large page-cache folios)."""


def _manifest_files(data_uri: str) -> list[FileEntry]:
    try:
        return read_manifest(data_uri).files
    except FileNotFoundError as e:
        raise DataError(f"{data_uri} is not a committed prepare_data output (no {MANIFEST_NAME})") from e


def arrow_cache_dir() -> str:
    """The local directory of the memory-mappable copies of prepared Parquet files."""
    return os.path.join(tempfile.gettempdir(), storage.CACHE_DIRNAME, "arrow")


def _parquet_to_arrow(uri: str, local_path: str) -> None:
    """Decode the Parquet file ``uri`` into the uncompressed Arrow IPC file ``local_path``, one
    record batch of at most :data:`CACHE_BATCH_ROWS` rows (and never more than a row group) at a
    time, on this thread, a local file read natively.

    A batch that spans row groups is assembled in new buffers, and Parquet's read-ahead and
    decoding threads keep memory of their own; reading without threads, a row group at a time,
    and releasing the Arrow pool's unused memory at the end keeps a large split's conversion from
    raising the process's peak (measured: ``docs/benchmarks/index.md``, "Data at scale").
    """
    fs, path = storage.url_to_fs(uri)
    with contextlib.ExitStack() as stack:
        source = path if isinstance(fs, LocalFileSystem) else stack.enter_context(fs.open(path, "rb"))
        try:
            parquet = pq.ParquetFile(source, pre_buffer=False)
            meta = parquet.metadata
            largest = max((meta.row_group(i).num_rows for i in range(meta.num_row_groups)), default=1)
            with pa.OSFile(local_path, "wb") as sink, pa.ipc.new_file(sink, parquet.schema_arrow) as writer:
                for batch in parquet.iter_batches(batch_size=max(1, min(CACHE_BATCH_ROWS, largest)), use_threads=False):
                    writer.write_batch(batch)
        except pa.ArrowInvalid as e:  # an OSError (disk full writing the cache) keeps its kind
            raise DataError(f"{uri}: not a readable Parquet file: {e}") from e
    pa.default_memory_pool().release_unused()


def _readable_arrow(path: str) -> bool:
    """Whether ``path`` exists and is a whole Arrow IPC file (its footer reads)."""
    try:
        with pa.OSFile(path, "rb") as f:
            pa.ipc.open_file(f)
        return True
    except (FileNotFoundError, pa.ArrowInvalid):
        return False


def local_arrow(uri: str, sha256: str) -> str:
    """The path of the cached Arrow IPC copy of the Parquet file ``uri`` (content ``sha256``),
    converting it first when the cache does not hold it.

    Raises:
        DataError: ``uri`` is missing or not Parquet.
    """
    path = os.path.join(arrow_cache_dir(), f"{sha256}.arrow")
    if _readable_arrow(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter per machine; the others wait, then map its file
        if not _readable_arrow(path):  # absent, or damaged (a crash, a full disk): converted again
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            try:
                _parquet_to_arrow(uri, tmp)
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())  # on disk before it is named: a crash leaves no half file under the name
                os.replace(tmp, path)
            except FileNotFoundError as e:
                raise DataError(f"prepared split file not found: {uri}") from e
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
    return path


def load_table(data_uri: str, name: str) -> pa.Table:
    """One prepared split as a memory-mapped Arrow table (zero-copy: no row is read yet).

    Args:
        data_uri: the prepare_data final directory (any fsspec URI).
        name: one of :data:`SPLIT_NAMES` or :data:`OPTIONAL_SPLIT_NAMES` (``.parquet`` optional).

    Raises:
        DataError: the directory is not committed, or the split is missing or not Parquet.
    """
    return _mapped(_local_files(data_uri, name.removesuffix(".parquet")))[0]


def _mapped(paths: list[str]) -> tuple[pa.Table, list[mmap.mmap]]:
    """The Arrow IPC files ``paths`` memory-mapped (read-only, shared), as one table (zero-copy),
    and the mappings."""
    tables, maps = [], []
    for path in paths:
        with open(path, "rb") as f:
            maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        tables.append(pa.ipc.open_file(pa.BufferReader(pa.py_buffer(maps[-1]))).read_all())
    return pa.concat_tables(tables), maps


def _local_files(data_uri: str, name: str) -> list[str]:
    """The cached Arrow copies of split ``name``'s files, in row order.

    Raises:
        DataError: the directory is not committed, or the split is missing or not Parquet.
    """
    entries = split_files(_manifest_files(data_uri), name)
    if not entries:
        data_set = name.split("/", 1)[0]
        hint = f": this prepare_data output was made without data.{data_set}" if name in OPTIONAL_SPLIT_NAMES else ""
        uri = join_uri(data_uri, f"{name}.parquet")
        raise DataError(f"prepared split not found: {uri} (splits: {list(SPLIT_NAMES)}){hint}")
    return [local_arrow(join_uri(data_uri, entry.path), entry.sha256) for entry in entries]


def load_split(data_uri: str, name: str) -> PreparedRows:
    """Rows of one prepared split, e.g. ``load_split(uri, "sft/train")``, read lazily.

    Args:
        data_uri: the prepare_data final directory (any fsspec URI).
        name: one of :data:`SPLIT_NAMES` or :data:`OPTIONAL_SPLIT_NAMES` (``.parquet`` optional).

    Returns:
        A read-only sequence of row dicts over the memory-mapped split (:class:`PreparedRows`);
        list columns come back as ``list[int]``.

    Raises:
        DataError: the directory is not committed, or the split is missing or not Parquet.
    """
    name = name.removesuffix(".parquet")
    paths = _local_files(data_uri, name)
    table, maps = _mapped(paths)
    return PreparedRows(table, name, paths, maps)


class _Row(dict):
    """A row dict whose item assignments are kept by the :class:`PreparedRows` it came from."""

    __slots__ = ("_owner", "_index")

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self._owner._extra.setdefault(self._index, {})[key] = value

    def __reduce__(self) -> tuple:
        return dict, (dict(self),)  # pickled and copied as a plain dict, never with its table


class PreparedRows(Sequence):
    """The rows of a prepared split as a sequence of dicts, backed by an Arrow table.

    ``rows[i]`` builds row ``i``'s dict when asked (about 20 us for an SFT row) from the mapped
    table; ``rows[a:b]`` is a list. Iteration converts one record batch at a time, read from
    ``paths`` (not through the mapping: a pass over every row leaves no page of the file
    resident). Nothing is cached, so memory does not grow with the rows read. The one write kept
    is an item assignment on a row (``rows[i]["ref_logprobs"] = x``, as DPO and KTO attach
    reference log-probs): it is stored by row index and added to that row whenever it is read
    again. Column-wise reads (:meth:`list_lengths`, :meth:`values`) build no row.

    Reading a row faults in the pages around it (the kernel maps the whole page-cache folio, or
    up to 64 KiB around the fault, and reads ahead); those file pages count in the process's RSS. Every
    :data:`RELEASE_EVERY_ROWS` rows read, the mappings are released (``madvise(MADV_DONTNEED)``:
    the pages stay in the page cache, shared with the other ranks, and a later read maps them
    again), so a rank's resident set does not grow with the rows it has read.

    Args:
        table: the split (e.g. memory-mapped by :func:`load_table`).
        name: the split's name, for messages.
        paths: the Arrow IPC files ``table`` maps, in order (None: iterate ``table`` itself).
        maps: the mappings of ``paths`` (None: nothing to release).
    """

    def __init__(
        self, table: pa.Table, name: str = "rows", paths: list[str] | None = None, maps: list[mmap.mmap] | None = None
    ) -> None:
        self.table = table
        self.name = name
        self.paths = paths
        self._maps = maps or []
        self._reads = 0
        self._batches = [b for b in table.to_batches() if b.num_rows]
        self._starts = np.cumsum([0] + [b.num_rows for b in self._batches])
        self._extra: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return self.table.num_rows

    def __repr__(self) -> str:
        return f"PreparedRows({self.name!r}, {len(self)} rows)"

    def _count_reads(self, rows: int) -> None:
        self._reads += rows
        if self._reads >= RELEASE_EVERY_ROWS:
            self._reads = 0
            for mapping in self._maps:
                mapping.madvise(mmap.MADV_DONTNEED)

    def _row(self, index: int, data: dict) -> _Row:
        row = _Row(data)
        row._owner, row._index = self, index
        extra = self._extra.get(index)
        if extra:
            dict.update(row, extra)
        return row

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            rows = self.table.slice(start, max(stop - start, 0)).to_pylist()
            self._count_reads(len(rows))
            return [self._row(start + i, row) for i, row in enumerate(rows)]
        index = int(key)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name}: row {key} of {len(self)}")
        batch = int(np.searchsorted(self._starts, index, side="right")) - 1
        (data,) = self._batches[batch].slice(index - int(self._starts[batch]), 1).to_pylist()
        self._count_reads(1)
        return self._row(index, data)

    def __iter__(self) -> Iterator[dict]:
        start = 0
        for batch in self._read_batches():
            for i, data in enumerate(batch.to_pylist()):
                yield self._row(start + i, data)
            start += batch.num_rows

    def _read_batches(self) -> Iterator[pa.RecordBatch]:
        if self.paths is None:
            yield from self._batches
            return
        for path in self.paths:
            with pa.OSFile(path, "rb") as source:
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def column(self, name: str) -> pa.ChunkedArray:
        """Column ``name`` (zero-copy)."""
        return self.table.column(name)

    def values(self, name: str) -> list:
        """Column ``name`` as a Python list (for scalar columns: ``label``, ``answer``)."""
        return self.table.column(name).to_pylist()

    def list_lengths(self, name: str) -> np.ndarray:
        """``[len(self)]`` int64: the length of list column ``name`` in each row, the differences of
        its offsets read in place from the mapped file (no row is converted, nothing is allocated
        but the result; ``pyarrow.compute.list_value_length`` took 46 MB for 1M rows, this 8 MB);
        e.g. ``list_lengths("input_ids")`` = tokens per row. A null list counts 0.

        Raises:
            TypeError: ``name`` is not a list column.
        """
        column = self.table.column(name)
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            raise TypeError(f"{self.name}: column {name!r} is {column.type}, not a list column")
        offset_type = np.int64 if pa.types.is_large_list(column.type) else np.int32
        out = np.empty(len(self), dtype=np.int64)
        start = 0
        for chunk in column.chunks:
            n = len(chunk)
            offsets = np.frombuffer(chunk.buffers()[1], dtype=offset_type)[chunk.offset : chunk.offset + n + 1]
            np.subtract(offsets[1:], offsets[:-1], out=out[start : start + n])
            if chunk.null_count:  # a null slot's segment may be non-empty (Arrow columnar format)
                out[start : start + n][chunk.is_null().to_numpy(zero_copy_only=False)] = 0
            start += n
        return out

    def nonnull_indices(self, name: str) -> np.ndarray:
        """int64 indices of the rows whose ``name`` is not null, in order."""
        valid = pc.is_valid(self.table.column(name)).to_numpy(zero_copy_only=False)
        return np.flatnonzero(valid)


def row_lengths(rows: Sequence[dict], column: str) -> np.ndarray:
    """``[len(rows)]`` int64: the length of list column ``column`` in each row; from the Arrow
    offsets for :class:`PreparedRows` (no row is built), else row by row (a list of dicts).

    Raises:
        KeyError: a row without ``column``.
    """
    if isinstance(rows, PreparedRows):
        return rows.list_lengths(column)
    return np.fromiter((len(row[column]) for row in rows), dtype=np.int64, count=len(rows))


def load_tokenizer_from(data_uri: str) -> Any:
    """The tokenizer saved by prepare_data under ``<data_uri>/tokenizer`` (downloaded if remote).

    Raises:
        DataError: the directory is not committed or has no tokenizer.
        ConfigError: the tokenizer files cannot be loaded.
    """
    _manifest_files(data_uri)
    try:
        local = storage.materialize(join_uri(data_uri, "tokenizer"))
    except (FileNotFoundError, NotADirectoryError) as e:
        raise DataError(f"{data_uri} has no tokenizer/ directory") from e
    return load_tokenizer(local)
