"""tasks/launch/process.py against real child processes (small ``python -c`` scripts), the launcher
commands tasks/launch/commands.py builds, and tasks/launch/failures.py on torchrun failure summaries captured
from real 2-rank runs."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prefect.states import Failed

from tasks.launch.commands import trainer_command
from tasks.launch.failures import (
    BadStageInput,
    RankFailure,
    StageFailed,
    StageResourceError,
    blamed_failure,
    parse_torchrun_failures,
    raise_for_result,
)
from tasks.launch.process import LaunchResult, launch_stage_process, retry_condition
from tests.processes import ListLog, alive
from trainer_core.config import BackendConfig, load_config


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


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
    launch_stage_process(py("import os; print(os.environ['POSTTRAIN_TEST_VALUE'])"), env=env, log=log, timeout_s=30)
    assert log.lines == ["42"]


@pytest.mark.parametrize("flow_value", [None, "ACTIVE"])
def test_trainer_env_waits_passively_unless_the_flow_says_otherwise(monkeypatch, flow_value):
    """OpenMP threads of a trainer sleep while they wait (tasks.stages.SHARED_CPU_ENV) unless the
    flow's own environment sets the policy."""
    from tasks.stages import _spec_config_and_env

    if flow_value is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", flow_value)
    _, env = _spec_config_and_env(load_config())
    assert env["OMP_WAIT_POLICY"] == (flow_value or "PASSIVE")
    assert env["TQDM_DISABLE"] == "1"


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


def test_a_grandchild_in_its_own_session_is_swept():
    """torchrun starts each rank with ``start_new_session=True``, out of reach of ``killpg`` on
    the child's group; the launch id in their environment still finds them."""
    code = """
        import subprocess, sys
        gc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"pids 0 {gc.pid}", flush=True)
    """
    log = ListLog()
    result = launch_stage_process(py(code), env=None, log=log, timeout_s=30)
    assert result.returncode == 0
    assert wait_dead(pids_from(log.lines)[1], within_s=0.5)


def test_launch_ids_of_nested_launches_are_kept():
    env = dict(os.environ, POSTTRAIN_LAUNCH_ID="outer")
    log = ListLog()
    launch_stage_process(py("import os; print(os.environ['POSTTRAIN_LAUNCH_ID'])"), env=env, log=log, timeout_s=30)
    outer, inner = log.lines[0].split(":")
    assert outer == "outer" and len(inner) == 32


URI = "memory://runs/r/specs/sft.json"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TRAINER = ["-m", "trainer_core.run", URI]


def test_trainer_command_single_backend():
    cmd = trainer_command(URI, BackendConfig(), "r-sft")
    assert cmd == [sys.executable, "-m", "trainer_core.run", URI]


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "deepspeed"])
def test_trainer_command_one_node_runs_torchrun_with_a_loopback_rendezvous(name):
    cmd = trainer_command(URI, BackendConfig(name=name, nproc_per_node=2), "r-sft")
    assert cmd == [
        *TORCHRUN,
        "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", "r-sft",
        "--rdzv-conf", "is_host=true", "--max-restarts", "0", "--tee", "3",
        *TRAINER,
    ]  # fmt: skip


def test_world_size_1_with_a_distributed_backend_still_goes_through_torchrun():
    cmd = trainer_command(URI, BackendConfig(name="fsdp2", nproc_per_node=1), "r-sft")
    assert cmd[:3] == TORCHRUN and cmd[cmd.index("--nproc-per-node") + 1] == "1"


@pytest.mark.parametrize(("node_rank", "is_host"), [(0, "true"), (1, "false")])
def test_trainer_command_two_nodes(node_rank, is_host):
    """Every node gets the same endpoint and id; node 0 hosts the c10d store (torchrun ignores
    ``--node-rank`` for c10d, so node_rank is expressed as ``is_host``)."""
    backend = BackendConfig(
        name="ddp", nproc_per_node=8, nnodes=2, node_rank=node_rank, rdzv_endpoint="sft-run42-0.sft-run42:29500"
    )
    cmd = trainer_command(URI, backend, "run42-sft")
    flags = dict(zip(cmd[3:-3:2], cmd[4:-3:2], strict=True))
    assert flags == {
        "--nnodes": "2", "--nproc-per-node": "8", "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "sft-run42-0.sft-run42:29500", "--rdzv-id": "run42-sft",
        "--rdzv-conf": f"is_host={is_host}", "--max-restarts": "0", "--tee": "3",
    }  # fmt: skip
    assert cmd[-3:] == TRAINER


