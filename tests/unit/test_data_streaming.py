"""Data bigger than memory: streaming reads, staged examples and their split, chunked and parallel
tokenising, sharded Parquet (and the old single-file layout), memory-mapped lazy rows, samplers
from a lengths array."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer_core import storage
from trainer_core.checkpoint.manifest import ArtifactWriter, read_manifest
from trainer_core.config import DataSource, load_config
from trainer_core.data import prepared, sources
from trainer_core.data.formats import to_kto_examples, to_sft_example
from trainer_core.data.parallel import ChunkMap
from trainer_core.data.prepared import PreparedRows, _mapped, load_split, load_table, row_lengths
from trainer_core.data.samplers import BucketedBatchSampler, PackedBatchSampler
from trainer_core.data.shards import ShardWriter, split_files
from trainer_core.data.sources import iter_records
from trainer_core.data.staging import group_examples, shuffled, split_order, stage_examples
from trainer_core.errors import DataError
from trainer_core.spec import build_spec
from trainer_core.stages import prepare_data
from trainer_core.stages.runner import run_spec as run
from trainer_core.storage import StageLayout, join_uri

TINY = {
    "seed": 3,
    "data.synthetic.num_problems": 60,
    "data.synthetic.num_pairs": 30,
    "data.eval_fraction": 0.2,
    "data.max_eval_rows": 6,
    "tokenizer.vocab_size": 400,
}


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _prepare(root: Path, **overrides) -> str:
    """Run prepare_data on the tiny synthetic config; returns its final directory."""
    config = load_config(overrides={**TINY, **overrides})
    spec = build_spec(config, "prepare_data", "run-1", {}, output_uri=str(root / "prepare_data"))
    run(spec)
    return StageLayout(spec.output_uri).final


# -- streaming reads ----------------------------------------------------------------------------


def test_jsonl_is_read_lazily_and_a_bad_line_is_named_when_reached(tmp_path):
    """The first record comes before line 2 is parsed: nothing reads the whole file first."""
    uri = _jsonl(tmp_path / "d.jsonl", [{"a": 1}])
    with open(uri, "a") as f:
        f.write('{"a": 2,\n{"a": 3}\n')
    records = iter_records(DataSource(uri=uri))
    assert next(records)["a"] == 1
    with pytest.raises(DataError, match=rf"^{uri}:2: invalid JSON"):
        next(records)
    assert [r["a"] for r in iter_records(DataSource(uri=uri, max_rows=1))] == [1]  # line 2 never parsed


def test_parquet_is_read_in_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_PARQUET_BATCH_ROWS", 3)
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": f"q{i}"} for i in range(10)]), path, row_group_size=4)
    records = list(iter_records(DataSource(uri=str(path))))
    assert [r["q"] for r in records] == [f"q{i}" for i in range(10)]
    assert [r["_source"] for r in records] == [f"{path}:{i}" for i in range(1, 11)]
    assert [r["q"] for r in iter_records(DataSource(uri=str(path), max_rows=4))] == ["q0", "q1", "q2", "q3"]


# -- staging and the split ----------------------------------------------------------------------


def test_split_order_is_the_list_shuffle():
    """Index arrays give the rows the whole-list shuffle gave, in its order."""
    for n, seed in ((2, 0), (10, 1), (1000, 7)):
        order = list(range(n))
        random.Random(seed).shuffle(order)
        num_eval = min(5, max(1, round(n * 0.1)), n - 1)
        train, held_out = split_order(n, seed, 0.1, 5)
        assert held_out.tolist() == order[:num_eval] and train.tolist() == order[num_eval:]
    assert shuffled(0, 1).tolist() == []
    with pytest.raises(DataError, match="sft: 1 usable record"):
        split_order(1, 0, 0.5, 5, "sft")


def test_staged_examples_are_taken_by_index_in_any_order(tmp_path):
    records = ({"question": f"q{i}", "answer": f"#### {i}", "_source": f"f:{i + 1}"} for i in range(9000))
    metrics: dict[str, float] = {}
    store = stage_examples(records, "auto", to_sft_example, "sft", "sft", str(tmp_path / "s.arrow"), metrics)
    assert len(store) == 9000 and metrics == {"num_sft_invalid": 0}
    rows = store.take([8999, 3, 3, 4100])  # across record batches, repeated, unsorted
    assert [r["prompt"] for r in rows] == ["q8999", "q3", "q3", "q4100"]
    assert rows[0]["messages"] == [{"role": "user", "content": "q8999"}] and rows[0]["answer"] == "8999"
    assert json.loads(rows[1]["messages_json"]) == rows[1]["messages"]
    with pytest.raises(IndexError):
        store.take([9000])


def test_kto_groups_keep_a_pairs_two_examples_together(tmp_path):
    records = [{"prompt": f"p{i}", "chosen": "yes", "rejected": "no"} for i in range(3)]
    records.insert(1, {"prompt": "k", "completion": "c", "label": True})
    store = stage_examples(
        records, "auto", lambda r, _: to_kto_examples(r), "kto", "kto", str(tmp_path / "k.arrow"), {}
    )
    assert store.group_starts.tolist() == [0, 2, 3, 5, 7]
    assert group_examples(store, np.array([3, 1, 0])).tolist() == [5, 6, 2, 0, 1]


def test_too_many_unparsable_records_name_the_first(tmp_path):
    broken = {"chosen": "\n\nHuman: a\n\nAssistant: x", "rejected": "\n\nHuman: b\n\nAssistant: y", "_source": "h:2"}
    good = {"chosen": "\n\nHuman: a\n\nAssistant: x", "rejected": "\n\nHuman: a\n\nAssistant: y", "_source": "h:1"}
    from trainer_core.data.formats import to_preference_example

    with pytest.raises(DataError, match=r"1 of 2 records do not parse .*h:2"):
        stage_examples(
            [good, broken], "hh_rlhf", to_preference_example, "preference", "preference", str(tmp_path / "p.arrow"), {}
        )


# -- parallel chunks ----------------------------------------------------------------------------


def _square(x: int) -> int:
    if x == 7:
        raise DataError("chunk 7 is bad")
    return x * x


def _env(_: int) -> str | None:
    import os

    return os.environ.get("TOKENIZERS_PARALLELISM")


def test_chunk_map_keeps_order_in_worker_processes(monkeypatch):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    with ChunkMap(_square, 2) as pool:
        assert list(pool.map(range(7))) == [x * x for x in range(7)]
    with ChunkMap(_env, 2) as pool:  # the workers' tokenizers run single-threaded; this process keeps its pool
        assert set(pool.map(range(4))) == {"false"} and "TOKENIZERS_PARALLELISM" not in os.environ
    with ChunkMap(_square, 2) as pool, pytest.raises(DataError, match="chunk 7 is bad"):
        list(pool.map(range(10)))
    with pytest.raises(ValueError, match="num_proc"):
        ChunkMap(_square, 0)


# -- prepare_data: determinism, num_proc, shards --------------------------------------------------


def _files(final: str) -> dict[str, str]:
    return {f.path: f.sha256 for f in read_manifest(final).files}


def test_num_proc_2_writes_the_same_bytes_as_num_proc_1(tmp_path, monkeypatch):
    """Many chunks and several shards per split: the files (and so every row) are identical, and a
    second run with the same config too (determinism)."""
    monkeypatch.setattr(prepare_data, "CHUNK_ROWS", 5)
    monkeypatch.setattr("trainer_core.data.shards.SHARD_ROWS", 12)
    one = _prepare(tmp_path / "one", **{"data.kto": {}, "data.pretrain": {}})
    two = _prepare(tmp_path / "two", **{"data.kto": {}, "data.pretrain": {}, "data.num_proc": 2})
    again = _prepare(tmp_path / "again", **{"data.kto": {}, "data.pretrain": {}})
    assert _files(one) == _files(two) == _files(again)
    shards = [p for p in _files(one) if p.startswith("sft/train/")]
    assert len(shards) >= 3 and read_manifest(one).metrics == read_manifest(two).metrics
    assert len(load_split(one, "sft/train")) == read_manifest(one).metrics["num_sft_train"]


def test_a_bad_line_fails_with_file_and_line_at_any_num_proc(tmp_path):
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "#### 1"}] * 3)
    with open(bad, "a") as f:
        f.write('{"question": "q2"}\n')
    with pytest.raises(DataError, match=rf"{bad}:4: missing field 'answer'"):
        _prepare(tmp_path / "out", **{"data.sft.uri": bad, "data.num_proc": 2})


def test_max_rows_and_the_split_are_seeded(tmp_path):
    rows = [{"question": f"How many is {i}?", "answer": f"#### {i}"} for i in range(50)]
    sft = _jsonl(tmp_path / "sft.jsonl", rows)
    finals = [_prepare(tmp_path / k, **{"data.sft.uri": sft, "data.sft.max_rows": 30}) for k in "ab"]
    train, held_out = (load_split(finals[0], s) for s in ("sft/train", "sft/eval"))
    order = list(range(30))
    random.Random(TINY["seed"]).shuffle(order)
    assert [r["prompt"] for r in held_out] == [rows[i]["question"] for i in order[:6]]
    assert [r["prompt"] for r in train] == [rows[i]["question"] for i in order[6:]]
    assert _files(finals[0]) == _files(finals[1])


# -- reading: both layouts, lazy rows ------------------------------------------------------------


def _commit(uri: str, files: dict[str, pa.Table], sharded: bool, tmp_path: Path) -> None:
    writer = ArtifactWriter(uri, overwrite=True)
    for name, table in files.items():
        if sharded:
            out = ShardWriter(writer, name, table.schema, str(tmp_path), shard_rows=4)
            for batch in table.to_batches(max_chunksize=3):
                out.write(batch)
            out.close()
        else:  # the layout of outputs committed before sharding
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink, compression="zstd")
            writer.write_bytes(f"{name}.parquet", sink.getvalue().to_pybytes())
    writer.commit(kind="final", stage="prepare_data", run_id="r", config_hash="h")


def _table(n: int) -> pa.Table:
    return pa.table(
        {
            "input_ids": pa.array([list(range(i % 5)) for i in range(n)], pa.list_(pa.int32())),
            "answer": [None if i % 3 else str(i) for i in range(n)],
            "label": [i % 2 == 0 for i in range(n)],
        }
    )


@pytest.mark.parametrize("sharded", [True, False])
def test_both_layouts_load_the_same_rows(tmp_path, sharded):
    uri = str(tmp_path / "final")
    _commit(uri, {"sft/train": _table(11), "eval_problems": _table(0)}, sharded, tmp_path)
    names = [e.path for e in split_files(read_manifest(uri).files, "sft/train")]
    if sharded:
        assert names == ["sft/train/part-00000.parquet", "sft/train/part-00001.parquet"]  # batches 3+3, 3+2 rows
    else:
        assert names == ["sft/train.parquet"]
    rows = load_split(uri, "sft/train")
    assert rows == _table(11).to_pylist() and len(load_split(uri, "eval_problems")) == 0
    with pytest.raises(DataError, match=r"prepared split not found: .*kto/train.parquet .* made without data.kto"):
        load_split(uri, "kto/train")


def test_remote_splits_are_cached_locally_and_mapped(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    uri = f"memory://prepared-{tmp_path.name}/final"
    _commit(uri, {"sft/train": _table(7)}, True, tmp_path)
    table = load_table(uri, "sft/train")
    cached = sorted(Path(prepared.arrow_cache_dir()).glob("*.arrow"))
    assert len(cached) == 2 and table.to_pylist() == _table(7).to_pylist()
    storage.remove(uri)  # read again from the cache, keyed by the manifest's hashes: no download
    _commit(uri, {"sft/train": _table(7)}, True, tmp_path)
    mtimes = [p.stat().st_mtime_ns for p in cached]
    assert load_table(uri, "sft/train").to_pylist() == _table(7).to_pylist()
    assert [p.stat().st_mtime_ns for p in cached] == mtimes


def test_prepared_rows_are_a_lazy_sequence(tmp_path):
    rows = PreparedRows(pa.Table.from_batches(_table(10).to_batches(max_chunksize=4)), "sft/train")
    expected = _table(10).to_pylist()
    assert len(rows) == 10 and rows[5] == expected[5] and rows[-1] == expected[9]
    assert rows[2:6] == expected[2:6] and rows[::4] == expected[::4] and rows[:0] == []
    assert list(rows) == expected and rows == expected and rows != expected[:9]
    assert rows[3] is not rows[3]  # built when asked, never cached
    with pytest.raises(IndexError):
        rows[10]
    rows[4]["ref_logprobs"] = -1.5  # kept by index, as DPO attaches reference log-probs
    for row in rows:
        row.setdefault("seen", True)
    assert rows[4]["ref_logprobs"] == -1.5 and "ref_logprobs" not in rows[3] and "seen" not in rows[4]
    assert [r.get("ref_logprobs") for r in rows][4] == -1.5
    assert type(pickle.loads(pickle.dumps(rows[4]))) is dict
    assert rows.list_lengths("input_ids").tolist() == [i % 5 for i in range(10)]
    assert (
        row_lengths(rows, "input_ids").tolist()
        == row_lengths(expected, "input_ids").tolist()
        == [i % 5 for i in range(10)]
    )
    assert rows.nonnull_indices("answer").tolist() == [0, 3, 6, 9] and sum(rows.values("label")) == 5


def test_list_lengths_read_the_offsets_of_every_layout():
    """Sliced chunks (a non-zero array offset), nulls whose segment is not empty (allowed by the
    Arrow format), large lists, several chunks: the lengths equal ``list_value_length``'s, null -> 0."""
    values = pa.array(range(20), pa.int32())
    with_null = pa.ListArray.from_arrays(
        pa.array([0, 2, 5, 9, 9, 12], pa.int32()), values, mask=pa.array([False, False, True, False, False])
    )
    large = pa.LargeListArray.from_arrays(pa.array([0, 3, 3, 7], pa.int64()), values)
    for column, expected in (
        (pa.chunked_array([with_null.slice(1, 3), with_null.slice(0, 2)]), [3, 0, 0, 2, 3]),
        (pa.chunked_array([large.slice(1)]), [0, 4]),
    ):
        rows = PreparedRows(pa.table({"input_ids": column}), "sft/train")
        assert rows.list_lengths("input_ids").tolist() == expected
        assert rows.list_lengths("input_ids").dtype == np.int64
    with pytest.raises(TypeError, match="column 'label' is int64, not a list column"):
        PreparedRows(pa.table({"label": [1, 2]}), "sft/train").list_lengths("label")


