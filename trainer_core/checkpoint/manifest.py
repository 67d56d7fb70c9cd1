"""Artifact directories committed by a manifest written last.

Commit protocol: an :class:`ArtifactWriter` writes every file of a directory first, recording
each file's size and SHA-256 from the bytes it wrote, then writes ``manifest.json`` last. A
directory without a valid manifest does not exist: :func:`find_latest` skips it, and
:func:`purge_checkpoints` deletes it once a newer checkpoint is committed.

Checkpoint layout under a stage's ``checkpoints/``: ``step-{global_step:08d}[-{attempt}]/``
(:func:`step_dirname`): a stage attempt writes its own directories, never another attempt's.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import subprocess
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainer_core import storage
from trainer_core.errors import PosttrainError
from trainer_core.storage import join_uri

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
"""The commit marker, written last in an artifact directory."""

SCHEMA_VERSION = 1
"""The manifest schema this code writes and reads."""

STEP_DIGITS = 8
"""Zero-padded width of the global step in a checkpoint directory name."""


class ManifestError(PosttrainError, ValueError):
    """A manifest is unreadable, invalid, or does not match the files next to it."""


_DRIVE = re.compile(r"^[A-Za-z]:")


def check_relpath(path: str) -> str:
    """Validate a relative POSIX path inside an artifact directory and return it.

    Raises:
        ValueError: ``path`` is empty, absolute, has a drive letter or backslash, or has an
            empty, ``.`` or ``..`` component.
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"file path must be a non-empty string, got {path!r}")
    if "\\" in path:
        raise ValueError(f"file path {path!r} contains a backslash; use '/'")
    if path.startswith("/") or _DRIVE.match(path):
        raise ValueError(f"file path {path!r} is absolute; it must be relative to the artifact directory")
    bad = [part for part in path.split("/") if part in ("", ".", "..")]
    if bad:
        raise ValueError(f"file path {path!r} has an empty, '.' or '..' component")
    return path


