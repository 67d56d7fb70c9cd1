"""Save and restore a training stage's whole state for exact resume.

A checkpoint directory ``step-XXXXXXXX/`` holds::

    model.safetensors    weights (shared tensors stored once per name)
    optimizer.pt         optimizer state dict
    scheduler.pt         LR scheduler state dict
    rng.pt               torch CPU (and CUDA) generator states
    trainer_state.json   global step, data position, counters, python/numpy RNG
    manifest.json        written last: the commit marker (see manifest.py)

Resuming restores all of it, so the run continues with the same batches, the same random
numbers and the same optimizer moments as one never interrupted.
"""

from __future__ import annotations

import io
import json
import logging
import random
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch import nn

from trainer_core.checkpoint.manifest import ArtifactWriter, Manifest
from trainer_core.checkpoint.storage import read_bytes
from trainer_core.spec import join_uri

log = logging.getLogger(__name__)


@dataclass
class TrainProgress:
    """Counters that advance with training; saved in ``trainer_state.json``.

    Attributes:
        global_step: optimizer steps taken.
        epoch: data epoch of the next micro-batch.
        batch_index: index within the epoch of the next micro-batch.
        consumed_samples: examples (or pairs) consumed.
        consumed_tokens: non-padding tokens consumed.
        best_eval_loss: lowest eval loss seen (None before the first eval).
        evals_without_improvement: evaluations since the best one (early stopping).
        best_checkpoint: directory name of the checkpoint kept as the best one.
        best_checkpoint_metric: its value of ``keep_best_metric``.
        history: first and latest values of logged metrics, for the stage summary.
    """

    global_step: int = 0
    epoch: int = 0
    batch_index: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    best_eval_loss: float | None = None
    evals_without_improvement: int = 0
    best_checkpoint: str | None = None
    best_checkpoint_metric: float | None = None
    history: dict[str, Any] = field(default_factory=dict)


def _rng_states() -> tuple[dict, bytes]:
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    host = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    buf = io.BytesIO()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    torch.save({"torch": torch.get_rng_state(), "cuda": cuda}, buf)
    return host, buf.getvalue()


