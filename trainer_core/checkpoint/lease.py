"""One writer per stage prefix: a lease object with an owner, an attempt and an expiry.

A trainer takes ``<stage output>/lease.json`` before it writes anything and renews it from a
heartbeat thread; the flow takes ``<run>/lease.json`` for a whole pipeline run the same way. A
second process that finds a live lease held by another owner is refused with
:class:`LeaseHeldError`. An expired lease (its holder died without releasing it) is taken over:
a writer that finds a live lease waits up to one ``ttl_s`` for it to lapse before it is refused,
so a relaunch after a hard kill (SIGKILL, OOM) goes on once the dead holder's lease expires,
while a second live writer, which keeps renewing, is refused. A lease records its holder's host
and pid: on the same host, a lease whose process is gone is stale at once (its holder was
killed), without waiting for it to expire.

Attempts and fencing: a Prefect retry of a task run passes the same ``writer_id`` (owner), but
each launch of a stage is an attempt of its own (``attempt``: the launch id its processes carry,
``trainer_core/processes.py``). A new attempt of the same owner does not wait for the attempt it
replaces, but first makes sure that attempt's processes are gone: on the same host it SIGKILLs
every process carrying the old attempt's launch id (torchrun ranks orphaned by a killed agent
included) and waits for them; on another host it waits for the old lease to lapse, like another
owner. The holder's heartbeat notices a takeover (owner or attempt changed) and stops renewing;
every rank checks the lease through a :class:`WriteFence` before it writes a checkpoint or a
commit, so the ranks of an attempt whose lease was taken over stop (:class:`LeaseLostError`)
before writing. Checkpoints are written under attempt-unique names
(``checkpoint/session.py``), so a write already under way when the lease changed hands lands in
files no other attempt reads or writes.

Object stores have no compare-and-swap through fsspec, so acquisition is
write-then-read-back: two processes starting within the same moment could both believe they
hold the lease until the next heartbeat, when the loser logs an error and sets ``lost``. The
lease guards against a second pipeline run, a stray manual relaunch or an orphaned attempt, not
against adversaries. Times are UTC epoch seconds from the writers' clocks; keep them within a
small fraction of ``ttl_s`` of each other.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from typing import Any

from tenacity import stop_after_attempt

from trainer_core import storage
from trainer_core.errors import EXIT_FAILED, PosttrainError, classify
from trainer_core.processes import LAUNCH_ID_ENV, current_launch_id, kill_marked, process_alive, process_start
from trainer_core.storage import join_uri

log = logging.getLogger(__name__)

LEASE_NAME = "lease.json"


_SUPERSEDE_TIMEOUT_S = 10.0
"""How long a new attempt waits for the processes of the attempt it replaces to die."""


class LeaseHeldError(PosttrainError):
    """Another live writer holds the stage's lease."""


class LeaseLostError(PosttrainError):
    """This attempt's lease was taken over (another owner, or a newer attempt of the same owner):
    it must not write. A crash of the superseded attempt, not bad input."""

    exit_code = EXIT_FAILED


def new_attempt_id(launch_id: str | None = None) -> str:
    """The attempt id of a launch: the first 12 lowercase letters and digits of ``launch_id``
    (a launcher's is a uuid4 hex), or 12 fresh hex digits (a process not started by a launcher)."""
    cleaned = re.sub(r"[^0-9a-z]", "", (launch_id or "").lower())[:12]
    return cleaned or uuid.uuid4().hex[:12]


def default_owner() -> str:
    """``host:pid:random``: unique to this process."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


_process_alive = process_alive
"""Whether ``pid`` runs (a zombie, killed and not yet reaped by its parent, does not)."""

_process_start = process_start
"""The start time of a process: with the pid, its identity (``trainer_core.processes``)."""


def _boot_id() -> str:
    """This machine's boot id (the kernel's, shared by the containers on it), or ''."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    """This process's pid namespace (``pid:[inode]``): pids compare only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def holder_alive(record: dict, now: float | None = None) -> bool:
    """Whether the lease ``record`` (``lease.json``'s content) is held by a live writer.

    Live: not expired and, when it was written on this machine in this pid namespace (containers
    sharing a host name do not share pids), its process still exists (the same process: its pid
    with the start time the record holds, not a later process given the same pid).
    """
    now = time.time() if now is None else now
    if record.get("expires_at", 0) <= now:
        return False
    if _same_pids(record) and isinstance(record.get("pid"), int):
        started = record.get("pid_start")
        return _process_alive(record["pid"]) and (started is None or started == _process_start(record["pid"]))
    return True


def _same_pids(record: dict) -> bool:
    """Whether ``record`` was written on this machine (host name and boot id, when recorded) in
    this pid namespace: whether its pids are ours."""
    same_boot = record.get("boot_id") in (None, _boot_id())
    return same_boot and record.get("host") == socket.gethostname() and record.get("pidns") == _pid_namespace() != ""


