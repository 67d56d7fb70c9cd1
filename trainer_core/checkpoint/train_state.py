"""A training stage's whole state, for exact resume: what a checkpoint holds and how it loads.

A checkpoint directory ``step-XXXXXXXX/`` holds (see ``components.py`` for the sharing patterns)::

    model and optimizer   in the backend's format (Backend.save_model_state): full
                          (model.safetensors, optimizer.pt), dcp/ or deepspeed/
    scheduler.pt          LR scheduler state dict (REPLICATED)
    rank-XXXXX/rng.pt     each rank's torch CPU (and CUDA) generator states (PER_RANK)
    trainer_state.json    global step, data position, counters, python/numpy RNG (GLOBAL)
    metrics.json          the (metrics, step) pairs logged since the previous checkpoint (GLOBAL)
    ...                   a loop's own GLOBAL files (the RL trainer's KL controller and samplers)
    manifest.json         written last: the commit marker (see manifest.py)

Resuming restores all of it, so the run continues with the same batches, the same random
numbers and the same optimizer moments as one never interrupted. :func:`put_train_state` is
the one writer of this layout, whatever the backend; :func:`load_checkpoint_state` the one
reader. ``checkpoint/session.py`` drives them.
"""

from __future__ import annotations

import io
import json
import logging
import random
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from trainer_core.checkpoint.components import Sharing, per_rank_path, state_checksum, torch_bytes
from trainer_core.checkpoint.manifest import Manifest, find_latest
from trainer_core.storage import join_uri, read_bytes

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
        nonfinite_steps: optimizer steps skipped for a NaN/inf loss or gradient norm.
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
    nonfinite_steps: int = 0
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


METRICS_FILE = "metrics.json"
"""In a checkpoint: the ``[[metrics, step], ...]`` logged since the previous checkpoint."""


def checkpoint_metrics(uri: str, manifest: Manifest) -> list[tuple[dict[str, float], int]]:
    """The ``(metrics, step)`` pairs a committed checkpoint covers ([] if it stores none)."""
    if not any(f.path == METRICS_FILE for f in manifest.files):
        return []
    return [(metrics, int(step)) for metrics, step in json.loads(read_bytes(join_uri(uri, METRICS_FILE)))]


def checkpoint_format_of(manifest: Manifest) -> str:
    """The checkpoint format a manifest records (``full`` for checkpoints that predate the field)."""
    return str((manifest.extra or {}).get("checkpoint_format", "full"))


def resume_problem(manifest: Manifest, backend: Any, config_hash: str | None) -> str | None:
    """Why a checkpoint cannot be resumed by ``backend`` (None when it can).

    A checkpoint written under another config or in another backend's format is not resumed
    from. Any world size is: full checkpoints hold whole tensors, DCP reshards, and DeepSpeed
    converts a checkpoint of another world size to a universal one (``backends/deepspeed_zero.py``).
    """
    if manifest.config_hash != config_hash:
        return f"written with another config ({manifest.config_hash})"
    fmt = checkpoint_format_of(manifest)
    if fmt != backend.checkpoint_format:
        return (
            f"format {fmt!r} (backend {manifest.backend}); backend {backend.name} reads {backend.checkpoint_format!r}"
        )
    return None


def find_resumable(checkpoints_uri: str, backend: Any, config_hash: str | None) -> tuple[str, Manifest] | None:
    """Collective: rank 0 finds the latest complete checkpoint; every rank gets the same answer.

    Returns:
        (uri, manifest) of a checkpoint ``backend`` can resume, else None (a warning says why).
    """
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


def put_train_state(
    out: Any,
    *,
    backend: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    progress: TrainProgress,
    files: dict[str, bytes],
) -> None:
    """Collective: put every component of a checkpoint through ``out``.

    Model and optimizer in the backend's format (``Backend.save_model_state``),
    ``scheduler.pt`` REPLICATED (its checksum over the live state), ``rng.pt`` PER_RANK,
    ``trainer_state.json`` and ``files`` GLOBAL.

    Args:
        out: a ``RankWriter`` (writes now) or a ``StagedWriter`` (keeps bytes for a later write).
        backend: the running backend.
        model: the model as the backend wrapped it.
        optimizer: its optimizer.
        scheduler: the LR scheduler (anything with ``state_dict()``).
        progress: counters and data position (a copy taken at this step).
        files: the loop's other GLOBAL files, name -> bytes.

    Raises:
        ReplicaMismatchError: a replicated component differs across ranks (nothing is written).
    """
    backend.save_model_state(model, optimizer, out)
    sched = scheduler.state_dict()
    checksum = state_checksum(sched) if getattr(out, "validate", False) else None
    out.put("scheduler.pt", Sharing.REPLICATED, torch_bytes(sched), checksum)
    host_rng, torch_rng = _rng_states()
    out.put("rng.pt", Sharing.PER_RANK, torch_rng)
    out.put("trainer_state.json", Sharing.GLOBAL, json.dumps({"progress": asdict(progress), "rng": host_rng}).encode())
    for name, data in files.items():
        out.put(name, Sharing.GLOBAL, data)


def load_checkpoint_state(
    uri: str, manifest: Manifest, *, backend: Any, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> TrainProgress:
    """Collective: restore a checkpoint found by :func:`find_resumable` into live objects.

    Reads the backend's model and optimizer state, the (replicated) scheduler, the global
    progress and this rank's RNG; a rank with no RNG file of its own (the checkpoint was
    written by fewer ranks) keeps its seeded generator and says so.
    """
    backend.load_model_state(model, optimizer, uri)
    scheduler.load_state_dict(torch.load(io.BytesIO(read_bytes(join_uri(uri, "scheduler.pt"))), weights_only=True))
    state = json.loads(read_bytes(join_uri(uri, "trainer_state.json")))
    names = {f.path for f in manifest.files}
    mine = per_rank_path("rng.pt", backend.rank)
    rng = mine if mine in names else ("rng.pt" if "rng.pt" in names and backend.rank == 0 else None)
    if rng is not None:
        _set_rng_states(state["rng"], read_bytes(join_uri(uri, rng)))
    else:
        log.warning(
            "checkpoint %s has no RNG state for rank %d (written by %d ranks)", uri, backend.rank, manifest.world_size
        )
    progress = TrainProgress(**state["progress"])
    log.info("resumed from %s at global_step %d", uri, progress.global_step)
    return progress