def test_configured_rdzv_id_wins_over_the_default():
    cmd = trainer_command(URI, BackendConfig(name="ddp", nproc_per_node=2, rdzv_id="shared-job"), "r-sft")
    assert cmd[cmd.index("--rdzv-id") + 1] == "shared-job"


def test_deepspeed_launcher_command():
    cmd = trainer_command(URI, BackendConfig(name="deepspeed", nproc_per_node=2, launcher="deepspeed"), "r-sft")
    assert cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    assert cmd[-3:] == ["--module", "trainer_core.run", URI]
    flags = cmd[3:-3]
    assert flags[flags.index("--num_nodes") + 1] == "1" and flags[flags.index("--num_gpus") + 1] == "2"
    assert flags[flags.index("--master_addr") + 1] == "127.0.0.1"
    assert 0 < int(flags[flags.index("--master_port") + 1]) < 65536
    assert "--no_local_rank" in flags and flags[flags.index("--hostfile") + 1] == "/dev/null"
    pinned = BackendConfig(name="deepspeed", nproc_per_node=2, launcher="deepspeed", rdzv_endpoint="10.0.0.5:29600")
    flags = trainer_command(URI, pinned, "r-sft")
    assert flags[flags.index("--master_addr") + 1] == "10.0.0.5" and flags[flags.index("--master_port") + 1] == "29600"


def test_deepspeed_launcher_refuses_several_nodes():
    backend = BackendConfig(name="deepspeed", nproc_per_node=2, nnodes=2, rdzv_endpoint="h:1", launcher="deepspeed")
    with pytest.raises(ValueError, match="launcher=torchrun"):
        trainer_command(URI, backend, "r-sft")


def test_stage_backend_override_picks_the_launcher():
    """``sft.backend`` is merged over ``backend``; stages without an optimizer run one process."""
    config = load_config(overrides=["backend.name=fsdp2", "backend.nproc_per_node=2", "sft.backend.name=ddp"])
    assert trainer_command(URI, config.backend_for("sft"), "r-sft")[:3] == TORCHRUN
    assert config.backend_for("sft").name == "ddp" and config.backend_for("dpo").name == "fsdp2"
    assert trainer_command(URI, config.backend_for("evaluate"), "r-evaluate") == [sys.executable, *TRAINER]


# Real torchrun (torch 2.13) output of tests/integration/fixtures/gloo_ranks.py at 2 ranks, captured with
#   python -m torch.distributed.run <torchrun_args(ddp x 2)> tests/integration/fixtures/gloo_ranks.py \
#       --fail 1:exit3 --steps 20 > rank1_exit3.log 2>&1
# (likewise --fail 1:sigkill, --fail 1:exit2, --fail 0:exit3 --fail 1:exit2, --fail 1:raise;
# rank1_sigkill_misattributed.log is a --fail 1:sigkill run, two at a time until torchrun blamed rank 0).
CAPTURED = Path(__file__).resolve().parents[1] / "integration" / "fixtures" / "torchrun_output"


def replay(name: str) -> LaunchResult:
    """The captured output printed again by a real child that exits 1, as torchrun did."""
    code = f"import sys; sys.stdout.write(open({str(CAPTURED / name)!r}).read()); sys.exit(1)"
    return launch_stage_process([sys.executable, "-c", code], env=None, log=ListLog(), timeout_s=30)


def test_parse_torchrun_summary_root_cause_and_other_failures():
    lines = (CAPTURED / "rank1_sigkill.log").read_text().splitlines()
    assert parse_torchrun_failures(lines) == [
        RankFailure(rank=0, local_rank=0, exitcode=-15, host="localhost", root_cause=False,
                    traceback="Signal 15 (SIGTERM) received by PID 368"),
        RankFailure(rank=1, local_rank=1, exitcode=-9, host="localhost", root_cause=True,
                    traceback="Signal 9 (SIGKILL) received by PID 369"),
    ]  # fmt: skip
    assert parse_torchrun_failures(["no summary here"]) == []


