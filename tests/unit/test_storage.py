"""Storage on a local directory and on S3 (moto's server on loopback)."""

from __future__ import annotations

import errno
import json
import logging
import os
import tempfile

import fsspec
import fsspec.config
import pytest
from botocore.exceptions import EndpointConnectionError
from fsspec.implementations.memory import MemoryFileSystem
from pydantic import SecretStr
from tenacity import wait_none

from trainer_core import storage
from trainer_core.config import StorageConfig
from trainer_core.storage import join_uri


@pytest.fixture(autouse=True)
def _restore_s3_conf(monkeypatch):
    """Every test leaves fsspec's process-wide S3 settings as it found them."""
    monkeypatch.setitem(fsspec.config.conf, "s3", dict(fsspec.config.conf.get("s3", {})))


def _tree(local_dir: str) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(local_dir):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, local_dir).replace(os.sep, "/")] = f.read()
    return out


def test_bytes_and_json_round_trip(storage_root):
    uri = join_uri(storage_root, "a", "b", "blob.bin")
    storage.write_bytes(uri, b"\x00\x01payload")
    assert storage.read_bytes(uri) == b"\x00\x01payload"
    storage.write_bytes(uri, b"replaced")
    assert storage.read_bytes(uri) == b"replaced"

    juri = join_uri(storage_root, "obj.json")
    storage.write_json(juri, {"b": [1, 2], "a": None})
    assert storage.read_json(juri) == {"a": None, "b": [1, 2]}
    # indent 2 and sorted keys: "a" is written before "b"
    assert storage.read_bytes(juri).decode().startswith('{\n  "a": null,\n  "b": [')


def test_read_missing_raises_file_not_found(storage_root):
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(join_uri(storage_root, "nope.bin"))


def test_write_bytes_rejects_str(storage_root):
    with pytest.raises(TypeError, match="needs bytes"):
        storage.write_bytes(join_uri(storage_root, "x"), "text")  # type: ignore[arg-type]


def test_exists_and_list_dirs(storage_root):
    assert storage.list_dirs(storage_root) == []
    assert not storage.exists(join_uri(storage_root, "d1"))
    for rel in ("d2/x.bin", "d1/y.bin", "d1/deep/z.bin", "top.bin"):
        storage.write_bytes(join_uri(storage_root, rel), b"1")
    assert storage.exists(join_uri(storage_root, "d1"))
    assert storage.exists(join_uri(storage_root, "top.bin"))
    assert storage.list_dirs(storage_root) == ["d1", "d2"]
    assert storage.list_dirs(join_uri(storage_root, "d1")) == ["deep"]
    assert storage.list_dirs(join_uri(storage_root, "missing")) == []
    assert storage.list_files(join_uri(storage_root, "d1")) == {"y.bin": 1, "deep/z.bin": 1}
    assert storage.list_files(join_uri(storage_root, "missing")) == {}


def test_remove(storage_root):
    storage.write_bytes(join_uri(storage_root, "d/a.bin"), b"1")
    storage.write_bytes(join_uri(storage_root, "d/sub/b.bin"), b"2")
    assert storage.remove(join_uri(storage_root, "d")) is True
    assert not storage.exists(join_uri(storage_root, "d/sub/b.bin"))
    assert storage.list_dirs(storage_root) == []
    assert storage.remove(join_uri(storage_root, "d")) is False


def test_remove_never_raises(caplog):
    with caplog.at_level(logging.WARNING, logger="trainer_core.storage"):
        assert storage.remove("nosuchprotocol://bucket/x") is False
    assert "could not remove nosuchprotocol://bucket/x" in caplog.text


def test_upload_and_download_dir(storage_root, tmp_path):
    src = tmp_path / "src"
    (src / "nested").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"alpha")
    (src / "nested" / "b.bin").write_bytes(os.urandom(1000))
    remote = join_uri(storage_root, "model")
    for rel in ("a.txt", "nested/b.bin"):
        storage.upload_file(str(src / rel), join_uri(remote, rel))
    out = storage.download_dir(remote, str(tmp_path / "dst"))
    assert out == str(tmp_path / "dst")
    assert _tree(out) == _tree(str(src))


