"""Read raw records from JSONL, Parquet, plain text or a Hugging Face ``datasets`` id.

Every record comes back as a plain ``dict`` with one added key, ``"_source"``:
``"<uri>:<line>"`` (1-based line of a JSONL or text file, 1-based row of a Parquet file or a
``datasets`` split), so that any later error can name where the bad record came from. A
plain-text file (``.txt``) gives one record per non-blank line, the line (without its newline)
under the source's ``text_field``, as ``datasets``' ``text`` loader reads it.

:func:`iter_records` streams: memory stays bounded whatever the file's size (a line, or a
Parquet batch, at a time; ``hf://`` ids through ``datasets`` streaming).

Files are opened through ``fsspec``, so any URI works (local path, ``file://``, ``s3://``,
``memory://``); compressed files (``.jsonl.gz``, ``.json.bz2``, ...) are decompressed on the fly.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import lzma
import zlib
from typing import Any, Iterator

import fsspec

from trainer_core.config import DataSource
from trainer_core.errors import DataError, PosttrainError, classify

logger = logging.getLogger(__name__)

HF_PREFIX = "hf://"
"""URI prefix of a Hugging Face ``datasets`` id (``hf://openai/gsm8k``)."""

_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_TEXT_SUFFIXES = (".txt",)
_PARQUET_BATCH_ROWS = 4096
_DECOMPRESSION_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error, lzma.LZMAError)
"""What a corrupt or truncated compressed file raises while it is read."""


def read_records(source: DataSource) -> list[dict]:
    """All records of ``source`` (at most ``source.max_rows``) in a list: :func:`iter_records`
    collected. For small inputs (eval files, tests); prepare_data streams with :func:`iter_records`.

    Raises:
        As :func:`iter_records`.
    """
    return list(iter_records(source))


def iter_records(source: DataSource) -> Iterator[dict]:
    """The records of ``source`` (at most ``source.max_rows``), each with ``"_source"`` set, read
    in bounded memory: JSON lines one at a time, Parquet in batches of
    :data:`_PARQUET_BATCH_ROWS` rows, ``hf://`` ids with ``datasets`` streaming.

    Args:
        source: the data source; ``source.uri`` ends in ``.jsonl`` / ``.json`` (one JSON object
            per line, blank lines skipped), ``.parquet`` or ``.txt`` (one record per non-blank
            line), or is ``hf://<dataset id>`` (read with
            ``datasets.load_dataset(id, split=source.split, streaming=True)``).

    Yields:
        Records in file order; each a dict with the file's fields plus ``"_source"``.

    Raises:
        DataError: ``source.uri`` is None, has an unknown extension, does not exist or is a
            directory; a JSONL line is not valid JSON or not a JSON object (the message names
            ``file:line``); a compressed file is corrupt or truncated; a Parquet file cannot be
            read; the source holds no records (raised when the iteration ends).
        ConfigError: no permission to read it, or no S3 credentials for an ``s3://`` URI (the
            message names the URI).
    """
    uri = source.uri
    if uri is None:
        raise DataError("data source has no uri (None selects the synthetic task, not a file)")
    if uri.startswith(HF_PREFIX):
        records = _iter_hf(uri, source.split)
    else:
        kind = _file_kind(uri)
        records = {"jsonl": _iter_jsonl, "parquet": _iter_parquet,
                   "text": lambda u: _iter_text(u, source.text_field)}[kind](uri)
    count = 0
    with _named_errors(uri):
        for record in records:
            count += 1
            yield record
            if source.max_rows is not None and count >= source.max_rows:
                break  # before the next record is read: a bad line after max_rows is never parsed
    if not count:
        raise DataError(f"{uri}: no records")
    logger.info("read %d records from %s", count, uri)


@contextlib.contextmanager
def _named_errors(uri: str) -> Iterator[None]:
    """Library errors raised while ``uri`` is read, as the project's errors naming it."""
    try:
        yield
    except FileNotFoundError as e:
        raise DataError(f"data file not found: {uri}") from e
    except IsADirectoryError as e:
        raise DataError(f"data uri is a directory, not a file: {uri}") from e
    except PosttrainError:
        raise
    except Exception as e:  # noqa: BLE001 - a known kind gets its input named; the rest propagates
        error = classify(e, where=f"reading {uri}")
        if error is None:
            raise
        raise error from e


