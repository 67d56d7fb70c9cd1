"""An ordered map over chunks of work, in this process or in ``num_proc`` worker processes.

prepare_data tokenises chunk by chunk; with ``data.num_proc`` > 1 the chunks go to a
``multiprocessing`` pool (``fork`` where the platform has it, else ``spawn``) and come back in
submission order, so the output does not depend on the number of processes. At most
``2 * num_proc`` chunks are in flight: the results held at once stay bounded whatever the size
of the data set. The workers start with ``TOKENIZERS_PARALLELISM=false`` (the ``tokenizers``
library would otherwise warn in every forked worker, its thread pool having been used in the
parent, and turn it off there anyway); the parent keeps its own setting.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from typing import Any, Callable, Iterable, Iterator

_WORKER: Callable[[Any], Any] | None = None
"""The function of this worker process (set by :func:`_install`)."""


def _install(worker: Callable[[Any], Any]) -> None:
    global _WORKER
    _WORKER = worker


def _run(task: Any) -> Any:
    assert _WORKER is not None, "worker process started without its function"
    return _WORKER(task)


class ChunkMap:
    """``map(worker, tasks)`` in order, in-process (``num_proc`` 1) or in a process pool.

    Use as a context manager; the pool is closed (its workers joined) on exit.

    Args:
        worker: a picklable callable (with ``spawn`` it is pickled once per worker; with
            ``fork`` the workers inherit it).
        num_proc: worker processes; 1 runs everything in the calling process.

    Raises:
        ValueError: ``num_proc`` below 1.
    """

    def __init__(self, worker: Callable[[Any], Any], num_proc: int) -> None:
        if num_proc < 1:
            raise ValueError(f"num_proc must be >= 1, got {num_proc}")
        self.worker = worker
        self.num_proc = num_proc
        self._pool: Any = None

    def __enter__(self) -> ChunkMap:
        if self.num_proc > 1:
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            saved = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers' environment, from their start on
            try:
                context = multiprocessing.get_context(method)
                self._pool = context.Pool(self.num_proc, initializer=_install, initargs=(self.worker,))
            finally:  # this process keeps its own setting (its BPE training uses the thread pool)
                if saved is None:
                    os.environ.pop("TOKENIZERS_PARALLELISM", None)
                else:
                    os.environ["TOKENIZERS_PARALLELISM"] = saved
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._pool is not None:
            if exc_type is None:
                self._pool.close()
            else:
                self._pool.terminate()
            self._pool.join()
            self._pool = None

    def map(self, tasks: Iterable[Any]) -> Iterator[Any]:
        """``worker(task)`` for each task, in order; a worker's exception is raised here."""
        if self._pool is None:
            yield from map(self.worker, tasks)
            return
        pending: deque = deque()
        for task in tasks:
            pending.append(self._pool.apply_async(_run, (task,)))
            if len(pending) >= 2 * self.num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
