"""Read raw records from JSONL, Parquet, plain text or a Hugging Face ``datasets`` id.

Every record comes back as a plain ``dict`` with one added key, ``"_source"``:
``"<uri>:<line>"`` (1-based line of a JSONL or text file, 1-based row of a Parquet file or a
``datasets`` split), so that any later error can name where the bad record came from. A
plain-text file (``.txt``) gives one record per non-blank line, the line (without its newline)
under the source's ``text_field``, as ``datasets``' ``text`` loader reads it.

A JSON file (``.jsonl``, ``.json``, ``.ndjson``) holds one JSON object per line, or, when its first
non-blank character is ``[``, one JSON array of objects (as ``datasets``' ``json`` loader reads
both); an array item's ``"_source"`` is ``"<uri>:<line> (array item <n>)"``, the line where the
item starts and its 1-based position. A string that holds a lone UTF-16 surrogate (the JSON
escape ``"\\ud800"`` without its pair) is refused: it is not a Unicode character and cannot be
stored as UTF-8.

:func:`iter_records` streams: memory stays bounded whatever the file's size (a line, a JSON array
item, or a Parquet batch, at a time; ``hf://`` ids through ``datasets`` streaming).

Files are opened through ``fsspec``, so any URI works (local path, ``file://``, ``s3://``,
``memory://``); compressed files (``.jsonl.gz``, ``.json.bz2``, ...) are decompressed on the fly.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import json
import logging
import os
import lzma
import re
import zlib
from typing import Any, Iterator

import fsspec

from trainer_core.config import DataSource
from trainer_core.data.tools import parse_json
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
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate: a line without one cannot decode to a lone surrogate."""
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
"""A surrogate code point left in a decoded string (a valid pair decodes to one character)."""
_JSON_BLANK = re.compile(r"[ \t\n\r]*")
_JSON_READ_BYTES = 1 << 20
"""Bytes a JSON array file is read by (more at a time while an item does not fit)."""
MAX_JSON_ITEM_CHARS = 64 << 20
"""Longest item of a JSON array file, in characters (a JSON-lines file's lines are not capped)."""


def read_records(source: DataSource) -> list[dict]:
    """All records of ``source`` (at most ``source.max_rows``) in a list: :func:`iter_records`
    collected. For small inputs (eval files, tests); prepare_data streams with :func:`iter_records`.

    Raises:
        As :func:`iter_records`.
    """
    return list(iter_records(source))