def _file_kind(uri: str) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"text"`` from the file name (compression suffix ignored)."""
    name = uri.split("?", 1)[0].lower()
    for suffix in _COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(_TEXT_SUFFIXES):
        return "text"
    raise DataError(
        f"{uri}: unknown data file type; expected .jsonl/.json (JSON lines), .parquet, .txt (plain text), or an "
        "hf:// id"
    )


def _parse_line(uri: str, line_no: int, line: str) -> dict[str, Any] | None:
    """The JSON object on one line, or None for a blank line."""
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{uri}:{line_no}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{uri}:{line_no}: expected a JSON object per line, got {type(obj).__name__}")
    obj["_source"] = f"{uri}:{line_no}"
    return obj


def _iter_text(uri: str, field: str) -> Iterator[dict]:
    """``{field: line}`` for each non-blank line of a plain-text file, in order."""
    for line_no, line in _iter_lines(uri, "text"):
        if line.strip():
            yield {field: line.rstrip("\r\n"), "_source": f"{uri}:{line_no}"}


def _iter_jsonl(uri: str) -> Iterator[dict]:
    """Records of a JSON-lines file, in order; blank lines skipped."""
    for line_no, line in _iter_lines(uri, "JSON"):
        record = _parse_line(uri, line_no, line)
        if record is not None:
            yield record


def _iter_lines(uri: str, what: str) -> Iterator[tuple[int, str]]:
    """``(1-based line number, line)`` of a UTF-8 text file, decompressed on the fly.

    Raises:
        DataError: a corrupt or truncated compressed file, or a line that is not UTF-8 (both name
            the line).
    """
    with fsspec.open(uri, "rb", compression="infer") as f:
        line_no = 0
        lines = iter(f)
        while True:
            try:
                raw = next(lines)
            except StopIteration:
                return
            except _DECOMPRESSION_ERRORS as e:
                raise DataError(
                    f"{uri}:{line_no + 1}: corrupt or truncated compressed file after {line_no} lines "
                    f"({type(e).__name__}: {e})"
                ) from None
            line_no += 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{uri}:{line_no}: invalid {what}: not UTF-8 ({e.reason})") from None
            yield line_no, line


def _iter_parquet(uri: str) -> Iterator[dict]:
    """Rows of a Parquet file, in order, read in batches (so ``max_rows`` reads little)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with fsspec.open(uri, "rb") as f:
        try:
            parquet = pq.ParquetFile(f)
        except (pa.ArrowInvalid, OSError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise DataError(f"{uri}: not a readable Parquet file: {e}") from None
        row = 0
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for record in batch.to_pylist():
                row += 1
                record["_source"] = f"{uri}:{row}"
                yield record


def _hf_streams(split: str) -> bool:
    """Whether a ``datasets`` split is read streaming: yes, unless the split is sliced
    (``train[:1000]``, which streaming refuses) or the hub is offline (``HF_HUB_OFFLINE`` /
    ``HF_DATASETS_OFFLINE``: streaming reads the hub, the download cache is what is there). A
    non-streaming split is downloaded into ``datasets``' cache and iterated memory-mapped, also in
    bounded memory."""
    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
                  for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return "[" not in split and not offline


def _iter_hf(uri: str, split: str) -> Iterator[dict]:
    """Records of a Hugging Face ``datasets`` split (``hf://<id>``), streamed (:func:`_hf_streams`)."""
    import datasets

    dataset_id = uri[len(HF_PREFIX) :].rstrip("/")
    if not dataset_id:
        raise DataError(f"{uri}: empty Hugging Face dataset id")
    try:
        ds = datasets.load_dataset(dataset_id, split=split, streaming=_hf_streams(split))
    except FileNotFoundError as e:  # DatasetNotFoundError, DataFilesNotFoundError, EmptyDatasetError
        raise DataError(f"data set not found: {uri} (split {split!r}): {e}") from e
    except ValueError as e:  # unknown split, unsupported layout
        raise DataError(f"{uri}: cannot load split {split!r}: {e}") from e
    except ConnectionError as e:  # after huggingface_hub's own retries (5, about 30 s): not worth a stage retry
        raise DataError(f"{uri}: the Hugging Face Hub cannot be reached ({e}); on a machine without internet, "
                        "put the data set in the datasets cache beforehand (HF_DATASETS_OFFLINE=1) or point the "
                        "data uri at a local or object-storage file") from e
    for row, record in enumerate(ds, start=1):
        record = dict(record)
        record["_source"] = f"{uri}:{row}"
        yield record
