"""Checkpoint state components (``trainer_core/checkpoint/components.py``) in one process.

The multi-rank side (replicas compared across real gloo ranks) is in
``tests/integration/test_backends.py``; here a stub backend stands in for rank 0 of two.
"""

from __future__ import annotations

import hashlib
import struct
import uuid

import pytest
import torch

from trainer_core.backends.single import SingleDeviceBackend
from trainer_core import storage
from trainer_core.checkpoint.components import (
    RankWriter,
    ReplicaMismatchError,
    Sharing,
    per_rank_path,
    state_checksum,
)
from trainer_core.checkpoint.manifest import MANIFEST_NAME, read_manifest, verify
from trainer_core.checkpoint.session import CheckpointSession, MetricsBuffer
from trainer_core.checkpoint.train_state import TrainProgress
from trainer_core.storage import join_uri


class _NoSink:
    def log(self, metrics, step):
        return metrics

    def log_missing(self, batch):
        return 0


def _root() -> str:
    return f"memory://components-{uuid.uuid4().hex}/step-00000003"


def test_state_checksum_worked_by_hand():
    """A tensor contributes ``T<dtype><shape>`` then its raw bytes; a dict ``{``, each key's repr
    and value in sorted key order, ``}``; a scalar its repr."""
    expected = hashlib.sha256(b"{'lr'" + b"0.5" + b"'w'" + b"Ttorch.float32(2,)" + struct.pack("<2f", 1.0, -2.0) + b"}")
    assert state_checksum({"w": torch.tensor([1.0, -2.0]), "lr": 0.5}) == expected.hexdigest()


def test_state_checksum_sees_one_ulp_dtype_and_shape():
    state = {"step": 3, "exp_avg": torch.linspace(-1, 1, 6).reshape(2, 3), "groups": [{"lr": 1e-3}]}
    same = {"groups": [{"lr": 1e-3}], "exp_avg": torch.linspace(-1, 1, 6).reshape(2, 3), "step": 3}
    assert state_checksum(state) == state_checksum(same)  # dict order does not matter
    nudged = {**state, "exp_avg": state["exp_avg"].clone()}
    nudged["exp_avg"][1, 2] = torch.nextafter(nudged["exp_avg"][1, 2], torch.tensor(2.0))
    assert state_checksum(nudged) != state_checksum(state)
    zeros = torch.zeros(2, dtype=torch.float32)  # the same 8 zero bytes as one float64 zero
    assert state_checksum(zeros) != state_checksum(torch.zeros(1, dtype=torch.float64))
    assert state_checksum(torch.zeros(2, 2)) != state_checksum(torch.zeros(4))
    t = torch.arange(6.0).reshape(2, 3)
    assert state_checksum(t.T) == state_checksum(t.T.contiguous())  # values, not memory layout
    assert state_checksum(torch.zeros(0)) != state_checksum(torch.zeros(0, 1))


def test_per_rank_path():
    assert per_rank_path("rng.pt", 0) == "rank-00000/rng.pt"
    assert per_rank_path("zero/partition.pt", 12) == "rank-00012/zero/partition.pt"


def test_replica_mismatch_error_names_component_and_ranks():
    checksums = ["a" * 64, "a" * 64, "b" * 64, "c" * 64]
    error = ReplicaMismatchError("optimizer.pt", checksums)
    assert str(error) == (
        "replicated state 'optimizer.pt' differs across ranks: rank(s) [2, 3] disagree with rank 0 "
        "(sha256 rank 0: aaaaaaaaaaaa, rank 1: aaaaaaaaaaaa, rank 2: bbbbbbbbbbbb, rank 3: cccccccccccc); "
        "the checkpoint is not written"
    )
    assert (error.component, error.checksums) == ("optimizer.pt", checksums)
    assert isinstance(error, RuntimeError)