def test_upload_file_hashed_reports_size_and_sha(storage_root, tmp_path):
    local = tmp_path / "abc.txt"
    local.write_bytes(b"abc")
    size, sha = storage.upload_file_hashed(str(local), join_uri(storage_root, "abc.txt"), chunk_bytes=2)
    # SHA-256("abc") from FIPS 180-2, appendix B.1
    assert (size, sha) == (3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    assert storage.sha256_uri(join_uri(storage_root, "abc.txt"), chunk_bytes=1) == sha


def test_upload_missing_local_file(storage_root, tmp_path):
    with pytest.raises(FileNotFoundError, match="no local file"):
        storage.upload_file(str(tmp_path / "absent"), join_uri(storage_root, "x"))


def test_download_dir_missing_raises(storage_root, tmp_path):
    with pytest.raises(FileNotFoundError, match="no files under"):
        storage.download_dir(join_uri(storage_root, "absent"), str(tmp_path / "dst"))


def test_materialize_local_returns_the_path(tmp_path):
    assert storage.materialize(str(tmp_path)) == str(tmp_path)
    assert storage.materialize(f"file://{tmp_path}") == str(tmp_path)
    with pytest.raises(FileNotFoundError):
        storage.materialize(str(tmp_path / "absent"))
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        storage.materialize(str(tmp_path / "f"))


@pytest.mark.parametrize("storage_root", ["s3"], indirect=True)
def test_materialize_s3_downloads_and_caches(storage_root, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tempfile.tempdir)
    remote = join_uri(storage_root, "models/m1")
    storage.write_bytes(join_uri(remote, "weights.bin"), b"w1")
    storage.write_bytes(join_uri(remote, "cfg/config.json"), b"{}")
    storage.write_bytes(join_uri(remote, "manifest.json"), b'{"v": 1}')

    local = storage.materialize(remote)
    assert local.startswith(os.path.join(str(tmp_path / "tmp"), storage.CACHE_DIRNAME))
    assert _tree(local) == {"weights.bin": b"w1", "cfg/config.json": b"{}", "manifest.json": b'{"v": 1}'}

    # Same remote manifest: the cached copy is reused (a local edit survives).
    with open(os.path.join(local, "weights.bin"), "wb") as f:
        f.write(b"local edit")
    assert storage.materialize(remote) == local
    assert _tree(local)["weights.bin"] == b"local edit"

    # New remote manifest: downloaded again.
    storage.write_bytes(join_uri(remote, "weights.bin"), b"w2")
    storage.write_bytes(join_uri(remote, "manifest.json"), b'{"v": 2}')
    assert storage.materialize(remote) == local
    assert _tree(local)["weights.bin"] == b"w2"


def test_configure_sets_s3_defaults_without_logging_secrets(monkeypatch, caplog):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    cfg = StorageConfig(
        endpoint_url="http://127.0.0.1:9",
        region="eu-west-1",
        access_key_id=SecretStr("AKIDSECRETVALUE"),
        secret_access_key=SecretStr("very-secret-key"),
    )
    with caplog.at_level(logging.DEBUG):
        storage.configure(cfg)
    conf = fsspec.config.conf["s3"]
    assert conf["endpoint_url"] == "http://127.0.0.1:9"
    assert conf["client_kwargs"]["region_name"] == "eu-west-1"
    assert (conf["key"], conf["secret"]) == ("AKIDSECRETVALUE", "very-secret-key")
    assert "AKIDSECRETVALUE" not in caplog.text and "very-secret-key" not in caplog.text
    fs, path = storage.url_to_fs("s3://bucket/key")
    assert path == "bucket/key" and fs.key == "AKIDSECRETVALUE"

    # A new configure replaces the old settings; None falls back to the environment.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:10")
    storage.configure(StorageConfig())
    conf = fsspec.config.conf["s3"]
    assert conf["endpoint_url"] == "http://127.0.0.1:10"
    assert "key" not in conf and "secret" not in conf


def test_process_env_gives_a_fresh_process_the_settings(monkeypatch):
    """What a trainer gets in its environment (``storage.process_env``) configures S3 as the config
    would, before the trainer has read any config; nothing is set for what the config leaves unset."""
    cfg = StorageConfig(
        endpoint_url="http://127.0.0.1:9",
        region="eu-west-1",
        access_key_id=SecretStr("AKIDSECRETVALUE"),
        secret_access_key=SecretStr("very-secret-key"),
    )
    env = storage.process_env(cfg)
    assert env == {
        "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9",
        "AWS_DEFAULT_REGION": "eu-west-1",
        "AWS_ACCESS_KEY_ID": "AKIDSECRETVALUE",
        "AWS_SECRET_ACCESS_KEY": "very-secret-key",
    }
    assert storage.process_env(StorageConfig()) == {}
    for name in ("AWS_ENDPOINT_URL", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    storage.configure(StorageConfig())  # a process that has read no config yet
    conf = fsspec.config.conf["s3"]
    assert conf["endpoint_url"] == "http://127.0.0.1:9" and conf["client_kwargs"]["region_name"] == "eu-west-1"


def test_configure_then_read_write_through_moto(s3_server, monkeypatch):
    import boto3

    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket="env-bucket")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    storage.configure(StorageConfig())  # endpoint from AWS_ENDPOINT_URL, keys from AWS_* env
    storage.write_json("s3://env-bucket/k/v.json", {"x": 1})
    assert storage.read_json("s3://env-bucket/k/v.json") == {"x": 1}
    body = (
        boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
        .get_object(Bucket="env-bucket", Key="k/v.json")["Body"]
        .read()
    )
    assert json.loads(body) == {"x": 1}


def test_url_to_fs_rejects_empty():
    with pytest.raises(ValueError, match="non-empty"):
        storage.url_to_fs("")


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), True),
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (OSError(errno.EIO, "InternalError"), True),
        (FileNotFoundError(errno.ENOENT, "x"), False),
        (PermissionError(errno.EACCES, "x"), False),
        (OSError(errno.ENOSPC, "disk full"), False),
        (ValueError("bad"), False),
    ],
)
def test_is_transient(exc, transient):
    assert storage.is_transient(exc) is transient


