"""Seconds spent in the phases of an optimizer step (forward, backward, optimizer), true on any device.

On CUDA the host runs ahead of the device: ``time.perf_counter`` around a forward measures how
long its kernels took to *launch*, not to run. :class:`CudaPhaseTimer` instead records a pair of
``torch.cuda.Event(enable_timing=True)`` on the current stream around each phase and reads their
``elapsed_time`` only when asked, at logging time, after the loop's one device-to-host read of the
step's metrics: the events are complete by then and reading them waits for nothing. On the CPU,
where every op returns when done, :class:`HostPhaseTimer` uses ``time.perf_counter``. Steps that
do not log get a :class:`NullPhaseTimer` (nothing recorded).

A phase entered several times in a step (once per micro-batch) sums its intervals. Event timing
follows the PyTorch CUDA semantics notes ("Asynchronous execution": time with events, or after
``torch.cuda.synchronize()``) and torchtitan's reasoning for keeping the step free of host waits.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

import torch


class PhaseTimer(Protocol):
    """Times named phases of one optimizer step."""

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Context around one interval of phase ``name``."""

    def seconds(self) -> dict[str, float]:
        """Seconds per phase entered (summed over its intervals); call once the step has been read."""


class NullPhaseTimer:
    """Records nothing (a step that does not log)."""

    def phase(self, name: str) -> AbstractContextManager[None]:
        return nullcontext()

    def seconds(self) -> dict[str, float]:
        return {}


class HostPhaseTimer:
    """``time.perf_counter`` intervals: the phase's time where ops run synchronously (CPU)."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self._seconds[name] = self._seconds.get(name, 0.0) + (time.perf_counter() - start)

    def seconds(self) -> dict[str, float]:
        return dict(self._seconds)


class CudaPhaseTimer:
    """CUDA event pairs on the current stream of ``device``, read in :meth:`seconds` only.

    Recording an event enqueues it; nothing here waits for the device until :meth:`seconds`,
    which waits for the last event (already complete once the loop has read the step's metrics).

    Args:
        device: the CUDA device the step runs on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._intervals: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._record()
        yield
        self._intervals.append((name, start, self._record()))

    def seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, start, end in self._intervals:
            end.synchronize()
            out[name] = out.get(name, 0.0) + start.elapsed_time(end) / 1000.0
        return out


def phase_timer(device: torch.device, enabled: bool = True) -> PhaseTimer:
    """The timer for a step on ``device``: CUDA events on CUDA, ``perf_counter`` elsewhere, nothing
    when not ``enabled``."""
    if not enabled:
        return NullPhaseTimer()
    if device.type == "cuda":
        return CudaPhaseTimer(device)
    return HostPhaseTimer()