def iter_records(source: DataSource) -> Iterator[dict]:
    """The records of ``source`` (at most ``source.max_rows``), each with ``"_source"`` set, read
    in bounded memory: JSON lines (or a JSON array's items) one at a time, Parquet in batches of
    :data:`_PARQUET_BATCH_ROWS` rows, ``hf://`` ids with ``datasets`` streaming.

    Args:
        source: the data source; ``source.uri`` ends in ``.jsonl`` / ``.json`` / ``.ndjson`` (one
            JSON object per line, blank lines skipped, or a JSON array of objects),
            ``.parquet`` or ``.txt`` (one record per non-blank line), or is
            ``hf://<dataset id>`` (read with
            ``datasets.load_dataset(id, split=source.split, streaming=True)``).

    Yields:
        Records in file order; each a dict with the file's fields plus ``"_source"``.

    Raises:
        DataError: ``source.uri`` is None, has an unknown extension, does not exist or is a
            directory; a JSONL line (or a JSON array item) is not valid JSON, not a JSON
            object, or holds a lone surrogate (the message names ``file:line`` and the field); a
            compressed file is corrupt or truncated; a Parquet file cannot be
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
        records = {"jsonl": _iter_json, "parquet": _iter_parquet, "text": lambda u: _iter_text(u, source.text_field)}[
            kind
        ](uri)
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
        f"{uri}: unknown data file type; expected .jsonl/.json/.ndjson (JSON lines, or a JSON array of objects), "
        ".parquet, .txt (plain text), or an hf:// id"
    )


def _parse_line(uri: str, line_no: int, line: str) -> dict[str, Any] | None:
    """The JSON object on one line, or None for a blank line."""
    if not line.strip():
        return None
    obj = parse_json(line, f"{uri}:{line_no}", dict, "a JSON object per line")
    if _SURROGATE_ESCAPE.search(line):
        _refuse_lone_surrogates(f"{uri}:{line_no}", obj)
    obj["_source"] = f"{uri}:{line_no}"
    return obj


def _lone_surrogate_at(value: Any, field: str) -> tuple[str, str] | None:
    """``(what, offending string)`` of the first string (a value or a key) in ``value`` that holds
    a lone surrogate, or None; ``what`` names it as ``field 'messages'[0]['content']`` or
    ``a field name in field 'meta'``."""
    if isinstance(value, str):
        return (f"field {field}", value) if _LONE_SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _LONE_SURROGATE.search(key):
            return (f"a field name in field {field}" if field else "a field name"), key
        step = f"[{key}]" if isinstance(key, int) else f"['{key}']" if field else f"'{key}'"
        if found := _lone_surrogate_at(item, field + step):
            return found
    return None


def _refuse_lone_surrogates(where: str, record: dict) -> None:
    """Raise unless every string (value or key) of ``record`` is valid Unicode.

    Raises:
        DataError: a string holds a lone UTF-16 surrogate (the JSON escape ``"\\ud800"`` without
            its pair), naming ``where`` (``file:line``) and the field.
    """
    found = _lone_surrogate_at(record, "")
    if found is None:
        return
    what, text = found
    at = _LONE_SURROGATE.search(text)
    raise DataError(
        f"{where}: {what} holds a lone UTF-16 surrogate ({ascii(at.group())[1:-1]} at character "
        f"{at.start()}), which is not a Unicode character and cannot be stored as UTF-8; write the "
        "character itself, or both halves of its surrogate pair"
    )


def _iter_text(uri: str, field: str) -> Iterator[dict]:
    """``{field: line}`` for each non-blank line of a plain-text file, in order."""
    for line_no, line in _iter_lines(uri, "text"):
        if line.strip():
            yield {field: line.rstrip("\r\n"), "_source": f"{uri}:{line_no}"}


def _iter_json(uri: str) -> Iterator[dict]:
    """Records of a JSON file: its array's items when its first non-blank character is ``[``
    (:class:`_JsonArray`), else its lines (JSON lines)."""
    if _is_json_array(uri):
        yield from _iter_json_array(uri)
    else:
        yield from _iter_jsonl(uri)


def _is_json_array(uri: str) -> bool:
    """Whether the file's first non-blank byte is ``[`` (a corrupt compressed file: False, so that
    :func:`_iter_lines` names it and its line)."""
    try:
        with fsspec.open(uri, "rb", compression="infer") as f:
            while chunk := f.read(4096):
                if start := chunk.lstrip(b" \t\r\n"):
                    return start.startswith(b"[")
    except _DECOMPRESSION_ERRORS:
        return False
    return False


def _iter_json_array(uri: str) -> Iterator[dict]:
    """The items of a file holding one JSON array of objects, in order, one item in memory at a
    time; each item's ``"_source"`` is ``"<uri>:<line> (array item <n>)"``."""
    with fsspec.open(uri, "rb", compression="infer") as f:
        for line_no, n, item, escaped in _JsonArray(uri, f).items():
            where = f"{uri}:{line_no} (array item {n})"
            if not isinstance(item, dict):
                raise DataError(f"{where}: expected a JSON object per array item, got {type(item).__name__}")
            if escaped:
                _refuse_lone_surrogates(where, item)
            item["_source"] = where
            yield item


