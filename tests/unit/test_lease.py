"""Stage writer lease: one live writer per stage prefix, on local disk and S3."""

from __future__ import annotations

import json
import time

import pytest

from tests.processes import alive
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
    second.acquire(wait_s=0)  # at once: waiting out the first attempt's 30 s would hide a broken retake
    assert json.loads(storage.read_bytes(join_uri(prefix, LEASE_NAME)))["attempt"] == second.attempt != first.attempt
    second.release()
    assert not storage.exists(join_uri(prefix, LEASE_NAME))


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
    storage.write_bytes(
        join_uri(prefix, LEASE_NAME), json.dumps({"owner": "b", "expires_at": time.time() + 60}).encode()
    )
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


# --- attempts of one owner and the write fence ------------------------------------------------

_HOLDER = """
import os, subprocess, sys, time
from trainer_core.checkpoint.lease import StageLease
lease = StageLease(sys.argv[1], owner="task-run-1", ttl_s=30, attempt="a1")
lease.acquire()
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(rank.pid, flush=True)
time.sleep(600)
"""


def test_new_attempt_stops_the_earlier_attempts_processes_first(tmp_path):
    """A retry of the same task run (same owner, new attempt) on the same host SIGKILLs every
    process of the attempt it replaces, found by the launch id they carry (here a 'rank' in a
    session of its own, as torchrun starts ranks), then takes the lease without waiting for it
    to expire; the old attempt's fence then refuses its writes."""
    import os
    import subprocess
    import sys

    from trainer_core.checkpoint.lease import LeaseLostError, WriteFence

    prefix = str(tmp_path / "stage")
    env = {**os.environ, "POSTTRAIN_LAUNCH_ID": "outer:launch-a"}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, prefix], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        rank = int(holder.stdout.readline())
        record = json.loads(storage.read_bytes(join_uri(prefix, LEASE_NAME)))
        assert (record["attempt"], record["launch_id"], record["pid"]) == ("a1", "launch-a", holder.pid)
        old_fence = WriteFence(prefix, "task-run-1", "a1")
        old_fence.check("a checkpoint")
        t0 = time.monotonic()
        retry = StageLease(prefix, owner="task-run-1", ttl_s=30, attempt="b2")
        retry.acquire(wait_s=0)  # no wait for the live lease: its processes are stopped instead
        took = time.monotonic() - t0
        assert holder.wait(timeout=10) == -9
        deadline = time.monotonic() + 5  # SIGKILL is delivered asynchronously: the rank dies within moments
        while alive(rank) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not alive(rank)
        assert took < 10, took
        assert json.loads(storage.read_bytes(join_uri(prefix, LEASE_NAME)))["attempt"] == "b2"
        with pytest.raises(LeaseLostError, match=r"held by task-run-1 \(attempt b2\), not by this attempt"):
            old_fence.check("a checkpoint")
        retry.fence().check("a checkpoint")
        retry.release()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_earlier_attempt_on_another_host_is_waited_for(tmp_path):
    """Processes on another host cannot be stopped from here: its live lease is waited for (and
    refused when it stays live), as another owner's would be; nothing is killed."""
    prefix = str(tmp_path / "stage")
    record = {
        "owner": "task-run-1",
        "attempt": "a1",
        "launch_id": "launch-a",
        "host": "another-host",
        "pid": 1,
        "pidns": "pid:[1]",
        "expires_at": time.time() + 30,
    }
    storage.write_bytes(join_uri(prefix, LEASE_NAME), json.dumps(record).encode())
    t0 = time.monotonic()
    with pytest.raises(LeaseHeldError, match="task-run-1"):
        StageLease(prefix, owner="task-run-1", ttl_s=30, attempt="b2").acquire(wait_s=0.5)
    assert time.monotonic() - t0 >= 0.5
    assert json.loads(storage.read_bytes(join_uri(prefix, LEASE_NAME)))["attempt"] == "a1"