class FileEntry(BaseModel):
    """One file of an artifact directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="POSIX path relative to the artifact directory.")
    size_bytes: int = Field(ge=0, description="File size in bytes.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the content, lowercase hex.")

    @field_validator("path")
    @classmethod
    def _safe_path(cls, value: str) -> str:
        return check_relpath(value)


@functools.lru_cache(maxsize=1)
def get_code_version() -> str:
    """The posttrain package version, plus ``+g<git short sha>`` when run from a git checkout.

    Computed once per process; never raises (``"unknown"`` parts stand in for what cannot be read).
    """
    try:
        version = importlib.metadata.version("posttrain")
    except Exception:  # noqa: BLE001 - must never fail
        version = "unknown"
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=2,
            check=False,
        )
        sha = out.stdout.strip() if out.returncode == 0 else ""
    except Exception:  # noqa: BLE001 - git missing, timeout: no sha
        sha = ""
    return f"{version}+g{sha}" if sha else version


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


class Manifest(BaseModel):
    """The commit record of an artifact directory (a step checkpoint or a stage's final output)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = Field(SCHEMA_VERSION, description="Manifest schema version.")
    kind: Literal["checkpoint", "final"] = Field(description="A resumable step checkpoint or a stage result.")
    stage: str = Field(description="The stage that wrote the directory.")
    run_id: str = Field(description="Pipeline run id.")
    global_step: int = Field(0, ge=0, description="Optimizer steps taken when written.")
    consumed_samples: int = Field(0, ge=0, description="Training examples consumed (all ranks).")
    consumed_tokens: int = Field(0, ge=0, description="Training tokens consumed (all ranks).")
    world_size: int = Field(1, ge=1, description="Processes that trained.")
    backend: str = Field("single", description="Training backend name.")
    config_hash: str = Field("", description="config.config_hash of the stage config.")
    code_version: str = Field(default_factory=get_code_version, description="Package version + git sha.")
    created_at: datetime = Field(default_factory=_utc_now, description="Commit time (UTC).")
    files: list[FileEntry] = Field(description="Every file of the directory except the manifest.")
    metrics: dict[str, float] = Field(default_factory=dict, description="Metrics at commit time.")
    extra: dict[str, Any] = Field(default_factory=dict, description="E.g. mlflow_run_id, input manifests.")

    @field_validator("schema_version")
    @classmethod
    def _known_schema(cls, value: int) -> int:
        if value != SCHEMA_VERSION:
            raise ValueError(f"unsupported manifest schema_version {value}; this code reads {SCHEMA_VERSION}")
        return value

    @field_validator("created_at")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)

    @field_validator("files")
    @classmethod
    def _unique_files(cls, value: list[FileEntry]) -> list[FileEntry]:
        paths = [f.path for f in value]
        dupes = sorted({p for p in paths if paths.count(p) > 1})
        if dupes:
            raise ValueError(f"duplicate file paths {dupes}")
        if MANIFEST_NAME in paths:
            raise ValueError(f"'{MANIFEST_NAME}' is reserved and cannot be a listed file")
        return value


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(local_path: str, chunk_bytes: int = storage.CHUNK_BYTES) -> str:
    """SHA-256 (lowercase hex) of a local file, read in chunks.

    Raises:
        FileNotFoundError: ``local_path`` does not exist.
    """
    digest = hashlib.sha256()
    with open(local_path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


class ArtifactWriter:
    """Write the files of one artifact directory, then commit it with a manifest.

    Opening a writer clears the target: an uncommitted directory's leftovers are removed (they
    are garbage by the protocol), and with ``overwrite=True`` a committed directory is first
    uncommitted (its manifest deleted) and then removed.

    Args:
        uri: the target directory URI.
        overwrite: replace a committed directory instead of failing.

    Raises:
        FileExistsError: ``uri`` already holds a manifest and ``overwrite`` is False.
        OSError: the old manifest could not be removed.
    """

    def __init__(self, uri: str, *, overwrite: bool = False) -> None:
        self.uri = uri.rstrip("/")
        self._manifest_uri = join_uri(self.uri, MANIFEST_NAME)
        self._entries: dict[str, FileEntry] = {}
        self._manifest: Manifest | None = None
        if storage.exists(self._manifest_uri):
            if not overwrite:
                raise FileExistsError(f"{self.uri} is already committed (has {MANIFEST_NAME}); pass overwrite=True")
            if not storage.remove(self._manifest_uri, recursive=False) and storage.exists(self._manifest_uri):
                raise OSError(f"could not remove {self._manifest_uri} before overwriting")
        if storage.exists(self.uri):
            logger.info("clearing uncommitted contents of %s before writing", self.uri)
            storage.remove(self.uri)

    @property
    def entries(self) -> list[FileEntry]:
        """The files written so far, sorted by path."""
        return sorted(self._entries.values(), key=lambda e: e.path)

    def _target(self, relpath: str) -> str:
        if self._manifest is not None:
            raise RuntimeError(f"{self.uri} is already committed; no more writes")
        check_relpath(relpath)
        if relpath == MANIFEST_NAME:
            raise ValueError(f"'{MANIFEST_NAME}' is written by commit(), not by write_*")
        return join_uri(self.uri, relpath)

    def add_entry(self, entry: FileEntry) -> None:
        """Record a file another process (another rank) wrote under this directory.

        Raises:
            ValueError: unsafe path, or the reserved manifest name.
            RuntimeError: the writer has committed.
        """
        self._target(entry.path)
        self._entries[entry.path] = entry

    def write_bytes(self, relpath: str, data: bytes) -> FileEntry:
        """Write ``data`` to ``<uri>/<relpath>`` and record its entry.

        Raises:
            ValueError: unsafe ``relpath`` or the reserved manifest name.
            RuntimeError: the writer has committed.
        """
        target = self._target(relpath)
        storage.write_bytes(target, data)
        entry = FileEntry(path=relpath, size_bytes=len(data), sha256=_sha256_bytes(bytes(data)))
        self._entries[relpath] = entry
        return entry

    def write_json(self, relpath: str, obj: Any) -> FileEntry:
        """Write ``obj`` as JSON (indent 2, sorted keys) to ``<uri>/<relpath>``.

        Raises:
            TypeError: ``obj`` is not JSON-serialisable.
            ValueError: unsafe ``relpath``.
            RuntimeError: the writer has committed.
        """
        return self.write_bytes(relpath, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))

    def write_file(self, relpath: str, local_path: str) -> FileEntry:
        """Stream the local file ``local_path`` to ``<uri>/<relpath>``, hashing as it is read.

        Raises:
            FileNotFoundError: ``local_path`` does not exist.
            ValueError: unsafe ``relpath``.
            RuntimeError: the writer has committed.
        """
        target = self._target(relpath)
        size, sha = storage.upload_file_hashed(local_path, target)
        entry = FileEntry(path=relpath, size_bytes=size, sha256=sha)
        self._entries[relpath] = entry
        return entry

    def write_dir(self, local_dir: str, prefix: str = "") -> list[FileEntry]:
        """Write every file under ``local_dir`` (recursively) to ``<uri>/<prefix>/<relative path>``.

        Returns:
            The entries written, in path order.

        Raises:
            NotADirectoryError: ``local_dir`` is not a directory.
            ValueError: unsafe ``prefix``.
        """
        if not os.path.isdir(local_dir):
            raise NotADirectoryError(f"write_dir: {local_dir} is not a directory")
        if prefix:
            check_relpath(prefix.strip("/"))
        written = []
        for root, dirs, files in os.walk(local_dir):
            dirs.sort()
            for name in sorted(files):
                rel = os.path.relpath(os.path.join(root, name), local_dir).replace(os.sep, "/")
                relpath = f"{prefix.strip('/')}/{rel}" if prefix else rel
                written.append(self.write_file(relpath, os.path.join(root, name)))
        return written

    def commit(self, **manifest_fields: Any) -> Manifest:
        """Write ``manifest.json`` (last) and return the manifest.

        Args:
            **manifest_fields: :class:`Manifest` fields except ``files`` (``kind``, ``stage`` and
                ``run_id`` are required).

        Raises:
            TypeError: ``files`` is passed.
            pydantic.ValidationError: a missing, unknown or invalid field (nothing is written).
            RuntimeError: already committed.
        """
        if self._manifest is not None:
            raise RuntimeError(f"{self.uri} is already committed")
        if "files" in manifest_fields:
            raise TypeError("commit() records the written files itself; do not pass files=")
        manifest = Manifest(files=self.entries, **manifest_fields)
        storage.write_bytes(self._manifest_uri, manifest.model_dump_json(indent=2).encode("utf-8"))
        self._manifest = manifest
        return manifest


