"""Checkpoints written by several ranks: state components with a sharing pattern.

Every piece of trainer state in a checkpoint is a component with one of three patterns
(after torchtitan's and DCP's planners; the seed document on distributed checkpoints):

- ``GLOBAL``: one logical copy, meaningful on rank 0 only (progress counters, metrics);
  rank 0 writes it.
- ``PER_RANK``: one per rank (RNG states, DeepSpeed ZeRO partitions, DCP shards); each rank
  writes its own, under ``rank-XXXXX/`` unless the writer names it (DCP, DeepSpeed).
- ``REPLICATED``: identical on every rank (DDP weights and optimizer state, the LR
  scheduler); written once, by rank 0. With validation on, every rank first hashes its copy
  and the hashes are compared: a replica that drifted (a bug, a missed all-reduce, bad
  hardware) fails the save with :class:`ReplicaMismatchError` instead of being checkpointed.

Commit protocol, unchanged from one process: rank 0 clears the target directory, a barrier
lets every rank write its files, each rank reports the size and SHA-256 of what it wrote,
and rank 0 writes ``manifest.json`` last, listing all of them. A crash of any rank before
that leaves a directory without a manifest, which readers ignore.
"""

from __future__ import annotations

import enum
import hashlib
import io
from typing import Any

import torch

from trainer_core import storage
from trainer_core.checkpoint.manifest import ArtifactWriter, FileEntry, Manifest
from trainer_core.storage import join_uri


class Sharing(str, enum.Enum):
    """How a state component is shared across ranks (see the module docstring)."""

    GLOBAL = "global"
    PER_RANK = "per_rank"
    REPLICATED = "replicated"


class ReplicaMismatchError(RuntimeError):
    """A REPLICATED component differs between ranks: the replicas have desynchronised.

    Attributes:
        component: the component's file name.
        checksums: each rank's checksum, in rank order.
    """

    def __init__(self, component: str, checksums: list[str]) -> None:
        reference = checksums[0]
        bad = [r for r, c in enumerate(checksums) if c != reference]
        super().__init__(
            f"replicated state {component!r} differs across ranks: rank(s) {bad} disagree with rank 0 "
            f"(sha256 {', '.join(f'rank {r}: {c[:12]}' for r, c in enumerate(checksums))}); "
            "the checkpoint is not written"
        )
        self.component = component
        self.checksums = checksums


def torch_bytes(obj: Any) -> bytes:
    """``torch.save`` of ``obj`` to bytes (a state component's serialised form)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def per_rank_path(name: str, rank: int) -> str:
    """Relative path of rank ``rank``'s copy of PER_RANK component ``name``."""
    return f"rank-{rank:05d}/{name}"


def state_checksum(obj: Any) -> str:
    """SHA-256 of a nested state (dicts, lists, tensors, numbers, strings), independent of pickling.

    Tensors contribute their dtype, shape and raw bytes (DTensors their local shard); dict
    keys are visited in sorted order. Two bit-identical states hash equal on any rank.
    """
    h = hashlib.sha256()

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.to_local() if hasattr(x, "to_local") else x
            t = t.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(x.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                visit(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for v in x:
                visit(v)
            h.update(b"]")
        else:
            h.update(repr(x).encode())

    visit(obj)
    return h.hexdigest()


class RankWriter:
    """One rank's side of writing a checkpoint directory; collective (every rank constructs it).

    Args:
        uri: the checkpoint directory (``.../step-XXXXXXXX``).
        backend: the running backend (rank, world size, collectives).
        validate_replicas: compare REPLICATED components' checksums across ranks before writing.

    Every rank must call :meth:`put` for the same components in the same order, then
    :meth:`commit`.
    """

    def __init__(self, uri: str, backend: Any, *, validate_replicas: bool = True) -> None:
        self.uri = uri.rstrip("/")
        self.backend = backend
        self.rank = backend.rank
        self.validate = validate_replicas and backend.world_size > 1
        self._entries: list[FileEntry] = []
        self._writer = ArtifactWriter(self.uri, overwrite=True) if self.rank == 0 else None
        backend.barrier()  # the directory is cleared before any rank writes into it

    def write_bytes(self, relpath: str, data: bytes) -> None:
        """Write a file of this rank's."""
        storage.write_bytes(join_uri(self.uri, relpath), data)
        self._entries.append(FileEntry(path=relpath, size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))

    def write_file(self, relpath: str, local_path: str) -> None:
        """Upload a local file of this rank's (hashed as it is read)."""
        size, sha = storage.upload_file_hashed(local_path, join_uri(self.uri, relpath))
        self._entries.append(FileEntry(path=relpath, size_bytes=size, sha256=sha))

    def record(self, relpath: str) -> None:
        """Record a file this rank already wrote under the directory by other means (DCP)."""
        target = join_uri(self.uri, relpath)
        size = storage.list_files(self.uri).get(relpath)
        if size is None:
            raise FileNotFoundError(f"{target}: expected this rank to have written it")
        self._entries.append(FileEntry(path=relpath, size_bytes=size, sha256=storage.sha256_uri(target)))

    def put(self, name: str, sharing: Sharing, data: bytes, checksum: str | None = None) -> None:
        """Write one component according to its sharing pattern.

        Args:
            name: the component's file name (relative path).
            sharing: its pattern.
            data: this rank's serialised copy.
            checksum: for REPLICATED, :func:`state_checksum` of the live state (default:
                SHA-256 of ``data``, which assumes deterministic serialisation).

        Raises:
            ReplicaMismatchError: a REPLICATED component differs across ranks (raised on
                every rank, so none waits for the others).
        """
        if sharing is Sharing.PER_RANK:
            self.write_bytes(per_rank_path(name, self.rank), data)
            return
        if sharing is Sharing.REPLICATED and self.validate:
            mine = checksum or hashlib.sha256(data).hexdigest()
            checksums = self.backend.all_gather_object(mine)
            if len(set(checksums)) != 1:
                raise ReplicaMismatchError(name, checksums)
        if self.rank == 0:
            self.write_bytes(name, data)

    def commit(self, **manifest_fields: Any) -> Manifest:
        """Gather every rank's file entries; rank 0 writes the manifest last. Returns it on every rank."""
        gathered = self.backend.all_gather_object([e.model_dump(mode="json") for e in self._entries])
        manifest = None
        if self._writer is not None:
            for entries in gathered:
                for e in entries:
                    self._writer.add_entry(FileEntry.model_validate(e))
            manifest = self._writer.commit(**manifest_fields)
        data = self.backend.broadcast_object(manifest.model_dump(mode="json") if manifest is not None else None)
        return Manifest.model_validate(data)


class StagedWriter:
    """Records :meth:`RankWriter.put` calls in host memory, to be written later.

    What an asynchronous save uses on one process: the state is serialised now (the bytes no
    longer depend on the live model), and :meth:`replay` writes it through a
    :class:`RankWriter` in the background. Only ``put`` is offered: formats that write files
    themselves (DCP, DeepSpeed) are collectives and are saved in step.
    """

    validate = False
    """Never compares replicas: a staged save runs on a single process."""

    def __init__(self) -> None:
        self._puts: list[tuple[str, Sharing, bytes, str | None]] = []

    def put(self, name: str, sharing: Sharing, data: bytes, checksum: str | None = None) -> None:
        """Keep one component's bytes (see :meth:`RankWriter.put`)."""
        self._puts.append((name, sharing, bytes(data), checksum))

    def replay(self, out: RankWriter) -> None:
        """Write every kept component through ``out``, in the order they were put."""
        for name, sharing, data, checksum in self._puts:
            out.put(name, sharing, data, checksum)
