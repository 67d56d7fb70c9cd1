"""The file layout of a prepared split: Parquet shards, and the writer prepare_data uses.

A split ``<name>`` (``sft/train`` ...) is written as ``<name>/part-00000.parquet``,
``<name>/part-00001.parquet``, ... (zstd), each of about :data:`SHARD_ROWS` rows in row groups of
one tokenisation chunk; the manifest lists every shard. Outputs committed before sharding hold
one file, ``<name>.parquet``; :func:`split_files` finds either layout.
"""

from __future__ import annotations

import os
import re

import pyarrow as pa
import pyarrow.parquet as pq

from trainer_core.checkpoint.manifest import ArtifactWriter, FileEntry

SHARD_ROWS = 65536
"""Rows per shard: a shard is closed at the first chunk boundary at or past this many rows."""

_SHARD_RE = re.compile(r"/part-\d{5}\.parquet")


def shard_path(name: str, index: int) -> str:
    """Relative path of shard ``index`` of split ``name``: ``<name>/part-00000.parquet``."""
    return f"{name}/part-{index:05d}.parquet"


def split_files(entries: list[FileEntry], name: str) -> list[FileEntry]:
    """The manifest entries of split ``name``, in row order: its shards (by index) or, in an output
    written before sharding, the single ``<name>.parquet``; [] when the split is absent."""
    shards = sorted(
        (e for e in entries if e.path.startswith(f"{name}/") and _SHARD_RE.fullmatch(e.path[len(name) :])),
        key=lambda e: e.path,
    )
    return shards or [e for e in entries if e.path == f"{name}.parquet"]


class ShardWriter:
    """Write one split's record batches, in order, as Parquet shards of ``artifact``.

    Each batch becomes one row group; a shard is staged in ``local_dir`` and uploaded (hashed into
    the manifest) when it reaches ``shard_rows`` rows or the writer closes. A split that receives
    no rows is written as one empty shard, so that it exists with its schema.

    Args:
        artifact: the output directory's writer.
        name: the split (``sft/train``).
        schema: its Arrow schema.
        local_dir: a local directory for the shard being written.
        shard_rows: rows per shard (None: :data:`SHARD_ROWS`).
    """

    def __init__(
        self, artifact: ArtifactWriter, name: str, schema: pa.Schema, local_dir: str, shard_rows: int | None = None
    ) -> None:
        self.artifact = artifact
        self.name = name
        self.schema = schema
        self.local_dir = local_dir
        self.shard_rows = SHARD_ROWS if shard_rows is None else shard_rows
        self.num_rows = 0
        self._index = 0
        self._writer: pq.ParquetWriter | None = None
        self._rows_in_shard = 0

    def _local(self) -> str:
        return os.path.join(self.local_dir, f"{self.name.replace('/', '-')}-part-{self._index:05d}.parquet")

    def write(self, batch: pa.RecordBatch) -> None:
        """Append ``batch`` (of :attr:`schema`) as one row group; empty batches are skipped."""
        if batch.num_rows == 0:
            return
        if self._writer is None:
            self._writer = pq.ParquetWriter(self._local(), self.schema, compression="zstd")
        self._writer.write_batch(batch)
        self._rows_in_shard += batch.num_rows
        self.num_rows += batch.num_rows
        if self._rows_in_shard >= self.shard_rows:
            self._finish_shard()

    def _finish_shard(self) -> None:
        if self._writer is None:
            self._writer = pq.ParquetWriter(self._local(), self.schema, compression="zstd")
        self._writer.close()
        local = self._local()
        self.artifact.write_file(shard_path(self.name, self._index), local)
        os.remove(local)
        self._writer, self._rows_in_shard = None, 0
        self._index += 1

    def close(self) -> int:
        """Upload the last shard; returns the split's rows."""
        if self._writer is not None or self._index == 0:
            self._finish_shard()
        return self.num_rows