def test_parse_multiline_traceback_from_an_error_file():
    lines = (CAPTURED / "rank1_raise.log").read_text().splitlines()
    [other, root] = parse_torchrun_failures(lines)
    assert (root.rank, root.exitcode, root.root_cause) == (1, 1, True)
    assert root.error_file.endswith("/1/error.json")
    assert root.traceback.startswith("Traceback (most recent call last):")
    assert root.traceback.splitlines()[-1] == "ValueError: rank 1 cannot go on"
    assert other.traceback.splitlines()[-1].startswith("RuntimeError: [")


@pytest.mark.parametrize(
    ("log", "error", "code", "last"),
    [
        ("rank1_exit3.log", StageResourceError, 3, "rank 1 failing: exit3"),  # 3: EXIT_RESOURCE
        ("rank1_sigkill.log", StageFailed, -9, "rank 1 failing: sigkill"),
        ("rank1_exit2.log", BadStageInput, 2, "rank 1 failing: exit2"),
        ("rank1_raise.log", StageFailed, 1, "rank 1 failing: raise"),
        ("rank1_sigkill_misattributed.log", StageFailed, -9, "rank 1 failing: sigkill"),
    ],
)
def test_failure_names_the_rank_with_its_own_tail(log, error, code, last):
    result = replay(log)
    assert result.returncode == 1 and set(result.rank_tails) == {0, 1}
    with pytest.raises(StageFailed) as info:
        raise_for_result(result, "sft")
    assert type(info.value) is error and info.value.rank == 1 and info.value.returncode == code
    message = str(info.value)
    assert message.startswith("stage 'sft' trainer rank 1 (local rank 1 on localhost) ")
    shown = message.split("last output:\n", 1)[1]
    assert last in shown and "[rank0]" not in shown and "rank 0 step" not in shown
    assert info.value.tail == result.tail  # the interleaved tail is still kept
    assert message.endswith("also failed: rank 0 was killed by signal 15 (SIGTERM)")
    if log == "rank1_raise.log":
        assert "ValueError: rank 1 cannot go on" in message.split("traceback:\n", 1)[1]


def test_a_rank_that_lost_its_peer_is_not_blamed():
    """Captured under load: rank 1 was SIGKILLed; rank 0 then raised "Connection reset by peer"
    (its error file dated a second before torchrun noticed rank 1), so torchrun's root cause is
    rank 0. Rank 0 was also stopped by torchrun (SIGTERM): a consequence either way."""
    result = replay("rank1_sigkill_misattributed.log")
    failures = parse_torchrun_failures(result.launcher_lines)
    assert [(f.rank, f.exitcode, f.root_cause) for f in failures] == [(1, -9, False), (0, -15, True)]
    assert blamed_failure(failures) == failures[0]  # SIGTERM alone marks rank 0
    exited = [RankFailure(**{**vars(f), "exitcode": 1}) if f.rank == 0 else f for f in failures]
    assert blamed_failure(exited) == exited[0]  # "reset by peer" ends its traceback
    bare = [RankFailure(**{**vars(f), "traceback": ""}) for f in exited]
    assert blamed_failure(bare, result.rank_tails) == bare[0]  # and its last lines
    assert blamed_failure(bare) == bare[1]  # with neither: torchrun's root cause


def test_bad_input_on_any_rank_wins_over_the_root_cause():
    """Captured: rank 0 exited 3 and rank 1 exited 2 in the same step; torchrun's root cause is
    rank 0, but a retry cannot fix rank 1's bad input."""
    result = replay("rank0_exit3_rank1_exit2.log")
    failures = parse_torchrun_failures(result.launcher_lines)
    assert [(f.rank, f.exitcode, f.root_cause) for f in failures] == [(1, 2, False), (0, 3, True)]
    assert blamed_failure(failures) == failures[0]
    with pytest.raises(BadStageInput) as info:
        raise_for_result(result, "sft")
    assert info.value.rank == 1 and "rank 1 failing: exit2" in str(info.value)


def test_rank_tails_are_kept_apart_from_the_interleaved_tail():
    code = """
        for i in range(30):
            print(f"[default0]:zero {i}")
            print(f"[default1]:one {i}")
        print("launcher line")
    """
    result = launch_stage_process(py(code), env=None, log=ListLog(), timeout_s=30, tail_lines=10)
    assert result.rank_tails == {0: [f"zero {i}" for i in range(20, 30)], 1: [f"one {i}" for i in range(20, 30)]}
    assert result.launcher_lines == ["launcher line"] and len(result.tail) == 10


def test_clean_result_does_not_raise():
    raise_for_result(LaunchResult(returncode=0, tail=["ok"], wall_s=0.1), "sft")
