"""Byte-level storage on any fsspec URI: local paths, ``file://``, ``s3://``, ``memory://``.

Every path here is a URI string (a ``pathlib.Path`` would mangle ``s3://``); join parts with
:func:`trainer_core.storage.layout.join_uri`. Operations that talk to storage retry transient failures
(connection refused or reset, timeouts, S3 5xx answers) with exponential backoff: up to
:data:`~trainer_core.storage.retry.RETRY_ATTEMPTS` attempts over about
:data:`~trainer_core.storage.retry.RETRY_MAX_DELAY_S` seconds (``trainer_core/storage/retry.py``,
which also names what an operation that gave up was doing, for the error). Missing files,
permission errors and other bad input fail at once.

S3 settings come from :func:`trainer_core.storage.s3.configure`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from trainer_core.errors import ResourceError
from trainer_core.storage.retry import retrying as _retrying


logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 * 1024 * 1024
"""Read size when streaming a file through a hash."""

CACHE_DIRNAME = "posttrain-cache"
"""Directory under ``tempfile.gettempdir()`` where :func:`materialize` keeps remote copies."""


@contextmanager
def _writing(uri: str) -> Iterator[None]:
    """Name ``uri`` when a write runs out of space (the OS's ``ENOSPC`` names no file)."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ResourceError(
                f"disk full (or quota exceeded) writing {uri}: free space there, or point storage.root (and "
                "TMPDIR for local staging) at a larger volume"
            ) from e
        raise


def names_a_path(source: str) -> bool:
    """Whether a model or data source names a location (a URI, or a local path: absolute, ``./``,
    ``../``, ``~``, or one that exists) rather than a hub id such as ``org/name``."""
    local = source.removeprefix("file://")
    return "://" in local or local.startswith(("/", "./", "../", "~")) or os.path.exists(local)


def url_to_fs(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem of ``uri`` and the path within it.

    Raises:
        ValueError: ``uri`` is empty or not a string.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"storage URI must be a non-empty string, got {uri!r}")
    return fsspec.core.url_to_fs(uri)


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def _invalidate(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Drop cached listings of ``path`` and its parents (s3fs caches directory listings)."""
    fs.invalidate_cache(path)


@_retrying
def write_bytes(uri: str, data: bytes) -> None:
    """Write ``data`` to ``uri``, replacing any file there.

    Local files are written to a temporary name and renamed, so a reader never sees half a
    file; object stores publish a whole object on upload.

    Raises:
        TypeError: ``data`` is not bytes-like.
        PermissionError: the target is not writable.
        ResourceError: the disk is full (the message names ``uri``).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"write_bytes({uri!r}) needs bytes, got {type(data).__name__}")
    fs, path = url_to_fs(uri)
    with _writing(uri):
        if _is_local(fs):
            parent = os.path.dirname(path)
            os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            return
        fs.pipe_file(path, bytes(data))
    _invalidate(fs, path)


@_retrying
def read_bytes(uri: str) -> bytes:
    """The whole content of the file at ``uri``.

    Raises:
        FileNotFoundError: no file at ``uri``.
    """
    fs, path = url_to_fs(uri)
    return fs.cat_file(path)


