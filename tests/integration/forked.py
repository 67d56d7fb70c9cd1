"""Stage processes forked from a warm interpreter: ``python -m trainer_core.run SPEC`` without
the ~5 s of imports.

A stage process spends about 5.5 of its 6-7 CPU seconds importing torch and transformers (see
bench/README.md, "The test suite's time"); the tiny stages of the tests train for well under a
second. The standard library's fork server (:mod:`multiprocessing.forkserver`) imports the stage
runner once per pytest process; each stage then runs in a fresh child forked from it. The child
is a real process of its own (own pid and session, killable with ``os.killpg``, its exit status
or ``-signal`` as ``returncode``) that runs ``trainer_core.run`` as ``python -m`` runs it
(:func:`runpy.run_module` as ``__main__``, ``sys.argv`` set, the interpreter's exit handlers run
at the end), with the environment, working directory and one compute thread a subprocess would
get, and its stdout and stderr in a file the test reads line by line. A script path (``.py``)
runs as ``python script`` runs it (:func:`runpy.run_path`); the ranks of a compute-only job are
forked the same way with torchrun's rank environment (``helpers.run_ranks_forked``).

What a fork does not give: the interpreter's start-up (``python -X``/``-m`` flags, ``site``), a
parent that is the test (its parent is the server, so ``trainer_core.run``'s parent watchdog
watches the server), and modules the server imported that a fresh stage would not have (the
stage runner's own imports only). Kills of a rank and every pipeline run through the CLI or a
flow stay real subprocesses.

A test that kills a stage at an output line hands the line's pattern in ``STOP_AT_ENV``: the
child stops itself right after writing it (:class:`StopAtLine`) and waits for the SIGKILL, so
the kill lands at that line even when the test's polling thread is starved of CPU.

The server imports only; it runs no torch op and starts no thread, so each fork starts from the
state a fresh interpreter has after its imports. ``POSTTRAIN_TEST_FORK=0`` launches every stage
as a subprocess instead (what a coverage measurement with ``COVERAGE_PROCESS_START`` needs).
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import re
import runpy
import signal
import sys
import threading
from multiprocessing.context import ForkServerContext
from pathlib import Path

PRELOAD = ["trainer_core.run", "trainer_core.stages.runner", "tests.integration.forked"]
"""Modules the fork server imports before it forks (a stage imports the rest lazily, as a fresh
process would)."""

STOP_AT_ENV = "POSTTRAIN_TEST_STOP_AT"
"""A regular expression: the forked child stops itself (SIGSTOP) right after it writes the first
stdout line that matches it, so the test can SIGKILL it exactly there (see :class:`StopAtLine`).
The child removes the variable from its environment before the stage starts."""

_lock = threading.Lock()
_context: ForkServerContext | None = None


def enabled() -> bool:
    """Whether single-process stages are forked (default) rather than started as subprocesses."""
    return os.environ.get("POSTTRAIN_TEST_FORK", "1") != "0"


def _server(env: dict[str, str]) -> ForkServerContext:
    """The fork-server context, started on first use with ``env`` (the stage processes' one)."""
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            saved = dict(os.environ)
            try:
                # the server's interpreter starts with the stages' environment (one compute thread)
                os.environ.clear()
                os.environ.update(env)
                from multiprocessing import forkserver

                forkserver.ensure_running()
            finally:
                os.environ.clear()
                os.environ.update(saved)
            _context = ctx
        return _context


class StopAtLine(io.TextIOWrapper):
    """The forked child's stdout when the test kills it at a line: each complete line written is
    matched against ``pattern``; after the first match is written and flushed, the whole process
    stops (``SIGSTOP``, every thread) until the test's SIGKILL arrives.

    Why: a tiny stage runs 12 steps in well under a second; a test that polls the output from
    another process can miss a 0.2 s window on a loaded 2-core machine and see the stage finish
    before the kill point. Stopped at the line, the stage is killed with the state it had when it
    wrote it (a checkpoint's "committed" log line follows its manifest on storage).
    """

    def __init__(self, fd: int, pattern: str) -> None:
        super().__init__(io.FileIO(fd, "w", closefd=False), line_buffering=True)
        self._pattern = re.compile(pattern)
        self._pending = ""
        self._stopped = False

    def write(self, s: str) -> int:
        n = super().write(s)
        if self._stopped:
            return n
        self._pending += s
        if "\n" in self._pending:
            *complete, self._pending = self._pending.split("\n")
            if any(self._pattern.search(line) for line in complete):
                self._stopped = True
                self.flush()
                os.kill(os.getpid(), signal.SIGSTOP)
        return n


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (state ``T`` in ``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[-1].split()[0] == "T"


def _run_module(module: str, args: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """In the forked child: become what ``python -m module args...`` (``module`` a path ending in
    ``.py``: ``python module args...``) in ``cwd`` with ``env`` would be, run it, and exit with
    its status."""
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    stop_at = os.environ.pop(STOP_AT_ENV, None)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if stop_at is None:
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    else:
        sys.stdout = StopAtLine(1, stop_at)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [module, *args]
    code: int = 0
    try:
        if module.endswith(".py"):
            sys.path.insert(0, os.path.dirname(os.path.abspath(module)))  # as for a script
            runpy.run_path(module, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - an uncaught exception, as the interpreter reports it
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_server(env: dict[str, str]) -> None:
    """Start the fork server now (once), its interpreter with ``env``; later calls do nothing."""
    _server(env)


class ForkedProcess:
    """A ``python -m <module>`` process forked from the fork server; quacks like the parts of
    :class:`subprocess.Popen` the test helpers use (``pid``, ``poll``, ``wait``, ``returncode``).

    Its merged stdout/stderr go to ``log_path``; :meth:`read_lines` tails it.
    """

    def __init__(
        self, module: str, args: list[str], env: dict[str, str], cwd: str | Path, log_path: str | Path
    ) -> None:
        self.log_path = str(log_path)
        Path(self.log_path).write_bytes(b"")
        ctx = _server(env)
        self._process = ctx.Process(
            target=_run_module, args=(module, list(args), env, str(cwd), self.log_path), daemon=False
        )
        self._process.start()
        self.pid: int = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def stopped(self) -> bool:
        """Whether it stopped itself at its :data:`STOP_AT_ENV` line (and waits for the kill)."""
        return self.poll() is None and stopped(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit; returns the status.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
        """
        self._process.join(timeout)
        if self.poll() is None:
            raise TimeoutError(f"process {self.pid} still running after {timeout}s")
        return self.returncode

    def kill_group(self) -> None:
        """SIGKILL its session's process group (the process itself if it has not made one yet)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def read_lines(self, lines: list[str], stop: threading.Event, poll_s: float = 0.002) -> None:
        """Append the log's complete lines to ``lines`` as they are written, until ``stop`` is set
        and the log is read to its end."""
        with open(self.log_path, "rb") as f:
            partial = b""
            while True:
                chunk = f.read()
                if chunk:
                    partial += chunk
                    *done, partial = partial.split(b"\n")
                    lines.extend(line.decode(errors="replace") for line in done)
                elif stop.is_set():
                    break
                else:
                    stop.wait(poll_s)
            if partial:
                lines.append(partial.decode(errors="replace"))
