"""One writer per stage prefix: a lease object with an owner and an expiry.

A trainer takes ``<stage output>/lease.json`` before it writes anything and renews it from a
heartbeat thread; the flow takes ``<run>/lease.json`` for a whole pipeline run the same way. A second process that finds a live lease held by another owner is refused
with :class:`LeaseHeldError`. An expired lease (its holder died without releasing it) is taken
over: a writer that finds a live lease waits up to one ``ttl_s`` for it to lapse before it is
refused, so a relaunch after a hard kill (SIGKILL, OOM) goes on once the dead holder's lease
expires, while a second live writer, which keeps renewing, is refused. The same owner may
take its own lease again at once: a Prefect retry of a task run passes the same
``writer_id``, so it does not wait for the attempt it replaces. A lease records its holder's
host and pid: on the same host, a lease whose process is gone is stale at once (its holder was
killed), without waiting for it to expire.

Object stores have no compare-and-swap through fsspec, so acquisition is
write-then-read-back: two processes starting within the same moment could both believe they
hold the lease until the next heartbeat, when the loser logs an error and sets ``lost``. The
lease guards against a second pipeline run or a stray manual relaunch, not against
adversaries. Times are UTC epoch seconds from the writers' clocks; keep them within a small
fraction of ``ttl_s`` of each other.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from trainer_core import storage
from trainer_core.errors import PosttrainError
from trainer_core.storage import join_uri

log = logging.getLogger(__name__)

LEASE_NAME = "lease.json"


class LeaseHeldError(PosttrainError):
    """Another live writer holds the stage's lease."""


def default_owner() -> str:
    """``host:pid:random``: unique to this process."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _pid_namespace() -> str:
    """This process's pid namespace (``pid:[inode]``): pids compare only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def holder_alive(record: dict, now: float | None = None) -> bool:
    """Whether the lease ``record`` (``lease.json``'s content) is held by a live writer.

    Live: not expired and, when it was written on this host in this pid namespace (containers
    sharing a host name do not share pids), its process still exists.
    """
    now = time.time() if now is None else now
    if record.get("expires_at", 0) <= now:
        return False
    same_pids = record.get("host") == socket.gethostname() and record.get("pidns") == _pid_namespace() != ""
    if same_pids and isinstance(record.get("pid"), int):
        return _process_alive(record["pid"])
    return True


def read_lease(prefix_uri: str) -> dict | None:
    """``<prefix_uri>/lease.json`` with ``live`` (see :func:`holder_alive`) added; None when absent."""
    try:
        record = json.loads(storage.read_bytes(join_uri(prefix_uri, LEASE_NAME)))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError):
        return {"owner": None, "live": False}
    return {**record, "live": holder_alive(record)}


class StageLease:
    """The writer lease of one output prefix (a stage's output directory, or a whole run's).

    Args:
        prefix_uri: the directory the lease guards.
        owner: writer identity; the same string may re-take its own lease.
        ttl_s: seconds a lease lives without renewal.
        what: what a second writer would be doing, for the refusal message.

    Raises:
        ValueError: ``ttl_s`` is not positive.
    """

    def __init__(
        self, prefix_uri: str, owner: str | None = None, ttl_s: float = 30.0,
        what: str = "another process is training this stage of this run",
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.uri = join_uri(prefix_uri, LEASE_NAME)
        self.owner = owner or default_owner()
        self.ttl_s = ttl_s
        self.what = what
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = threading.Event()

    def _read(self) -> dict | None:
        try:
            return json.loads(storage.read_bytes(self.uri))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError):
            log.warning("unreadable lease %s; treating it as expired", self.uri)
            return None

    def _write(self) -> None:
        record = {
            "owner": self.owner, "expires_at": time.time() + self.ttl_s, "pid": os.getpid(),
            "host": socket.gethostname(), "pidns": _pid_namespace(),
        }
        storage.write_bytes(self.uri, json.dumps(record).encode())

    def check_free(self) -> None:
        """Raise :class:`LeaseHeldError` (naming the holder) when another live writer holds the lease."""
        current = self._read()
        if current and current.get("owner") != self.owner and holder_alive(current):
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
        if current is None or current.get("owner") != self.owner:
            raise LeaseHeldError(f"{self.uri} was taken by {current and current.get('owner')} at the same time")
        self._thread = threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True)
        self._thread.start()
        log.info("lease %s taken by %s", self.uri, self.owner)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                current = self._read()
                if current is not None and current.get("owner") != self.owner:
                    log.error("lease %s was taken over by %s", self.uri, current.get("owner"))
                    self.lost.set()
                    return
                self._write()
            except Exception as e:  # noqa: BLE001 - a missed renewal is retried next beat
                log.warning("lease renewal failed: %s", e)

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours (best effort)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        current = self._read()
        if current is not None and current.get("owner") == self.owner:
            storage.remove(self.uri, recursive=False)

    def __enter__(self) -> StageLease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