def write_json(uri: str, obj: Any) -> None:
    """Write ``obj`` as JSON (indent 2, sorted keys, UTF-8).

    Raises:
        TypeError: ``obj`` is not JSON-serialisable.
    """
    write_bytes(uri, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def read_json(uri: str) -> Any:
    """Parse the JSON file at ``uri``.

    Raises:
        FileNotFoundError: no file at ``uri``.
        ValueError: the file is not valid UTF-8 JSON (``json.JSONDecodeError``, ``UnicodeDecodeError``).
    """
    return json.loads(read_bytes(uri).decode("utf-8"))


@_retrying
def exists(uri: str) -> bool:
    """Whether a file or directory exists at ``uri`` (listing caches are bypassed)."""
    fs, path = url_to_fs(uri)
    _invalidate(fs, path)
    return bool(fs.exists(path))


@_retrying
def list_dirs(uri: str) -> list[str]:
    """Names (not paths) of the immediate child directories of ``uri``, sorted; [] if absent."""
    fs, path = url_to_fs(uri)
    _invalidate(fs, path)
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    base = path.rstrip("/")
    names = {
        e["name"].rstrip("/").rsplit("/", 1)[-1]
        for e in entries
        if e.get("type") == "directory" and e["name"].rstrip("/") != base
    }
    return sorted(names)


@_retrying
def _remove(uri: str, recursive: bool) -> bool:
    fs, path = url_to_fs(uri)
    _invalidate(fs, path)
    if not fs.exists(path):
        return False
    fs.rm(path, recursive=recursive)
    _invalidate(fs, path)
    return True


def remove(uri: str, recursive: bool = True) -> bool:
    """Delete the file or directory tree at ``uri``; best effort, never raises.

    Returns:
        True when something was removed; False when nothing was there, or on failure (then a
        warning names the URI and the error).
    """
    try:
        return _remove(uri, recursive)
    except Exception as e:  # noqa: BLE001 - best effort by contract
        logger.warning("could not remove %s: %s: %s", uri, type(e).__name__, e)
        return False


@_retrying
def upload_file_hashed(local_path: str, uri: str, chunk_bytes: int = CHUNK_BYTES) -> tuple[int, str]:
    """Stream the local file ``local_path`` to ``uri``, hashing the bytes as they are read.

    Returns:
        ``(size_bytes, sha256_hex)`` of the bytes written.

    Raises:
        FileNotFoundError: ``local_path`` does not exist.
        IsADirectoryError: ``local_path`` is a directory.
        ResourceError: the target's disk is full (the message names ``uri``).
    """
    if not os.path.exists(local_path):
        raise FileNotFoundError(f"upload: no local file {local_path}")
    if os.path.isdir(local_path):
        raise IsADirectoryError(f"upload: {local_path} is a directory")
    fs, path = url_to_fs(uri)
    if _is_local(fs):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with _writing(uri), open(local_path, "rb") as src, fs.open(path, "wb") as dst:
        while chunk := src.read(chunk_bytes):
            digest.update(chunk)
            size += len(chunk)
            dst.write(chunk)
    _invalidate(fs, path)
    return size, digest.hexdigest()


def upload_file(local_path: str, uri: str) -> None:
    """Copy the local file ``local_path`` to ``uri`` (streamed; parent directories created when local).

    Raises:
        FileNotFoundError: ``local_path`` does not exist.
        IsADirectoryError: ``local_path`` is a directory.
    """
    upload_file_hashed(local_path, uri)


@_retrying
def sha256_uri(uri: str, chunk_bytes: int = CHUNK_BYTES) -> str:
    """SHA-256 (hex) of the file at ``uri``, read in chunks (never whole into memory).

    Raises:
        FileNotFoundError: no file at ``uri``.
    """
    fs, path = url_to_fs(uri)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


@_retrying
def _download_file(fs: fsspec.AbstractFileSystem, path: str, local_path: str) -> None:
    os.makedirs(os.path.dirname(local_path), exist_ok=True)
    with _writing(local_path):
        fs.get_file(path, local_path)


def download_file(uri: str) -> str:
    """A local copy of the file ``uri``: ``<tempdir>/posttrain-cache/<sha256(uri)>-<name>``,
    downloaded when absent or of another size than the remote file (a local ``uri`` is returned
    as a path).

    Raises:
        FileNotFoundError: no file at ``uri``.
    """
    fs, path = url_to_fs(uri)
    if _is_local(fs):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"download_file: no file {uri}")
        return path
    name = os.path.basename(path.rstrip("/")) or "file"
    local = os.path.join(
        tempfile.gettempdir(), CACHE_DIRNAME, f"{hashlib.sha256(uri.encode('utf-8')).hexdigest()}-{name}"
    )
    size = fs.info(path).get("size")
    if not (os.path.isfile(local) and size is not None and os.path.getsize(local) == int(size)):
        _download_file(fs, path, local)
    return local