def read_manifest(dir_uri: str) -> Manifest:
    """Read and validate ``<dir_uri>/manifest.json``.

    Raises:
        FileNotFoundError: no manifest (the directory is absent or uncommitted).
        ManifestError: not JSON, an unknown schema version, a bad field or an unsafe path.
    """
    uri = join_uri(dir_uri, MANIFEST_NAME)
    raw = storage.read_bytes(uri)
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as e:
        details = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in e.errors())
        raise ManifestError(f"invalid manifest {uri}: {details}") from None


def verify(dir_uri: str, manifest: Manifest | None = None, *, hashes: bool = True) -> list[str]:
    """Check the files of ``dir_uri`` against its manifest.

    Sizes are checked first from one listing (cheap); then, when ``hashes`` is set, the
    SHA-256 of every file whose size matched is computed by streaming it.

    Args:
        dir_uri: the artifact directory.
        manifest: its manifest, if already read (default: read it).
        hashes: also compare content hashes (False: sizes only).

    Returns:
        One line per problem (missing file, size mismatch, sha256 mismatch); [] when all match.

    Raises:
        FileNotFoundError: no manifest and none given.
        ManifestError: the manifest is invalid.
    """
    if manifest is None:
        manifest = read_manifest(dir_uri)
    sizes = storage.list_files(dir_uri)
    problems: list[str] = []
    to_hash: list[FileEntry] = []
    for entry in manifest.files:
        found = sizes.get(entry.path)
        if found is None:
            problems.append(f"missing file {entry.path}")
        elif found != entry.size_bytes:
            problems.append(f"size mismatch {entry.path}: manifest {entry.size_bytes} bytes, found {found}")
        else:
            to_hash.append(entry)
    for entry in to_hash if hashes else []:
        actual = storage.sha256_uri(join_uri(dir_uri, entry.path))
        if actual != entry.sha256:
            problems.append(f"sha256 mismatch {entry.path}: manifest {entry.sha256[:12]}..., found {actual[:12]}...")
    return problems


def load_verified(dir_uri: str) -> Manifest:
    """Read the manifest of ``dir_uri`` and check every file's size and hash.

    Raises:
        FileNotFoundError: no manifest (absent or uncommitted directory).
        ManifestError: the manifest is invalid, or files are missing or differ (all named).
    """
    manifest = read_manifest(dir_uri)
    problems = verify(dir_uri, manifest)
    if problems:
        raise ManifestError(f"{dir_uri} failed verification: " + "; ".join(problems))
    return manifest