def read_lease(prefix_uri: str) -> dict | None:
    """``<prefix_uri>/lease.json`` with ``live`` (see :func:`holder_alive`) added; None when absent."""
    try:
        record = json.loads(storage.read_bytes(join_uri(prefix_uri, LEASE_NAME)))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError):
        return {"owner": None, "live": False}
    return {**record, "live": holder_alive(record)}


class WriteFence:
    """What a rank checks before it writes: that the lease is still held by its own attempt.

    Args:
        prefix_uri: the directory the lease guards (the stage's output).
        owner: the attempt's writer identity.
        attempt: the attempt id.
    """

    def __init__(self, prefix_uri: str, owner: str, attempt: str) -> None:
        self.uri = join_uri(prefix_uri, LEASE_NAME)
        self.owner, self.attempt = owner, attempt

    def check(self, what: str) -> None:
        """Raise unless the lease names this owner and attempt (one read of ``lease.json``).

        Args:
            what: what was about to be written (for the message).

        Raises:
            LeaseLostError: the lease is gone, unreadable, or held by another owner or attempt.
        """
        try:
            record = json.loads(storage.read_bytes(self.uri))
        except FileNotFoundError:
            record = None
        except ValueError:
            record = {}
        if record is not None and record.get("owner") == self.owner and record.get("attempt") == self.attempt:
            return
        holder = "nobody" if record is None else f"{record.get('owner')} (attempt {record.get('attempt')})"
        raise LeaseLostError(
            f"{self.uri} is held by {holder}, not by this attempt ({self.owner}, attempt "
            f"{self.attempt}): it was taken over; {what} is not written"
        )


def check_fence(fence: WriteFence | None, backend: Any, what: str, collective: bool = True) -> None:
    """Raise :class:`LeaseLostError` unless the stage's lease is still this attempt's.

    Args:
        fence: the attempt's fence; None: nothing checked.
        backend: the running backend (rank, world size, ``broadcast_object``).
        what: what is about to be written (for the message).
        collective: under a distributed backend, rank 0 reads the lease and broadcasts what it
            found, so every rank raises alike and none is left waiting in a collective of the
            write; False: this rank checks on its own (no collective).

    Raises:
        LeaseLostError: the lease is another attempt's (on every rank when ``collective``).
        OSError: rank 0 could not read the lease (on every rank when ``collective``).
    """
    if fence is None:
        return
    if not collective or backend.world_size == 1:
        fence.check(what)
        return
    problem = None
    if backend.rank == 0:
        try:
            fence.check(what)
        except LeaseLostError as e:
            problem = ("lost", str(e))
        except Exception as e:  # noqa: BLE001 - broadcast first: the other ranks wait for rank 0's answer
            problem = ("error", f"rank 0 could not read {fence.uri} before {what}: {type(e).__name__}: {e}")
    problem = backend.broadcast_object(problem)
    if problem is not None:
        kind, message = problem
        raise LeaseLostError(message) if kind == "lost" else OSError(message)