@_retrying
def list_files(uri: str) -> dict[str, int]:
    """Every file under the directory ``uri`` (recursively), from one listing (caches bypassed).

    Returns:
        POSIX path relative to ``uri`` -> size in bytes; {} when ``uri`` does not exist.
    """
    fs, path = url_to_fs(uri)
    base = path.rstrip("/")
    _invalidate(fs, base)
    try:
        found = fs.find(base, withdirs=False, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {
        name[len(base) :].lstrip("/"): int(info.get("size") or 0)
        for name, info in found.items()
        if name.rstrip("/") != base and info.get("type") != "directory"
    }


def download_dir(uri: str, local_dir: str) -> str:
    """Copy every file under the directory ``uri`` into ``local_dir``, keeping relative paths.

    Returns:
        ``local_dir``.

    Raises:
        FileNotFoundError: ``uri`` holds no files.
    """
    files = list_files(uri)
    if not files:
        raise FileNotFoundError(f"download_dir: no files under {uri}")
    fs, path = url_to_fs(uri)
    base = path.rstrip("/")
    os.makedirs(local_dir, exist_ok=True)
    for rel in sorted(files):
        _download_file(fs, f"{base}/{rel}", os.path.join(local_dir, *rel.split("/")))
    return local_dir


@_retrying
def _copy_file(fs: fsspec.AbstractFileSystem, source: str, target: str) -> None:
    """One file within one filesystem: a hard link where the disk allows (no bytes copied), else
    a copy (local), or the store's server-side copy (object storage)."""
    if _is_local(fs):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.tmp-{uuid.uuid4().hex}")
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
        os.replace(tmp, target)
        return
    with _writing(target):
        fs.copy(source, target)
    _invalidate(fs, target)


def copy_dir(uri: str, target_uri: str, last: str | None = None) -> int:
    """Copy every file under the directory ``uri`` to the same relative paths under
    ``target_uri`` (both on one filesystem); the file named ``last`` (relative) is copied after
    every other, so a reader that takes it as the sign of a complete directory (a committed
    ``manifest.json``) never sees a partial one.

    Returns:
        The number of files copied.

    Raises:
        FileNotFoundError: ``uri`` holds no files.
        ValueError: the two URIs are on different filesystems.
    """
    files = list_files(uri)
    if not files:
        raise FileNotFoundError(f"copy_dir: no files under {uri}")
    fs, path = url_to_fs(uri)
    target_fs, target = url_to_fs(target_uri)
    if type(fs) is not type(target_fs):
        raise ValueError(f"copy_dir: {uri} and {target_uri} are on different filesystems")
    for rel in sorted(files, key=lambda r: (r == last, r)):
        _copy_file(fs, f"{path.rstrip('/')}/{rel}", f"{target.rstrip('/')}/{rel}")
    return len(files)


def _read_local(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _install_cache(tmp_dir: str, cache_dir: str, remote_manifest: bytes | None) -> str:
    """Move a fresh download into place; keep a concurrent writer's identical copy if one won."""
    if os.path.exists(cache_dir):
        stale = f"{cache_dir}.stale-{uuid.uuid4().hex}"
        try:
            os.replace(cache_dir, stale)
            shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
    try:
        os.replace(tmp_dir, cache_dir)
    except OSError:
        cached = _read_local(os.path.join(cache_dir, "manifest.json"))
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if remote_manifest is None or cached != remote_manifest:
            raise
    return cache_dir


def materialize(uri: str) -> str:
    """A local directory holding the content of the directory ``uri`` (e.g. to load an HF model).

    A local path or ``file://`` URI is returned as a plain path. Anything else is downloaded to
    ``<tempdir>/posttrain-cache/<sha256(uri)>``; the copy is reused while its ``manifest.json``
    equals the remote one, and downloaded again otherwise (always, when ``uri`` has none).

    Raises:
        FileNotFoundError: ``uri`` does not exist (or holds no files).
        NotADirectoryError: a local ``uri`` is a file.
    """
    fs, path = url_to_fs(uri)
    if _is_local(fs):
        if not os.path.exists(path):
            raise FileNotFoundError(f"materialize: no directory {uri}")
        if not os.path.isdir(path):
            raise NotADirectoryError(f"materialize: {uri} is not a directory")
        return path
    cache_root = os.path.join(tempfile.gettempdir(), CACHE_DIRNAME)
    cache_dir = os.path.join(cache_root, hashlib.sha256(uri.encode("utf-8")).hexdigest())
    manifest_uri = uri.rstrip("/") + "/manifest.json"
    remote_manifest = read_bytes(manifest_uri) if exists(manifest_uri) else None
    if remote_manifest is not None and _read_local(os.path.join(cache_dir, "manifest.json")) == remote_manifest:
        logger.debug("materialize: cache hit for %s at %s", uri, cache_dir)
        return cache_dir
    os.makedirs(cache_root, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".download-", dir=cache_root)
    try:
        download_dir(uri, tmp_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("materialize: downloaded %s to %s", uri, cache_dir)
    return _install_cache(tmp_dir, cache_dir, remote_manifest)
