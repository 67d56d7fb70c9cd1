"""Reading what prepare_data committed: tokenised Parquet splits and the tokenizer.

The writer is the ``prepare_data`` stage (``trainer_core/stages/prepare_data.py``, which
documents the columns); every other stage reads its output through this module.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trainer_core import storage
from trainer_core.checkpoint.manifest import MANIFEST_NAME
from trainer_core.data.tokenizer import load_tokenizer
from trainer_core.errors import DataError
from trainer_core.storage import join_uri

SPLIT_NAMES = ("sft/train", "sft/eval", "preference/train", "preference/eval", "eval_problems")
"""Parquet files (without suffix) of every prepared-data directory, for :func:`load_split`."""

OPTIONAL_SPLIT_NAMES = ("kto/train", "kto/eval", "pretrain/train", "pretrain/eval")
"""Parquet files a prepared-data directory holds only when its config set their source
(``data.kto``, ``data.pretrain``)."""


def _committed(data_uri: str) -> None:
    if not storage.exists(join_uri(data_uri, MANIFEST_NAME)):
        raise DataError(f"{data_uri} is not a committed prepare_data output (no {MANIFEST_NAME})")


def load_split(data_uri: str, name: str) -> list[dict]:
    """Rows of one prepared Parquet file, e.g. ``load_split(uri, "sft/train")``.

    Args:
        data_uri: the prepare_data final directory (any fsspec URI).
        name: one of :data:`SPLIT_NAMES` or :data:`OPTIONAL_SPLIT_NAMES` (``.parquet`` optional).

    Returns:
        One dict per row; list columns come back as ``list[int]``.

    Raises:
        DataError: the directory is not committed, or the file is missing or not Parquet.
    """
    _committed(data_uri)
    uri = join_uri(data_uri, name if name.endswith(".parquet") else f"{name}.parquet")
    try:
        raw = storage.read_bytes(uri)
    except FileNotFoundError as e:
        data_set = name.split("/", 1)[0]
        hint = (f": this prepare_data output was made without data.{data_set}"
                if name.removesuffix(".parquet") in OPTIONAL_SPLIT_NAMES else "")
        raise DataError(f"prepared split not found: {uri} (splits: {list(SPLIT_NAMES)}){hint}") from e
    try:
        return pq.read_table(pa.BufferReader(raw)).to_pylist()
    except pa.ArrowInvalid as e:
        raise DataError(f"{uri}: not a readable Parquet file: {e}") from e


def load_tokenizer_from(data_uri: str) -> Any:
    """The tokenizer saved by prepare_data under ``<data_uri>/tokenizer`` (downloaded if remote).

    Raises:
        DataError: the directory is not committed or has no tokenizer.
        ConfigError: the tokenizer files cannot be loaded.
    """
    _committed(data_uri)
    try:
        local = storage.materialize(join_uri(data_uri, "tokenizer"))
    except (FileNotFoundError, NotADirectoryError) as e:
        raise DataError(f"{data_uri} has no tokenizer/ directory") from e
    return load_tokenizer(local)
