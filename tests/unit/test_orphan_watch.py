"""trainer_core/run.py's parent watchdog against real processes: a trainer stops once the process
that launched it is gone, also while that process is a zombie (killed, not yet reaped).

Under torchrun a rank's own parent is the agent, which outlives a SIGKILLed CLI, so only the
launcher check (``POSTTRAIN_WATCH_PID``) can notice. A killed CLI stays a zombie until its own
parent reaps it (a shell does at once; a Python harness holding its ``Popen`` only once it waits),
and signal 0 reaches a zombie: the watchdog must read the process's state, not probe it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.processes import alive
from trainer_core.processes import process_start
from trainer_core.run import EXIT_PARENT_GONE, WATCH_PID_ENV, process_alive

RANK = (
    "import time; from trainer_core.run import watch_parent; watch_parent(poll_s=0.1); "
    "print('watching', flush=True); time.sleep(60)"
)
"""A stand-in for a rank: the watchdog, then a minute of "training"."""


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_zombie(proc: subprocess.Popen, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while _state(proc.pid) != "Z":
        assert time.monotonic() < deadline, f"{proc.pid} did not become a zombie"
        time.sleep(0.01)


def test_a_zombie_is_not_alive():
    """SIGKILLed and not reaped: the pid still answers signal 0, but the process is gone."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert process_alive(child.pid)
        child.kill()
        _wait_zombie(child)
        os.kill(child.pid, 0)  # what process_alive used to rely on: it succeeds on a zombie
        assert not process_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not process_alive(child.pid)


def test_a_pid_taken_by_another_process_is_not_the_one_watched():
    """A pid with another start time than the one recorded is another process (the pid was reused)."""
    me = os.getpid()
    assert process_alive(me, started=process_start(me))
    assert not process_alive(me, started=process_start(me) + 1)


def test_a_rank_exits_when_its_launcher_is_a_zombie_and_its_own_parent_lives():
    """The torchrun case: the rank's parent (here the test, standing in for the agent) is alive;
    the launcher it watches is SIGKILLed and left unreaped. The rank exits within a second or so,
    with :data:`EXIT_PARENT_GONE` and a line naming the launcher."""
    launcher = subprocess.Popen(["sleep", "60"])
    env = {**os.environ, WATCH_PID_ENV: str(launcher.pid), "PYTHONPATH": os.getcwd()}
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert rank.stdout.readline().strip() == "watching"
        launcher.kill()  # not reaped: a zombie
        _wait_zombie(launcher)
        t0 = time.monotonic()
        try:
            code = rank.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        gone_s = time.monotonic() - t0
        assert code == EXIT_PARENT_GONE, f"the rank kept running {gone_s:.1f}s after its launcher died (zombie)"
        assert gone_s < 3
        assert f"launching process {launcher.pid} is gone" in rank.stderr.read()
    finally:
        for proc in (rank, launcher):
            if alive(proc.pid):
                proc.send_signal(signal.SIGKILL)
            proc.wait()