def test_rank_writer_world_1_writes_each_pattern_and_commits():
    """The single backend: REPLICATED and GLOBAL at the top, PER_RANK under ``rank-00000/``;
    no replica check at world size 1 (a checksum that matches nothing is not looked at)."""
    uri = _root()
    storage.write_bytes(join_uri(uri, "stale.bin"), b"from a dead writer")
    out = RankWriter(uri, SingleDeviceBackend("cpu"))
    assert not storage.exists(join_uri(uri, "stale.bin"))  # cleared before any rank writes
    out.put("model.safetensors", Sharing.REPLICATED, b"weights", checksum="not-the-sha256")
    out.put("rng.pt", Sharing.PER_RANK, b"rng")
    out.put("trainer_state.json", Sharing.GLOBAL, b"{}")
    storage.write_bytes(join_uri(uri, "dcp/__0_0.distcp"), b"shard")
    out.record("dcp/__0_0.distcp")
    with pytest.raises(FileNotFoundError, match="dcp/__1_0.distcp"):
        out.record("dcp/__1_0.distcp")
    assert not storage.exists(join_uri(uri, MANIFEST_NAME))
    manifest = out.commit(kind="checkpoint", stage="sft", run_id="r1", global_step=3)
    sizes = {f.path: f.size_bytes for f in manifest.files}
    assert sizes == {"dcp/__0_0.distcp": 5, "model.safetensors": 7, "rank-00000/rng.pt": 3, "trainer_state.json": 2}
    by_path = {f.path: f.sha256 for f in manifest.files}
    assert by_path["model.safetensors"] == hashlib.sha256(b"weights").hexdigest()
    assert read_manifest(uri) == manifest and verify(uri) == []


class TwoRankStub(SingleDeviceBackend):
    """Rank 0 of two whose peer (rank 1) reports ``peer_checksum`` for every replicated component."""

    def __init__(self, peer_checksum: str | None) -> None:
        super().__init__("cpu")
        self.world_size, self.peer_checksum = 2, peer_checksum

    def all_gather_object(self, obj):
        return [obj, obj if self.peer_checksum is None else self.peer_checksum]


def test_rank_writer_replica_mismatch_writes_nothing():
    uri = _root()
    out = RankWriter(uri, TwoRankStub(peer_checksum="f" * 64))
    with pytest.raises(ReplicaMismatchError, match=r"'scheduler.pt' differs across ranks: rank\(s\) \[1\]") as info:
        out.put("scheduler.pt", Sharing.REPLICATED, b"sched")
    assert info.value.checksums == [hashlib.sha256(b"sched").hexdigest(), "f" * 64]  # default: SHA-256 of the bytes
    assert storage.list_files(uri) == {}


def test_rank_writer_replicas_that_agree_are_written_once_by_rank_0():
    uri = _root()
    out = RankWriter(uri, TwoRankStub(peer_checksum=None))
    out.put("scheduler.pt", Sharing.REPLICATED, b"sched", checksum=state_checksum({"last_epoch": 3}))
    out.put("rng.pt", Sharing.PER_RANK, b"rng0")
    assert storage.list_files(uri) == {"scheduler.pt": 5, "rank-00000/rng.pt": 4}
    out = RankWriter(uri, TwoRankStub(peer_checksum=None), validate_replicas=False)
    assert storage.list_files(uri) == {}  # rank 0 clears the directory it is about to write


@pytest.mark.parametrize("asynchronous", [False, True])
def test_checkpoint_session_world_1_file_list(asynchronous):
    """What every loop writes at world size 1 (in step, or staged and uploaded in the background):
    the same files as at several ranks."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    uri = _root()
    session = CheckpointSession(
        uri.rsplit("/", 1)[0],
        SingleDeviceBackend("cpu"),
        fingerprint="f1",
        stage="sft",
        run_id="r1",
        metrics=MetricsBuffer(sink=_NoSink(), printer=lambda metrics, step: None),
        extra={"mlflow_run_id": None},
        asynchronous=asynchronous,
    )
    session.save(TrainProgress(global_step=3), model=model, optimizer=optimizer, scheduler=scheduler)
    session.close()
    assert session.deferred is asynchronous
    manifest = read_manifest(uri)
    assert sorted(f.path for f in manifest.files) == [
        "metrics.json",
        "model.safetensors",
        "optimizer.pt",
        "rank-00000/rng.pt",
        "scheduler.pt",
        "trainer_state.json",
    ]
    assert (manifest.backend, manifest.world_size, manifest.global_step, manifest.config_hash) == ("single", 1, 3, "f1")
    assert manifest.extra == {"mlflow_run_id": None, "checkpoint_format": "full"}
    assert verify(uri) == []
