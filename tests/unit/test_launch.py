"""tasks/launch.py against real child processes (small ``python -c`` scripts)."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest
from prefect.states import Failed

from tasks.launch import (
    BadStageInput,
    LaunchResult,
    StageFailed,
    launch_stage_process,
    raise_for_result,
    retry_condition,
    trainer_command,
)
from trainer_core.config import PipelineConfig


class ListLog:
    """Collects ``info`` lines; ``on_line`` may act on (or raise from) each one."""

    def __init__(self, on_line=None):
        self.lines: list[str] = []
        self.on_line = on_line

    def info(self, msg, *args):
        line = msg % args if args else msg
        self.lines.append(line)
        if self.on_line is not None:
            self.on_line(line)


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (killed, not yet reaped by init) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_dead(pid: int, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return not alive(pid)


SPAWN_GRANDCHILD = """
    import subprocess, sys, time
    gc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(f"pids {__import__('os').getpid()} {gc.pid}", flush=True)
    time.sleep(60)
"""


def pids_from(lines: list[str]) -> tuple[int, int]:
    line = next(line for line in lines if line.startswith("pids "))
    child, grandchild = line.split()[1:]
    return int(child), int(grandchild)


def test_output_is_streamed_line_by_line_while_child_runs(tmp_path):
    """The child waits for a marker the logger writes on its first line: it can only print
    'second' (and exit 0) if 'first' reached the logger while the child was still running."""
    marker = tmp_path / "seen-first"

    def on_line(line):
        if line == "first":
            marker.write_text("x")

    log = ListLog(on_line)
    code = f"""
        import os, sys, time
        print("first", flush=True)
        deadline = time.time() + 10
        while not os.path.exists({str(marker)!r}):
            if time.time() > deadline:
                sys.exit(1)
            time.sleep(0.02)
        print("second", file=sys.stderr, flush=True)
    """
    result = launch_stage_process(py(code), env=None, log=log, timeout_s=30, poll_interval_s=0.05)
    assert result.returncode == 0
    assert log.lines == ["first", "second"]  # stderr merged into the same stream
    assert result.tail == ["first", "second"]
    assert result.wall_s > 0 and not result.timed_out


def test_nonzero_exit_raises_stage_failed_with_tail():
    log = ListLog()
    code = """
        import sys
        for i in range(100):
            print(f"line {i}")
        sys.exit(3)
    """
    result = launch_stage_process(py(code), env=None, log=log, timeout_s=30, tail_lines=50)
    assert result.returncode == 3
    assert len(log.lines) == 100
    assert result.tail == [f"line {i}" for i in range(50, 100)]
    with pytest.raises(StageFailed) as info:
        raise_for_result(result, "sft")
    assert not isinstance(info.value, BadStageInput)
    assert info.value.returncode == 3
    assert info.value.tail[-1] == "line 99"
    assert "line 99" in str(info.value) and "'sft'" in str(info.value)


def test_exit_code_2_raises_bad_stage_input_and_is_not_retried():
    result = launch_stage_process(
        py("import sys; print('bad config: sft.max_steps', flush=True); sys.exit(2)"),
        env=None,
        log=ListLog(),
        timeout_s=30,
    )
    with pytest.raises(BadStageInput) as info:
        raise_for_result(result, "sft")
    assert info.value.returncode == 2 and "bad config" in str(info.value)
    assert retry_condition(None, None, Failed(data=info.value)) is False
    assert retry_condition(None, None, Failed(data=StageFailed("boom", 1))) is True


def test_env_is_passed_to_child():
    log = ListLog()
    env = dict(os.environ, POSTTRAIN_TEST_VALUE="42")
    launch_stage_process(
        py("import os; print(os.environ['POSTTRAIN_TEST_VALUE'])"), env=env, log=log, timeout_s=30
    )
    assert log.lines == ["42"]


def test_timeout_kills_child_and_grandchild():
    log = ListLog()
    start = time.monotonic()
    result = launch_stage_process(py(SPAWN_GRANDCHILD), env=None, log=log, timeout_s=1.5, kill_grace_s=1.0)
    assert time.monotonic() - start < 10
    assert result.timed_out and result.returncode != 0
    child, grandchild = pids_from(log.lines)
    assert wait_dead(child) and wait_dead(grandchild)
    with pytest.raises(StageFailed, match="timed out"):
        raise_for_result(result, "dpo")


def test_timeout_sigkills_a_child_that_ignores_sigterm():
    code = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """
    start = time.monotonic()
    result = launch_stage_process(py(code), env=None, log=ListLog(), timeout_s=1.0, kill_grace_s=0.5)
    assert result.timed_out and result.returncode == -9
    assert time.monotonic() - start < 10


def test_exception_in_polling_thread_kills_the_group():
    """A KeyboardInterrupt (as Prefect's TerminationSignal would) raised while forwarding output
    propagates, and the child and grandchild are both gone."""
    seen: list[str] = []

    def interrupt(line):
        if line.startswith("pids "):
            seen.append(line)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch_stage_process(py(SPAWN_GRANDCHILD), env=None, log=ListLog(interrupt), timeout_s=60)
    child, grandchild = pids_from(seen)
    assert wait_dead(child) and wait_dead(grandchild)


def test_grandchild_holding_the_pipe_does_not_hang_a_finished_stage():
    code = """
        import subprocess, sys
        gc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(f"pids 0 {gc.pid}", flush=True)
    """
    log = ListLog()
    start = time.monotonic()
    result = launch_stage_process(py(code), env=None, log=log, timeout_s=30, poll_interval_s=0.05)
    assert result.returncode == 0 and not result.timed_out
    assert time.monotonic() - start < 8
    assert wait_dead(pids_from(log.lines)[1])


def test_trainer_command_single_backend():
    cmd = trainer_command("memory://runs/r/specs/sft.json", PipelineConfig())
    assert cmd == [sys.executable, "-m", "trainer_core.run", "memory://runs/r/specs/sft.json"]


def test_clean_result_does_not_raise():
    raise_for_result(LaunchResult(returncode=0, tail=["ok"], wall_s=0.1), "sft")
