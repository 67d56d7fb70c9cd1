"""Stage writer lease: one live writer per stage prefix, on local disk and S3."""

from __future__ import annotations

import json
import time

import pytest

from trainer_core import storage
from trainer_core.checkpoint.lease import LEASE_NAME, LeaseHeldError, StageLease
from trainer_core.storage import join_uri


def test_second_writer_is_refused_while_lease_is_live(storage_root):
    prefix = join_uri(storage_root, "runs/r/stages/sft")
    with StageLease(prefix, owner="writer-a", ttl_s=30):
        with pytest.raises(LeaseHeldError, match="writer-a"):
            StageLease(prefix, owner="writer-b", ttl_s=30).acquire(wait_s=0)
    assert not storage.exists(join_uri(prefix, LEASE_NAME))


def test_same_owner_retakes_its_own_lease(storage_root):
    """A Prefect retry passes the same writer_id and must not wait for the old lease to expire."""
    prefix = join_uri(storage_root, "p")
    first = StageLease(prefix, owner="task-run-1", ttl_s=30)
    first.acquire()
    first._stop.set()  # the first attempt died without releasing
    second = StageLease(prefix, owner="task-run-1", ttl_s=30)
    second.acquire()
    second.release()


def test_expired_lease_is_taken_over(tmp_path):
    prefix = str(tmp_path / "stage")
    storage.write_bytes(
        join_uri(prefix, LEASE_NAME), json.dumps({"owner": "dead", "expires_at": time.time() - 1}).encode()
    )
    lease = StageLease(prefix, owner="new", ttl_s=30)
    lease.acquire()
    assert json.loads(storage.read_bytes(join_uri(prefix, LEASE_NAME)))["owner"] == "new"
    lease.release()


def test_heartbeat_renews_and_notices_takeover(tmp_path):
    prefix = str(tmp_path / "stage")
    lease = StageLease(prefix, owner="a", ttl_s=0.3)
    lease.acquire()
    first_expiry = json.loads(storage.read_bytes(join_uri(prefix, LEASE_NAME)))["expires_at"]
    time.sleep(0.25)
    renewed = json.loads(storage.read_bytes(join_uri(prefix, LEASE_NAME)))["expires_at"]
    assert renewed > first_expiry
    storage.write_bytes(join_uri(prefix, LEASE_NAME), json.dumps({"owner": "b", "expires_at": time.time() + 60}).encode())
    assert lease.lost.wait(1.0)
    lease.release()
    assert json.loads(storage.read_bytes(join_uri(prefix, LEASE_NAME)))["owner"] == "b"


def test_writer_waits_for_a_dead_holders_lease_then_takes_it(tmp_path):
    """A holder killed without release stops renewing: the next writer waits, then takes over."""
    prefix = str(tmp_path / "stage")
    storage.write_bytes(
        join_uri(prefix, LEASE_NAME), json.dumps({"owner": "killed", "expires_at": time.time() + 0.5}).encode()
    )
    lease = StageLease(prefix, owner="relaunch", ttl_s=2)
    t0 = time.time()
    lease.acquire()
    assert 0.4 < time.time() - t0 < 3
    lease.release()


def test_live_renewing_writer_keeps_the_lease_against_a_waiting_one(tmp_path):
    prefix = str(tmp_path / "stage")
    with StageLease(prefix, owner="live", ttl_s=0.6):
        with pytest.raises(LeaseHeldError, match="live"):
            StageLease(prefix, owner="second", ttl_s=0.6).acquire(wait_s=1.5)
