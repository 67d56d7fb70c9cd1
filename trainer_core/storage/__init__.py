"""The bottom floor: byte-level I/O on any fsspec URI, and where a run keeps its files.

- :mod:`~trainer_core.storage.fs`: read, write, list, remove, upload and hash files on local
  paths, ``s3://`` and ``memory://`` URIs, retrying transient failures.
- :mod:`~trainer_core.storage.retry`: that retry policy, and what an operation that gave up was
  doing (the URI and the S3 endpoint, for the error that names them).
- :mod:`~trainer_core.storage.s3`: the process's S3 settings (:func:`configure`) and the
  environment that hands them to a child process (:func:`process_env`).
- :mod:`~trainer_core.storage.layout`: :func:`join_uri`, :class:`RunLayout` and
  :class:`StageLayout` (the names of a run's files; no I/O).

Nothing here imports the config, torch or any other part of ``trainer_core``: every other
floor (checkpoints, data, stages, the tasks) stands on it. ``from trainer_core import storage``
then ``storage.read_json(uri)`` is the usual way in.
"""

from trainer_core.storage.fs import (
    CACHE_DIRNAME,
    CHUNK_BYTES,
    copy_dir,
    download_dir,
    download_file,
    exists,
    list_dirs,
    list_files,
    materialize,
    names_a_path,
    read_bytes,
    read_json,
    remove,
    sha256_uri,
    upload_file,
    upload_file_hashed,
    url_to_fs,
    write_bytes,
    write_json,
)
from trainer_core.storage.layout import RunLayout, StageLayout, join_uri
from trainer_core.storage.retry import RETRY_ATTEMPTS, RETRY_MAX_DELAY_S, is_transient
from trainer_core.storage.s3 import S3Settings, configure, process_env

__all__ = [
    "CACHE_DIRNAME",
    "CHUNK_BYTES",
    "RETRY_ATTEMPTS",
    "RETRY_MAX_DELAY_S",
    "RunLayout",
    "S3Settings",
    "StageLayout",
    "configure",
    "copy_dir",
    "download_dir",
    "download_file",
    "exists",
    "is_transient",
    "join_uri",
    "list_dirs",
    "list_files",
    "materialize",
    "names_a_path",
    "process_env",
    "read_bytes",
    "read_json",
    "remove",
    "sha256_uri",
    "upload_file",
    "upload_file_hashed",
    "url_to_fs",
    "write_bytes",
    "write_json",
]
