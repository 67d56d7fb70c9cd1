"""``launch_stage_process`` running real ``torchrun`` at 2 gloo ranks on CPU.

The ranks run ``fixtures/gloo_ranks.py`` (a stand-in trainer: all-reduce in a loop, one
sleeping subprocess per rank), not ``trainer_core.run``. torchrun starts every rank in a
session of its own, so killing torchrun's process group does not reach the ranks: these tests
check that nothing tagged with the test's id is alive once the launch returns, however it ended.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prefect.states import Failed

from tasks.launch.commands import launcher_command
from tasks.launch.failures import BadStageInput, StageFailed, raise_for_result
from tasks.launch.process import launch_stage_process, retry_condition
from tests.integration.helpers import free_port
from tests.processes import ListLog, alive, command_lines
from trainer_core.config import BackendConfig

FIXTURE = Path(__file__).parent / "fixtures" / "gloo_ranks.py"
BACKEND = BackendConfig(name="ddp", device="cpu", nproc_per_node=2)
PIDS = re.compile(r"pids rank=(\d+) pid=(\d+) ppid=(\d+) child=(\d+)")


def ranks_command(tag: str, *args: str) -> list[str]:
    """torchrun (the flags ``trainer_command`` uses) at 2 ranks on the fixture script."""
    return launcher_command(BACKEND, f"test-{tag}", [str(FIXTURE), "--tag", tag, *args])


def launched_pids(lines: list[str]) -> dict[int, list[int]]:
    """Rank -> [its pid, its parent (torchrun), its child] from the fixture's ``pids`` lines."""
    found = {}
    for line in lines:
        for m in PIDS.finditer(line):
            found[int(m.group(1))] = [int(g) for g in m.groups()[1:]]
    return found


def alive_with_tag(tag: str) -> list[str]:
    """``"<pid>: <command line>"`` of live processes that mention ``tag`` (torchrun, ranks, their children)."""
    return [f"{pid}: {cmdline}" for pid, cmdline in command_lines().items() if tag in cmdline and alive(pid)]


def assert_nothing_left(tag: str, pids: dict[int, list[int]]) -> None:
    assert sorted(pids) == [0, 1], f"both ranks should have started: {pids}"
    # No grace period: the launcher has SIGKILLed the tree and waited for it when it returns.
    survivors = [pid for triple in pids.values() for pid in triple if alive(pid)]
    assert not survivors, f"still alive: {survivors}"
    assert not alive_with_tag(tag)


@pytest.fixture
def tag() -> str:
    value = f"launch-ranks-{uuid.uuid4().hex[:8]}"
    yield value
    for line in alive_with_tag(value):  # never leave a leak behind a failed assertion
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)


@pytest.mark.parametrize(
    ("how", "exit_words"), [("sigkill", "killed by signal 9 (SIGKILL)"), ("exit3", "exited with code 3")]
)
def test_failed_rank_is_named_with_its_own_last_lines_and_the_tree_is_gone(tag, how, exit_words):
    log = ListLog()
    result = launch_stage_process(ranks_command(tag, "--fail", f"1:{how}"), env=None, log=log, timeout_s=60)
    assert result.returncode == 1 and not result.timed_out  # torchrun's own exit code
    with pytest.raises(StageFailed) as info:
        raise_for_result(result, "sft")
    error = info.value
    assert not isinstance(error, BadStageInput)
    assert error.rank == 1 and error.returncode == (-9 if how == "sigkill" else 3)
    message = str(error)
    assert "rank 1 (local rank 1 on" in message and exit_words in message
    assert f"rank 1 failing: {how}" in message
    shown = message.split("last output:\n", 1)[1]
    assert "rank 1 step 2" in shown and "rank 0 step" not in shown  # that rank's lines only
    assert_nothing_left(tag, launched_pids(log.lines))


def test_timeout_kills_every_rank_even_ranks_that_ignore_sigterm(tag):
    """The ranks ignore SIGTERM and torchrun waits 30 s before its own SIGKILL: only the
    launcher's sweep after ``kill_grace_s`` can end them within the test's time."""
    log = ListLog()
    start = time.monotonic()
    result = launch_stage_process(
        ranks_command(tag, "--ignore-sigterm"), env=None, log=log, timeout_s=16, kill_grace_s=1.0
    )
    # 16 s lets both ranks start on a loaded 2-core box; torchrun's own SIGKILL would come 30 s
    # after its SIGTERM, so ending within 25 s proves the launcher's sweep did it.
    assert result.timed_out and time.monotonic() - start < 25
    assert_nothing_left(tag, launched_pids(log.lines))
    with pytest.raises(StageFailed, match="timed out"):
        raise_for_result(result, "sft")


def test_exit_code_2_on_one_rank_is_bad_input(tag):
    log = ListLog()
    result = launch_stage_process(ranks_command(tag, "--fail", "1:exit2"), env=None, log=log, timeout_s=60)
    with pytest.raises(BadStageInput) as info:
        raise_for_result(result, "dpo")
    assert info.value.rank == 1 and info.value.returncode == 2
    assert "rank 1 failing: exit2" in str(info.value)
    assert retry_condition(None, None, Failed(data=info.value)) is False
    assert_nothing_left(tag, launched_pids(log.lines))


def test_interrupt_while_ranks_run_kills_the_tree(tag):
    """A KeyboardInterrupt (as Prefect's TerminationSignal on cancel) while forwarding output:
    torchrun is SIGKILLed, so it cannot stop its ranks; the launcher's sweep must."""
    seen: list[str] = []

    def interrupt(line):
        seen.append(line)
        if "rank 1 step 2" in line or "rank 0 step 2" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch_stage_process(ranks_command(tag), env=None, log=ListLog(interrupt), timeout_s=60)
    assert_nothing_left(tag, launched_pids(seen))


def test_deepspeed_launcher_runs_two_ranks_on_cpu(tag):
    """``launcher=deepspeed`` (DeepSpeed 0.19's runner, CPU accelerator): both ranks join one
    gloo group from its RANK/WORLD_SIZE/MASTER_* environment and finish; nothing is left."""
    backend = BackendConfig(name="deepspeed", device="cpu", nproc_per_node=2, launcher="deepspeed")
    log = ListLog()
    cmd = launcher_command(backend, f"test-{tag}", [str(FIXTURE), "--tag", tag, "--steps", "3"])
    result = launch_stage_process(cmd, env=None, log=log, timeout_s=120)
    assert result.returncode == 0, "\n".join(result.tail)
    assert any("rank 1 step 2 sum 4" in line for line in log.lines)
    assert_nothing_left(tag, launched_pids(log.lines))


def test_deepspeed_on_cpu_compiles_no_op(tmp_path):
    """``DeepSpeedBackend`` on CPU joins its gloo group without compiling DeepSpeed's
    shared-memory all-reduce op (a C++ build of about a minute into ``TORCH_EXTENSIONS_DIR``, which
    ``deepspeed.init_distributed`` runs on every CPU init and training never calls)."""
    extensions = tmp_path / "torch_extensions"
    code = (
        "from trainer_core.backends import build_backend\n"
        "from trainer_core.config import BackendConfig\n"
        "backend = build_backend(BackendConfig(name='deepspeed', device='cpu'))\n"
        "import torch.distributed as dist\n"
        "print('world', dist.get_world_size(), flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(extensions),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and "world 1" in done.stdout, (done.stdout + done.stderr)[-3000:]
    assert not list(extensions.rglob("*.so")), sorted(extensions.rglob("*"))
