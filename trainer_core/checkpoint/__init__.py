"""Committed artifact directories (the manifest protocol), step checkpoints and the writer lease.

Storage I/O itself is the floor below (:mod:`trainer_core.storage`); this package adds what
makes a directory trustworthy: files first, ``manifest.json`` (sizes and SHA-256) last.
"""

from trainer_core.checkpoint.manifest import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    ArtifactWriter,
    FileEntry,
    Manifest,
    ManifestError,
    check_relpath,
    find_latest,
    get_code_version,
    load_verified,
    purge_checkpoints,
    read_manifest,
    sha256_file,
    step_dirname,
    verify,
)

__all__ = [
    "MANIFEST_NAME",
    "SCHEMA_VERSION",
    "ArtifactWriter",
    "FileEntry",
    "Manifest",
    "ManifestError",
    "check_relpath",
    "find_latest",
    "get_code_version",
    "load_verified",
    "purge_checkpoints",
    "read_manifest",
    "sha256_file",
    "step_dirname",
    "verify",
]