# -- samplers from a lengths column ---------------------------------------------------------------


def test_samplers_take_a_lengths_array():
    lengths = [random.Random(1).randint(1, 40) for _ in range(200)]
    column = pa.chunked_array([pa.array(lengths[:90], pa.int32()), pa.array(lengths[90:], pa.int32())])
    for make in (
        lambda x: BucketedBatchSampler(x, 8, seed=2, drop_last=True),
        lambda x: PackedBatchSampler(x, 64, seed=2, chunk_rows=50),
    ):
        from_list, from_numpy, from_arrow = make(lengths), make(np.asarray(lengths, np.int32)), make(column)
        assert from_numpy.lengths.dtype == np.int64
        for epoch in (0, 1):
            batches = from_list.batches(epoch)
            assert batches == from_numpy.batches(epoch) == from_arrow.batches(epoch)
            assert all(isinstance(b, list) for b in batches) and batches[-1] == list(batches)[-1]
    first = list(itertools.chain.from_iterable(BucketedBatchSampler(lengths, 8, seed=2).batches(0)))
    assert sorted(first) == list(range(200))


def load_rows_of(path: str) -> PreparedRows:
    table, maps = _mapped([path])
    return PreparedRows(table, "a", [path], maps)


def _rss_file_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_reading_rows_leaves_few_file_pages_resident(tmp_path, monkeypatch):
    """Random reads of a 96 MB split: the mapping's pages are released every few rows, so the
    process's resident file pages grow by far less than the file (without the release, every page
    the reads and the kernel's fault-around touched would stay mapped)."""
    monkeypatch.setattr(prepared, "RELEASE_EVERY_ROWS", 4)  # at most 4 rows' folios mapped at once
    path = str(tmp_path / "rows.arrow")
    texts = pa.array(["x" * 2000] * 48_000)
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, pa.schema([("a", pa.string())])) as writer:
        for batch in pa.table({"a": texts}).to_batches(max_chunksize=8192):
            writer.write_batch(batch)
    rows = load_rows_of(path)
    before = _rss_file_kb()
    for i in random.Random(0).sample(range(48_000), 3000):
        assert len(rows[i]["a"]) == 2000
    assert _rss_file_kb() - before < 48 * 1024


