"""The manifest commit protocol on ``memory://``, a local directory and S3 (moto)."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from datetime import timezone

import pytest
from pydantic import ValidationError

from trainer_core import checkpoint, storage
from trainer_core.storage import join_uri

LOGGER = "trainer_core.checkpoint.manifest"


def _commit_step(ckpts: str, step: int, payload: bytes = b"weights") -> checkpoint.Manifest:
    writer = checkpoint.ArtifactWriter(join_uri(ckpts, checkpoint.step_dirname(step)))
    writer.write_bytes("model/weights.bin", payload * step)
    writer.write_json("state.json", {"global_step": step})
    return writer.commit(kind="checkpoint", stage="sft", run_id="r1", global_step=step)


def _round_trip(root: str, tmp_path) -> None:
    local_dir = tmp_path / "hf"
    (local_dir / "sub").mkdir(parents=True)
    (local_dir / "config.json").write_text('{"a": 1}')
    (local_dir / "sub" / "tok.bin").write_bytes(bytes(range(256)) * 3)
    single = tmp_path / "single.bin"
    single.write_bytes(b"abc")

    uri = join_uri(root, "final")
    writer = checkpoint.ArtifactWriter(uri)
    writer.write_bytes("raw.bin", b"\x00\xff")
    writer.write_json("meta.json", {"z": 1, "a": [1.5]})
    writer.write_file("single.bin", str(single))
    writer.write_dir(str(local_dir), prefix="model")
    assert not storage.exists(join_uri(uri, checkpoint.MANIFEST_NAME))  # nothing committed before commit()
    written = writer.commit(kind="final", stage="dpo", run_id="r1", metrics={"loss": 0.5}, extra={"mlflow_run_id": "m"})

    assert [f.path for f in written.files] == [
        "meta.json",
        "model/config.json",
        "model/sub/tok.bin",
        "raw.bin",
        "single.bin",
    ]
    by_path = {f.path: f for f in written.files}
    # SHA-256("abc"): FIPS 180-2, appendix B.1
    assert by_path["single.bin"].sha256 == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert by_path["model/sub/tok.bin"].size_bytes == 768
    assert checkpoint.read_manifest(uri) == written
    assert checkpoint.verify(uri) == []
    assert checkpoint.load_verified(uri) == written
    assert storage.read_json(join_uri(uri, "meta.json")) == {"a": [1.5], "z": 1}


def test_round_trip_memory(tmp_path):
    _round_trip(f"memory://manifest-test-{uuid.uuid4().hex}", tmp_path)


def test_round_trip_storage_root(storage_root, tmp_path):
    _round_trip(storage_root, tmp_path)


def test_manifest_defaults():
    m = checkpoint.Manifest(kind="checkpoint", stage="sft", run_id="r", files=[])
    assert m.schema_version == checkpoint.SCHEMA_VERSION == 1
    assert m.created_at.tzinfo == timezone.utc
    assert m.code_version.startswith("0.1.0")
    assert (m.global_step, m.world_size, m.backend, m.metrics, m.extra) == (0, 1, "single", {}, {})


def test_sha256_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 10_001)
    assert checkpoint.sha256_file(str(path), chunk_bytes=64) == hashlib.sha256(b"x" * 10_001).hexdigest()


@pytest.mark.parametrize("bad", ["../x", "a/../../x", "/etc/passwd", "a\\b", "", "a//b", "./a", "a/", "C:/x"])
def test_file_entry_rejects_unsafe_paths(bad):
    with pytest.raises(ValidationError):
        checkpoint.FileEntry(path=bad, size_bytes=1, sha256="0" * 64)


def test_file_entry_rejects_bad_hash_and_size():
    with pytest.raises(ValidationError):
        checkpoint.FileEntry(path="a", size_bytes=1, sha256="XYZ")
    with pytest.raises(ValidationError):
        checkpoint.FileEntry(path="a", size_bytes=-1, sha256="0" * 64)


def _raw_manifest(**changes) -> dict:
    entry = checkpoint.FileEntry(path="a", size_bytes=0, sha256="0" * 64)
    data = checkpoint.Manifest(kind="checkpoint", stage="sft", run_id="r", files=[entry]).model_dump(mode="json")
    data.update(changes)
    return data


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (json.dumps(_raw_manifest(files=[{"path": "../x", "size_bytes": 1, "sha256": "0" * 64}])), "'..'"),
        (json.dumps(_raw_manifest(schema_version=2)), "schema_version 2"),
        (json.dumps(_raw_manifest(kind="other")), "kind"),
        ("{not json", "invalid manifest"),
    ],
)
def test_read_manifest_rejects_invalid(raw, match):
    uri = f"memory://manifest-test-{uuid.uuid4().hex}/d"
    storage.write_bytes(join_uri(uri, checkpoint.MANIFEST_NAME), raw.encode())
    with pytest.raises(checkpoint.ManifestError, match=match):
        checkpoint.read_manifest(uri)


def test_read_manifest_missing():
    with pytest.raises(FileNotFoundError):
        checkpoint.read_manifest(f"memory://manifest-test-{uuid.uuid4().hex}/d")


def test_writer_refuses_committed_dir_unless_overwrite(storage_root):
    uri = join_uri(storage_root, "final")
    writer = checkpoint.ArtifactWriter(uri)
    writer.write_bytes("old-shard.bin", b"old")
    writer.commit(kind="final", stage="sft", run_id="r")
    with pytest.raises(FileExistsError, match="already committed"):
        checkpoint.ArtifactWriter(uri)

    rewriter = checkpoint.ArtifactWriter(uri, overwrite=True)
    assert not storage.exists(join_uri(uri, checkpoint.MANIFEST_NAME))  # uncommitted while rewriting
    assert not storage.exists(join_uri(uri, "old-shard.bin"))  # stale files do not linger
    rewriter.write_bytes("new.bin", b"new")
    assert [f.path for f in rewriter.commit(kind="final", stage="sft", run_id="r").files] == ["new.bin"]
    assert checkpoint.load_verified(uri).files[0].path == "new.bin"


def test_writer_misuse_errors():
    writer = checkpoint.ArtifactWriter(f"memory://manifest-test-{uuid.uuid4().hex}/d")
    with pytest.raises(ValueError, match="reserved|commit"):
        writer.write_bytes(checkpoint.MANIFEST_NAME, b"{}")
    with pytest.raises(ValueError, match="'..'"):
        writer.write_bytes("../escape", b"x")
    with pytest.raises(TypeError, match="files="):
        writer.commit(kind="final", stage="s", run_id="r", files=[])
    with pytest.raises(ValidationError):
        writer.commit(stage="s", run_id="r")  # no kind: nothing written
    assert not storage.exists(join_uri(writer.uri, checkpoint.MANIFEST_NAME))
    writer.commit(kind="final", stage="s", run_id="r")
    with pytest.raises(RuntimeError, match="committed"):
        writer.write_bytes("late.bin", b"x")
    with pytest.raises(RuntimeError, match="committed"):
        writer.commit(kind="final", stage="s", run_id="r")


def test_step_dirname():
    assert checkpoint.step_dirname(0) == "step-00000000"
    assert checkpoint.step_dirname(42) == "step-00000042"
    with pytest.raises(ValueError):
        checkpoint.step_dirname(-1)


def test_find_latest_empty_and_missing(storage_root):
    assert checkpoint.find_latest(join_uri(storage_root, "missing")) is None
    storage.write_bytes(join_uri(storage_root, "ckpts", "not-a-step", "x.bin"), b"1")
    assert checkpoint.find_latest(join_uri(storage_root, "ckpts")) is None


def test_find_latest_ignores_crashed_writer(storage_root, caplog):
    ckpts = join_uri(storage_root, "checkpoints")
    _commit_step(ckpts, 10)
    writer = checkpoint.ArtifactWriter(join_uri(ckpts, checkpoint.step_dirname(20)))
    with pytest.raises(RuntimeError, match="killed"):
        writer.write_bytes("model/weights.bin", b"partial")
        raise RuntimeError("killed before commit")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        uri, manifest = checkpoint.find_latest(ckpts)
    assert (uri, manifest.global_step) == (join_uri(ckpts, "step-00000010"), 10)
    assert "step-00000020" in caplog.text and "incomplete write" in caplog.text


def _truncate(uri: str) -> None:
    storage.write_bytes(uri, storage.read_bytes(uri)[:-1])


def _flip_byte(uri: str) -> None:
    data = bytearray(storage.read_bytes(uri))
    data[3] ^= 0xFF
    storage.write_bytes(uri, bytes(data))


def _delete(uri: str) -> None:
    assert storage.remove(uri, recursive=False)


@pytest.mark.parametrize(
    ("corrupt", "problem"),
    [(_truncate, "size mismatch"), (_flip_byte, "sha256 mismatch"), (_delete, "missing file")],
)
def test_corruption_detected_and_find_latest_falls_back(storage_root, caplog, corrupt, problem):
    ckpts = join_uri(storage_root, "checkpoints")
    _commit_step(ckpts, 5)
    _commit_step(ckpts, 7)
    newest = join_uri(ckpts, checkpoint.step_dirname(7))
    corrupt(join_uri(newest, "model/weights.bin"))

    problems = checkpoint.verify(newest)
    assert len(problems) == 1 and problems[0].startswith(f"{problem} model/weights.bin")
    with pytest.raises(checkpoint.ManifestError, match=problem):
        checkpoint.load_verified(newest)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        uri, manifest = checkpoint.find_latest(ckpts)
    assert uri == join_uri(ckpts, checkpoint.step_dirname(5)) and manifest.global_step == 5
    assert f"skipping checkpoint {newest}: {problem}" in caplog.text


def test_find_latest_skips_unsafe_manifest_and_step_mismatch(caplog):
    ckpts = f"memory://manifest-test-{uuid.uuid4().hex}/checkpoints"
    _commit_step(ckpts, 1)
    bad = _raw_manifest(global_step=3, files=[{"path": "../x", "size_bytes": 1, "sha256": "0" * 64}])
    storage.write_json(join_uri(ckpts, checkpoint.step_dirname(3), checkpoint.MANIFEST_NAME), bad)
    misnamed = _commit_step(ckpts, 2).model_dump(mode="json")
    storage.write_json(join_uri(ckpts, checkpoint.step_dirname(4), checkpoint.MANIFEST_NAME), misnamed)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        uri, _ = checkpoint.find_latest(ckpts)
    assert uri == join_uri(ckpts, checkpoint.step_dirname(2))
    assert "step-00000004: manifest global_step 2" in caplog.text
    assert "step-00000003: invalid manifest" in caplog.text


def test_purge_keeps_last_k(storage_root):
    ckpts = join_uri(storage_root, "checkpoints")
    for step in (1, 2, 3, 4, 5):
        _commit_step(ckpts, step)
    storage.write_bytes(join_uri(ckpts, checkpoint.step_dirname(0), "partial.bin"), b"x")  # older, uncommitted
    storage.write_bytes(join_uri(ckpts, checkpoint.step_dirname(6), "partial.bin"), b"x")  # newer: in progress

    removed = checkpoint.purge_checkpoints(ckpts, keep_last=2, keep={checkpoint.step_dirname(1)})
    assert sorted(removed) == [join_uri(ckpts, checkpoint.step_dirname(s)) for s in (0, 2, 3)]
    assert storage.list_dirs(ckpts) == [checkpoint.step_dirname(s) for s in (1, 4, 5, 6)]
    assert checkpoint.find_latest(ckpts)[1].global_step == 5
    assert checkpoint.purge_checkpoints(ckpts, keep_last=2, keep={join_uri(ckpts, checkpoint.step_dirname(1))}) == []


def test_purge_never_removes_newest_valid(caplog):
    ckpts = f"memory://manifest-test-{uuid.uuid4().hex}/checkpoints"
    for step in (1, 2, 3):
        _commit_step(ckpts, step)
    storage.remove(join_uri(ckpts, checkpoint.step_dirname(3), "state.json"), recursive=False)  # step 3 is broken
    removed = checkpoint.purge_checkpoints(ckpts, keep_last=1)
    assert removed == [join_uri(ckpts, checkpoint.step_dirname(1))]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert checkpoint.find_latest(ckpts)[1].global_step == 2


def test_purge_rejects_negative_keep_last():
    with pytest.raises(ValueError, match="keep_last"):
        checkpoint.purge_checkpoints("memory://x", keep_last=-1)