class StageLease:
    """The writer lease of one output prefix (a stage's output directory, or a whole run's).

    Args:
        prefix_uri: the directory the lease guards.
        owner: writer identity; the same string may take the lease over from its own earlier
            attempt (see the module docstring).
        ttl_s: seconds a lease lives without renewal.
        what: what a second writer would be doing, for the refusal message.
        attempt: this attempt's id (default: a fresh one).
        launch_id: the launch id this attempt's processes carry on this host (default: this
            process's innermost ``POSTTRAIN_LAUNCH_ID``), by which a later attempt of the same
            owner stops them.

    Raises:
        ValueError: ``ttl_s`` is not positive.
    """

    def __init__(
        self,
        prefix_uri: str,
        owner: str | None = None,
        ttl_s: float = 30.0,
        what: str = "another process is training this stage of this run",
        attempt: str | None = None,
        launch_id: str | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.prefix_uri = prefix_uri
        self.uri = join_uri(prefix_uri, LEASE_NAME)
        self.owner = owner or default_owner()
        self.ttl_s = ttl_s
        self.what = what
        self.attempt = attempt or new_attempt_id()
        self.launch_id = launch_id or current_launch_id()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = threading.Event()

    def _read(self, attempts: int | None = None) -> dict | None:
        """The lease record, or None when there is none (or it is unreadable).

        Args:
            attempts: storage attempts; None: the storage layer's retry policy.
        """
        read = (
            storage.read_bytes if attempts is None else storage.read_bytes.retry_with(stop=stop_after_attempt(attempts))
        )
        try:
            return json.loads(read(self.uri))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError):
            log.warning("unreadable lease %s; treating it as expired", self.uri)
            return None

    def _write(self) -> None:
        record = {
            "owner": self.owner,
            "attempt": self.attempt,
            "launch_id": self.launch_id,
            "expires_at": time.time() + self.ttl_s,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "pidns": _pid_namespace(),
            "boot_id": _boot_id(),
            "pid_start": _process_start(os.getpid()),
        }
        storage.write_bytes(self.uri, json.dumps(record).encode())

    def _mine(self, record: dict) -> bool:
        """Whether ``record`` is this attempt's (a record without an attempt, written before
        attempts existed, counts as the owner's own)."""
        return record.get("owner") == self.owner and record.get("attempt", self.attempt) == self.attempt

    def fence(self) -> WriteFence:
        """The fence of this attempt (what its ranks check before writing)."""
        return WriteFence(self.prefix_uri, self.owner, self.attempt)

    def _supersede(self, current: dict | None) -> None:
        """Stop the processes of this owner's earlier attempt, when ``current`` is its lease on
        this machine: SIGKILL every process carrying its launch id (not one of this process's own
        ids; the holder carries it too) and wait up to ``_SUPERSEDE_TIMEOUT_S`` for them to die.
        Only processes marked with that launch id are signalled, never a pid taken from the
        record (on another pod of the same name a pid means another process)."""
        if not current or current.get("owner") != self.owner or self._mine(current) or not _same_pids(current):
            return
        launch_id = current.get("launch_id")
        own_ids = set(os.environ.get(LAUNCH_ID_ENV, "").split(":"))
        if not launch_id or launch_id in own_ids:
            return
        survivors = kill_marked(launch_id, _SUPERSEDE_TIMEOUT_S)
        log.warning(
            "attempt %s of %s takes %s over from attempt %s: its processes (launch %s) stopped%s",
            self.attempt,
            self.owner,
            self.uri,
            current.get("attempt"),
            launch_id,
            f"; still running: {survivors}" if survivors else "",
        )

    def _held_by_another(self, current: dict | None) -> bool:
        """Whether ``current`` is a live lease of another owner or attempt (an earlier attempt
        of this owner in this very process, which ended without releasing, is not live)."""
        if not current or self._mine(current) or not holder_alive(current):
            return False
        this_process = current.get("pid") == os.getpid() and current.get("pid_start") in (
            None,
            _process_start(os.getpid()),
        )
        return not (current.get("owner") == self.owner and _same_pids(current) and this_process)

    def check_free(self) -> None:
        """Raise :class:`LeaseHeldError` (naming the holder) when another live writer holds the
        lease: another owner, or an earlier attempt of this owner (on another host, or whose
        processes survived :meth:`_supersede`)."""
        current = self._read()
        if self._held_by_another(current):
            left = current["expires_at"] - time.time()
            where = f" (pid {current['pid']} on {current['host']})" if "host" in current else ""
            raise LeaseHeldError(
                f"{self.uri} is held by {current['owner']}{where} for another {left:.0f}s: {self.what}. "
                "Wait for it, or use another run id."
            )

    def acquire(self, wait_s: float | None = None) -> None:
        """Take the lease and start renewing it every ``ttl_s / 3`` seconds.

        Args:
            wait_s: how long to wait for another owner's lease to expire (a holder that was
                killed stops renewing, so its lease lapses within ``ttl_s``); default
                ``ttl_s + 5``. 0 refuses at once.

        Raises:
            LeaseHeldError: another owner's lease stayed live for ``wait_s`` (it is renewed:
                a live writer), or was taken at the same moment (checked after writing).
        """
        deadline = time.time() + (self.ttl_s + 5 if wait_s is None else wait_s)
        self._supersede(self._read())
        while True:
            try:
                self.check_free()
                break
            except LeaseHeldError:
                if time.time() >= deadline:
                    raise
                log.warning("waiting for the lease %s of another writer to expire", self.uri)
                time.sleep(min(1.0, self.ttl_s / 10))
        self._write()
        time.sleep(0.05)
        current = self._read()
        if current is None or not self._mine(current):
            raise LeaseHeldError(f"{self.uri} was taken by {current and current.get('owner')} at the same time")
        self._thread = threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True)
        self._thread.start()
        log.info("lease %s taken by %s", self.uri, self.owner)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                current = self._read()
                if current is not None and not self._mine(current):
                    log.error(
                        "lease %s was taken over by %s (attempt %s)",
                        self.uri,
                        current.get("owner"),
                        current.get("attempt"),
                    )
                    self.lost.set()
                    return
                self._write()
            except Exception as e:  # noqa: BLE001 - a missed renewal is retried next beat
                log.warning("lease renewal failed: %s", e)

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours (best effort: never raises).

        A release runs as its holder ends, often because storage failed: one read, without the
        storage layer's retries, so it neither waits out the outage again nor replaces the error
        that ended the holder; a failure is one warning naming the lease. A lease left behind
        lapses within ``ttl_s``, and on this host as soon as this process is gone.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            current = self._read(attempts=1)
        except Exception as e:  # noqa: BLE001 - best effort by contract
            error = classify(e)
            log.warning(
                "lease %s not released (it lapses within %.0f s): %s",
                self.uri,
                self.ttl_s,
                error if error is not None else f"{type(e).__name__}: {e}",
            )
            return
        if current is not None and self._mine(current):
            storage.remove(self.uri, recursive=False)

    def __enter__(self) -> StageLease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