def test_a_committed_file_that_is_not_parquet_is_a_data_error(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    uri = str(tmp_path / "final")
    writer = ArtifactWriter(uri)
    writer.write_bytes("sft/train/part-00000.parquet", b"not parquet at all")
    writer.commit(kind="final", stage="prepare_data", run_id="r", config_hash="h")
    with pytest.raises(DataError, match=r"part-00000.parquet: not a readable Parquet file"):
        load_split(uri, "sft/train")
    left = [p.name for p in Path(prepared.arrow_cache_dir()).iterdir() if not p.name.endswith(".lock")]
    assert left == []  # no partial cache file


def test_a_damaged_arrow_cache_file_is_converted_again(tmp_path, monkeypatch):
    """A cache file that is not a whole Arrow IPC file (a crash, a full disk) is not mapped: the
    split is converted again from its Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer_core.data import prepared

    monkeypatch.setattr(prepared, "arrow_cache_dir", lambda: str(tmp_path / "cache"))
    source = tmp_path / "split.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2], [3]]}), source)
    path = prepared.local_arrow(str(source), "abc123")
    whole = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(whole[: len(whole) // 2])  # truncated
    assert prepared.local_arrow(str(source), "abc123") == path
    assert open(path, "rb").read() == whole
    with pa.OSFile(path, "rb") as f:
        assert pa.ipc.open_file(f).read_all().column("input_ids").to_pylist() == [[1, 2], [3]]