class _JsonArray:
    """The items of the JSON array a binary stream holds, decoded one at a time from text read a
    chunk at a time (``json.JSONDecoder.raw_decode`` from each item's start).

    Args:
        uri: the file, for messages.
        f: the stream (decompressed), positioned at the start of the file.
    """

    def __init__(self, uri: str, f: Any) -> None:
        self.uri, self.f = uri, f
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.decoder = json.JSONDecoder()
        self.text, self.pos, self.line, self.eof = "", 0, 1, False  # self.line: the line of text[pos]

    def items(self) -> Iterator[tuple[int, int, Any, bool]]:
        """``(line, 1-based item number, item, whether its text holds a surrogate escape)`` of
        each item, in order.

        Raises:
            DataError: invalid JSON, text after the array, a file that is not UTF-8 or a corrupt
                compressed file (each naming the line), or an item over :data:`MAX_JSON_ITEM_CHARS`.
        """
        if self._next_char() != "[":
            self._fail("expected a JSON array")
        self._consume(self.pos + 1)
        n, after = 0, "," if self._next_char() != "]" else ""
        while after == ",":
            n += 1
            if not self._next_char():
                self._fail(f"the array is not closed (the file ends after item {n - 1})")
            line = self.line
            yield line, n, *self._item(n)
            after = self._next_char()
            if after not in (",", "]"):
                self._fail(
                    f"expected ',' or ']' after array item {n}, got {repr(after) if after else 'the end of the file'}"
                )
            self._consume(self.pos + 1)
        if not n:
            self._consume(self.pos + 1)  # the ']' of an empty array
        if self._next_char():
            self._fail("text after the array's closing ']'")

    def _fail(self, what: str, pos: int | None = None) -> None:
        line = self.line + self.text.count("\n", self.pos, self.pos if pos is None else pos)
        raise DataError(f"{self.uri}:{line}: invalid JSON: {what}")

    def _consume(self, end: int) -> None:
        self.line += self.text.count("\n", self.pos, end)
        self.pos = end

    def _read(self, num_bytes: int = 0) -> bool:
        """Append the next ``num_bytes`` (at least :data:`_JSON_READ_BYTES`) of the file, decoded (the
        text before ``pos`` dropped); False at its end."""
        if self.eof:
            return False
        try:
            raw = self.f.read(max(num_bytes, _JSON_READ_BYTES))
        except _DECOMPRESSION_ERRORS as e:
            self._fail(f"corrupt or truncated compressed file ({type(e).__name__}: {e})", len(self.text))
        try:
            chunk = self.utf8.decode(raw, final=not raw)
        except UnicodeDecodeError as e:
            self._fail(f"not UTF-8 ({e.reason})", len(self.text))
        self.text, self.pos, self.eof = self.text[self.pos :] + chunk, 0, not raw
        return bool(raw)

    def _next_char(self) -> str:
        """The next non-blank character, not consumed ('' at the end of the file)."""
        while True:
            self._consume(_JSON_BLANK.match(self.text, self.pos).end())
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self._read():
                return ""

    def _item(self, n: int) -> tuple[Any, bool]:
        """Decode the value at ``pos`` (item ``n``), reading on while it may be cut off by the end of
        the text read so far; ``pos`` ends after it. Returns the value and whether its text holds
        a surrogate escape."""
        while True:
            try:
                item, end = self.decoder.raw_decode(self.text, self.pos)
            except json.JSONDecodeError as e:
                cut = e.msg.startswith("Unterminated string") or e.pos >= len(self.text) - 16
                if self.eof or not cut:
                    self._fail(f"{e.msg.removesuffix(' at').removesuffix(' starting')} (array item {n})", e.pos)
                if len(self.text) - self.pos > MAX_JSON_ITEM_CHARS:
                    self._fail(f"array item {n} is not valid JSON or is over {MAX_JSON_ITEM_CHARS} characters")
                self._read(len(self.text) - self.pos)  # doubling: linear in the item's length
                continue
            if end == len(self.text) and not self.eof:  # a number may go on in the next chunk
                self._read()
                continue
            escaped = _SURROGATE_ESCAPE.search(self.text, self.pos, end) is not None
            self._consume(end)
            return item, escaped


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
    offline = any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )
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
        raise DataError(
            f"{uri}: the Hugging Face Hub cannot be reached ({e}); on a machine without internet, "
            "put the data set in the datasets cache beforehand (HF_DATASETS_OFFLINE=1) or point the "
            "data uri at a local or object-storage file"
        ) from e
    for row, record in enumerate(ds, start=1):
        record = dict(record)
        record["_source"] = f"{uri}:{row}"
        yield record
