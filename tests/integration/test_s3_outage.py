"""The S3 endpoint goes away for ~10 s in the middle of a checkpoint upload: the save retries,
completes once the endpoint is back, and nothing is lost. An endpoint that goes away for good
after a committed checkpoint ends the next save in one error naming the endpoint and the URI
(transient: exit 1), and the trainer's entry point reports such an error in one line, no traceback.

A dedicated moto server (``ThreadedMotoServer``) on a fixed loopback port plays S3. The
checkpoint of a small model is written with the trainer's own writer (``put_train_state``
into a ``RankWriter``, what ``CheckpointSession`` runs in its background thread); right
after its first file is uploaded the server is stopped and its listening socket closed (so
connections are refused, as from a dead endpoint), and ~10 s later a new server is started on
the same port. moto keeps its backend state per process, so the bucket and the first file
survive the restart, as they would on a real S3 outage.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import types
import time
import uuid
from collections.abc import Iterator

import boto3
import fsspec.config
import pytest
import torch
from moto.server import ThreadedMotoServer
from tenacity import stop_after_attempt, wait_none
from torch import nn

from trainer_core import run as trainer_run
from trainer_core import storage
from trainer_core.checkpoint.lease import StageLease
from trainer_core.checkpoint.manifest import load_verified
from trainer_core.backends.single import SingleDeviceBackend
from trainer_core.checkpoint.components import RankWriter, Sharing, StagedWriter
from trainer_core.checkpoint.train_state import TrainProgress, load_checkpoint_state, put_train_state
from trainer_core.config import SFTConfig, StorageConfig
from trainer_core.errors import EXIT_FAILED, classify
from trainer_core.training.loop import build_optimizer, build_scheduler

OUTAGE_S = 10.0
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> ThreadedMotoServer:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


def stop_server(server: ThreadedMotoServer) -> None:
    """Stop serving and close the listening socket (``stop()`` alone leaves it open: clients
    would hang on a socket nobody reads, and the port could not be bound again)."""
    server.stop()
    server._server.server_close()


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, str, list[ThreadedMotoServer]]]:
    """(port, bucket, servers): a fresh moto server the test may stop, and a list to append its
    successors to (all stopped at the end). The process's S3 settings point at the port while
    the test runs and are restored afterwards."""
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    saved = dict(fsspec.config.conf.get("s3", {}))
    port = free_port()
    servers = [start_server(port)]
    endpoint = f"http://127.0.0.1:{port}"
    storage.configure(StorageConfig(endpoint_url=endpoint, region="us-east-1"))
    bucket = f"outage-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    try:
        yield port, bucket, servers
    finally:
        for server in servers:
            if server._server_ready_event.is_set():
                stop_server(server)
        fsspec.config.conf["s3"] = saved
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


CFG = SFTConfig(max_steps=10, warmup_steps=1)


def training_objects(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """A ~1M-parameter MLP with its AdamW and LR schedule."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    optimizer = build_optimizer(model, CFG)
    return model, optimizer, build_scheduler(optimizer, CFG)


def trained_state() -> tuple[nn.Module, torch.optim.Optimizer, object, TrainProgress]:
    """The MLP after one optimizer step: ~12 MB of checkpoint over five files."""
    model, optimizer, scheduler = training_objects(seed=0)
    model(torch.randn(4, 512)).square().mean().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler, TrainProgress(global_step=1, consumed_samples=4)


class OutageAfterFirstFile:
    """A ``RankWriter`` whose second component waits until ``resume`` is set: the test cuts the
    endpoint once the first file is written (the writer writes each component as it is put).

    Attributes:
        names: the relative paths written, in order.
    """

    def __init__(self, out: RankWriter) -> None:
        self.out = out
        self.first_written = threading.Event()
        self.resume = threading.Event()
        self.names: list[str] = []

    def put(self, name, sharing, data, checksum=None) -> None:
        if self.names:
            self.first_written.set()
            self.resume.wait(timeout=60)
        self.out.put(name, sharing, data, checksum)
        self.names.append(name)