class _FlakyMemoryFS(MemoryFileSystem):
    """A memory filesystem whose writes fail with a connection reset ``fail_times`` times."""

    protocol = ("flakymem",)
    fail_times = 0
    calls = 0

    def pipe_file(self, path, value, **kwargs):
        type(self).calls += 1
        if type(self).calls <= type(self).fail_times:
            raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
        return super().pipe_file(path, value, **kwargs)


@pytest.fixture
def flaky_fs(monkeypatch):
    fsspec.register_implementation("flakymem", _FlakyMemoryFS, clobber=True)
    for func in (storage.write_bytes, storage.read_bytes):
        monkeypatch.setattr(func.retry, "wait", wait_none())
    monkeypatch.setattr(_FlakyMemoryFS, "calls", 0)
    return _FlakyMemoryFS


def test_write_retries_transient_errors(flaky_fs, caplog, monkeypatch):
    monkeypatch.setattr(flaky_fs, "fail_times", 2)
    with caplog.at_level(logging.WARNING, logger="trainer_core.storage"):
        storage.write_bytes("flakymem://retry/a.bin", b"ok")
    assert flaky_fs.calls == 3
    assert storage.read_bytes("flakymem://retry/a.bin") == b"ok"
    assert "Retrying" in caplog.text


def test_write_gives_up_after_max_attempts(flaky_fs, monkeypatch):
    monkeypatch.setattr(flaky_fs, "fail_times", 100)
    with pytest.raises(ConnectionResetError):
        storage.write_bytes("flakymem://retry/b.bin", b"never")
    assert flaky_fs.calls == storage.RETRY_ATTEMPTS