def _set_rng_states(host: dict, torch_blob: bytes) -> None:
    version, state, gauss = host["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = host["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    states = torch.load(io.BytesIO(torch_blob), weights_only=True)
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def snapshot_train_state(
    *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, progress: TrainProgress
) -> dict[str, bytes]:
    """Serialise the whole training state to bytes in host memory, synchronously.

    What is returned no longer depends on the live objects, so training may go on while it
    is uploaded (see :class:`CheckpointSaver`).

    Returns:
        Relative file name -> bytes, the files of a checkpoint directory (no manifest).
    """
    weights = {k: v.detach().to("cpu").clone().contiguous() for k, v in model.state_dict().items()}
    host_rng, torch_rng = _rng_states()
    state = {"progress": asdict(progress), "rng": host_rng}
    return {
        "model.safetensors": safetensors.torch.save(weights),
        "optimizer.pt": _torch_bytes(optimizer.state_dict()),
        "scheduler.pt": _torch_bytes(scheduler.state_dict()),
        "rng.pt": torch_rng,
        "trainer_state.json": json.dumps(state).encode(),
    }


def write_checkpoint(uri: str, files: dict[str, bytes], progress: TrainProgress, manifest_fields: dict) -> Manifest:
    """Write a snapshot's files to ``uri`` and commit them with a manifest written last."""
    writer = ArtifactWriter(uri, overwrite=True)
    for name, data in files.items():
        writer.write_bytes(name, data)
    return writer.commit(
        kind="checkpoint",
        global_step=progress.global_step,
        consumed_samples=progress.consumed_samples,
        consumed_tokens=progress.consumed_tokens,
        **manifest_fields,
    )


def save_train_state(
    uri: str,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    progress: TrainProgress,
    manifest_fields: dict[str, Any],
) -> Manifest:
    """Write a complete checkpoint to ``uri`` and commit it with its manifest (written last).

    Args:
        uri: the ``step-XXXXXXXX`` directory URI.
        model: the plain (unwrapped) model.
        optimizer: its optimizer.
        scheduler: its LR scheduler (anything with ``state_dict()``).
        progress: counters and data position.
        manifest_fields: ``stage``, ``run_id``, ``config_hash``, ``backend``, ``extra`` ...

    Returns:
        The committed manifest.
    """
    files = snapshot_train_state(model=model, optimizer=optimizer, scheduler=scheduler, progress=progress)
    return write_checkpoint(uri, files, progress, manifest_fields)


METRICS_FILE = "metrics.json"
"""In a checkpoint: the ``[[metrics, step], ...]`` logged since the previous checkpoint."""


def checkpoint_metrics(uri: str, manifest: Manifest) -> list[tuple[dict[str, float], int]]:
    """The ``(metrics, step)`` pairs a committed checkpoint covers ([] if it stores none)."""
    if not any(f.path == METRICS_FILE for f in manifest.files):
        return []
    return [(metrics, int(step)) for metrics, step in json.loads(read_bytes(join_uri(uri, METRICS_FILE)))]


class CheckpointSaver:
    """Writes checkpoints, optionally in a background thread, with at most one save in flight.

    ``submit`` snapshots nothing itself: callers pass bytes from :func:`snapshot_train_state`,
    so the step loop is blocked only for the in-memory copy. A failed background save is
    raised by the next ``submit`` or ``wait`` (the stage then fails and is retried).

    Args:
        asynchronous: False writes in the caller's thread (the reference behaviour).
    """

    def __init__(self, asynchronous: bool = True) -> None:
        self.asynchronous = asynchronous
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt") if asynchronous else None
        self._pending: Future | None = None

    def submit(self, job: Callable[[], Any]) -> None:
        """Run ``job`` (write + commit + follow-ups) after the previous save has finished."""
        self.wait()
        if self._pool is None:
            job()
        else:
            self._pending = self._pool.submit(job)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the last save, then stop the thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)


