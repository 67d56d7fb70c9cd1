"""Processes as the launch and failure tests see them (Linux ``/proc``), and the logger they give
``launch_stage_process``.

The tests read ``/proc`` themselves rather than through ``trainer_core.processes``: that module
is what the launcher and the writer lease stop processes with, so it cannot also be the
evidence that they are gone.
"""

from __future__ import annotations

import contextlib
from pathlib import Path


class ListLog:
    """A logger for ``launch_stage_process``: collects ``info`` lines; ``on_line`` may act on (or
    raise from) each one."""

    def __init__(self, on_line=None):
        self.lines: list[str] = []
        self.on_line = on_line

    def info(self, msg, *args):
        line = msg % args if args else msg
        self.lines.append(line)
        if self.on_line is not None:
            self.on_line(line)


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (killed, not yet reaped) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def command_lines() -> dict[int, str]:
    """pid -> command line (its arguments joined by spaces) of every process whose
    ``/proc/<pid>/cmdline`` can be read."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return found