def test_checkpoint_upload_survives_a_10s_endpoint_outage(s3_endpoint, caplog):
    port, bucket, servers = s3_endpoint
    uri = f"s3://{bucket}/runs/r/stages/sft/checkpoints/step-00000001"
    model, optimizer, scheduler, progress = trained_state()
    backend = SingleDeviceBackend("cpu")
    staged = StagedWriter()  # the state serialised in step, as an asynchronous save does
    put_train_state(
        staged, backend=backend, model=model, optimizer=optimizer, scheduler=scheduler, progress=progress, files={}
    )
    out = RankWriter(uri, backend)
    files = OutageAfterFirstFile(out)
    outcome: dict[str, object] = {}

    def save() -> None:
        try:
            staged.replay(files)
            outcome["manifest"] = out.commit(kind="checkpoint", stage="sft", run_id="r", global_step=1)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            outcome["error"] = e
        outcome["done_at"] = time.monotonic()

    saver = threading.Thread(target=save, name="checkpoint-save", daemon=True)
    caplog.set_level(logging.DEBUG, logger="botocore.retryhandler")
    saver.start()
    assert files.first_written.wait(timeout=60), "the first checkpoint file was never written"
    stop_server(servers[0])
    down_at = time.monotonic()
    files.resume.set()
    time.sleep(OUTAGE_S)
    servers.append(start_server(port))
    up_at = time.monotonic()
    saver.join(timeout=60)
    assert not saver.is_alive(), "the save did not finish within 60 s of the endpoint's return"
    assert "error" not in outcome, f"the save failed: {outcome.get('error')!r}"
    manifest = load_verified(uri)
    total_mb = sum(f.size_bytes for f in manifest.files) / 2**20
    print(
        f"{total_mb:.1f} MB checkpoint; endpoint down {up_at - down_at:.1f}s; save done "
        f"{outcome['done_at'] - up_at:.1f}s after it came back"
    )

    # The save was held up by the outage and retried. botocore retries a refused connection
    # itself first (up to 5 attempts, random backoff of up to ~15 s in all; logged at DEBUG),
    # and the storage layer retries (logged as a WARNING) when botocore gives up: which of
    # them bridges a 10 s outage depends on botocore's random backoff.
    assert outcome["done_at"] > up_at
    storage_retries = [
        r.getMessage()
        for r in caplog.records
        if r.name == "trainer_core.storage" and r.getMessage().startswith("Retrying ")
    ]
    botocore_retries = [
        r.getMessage()
        for r in caplog.records
        if r.name == "botocore.retryhandler" and r.getMessage().startswith("retry needed")
    ]
    print(f"retries logged: {len(storage_retries)} by storage (WARNING), {len(botocore_retries)} by botocore (DEBUG)")
    assert all("EndpointConnectionError" in m for m in storage_retries), storage_retries
    assert all("Could not connect to the endpoint URL" in m for m in botocore_retries), botocore_retries
    assert storage_retries or botocore_retries, "no retry was logged"

    # moto's state outlived the server: the bucket and the file written before the outage.
    names = {
        o["Key"].rsplit("/", 1)[-1]
        for o in boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1").list_objects_v2(
            Bucket=bucket
        )["Contents"]
    }
    assert names == {*(n.rsplit("/", 1)[-1] for n in files.names), "manifest.json"}

    # Nothing lost: every file verifies against the manifest and the state loads back exactly.
    assert manifest == outcome["manifest"] and {f.path.rsplit("/", 1)[-1] for f in manifest.files} == set(files.names)
    fresh, fresh_optimizer, fresh_scheduler = training_objects(seed=1)
    restored = load_checkpoint_state(
        uri, manifest, backend=backend, model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler
    )
    assert restored.global_step == 1
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh_optimizer.state_dict()["state"][0]["exp_avg"].equal(optimizer.state_dict()["state"][0]["exp_avg"])


def test_an_endpoint_gone_for_good_ends_in_one_error_naming_it(s3_endpoint, monkeypatch, capsys, caplog):
    """After a committed checkpoint the endpoint dies and stays down. The next save fails with the
    write's own error: the lease's release, which cannot reach the endpoint either, neither waits
    the outage out again nor replaces that error (it logs one warning). The error classifies as
    transient (exit 1, retried) and names the endpoint and the URI written. The trainer's entry
    point reports such an error (its spec unreadable) as one ``error:`` line, without a traceback.
    Retries are cut to two attempts (botocore's own to one) to keep this to seconds."""
    port, bucket, servers = s3_endpoint
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.delenv("POSTTRAIN_WATCH_PID", raising=False)
    storage.configure(StorageConfig(endpoint_url=endpoint, region="us-east-1"))
    for op in (storage.write_bytes, storage.read_bytes, storage.exists):
        monkeypatch.setattr(op.retry, "stop", stop_after_attempt(2))
        monkeypatch.setattr(op.retry, "wait", wait_none())
    stage = f"s3://{bucket}/runs/r/stages/sft"
    backend = SingleDeviceBackend("cpu")
    caplog.set_level(logging.WARNING, logger="trainer_core.checkpoint.lease")
    with pytest.raises(Exception) as info, StageLease(stage, ttl_s=30):
        first = RankWriter(f"{stage}/checkpoints/step-00000001", backend)
        first.put("model.bin", Sharing.GLOBAL, b"weights")
        first.commit(kind="checkpoint", stage="sft", run_id="r", global_step=1)
        second = RankWriter(f"{stage}/checkpoints/step-00000002", backend)
        stop_server(servers[0])
        second.put("model.bin", Sharing.GLOBAL, b"weights")

    error = classify(info.value, where="stage sft")
    assert error is not None, f"unclassified: {info.value!r}"
    message = str(error)
    assert error.exit_code == EXIT_FAILED, message
    assert f"the S3 endpoint {endpoint} did not answer: writing {stage}/checkpoints/step-00000002/model.bin" in message
    released = [r.getMessage() for r in caplog.records if "not released" in r.getMessage()]
    assert len(released) == 1 and f"{stage}/lease.json" in released[0], caplog.text

    monkeypatch.setattr(trainer_run, "watch_parent", lambda: None)
    monkeypatch.setattr(trainer_run, "skip_exit_collection", lambda: None)
    runner = types.ModuleType("trainer_core.stages.runner")  # never reached (the spec is unreadable); its
    runner.run_spec = None  # torch-and-transformers imports would cost seconds here
    monkeypatch.setitem(sys.modules, "trainer_core.stages.runner", runner)
    capsys.readouterr()
    spec = f"s3://{bucket}/runs/r/specs/sft.json"
    code = trainer_run.main([spec])
    out, err = capsys.readouterr()
    assert code == EXIT_FAILED, err
    assert (out + err).count("Traceback (most recent call last)") == 0, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"the S3 endpoint {endpoint} did not answer" in errors[0], err
    assert f"/{bucket}/runs/r/specs/sft.json" in errors[0], err