def test_a_write_that_gives_up_names_what_it_was_writing(flaky_fs, monkeypatch):
    """The error is re-raised unchanged, with what the operation did attached for the taxonomy."""
    from trainer_core.errors import classify

    monkeypatch.setattr(flaky_fs, "fail_times", 100)
    with pytest.raises(ConnectionResetError) as info:
        storage.write_bytes("flakymem://retry/c.bin", b"never")
    failure = info.value.storage_failure
    assert (failure.action, failure.uri, failure.endpoint, failure.attempts) == (
        "writing",
        "flakymem://retry/c.bin",
        None,
        storage.RETRY_ATTEMPTS,
    )
    assert str(classify(info.value)).startswith("storage did not answer: writing flakymem://retry/c.bin failed after 6")


def test_asyncio_reports_an_abandoned_request_in_one_line(capsys):
    """A request left behind when an endpoint went away: one warning, no traceback."""
    storage.configure(StorageConfig())
    handler = logging.StreamHandler()
    log = logging.getLogger("asyncio")
    log.addHandler(handler)
    try:
        try:
            raise ConnectionResetError("Cannot write to closing transport")
        except ConnectionResetError as e:
            log.error("Task exception was never retrieved\nfuture: <Task ...>", exc_info=e)
    finally:
        log.removeHandler(handler)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "future:" not in err
    assert "Task exception was never retrieved (an abandoned storage request" in err and "closing transport" in err


def test_file_not_found_is_not_retried(flaky_fs, monkeypatch):
    calls = []
    original = _FlakyMemoryFS.cat_file

    def counting_cat_file(self, path, *args, **kwargs):
        calls.append(path)
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(_FlakyMemoryFS, "cat_file", counting_cat_file)
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("flakymem://retry/absent.bin")
    assert len(calls) == 1


@pytest.mark.parametrize("storage_root", ["s3"], indirect=True)
def test_listing_sees_writes_by_another_client(storage_root, s3_server):
    """s3fs caches listings; writes by another process (here: a plain boto3 client) must show."""
    import boto3

    storage.write_bytes(join_uri(storage_root, "ckpts/step-1/a.bin"), b"1")
    assert storage.list_dirs(join_uri(storage_root, "ckpts")) == ["step-1"]
    bucket, prefix = storage_root[len("s3://") :].split("/", 1)
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    client.put_object(Bucket=bucket, Key=f"{prefix}/ckpts/step-2/a.bin", Body=b"2")
    assert storage.list_dirs(join_uri(storage_root, "ckpts")) == ["step-1", "step-2"]
    assert storage.exists(join_uri(storage_root, "ckpts/step-2/a.bin"))
    assert storage.list_dirs(join_uri(storage_root, "ckpts/step-2")) == []  # fills s3fs's listing cache
    client.delete_object(Bucket=bucket, Key=f"{prefix}/ckpts/step-2/a.bin")
    assert not storage.exists(join_uri(storage_root, "ckpts/step-2/a.bin"))


def test_copy_dir_copies_every_file_and_the_named_one_last(storage_root, monkeypatch):
    src, dst = join_uri(storage_root, "a", "final"), join_uri(storage_root, "b", "final")
    for rel, data in {"manifest.json": b"{}", "model.safetensors": b"weights", "sub/tokenizer.json": b"tok"}.items():
        storage.write_bytes(join_uri(src, rel), data)
    order = []
    copy_file = storage.fs._copy_file
    monkeypatch.setattr(
        storage.fs,
        "_copy_file",
        lambda fs, source, target: (order.append(target.rsplit("/final/", 1)[1]), copy_file(fs, source, target)),
    )
    assert storage.copy_dir(src, dst, last="manifest.json") == 3
    assert order[-1] == "manifest.json"
    assert storage.list_files(dst) == storage.list_files(src)
    assert storage.read_bytes(join_uri(dst, "sub/tokenizer.json")) == b"tok"
    storage.write_bytes(join_uri(src, "model.safetensors"), b"new")  # a rewrite of the source is its own
    assert storage.read_bytes(join_uri(dst, "model.safetensors")) == b"weights"
    with pytest.raises(FileNotFoundError, match="no files under"):
        storage.copy_dir(join_uri(storage_root, "missing"), dst)