def test_superseded_attempt_stops_renewing_and_keeps_its_hands_off(tmp_path):
    """The old attempt's heartbeat sees the same owner's new attempt, sets ``lost`` and neither
    renews nor, on release, deletes the new attempt's lease."""
    prefix = str(tmp_path / "stage")
    old = StageLease(prefix, owner="w", ttl_s=0.3, attempt="a1")
    old.acquire()
    takeover = {"owner": "w", "attempt": "b2", "expires_at": time.time() + 60}
    storage.write_bytes(join_uri(prefix, LEASE_NAME), json.dumps(takeover).encode())
    assert old.lost.wait(1.0)
    time.sleep(0.2)
    old.release()
    assert json.loads(storage.read_bytes(join_uri(prefix, LEASE_NAME))) == takeover


def test_collective_fence_check_raises_on_every_rank(tmp_path):
    """Under a distributed backend rank 0 reads the lease and broadcasts what it found: a rank
    whose own read would pass raises too."""
    from trainer_core.checkpoint.lease import LeaseLostError, WriteFence, check_fence

    prefix = str(tmp_path / "stage")
    storage.write_bytes(join_uri(prefix, LEASE_NAME), json.dumps({"owner": "w", "attempt": "b2"}).encode())

    class Rank1:
        rank, world_size = 1, 2

        def broadcast_object(self, obj, src=0):
            assert obj is None  # rank 1 does not read the lease itself
            return ("lost", "lease.json is held by w (attempt b2), not by this attempt")

    with pytest.raises(LeaseLostError, match="attempt b2"):
        check_fence(WriteFence(prefix, "w", "b2"), Rank1(), "a checkpoint")
    check_fence(None, Rank1(), "a checkpoint")  # no fence: nothing checked, no collective

    class Rank0:
        rank, world_size = 0, 2
        sent = None

        def broadcast_object(self, obj, src=0):
            Rank0.sent = obj
            return obj

    class Unreadable(WriteFence):
        def check(self, what):
            raise PermissionError("access denied")

    # rank 0 cannot read the lease: it tells the other ranks before raising, not only itself
    with pytest.raises(OSError, match="rank 0 could not read .*lease.json before a checkpoint: PermissionError"):
        check_fence(Unreadable(prefix, "w", "b2"), Rank0(), "a checkpoint")
    assert Rank0.sent[0] == "error"
    check_fence(WriteFence(prefix, "w", "b2"), Rank0(), "a checkpoint")  # held: passes on every rank
    assert Rank0.sent is None


def test_a_reused_pid_is_neither_live_nor_killed(tmp_path):
    """A record's pid names its holder only with the start time it recorded: a later process
    given the same pid (another pod of the same Job name, a long gap) is not the holder, so the
    lease is stale and nothing is signalled; a superseding attempt kills by launch id only."""
    import os
    import socket
    import subprocess
    import sys

    from trainer_core.checkpoint.lease import _boot_id, _pid_namespace, _process_start, holder_alive

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # no launch id
    try:
        here = {
            "host": socket.gethostname(),
            "pidns": _pid_namespace(),
            "boot_id": _boot_id(),
            "expires_at": time.time() + 30,
        }
        record = {
            **here,
            "owner": "task-run-1",
            "attempt": "a1",
            "launch_id": "launch-gone",
            "pid": bystander.pid,
            "pid_start": _process_start(bystander.pid) - 1,
        }
        assert not holder_alive(record)
        assert holder_alive({**record, "pid_start": _process_start(bystander.pid)})
        prefix = str(tmp_path / "stage")
        storage.write_bytes(join_uri(prefix, LEASE_NAME), json.dumps(record).encode())
        lease = StageLease(prefix, owner="task-run-1", ttl_s=30, attempt="b2")
        lease.acquire(wait_s=0)
        assert bystander.poll() is None  # its pid was in the record, but it carries no launch id
        lease.release()
    finally:
        bystander.kill()
        bystander.wait()