def load_train_state(
    uri: str, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> TrainProgress:
    """Restore a checkpoint written by :func:`save_train_state` into live objects (one process).

    The caller has already verified the manifest (``find_latest`` does). Weights load with
    ``strict=True``. This is :func:`load_checkpoint_state` on the single-device backend.

    Raises:
        RuntimeError: the weights do not fit the model (from ``load_state_dict``).
    """
    from trainer_core.backends.single import SingleDeviceBackend
    from trainer_core.checkpoint.manifest import read_manifest

    backend = SingleDeviceBackend(next(model.parameters()).device.type)
    return load_checkpoint_state(
        uri, read_manifest(uri), backend=backend, model=model, optimizer=optimizer, scheduler=scheduler
    )


def checkpoint_format_of(manifest: Manifest) -> str:
    """The checkpoint format a manifest records (``full`` for checkpoints that predate the field)."""
    return str((manifest.extra or {}).get("checkpoint_format", "full"))


def resume_problem(manifest: Manifest, backend: Any, config_hash: str | None) -> str | None:
    """Why a checkpoint cannot be resumed by ``backend`` (None when it can).

    A checkpoint written under another config, in another backend's format, or by DeepSpeed
    at another world size (ZeRO partitions do not reshard) is not resumed from.
    """
    if manifest.config_hash != config_hash:
        return f"written with another config ({manifest.config_hash})"
    fmt = checkpoint_format_of(manifest)
    if fmt != backend.checkpoint_format:
        return f"format {fmt!r} (backend {manifest.backend}); backend {backend.name} reads {backend.checkpoint_format!r}"
    if fmt == "deepspeed" and manifest.world_size != backend.world_size:
        return f"DeepSpeed ZeRO partitions of {manifest.world_size} ranks; this run has {backend.world_size}"
    return None


def find_resumable(checkpoints_uri: str, backend: Any, config_hash: str | None) -> tuple[str, Manifest] | None:
    """Collective: rank 0 finds the latest complete checkpoint; every rank gets the same answer.

    Returns:
        (uri, manifest) of a checkpoint ``backend`` can resume, else None (a warning says why).
    """
    from trainer_core.checkpoint.manifest import find_latest

    found = find_latest(checkpoints_uri) if backend.rank == 0 else None
    found = backend.broadcast_object(found)
    if found is None:
        return None
    uri, manifest = found
    problem = resume_problem(manifest, backend, config_hash)
    if problem is not None:
        log.warning("checkpoint %s not resumed: %s; starting fresh", uri, problem)
        return None
    return uri, manifest


def save_distributed_checkpoint(
    uri: str,
    *,
    backend: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    progress: TrainProgress,
    global_files: dict[str, bytes],
    manifest_fields: dict[str, Any],
    validate_replicas: bool = True,
) -> Manifest:
    """Collective: write a checkpoint from every rank and commit it (manifest last, by rank 0).

    Components (see ``components.py``): model and optimizer in the backend's format
    (``Backend.save_model_state``), ``scheduler.pt`` REPLICATED, ``rng.pt`` PER_RANK,
    ``trainer_state.json`` and ``global_files`` GLOBAL.

    Raises:
        ReplicaMismatchError: a replicated component differs across ranks (nothing is committed).
    """
    from trainer_core.backends.single import torch_bytes
    from trainer_core.checkpoint.components import RankWriter, Sharing, state_checksum

    out = RankWriter(uri, backend, validate_replicas=validate_replicas)
    backend.save_model_state(model, optimizer, out)
    sched = scheduler.state_dict()
    out.put("scheduler.pt", Sharing.REPLICATED, torch_bytes(sched), state_checksum(sched))
    host_rng, torch_rng = _rng_states()
    out.put("rng.pt", Sharing.PER_RANK, torch_rng)
    out.put("trainer_state.json", Sharing.GLOBAL, json.dumps({"progress": asdict(progress), "rng": host_rng}).encode())
    for name, data in global_files.items():
        out.put(name, Sharing.GLOBAL, data)
    fields = dict(manifest_fields)
    fields["extra"] = {**fields.get("extra", {}), "checkpoint_format": backend.checkpoint_format}
    fields["backend"], fields["world_size"] = backend.name, backend.world_size
    return out.commit(
        kind="checkpoint",
        global_step=progress.global_step,
        consumed_samples=progress.consumed_samples,
        consumed_tokens=progress.consumed_tokens,
        **fields,
    )


def load_checkpoint_state(
    uri: str, manifest: Manifest, *, backend: Any, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> TrainProgress:
    """Collective: restore a checkpoint found by :func:`find_resumable` into live objects.

    Reads the backend's model and optimizer state, the (replicated) scheduler, the global
    progress and this rank's RNG; a rank with no RNG file of its own (the checkpoint was
    written by fewer ranks) keeps its seeded generator and says so.
    """
    from trainer_core.checkpoint.components import per_rank_path
    from trainer_core.checkpoint.storage import exists

    backend.load_model_state(model, optimizer, uri)
    scheduler.load_state_dict(torch.load(io.BytesIO(read_bytes(join_uri(uri, "scheduler.pt"))), weights_only=True))
    state = json.loads(read_bytes(join_uri(uri, "trainer_state.json")))
    names = {f.path for f in manifest.files}
    mine = per_rank_path("rng.pt", backend.rank)
    rng = mine if mine in names else ("rng.pt" if "rng.pt" in names and backend.rank == 0 else None)
    if rng is not None:
        _set_rng_states(state["rng"], read_bytes(join_uri(uri, rng)))
    else:
        log.warning("checkpoint %s has no RNG state for rank %d (written by %d ranks)", uri, backend.rank, manifest.world_size)
    progress = TrainProgress(**state["progress"])
    log.info("resumed from %s at global_step %d", uri, progress.global_step)
    return progress