def step_dirname(step: int, prefix: str = "step-", attempt: str | None = None) -> str:
    """``step-00000042`` for step 42 (``step-00000042-<attempt>`` for an attempt's): a checkpoint's directory name.

    Raises:
        ValueError: ``step`` is negative or not an int; ``attempt`` is not lowercase letters and
            digits.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"global step must be a non-negative int, got {step!r}")
    if attempt is not None and not re.fullmatch(r"[0-9a-z]+", attempt):
        raise ValueError(f"attempt must be lowercase letters and digits, got {attempt!r}")
    return f"{prefix}{step:0{STEP_DIGITS}d}" + (f"-{attempt}" if attempt else "")


def parse_step_dirname(name: str, prefix: str = "step-") -> tuple[int, str | None] | None:
    """``(global step, attempt or None)`` of a checkpoint directory name, or None for another name."""
    m = re.fullmatch(re.escape(prefix) + r"(\d{%d,})(?:-([0-9a-z]+))?" % STEP_DIGITS, name)
    return (int(m.group(1)), m.group(2)) if m else None


def _steps(checkpoints_uri: str, prefix: str) -> list[tuple[int, str]]:
    """``(step, dir name)`` of each child named ``<prefix><8+ digits>[-<attempt>]``, newest first."""
    parsed = [(parse_step_dirname(name, prefix), name) for name in storage.list_dirs(checkpoints_uri)]
    return sorted(((p[0], name) for p, name in parsed if p is not None), reverse=True)


def _checkpoint_problem(dir_uri: str, step: int, hashes: bool) -> tuple[Manifest | None, str]:
    """The manifest of a valid checkpoint dir, or None and why it is not valid."""
    try:
        manifest = read_manifest(dir_uri)
    except FileNotFoundError:
        return None, f"no {MANIFEST_NAME} (incomplete write)"
    except ManifestError as e:
        return None, str(e)
    if manifest.global_step != step:
        return None, f"manifest global_step {manifest.global_step} does not match the directory name"
    problems = verify(dir_uri, manifest, hashes=hashes)
    if problems:
        return None, "; ".join(problems)
    return manifest, ""


def find_latest(checkpoints_uri: str, prefix: str = "step-") -> tuple[str, Manifest] | None:
    """The newest checkpoint under ``checkpoints_uri`` whose manifest reads and verifies.

    Directories are tried by step, newest first; each one skipped is logged as a warning
    saying why (no manifest, bad size or hash, invalid manifest).

    Returns:
        ``(dir_uri, manifest)``, or None when no checkpoint is valid (or the directory is absent).

    Raises:
        OSError: storage keeps failing (transient errors are retried first); never guessed past.
    """
    for step, name in _steps(checkpoints_uri, prefix):
        dir_uri = join_uri(checkpoints_uri, name)
        manifest, why = _checkpoint_problem(dir_uri, step, hashes=True)
        if manifest is not None:
            return dir_uri, manifest
        logger.warning("skipping checkpoint %s: %s", dir_uri, why)
    return None


def _uncommit_and_remove(dir_uri: str) -> bool:
    """Delete the manifest first (a half-deleted dir is then uncommitted), then the dir."""
    manifest_uri = join_uri(dir_uri, MANIFEST_NAME)
    if storage.exists(manifest_uri) and not storage.remove(manifest_uri, recursive=False):
        return False
    return storage.remove(dir_uri)


def purge_checkpoints(checkpoints_uri: str, keep_last: int, keep: set[str] | None = None) -> list[str]:
    """Delete old checkpoints; best effort (failures are logged, the rest goes on).

    Committed directories beyond the newest ``keep_last`` are deleted, except those in ``keep``
    and the newest valid one. Uncommitted (manifest-less) directories older than the newest
    committed one are deleted too; newer ones may be writes in progress and are left alone.
    "Valid" here is the cheap check: the manifest reads and every file has its size (no hashing).
    The caller holds the stage's lease: another attempt's older uncommitted directory is that of
    an attempt stopped, or fenced before its manifest (``checkpoint/lease.py``); a file it was
    still writing may reappear there, garbage for a later purge, never a checkpoint.

    Args:
        checkpoints_uri: directory of ``step-XXXXXXXX`` checkpoints.
        keep_last: committed checkpoints kept, newest first.
        keep: directory names or full URIs never deleted.

    Returns:
        URIs removed.

    Raises:
        ValueError: ``keep_last`` is negative.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
        raise ValueError(f"keep_last must be a non-negative int, got {keep_last!r}")
    protected = {k.rstrip("/") for k in (keep or set())}
    steps = _steps(checkpoints_uri, "step-")
    committed = [(s, n) for s, n in steps if storage.exists(join_uri(checkpoints_uri, n, MANIFEST_NAME))]
    retained = {n for _, n in committed[:keep_last]}
    for step, name in committed:
        if _checkpoint_problem(join_uri(checkpoints_uri, name), step, hashes=False)[0] is not None:
            retained.add(name)
            break
    newest_committed = committed[0][0] if committed else None
    committed_names = {n for _, n in committed}
    removed = []
    for step, name in steps:
        uri = join_uri(checkpoints_uri, name)
        if name in retained or name in protected or uri in protected:
            continue
        if name in committed_names:
            ok = _uncommit_and_remove(uri)
        elif newest_committed is not None and step < newest_committed:
            ok = storage.remove(uri)
        else:
            continue
        if ok:
            removed.append(uri)
    if removed:
        logger.info("purged %d checkpoint dir(s) under %s", len(removed), checkpoints_uri)
    return removed
