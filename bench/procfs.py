"""The machine's CPU counters read from Linux ``/proc``, without torch: what ``common.py``'s load
measurements and ``bench_data_scale.py`` (which keeps its own process free of torch) both read."""

from __future__ import annotations


def cpu_ticks() -> tuple[int, int] | None:
    """(total, idle) clock ticks of all CPUs since boot, from ``/proc/stat``; None off Linux."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(values), values[3] + values[4]
