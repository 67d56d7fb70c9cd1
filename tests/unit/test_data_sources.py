"""read_records: JSONL / Parquet on local, memory:// and S3 (moto), error messages with file:line."""

from __future__ import annotations

import gzip
import io
import json
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.shared_data import GSM8K, HH, needs_shared_data
from trainer_core import storage
from trainer_core.config import DataSource
from trainer_core.data.sources import read_records
from trainer_core.errors import EXIT_BAD_INPUT, DataError
from trainer_core.storage import join_uri


def _write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def _parquet_bytes(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def test_jsonl_blank_lines_skipped_and_sources_are_1_based_lines(tmp_path):
    uri = _write(tmp_path / "d.jsonl", '{"a": 1}\n\n   \n{"a": 2}\n')
    records = read_records(DataSource(uri=uri))
    assert [r["a"] for r in records] == [1, 2]
    assert [r["_source"] for r in records] == [f"{uri}:1", f"{uri}:4"]


def test_max_rows(tmp_path):
    uri = _write(tmp_path / "d.jsonl", "".join(json.dumps({"i": i}) + "\n" for i in range(10)))
    assert [r["i"] for r in read_records(DataSource(uri=uri, max_rows=3))] == [0, 1, 2]


def test_malformed_json_line_names_file_and_line(tmp_path):
    uri = _write(tmp_path / "bad.jsonl", '{"a": 1}\n{"a": 2,\n{"a": 3}\n')
    with pytest.raises(DataError, match=rf"^{uri}:2: invalid JSON"):
        read_records(DataSource(uri=uri))


def test_line_that_is_not_an_object(tmp_path):
    uri = _write(tmp_path / "list.jsonl", '{"a": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=rf"{uri}:2: expected a JSON object per line, got list"):
        read_records(DataSource(uri=uri))


def test_non_utf8_line_names_line(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": "\xe9"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: invalid JSON: not UTF-8"):
        read_records(DataSource(uri=str(path)))


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_has_no_records(tmp_path, content):
    uri = _write(tmp_path / "empty.jsonl", content)
    with pytest.raises(DataError, match=rf"{uri}: no records"):
        read_records(DataSource(uri=uri))


def test_missing_file_names_uri(tmp_path):
    uri = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=f"not found: {uri}"):
        read_records(DataSource(uri=uri))


def test_directory_uri(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(DataError, match="is a directory"):
        read_records(DataSource(uri=str(tmp_path / "dir.jsonl")))


def test_unknown_extension_and_no_uri(tmp_path):
    with pytest.raises(DataError, match="unknown data file type"):
        read_records(DataSource(uri=_write(tmp_path / "d.csv", "a,b\n")))
    with pytest.raises(DataError, match="no uri"):
        read_records(DataSource(uri=None))


def test_gzipped_jsonl(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"q": "x"}\n{"q": "y"}\n'))
    assert [r["q"] for r in read_records(DataSource(uri=str(path)))] == ["x", "y"]


def test_parquet_rows_sources_and_max_rows(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(_parquet_bytes([{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(5)]))
    records = read_records(DataSource(uri=str(path)))
    assert [r["prompt"] for r in records] == [f"p{i}" for i in range(5)]
    assert records[2]["_source"] == f"{path}:3"
    assert len(read_records(DataSource(uri=str(path), max_rows=2))) == 2


def test_not_a_parquet_file(tmp_path):
    uri = _write(tmp_path / "fake.parquet", "this is not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read_records(DataSource(uri=uri))


def test_memory_uri_jsonl_and_parquet():
    base = f"memory://sources-{uuid.uuid4().hex}"
    storage.write_bytes(f"{base}/d.jsonl", b'{"question": "q", "answer": "#### 1"}\n')
    storage.write_bytes(f"{base}/d.parquet", _parquet_bytes([{"chosen": "a", "rejected": "b"}]))
    (rec,) = read_records(DataSource(uri=f"{base}/d.jsonl"))
    assert rec == {"question": "q", "answer": "#### 1", "_source": f"{base}/d.jsonl:1"}
    (rec,) = read_records(DataSource(uri=f"{base}/d.parquet"))
    assert rec == {"chosen": "a", "rejected": "b", "_source": f"{base}/d.parquet:1"}


def test_storage_root_local_and_s3(storage_root):
    uri = join_uri(storage_root, "data", "d.jsonl")
    storage.write_bytes(uri, b'{"prompt": "p", "completion": "c"}\n\n{"prompt": "p2", "completion": "c2"}\n')
    records = read_records(DataSource(uri=uri))
    assert [r["_source"] for r in records] == [f"{uri}:1", f"{uri}:3"]
    with pytest.raises(DataError, match="not found"):
        read_records(DataSource(uri=join_uri(storage_root, "data", "missing.jsonl")))


def test_hf_id_of_a_local_dataset_dir(tmp_path, monkeypatch):
    """``hf://<id>`` goes through ``datasets.load_dataset``; a local data directory is a valid id offline."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    (tmp_path / "ds").mkdir()
    _write(
        tmp_path / "ds" / "train.jsonl",
        '{"question": "a", "answer": "#### 1"}\n{"question": "b", "answer": "#### 2"}\n',
    )
    records = read_records(DataSource(uri=f"hf://{tmp_path / 'ds'}", split="train", max_rows=1))
    assert records == [{"question": "a", "answer": "#### 1", "_source": f"hf://{tmp_path / 'ds'}:1"}]
    with pytest.raises(DataError, match="nosuchsplit"):
        read_records(DataSource(uri=f"hf://{tmp_path / 'ds'}", split="nosuchsplit"))
    with pytest.raises(DataError, match="not found"):
        read_records(DataSource(uri=f"hf://{tmp_path / 'missing'}"))


def test_hf_split_slices_and_offline_hubs_read_without_streaming(tmp_path, monkeypatch):
    """Streaming refuses a sliced split and reads the hub; a sliced split, or an offline hub
    (the download cache), is read memory-mapped instead, with the same records."""
    import datasets

    from trainer_core.data.sources import _hf_streams

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    assert _hf_streams("train") and not _hf_streams("train[:10]")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert not _hf_streams("train")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "train.jsonl").write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in "abc"))
    records = read_records(DataSource(uri=f"hf://{ds}", split="train[1:3]"))
    assert [r["question"] for r in records] == ["b", "c"]


@needs_shared_data
def test_real_files_first_rows():
    gsm = read_records(DataSource(uri=str(GSM8K), max_rows=3))
    assert set(gsm[0]) == {"question", "answer", "_source"} and gsm[0]["answer"].endswith("#### 72")
    hh = read_records(DataSource(uri=str(HH), max_rows=2))
    assert hh[1]["_source"] == f"{HH}:2" and hh[0]["chosen"].startswith("\n\nHuman:")


def test_an_unreachable_hub_is_bad_input_naming_the_uri(monkeypatch):
    """After huggingface_hub's own retries (about 30 s here, where the Hub cannot be reached) the
    error is bad input, not a crash the stage retries 3 times with tracebacks (107 s)."""
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(
        DataError, match=r"hf://openai/gsm8k: the Hugging Face Hub cannot be reached \(Couldn't reach"
    ) as e:
        read_records(DataSource(uri="hf://openai/gsm8k", split="train"))
    assert e.value.exit_code == EXIT_BAD_INPUT


def test_lone_surrogate_is_bad_input_naming_line_and_field(tmp_path):
    """A JSON escape of half a surrogate pair decodes to no Unicode character: pyarrow could not
    store it as UTF-8 (a UnicodeEncodeError, retried as a crash, that named nothing). It is refused
    as it is read, naming the file, the line and the field; a whole pair is the character."""
    pair = json.dumps({"prompt": "smile \U0001f600", "completion": "c"})  # ensure_ascii: "\ud83d\ude00"
    lone = '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    uri = _write(tmp_path / "d.jsonl", f"{pair}\n{lone}\n")
    with pytest.raises(
        DataError,
        match=rf"^{uri}:2: field 'messages'\[0\]\['content'\] holds a lone UTF-16 "
        r"surrogate \(\\ud800 at character 1\)",
    ) as e:
        read_records(DataSource(uri=uri))
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert read_records(DataSource(uri=uri, max_rows=1))[0]["prompt"] == "smile \U0001f600"
    key = _write(tmp_path / "k.json", '[{"q\\udc00": 1}]')
    with pytest.raises(DataError, match=rf"^{key}:1 \(array item 1\): a field name holds a lone UTF-16 surrogate"):
        read_records(DataSource(uri=key))


@pytest.mark.parametrize("indent", [2, None], ids=["pretty", "one-line"])
def test_json_array_file_is_read_item_by_item(tmp_path, monkeypatch, indent):
    """A ``.json`` file holding one JSON array of objects (what ``json.dump(rows, f)`` writes, and
    ``datasets``' json loader reads) gives its items, read a few bytes at a time here so that items,
    strings, numbers and multi-byte characters straddle the reads; ``_source`` names the line where
    each item starts and its position."""
    import trainer_core.data.sources as sources

    monkeypatch.setattr(sources, "_JSON_READ_BYTES", 5)
    rows = [{"prompt": f'p{i} é \U0001f600 "q"\n', "completion": f"#### {10**i}", "n": [i, -1.5e-3]} for i in range(4)]
    path = tmp_path / "rows.json"
    path.write_text("\n" + json.dumps(rows, indent=indent) + "\n", encoding="utf-8")
    records = read_records(DataSource(uri=str(path)))
    assert [{k: v for k, v in r.items() if k != "_source"} for r in records] == rows
    lines = [3, 11, 19, 27] if indent else [2] * 4
    assert [r["_source"] for r in records] == [f"{path}:{line} (array item {i + 1})" for i, line in enumerate(lines)]
    gz = tmp_path / "rows.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert [r["prompt"] for r in read_records(DataSource(uri=str(gz), max_rows=2))] == [r["prompt"] for r in rows[:2]]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[{"a": 1},\n2]', r":2 \(array item 2\): expected a JSON object per array item, got int"),
        ('[{"a": 1},\n{"a": tru}]', r":2: invalid JSON: Expecting value \(array item 2\)"),
        ('[{"a": 1},\n{"a": "x}]', r":2: invalid JSON: Unterminated string \(array item 2\)"),
        ('[{"a": 1}\n{"a": 2}]', r":2: invalid JSON: expected ',' or ']' after array item 1, got '\{'"),
        ('[{"a": 1},\n', r":2: invalid JSON: the array is not closed"),
        ('[{"a": 1}]\n[{"a": 2}]', r":2: invalid JSON: text after the array's closing '\]'"),
        ("[]", r": no records"),
    ],
)
def test_json_array_errors_name_the_line(tmp_path, text, message):
    uri = _write(tmp_path / "bad.json", text)
    with pytest.raises(DataError, match=f"^{uri}{message}"):
        read_records(DataSource(uri=uri))
