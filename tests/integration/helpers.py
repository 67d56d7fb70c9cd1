"""Shared machinery of the integration tests: a tiny pipeline config, stage specs, stage
processes launched (and killed) the way the stage tasks launch them, and what the tests read
back from them (metric lines, failure causes, checkpoints, weights).

Every stage runs as ``python -m trainer_core.run <spec>`` in a process of its own pinned to
one CPU thread (``OMP_NUM_THREADS=1``): the runs compared bit for bit must do the same
float reductions, and one thread per process lets two processes share the 2-core CI box.
A single-process stage is forked from a warm interpreter that has imported the stage runner
(:mod:`tests.integration.forked`: 5 of a tiny stage's 6 seconds are imports);
``POSTTRAIN_TEST_FORK=0`` starts it as a subprocess instead. Ranks start under torchrun.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.integration import forked
from tests.tiny import TINY_DATA, TINY_GATES, TINY_MODEL
from trainer_core import registry, storage
from trainer_core.checkpoint.manifest import MANIFEST_NAME, parse_step_dirname, step_dirname
from trainer_core.config import PipelineConfig, load_config
from trainer_core.registry import TRAINING_STAGES, get_stage
from trainer_core.spec import StageSpec, build_spec
from trainer_core.storage import StageLayout, join_uri

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"
RUN_ID = "itest"
MAX_STEPS = 12
SAVE_EVERY = 4

_DATA_OVERRIDES = {
    # tests/tiny.py's task and model, with the sizes the stage-by-stage checks were written against
    # stated over them: more rows (the reward model's 71 training pairs below, 32 held-out rows), a
    # 2-layer model and a 300-token vocabulary.
    **TINY_DATA,
    **TINY_MODEL,
    "data.synthetic.num_problems": 200,
    "data.synthetic.num_pairs": 120,
    "data.synthetic.max_operand": 20,
    "data.max_length_tokens": 96,
    "data.max_prompt_length_tokens": 48,
    "data.eval_fraction": 0.1,
    "data.max_eval_rows": 32,
    "tokenizer.vocab_size": 300,
    "model.init.num_hidden_layers": 2,
    "model.init.max_position_embeddings": 128,
}
_TRAIN_OVERRIDES = {
    "max_steps": MAX_STEPS,
    "save_every": SAVE_EVERY,
    "eval_every": SAVE_EVERY,
    "eval_max_batches": 2,
    "micro_batch_size": 4,
    "grad_accum_steps": 1,
    "warmup_steps": 2,
    "log_every": 1,
    "keep_last_checkpoints": 2,
}
_STAGE_OVERRIDES = {
    # 16 pairs a step over the 71 training pairs (5 micro-batches an epoch): the step-8
    # checkpoint sits inside epoch 1, so a resume from it starts mid-way through a reshuffled epoch.
    # The scalar head (the default; configs/demo.yaml's implicit reward model runs in the e2e tiny demo).
    "reward_model": {"micro_batch_size": 16, "parameterization": "scalar_head"},
    # Two micro-batches a step: accumulation state must not leak across a resume.
    "dpo": {"grad_accum_steps": 2},
}

STEP_LINE = re.compile(r"\[(?P<stage>\w+)\] step (?P<step>\d+): (?P<metrics>.*)$")
TIMING_METRICS = ("train/tokens_per_s", "rollout/tokens_per_s")
"""Logged metrics that measure wall time: never equal between two runs."""

PRINTED_REL = 1e-3
"""Tolerance on printed metrics: the lines print 4 significant digits (``%.4g``), so two runs
whose floats differ in the 7th digit may print values one unit apart in the 4th (<= 1e-3 relative)."""
PRINTED_ABS = 1e-5
"""Absolute tolerance on printed metrics near 0: DPO's reward metrics (beta x log-ratio, ~1e-3)
come from reference log-probs computed in batches of 8 on one device and of 4 at 2 ranks, whose
padding differs; measured: 8e-7 apart (rewards/margins, step 6)."""


def tiny_overrides() -> dict[str, object]:
    """``key.path -> value`` overrides shrinking the demo config to a seconds-long run per stage."""
    out: dict[str, object] = {**_DATA_OVERRIDES, **TINY_GATES}
    for stage in TRAINING_STAGES:
        fields = PipelineConfig.model_fields[get_stage(stage).section].annotation.model_fields
        for key, value in {**_TRAIN_OVERRIDES, **_STAGE_OVERRIDES.get(stage, {})}.items():
            if key in fields:  # the RL sections have none of the supervised loop's fields
                out[f"{stage}.{key}"] = value
    return out


def tiny_config(root: str) -> PipelineConfig:
    """The demo config with :func:`tiny_overrides`, writing under ``root``."""
    return load_config(str(DEMO_CONFIG), overrides={**tiny_overrides(), "storage.root": root})


def stage_inputs(stage: str, data_uri: str, sft_model_uri: str | None) -> dict[str, str]:
    """The input roles of ``stage`` (``sft``, ``reward_model`` or ``dpo``), wired as the pipeline
    flow wires them: the registry's (:func:`trainer_core.registry.stage_inputs`) for the tiny
    config, whose stages set no ``*_from`` (SFT starts from ``init``, the others from SFT's
    output), given prepare_data's output ``data_uri`` and, after SFT, its model."""
    outputs = {"prepare_data": data_uri}
    if stage != "sft":
        assert sft_model_uri is not None, f"{stage} needs the SFT model"
        outputs["sft"] = sft_model_uri
    if stage not in ("sft", "reward_model", "dpo"):
        raise ValueError(f"not a training stage: {stage}")
    return registry.stage_inputs(_wiring_config(), stage, outputs)


@functools.cache
def _wiring_config() -> PipelineConfig:
    """The tiny config whose wiring :func:`stage_inputs` reads (loaded once; only read)."""
    return load_config(str(DEMO_CONFIG), overrides=tiny_overrides())


def write_spec(spec: StageSpec, path: str | Path) -> str:
    """Write ``spec`` as JSON to the local ``path``; returns the path."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(spec.model_dump_json())
    return str(path)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a stage process: one compute thread, no MLflow server, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_"))}
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        TQDM_DISABLE="1",
    )
    env.update(extra or {})
    return env


@dataclass
class StageRun:
    """What one stage process did.

    Attributes:
        returncode: exit status; ``-signal.SIGKILL`` when the test killed it.
        lines: its stdout and stderr lines, in order.
        killed: the test killed it (the kill condition came true while it ran).
        wall_s: seconds from launch to exit.
    """

    returncode: int
    lines: list[str]
    killed: bool
    wall_s: float

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    def step_metrics(self) -> dict[int, dict[str, str]]:
        """``{global_step: {metric: printed value}}`` from every ``[stage] step N: ...`` line.

        Train and eval lines of the same step are merged; wall-time metrics are left out.
        Values stay the printed strings: equal strings are what "the same lines" means.
        """
        out: dict[int, dict[str, str]] = {}
        for line in self.lines:
            m = STEP_LINE.search(line)
            if not m:
                continue
            values = out.setdefault(int(m["step"]), {})
            for pair in m["metrics"].split():
                key, _, value = pair.partition("=")
                if key not in TIMING_METRICS:
                    values[key] = value
        return out


def stage_lines(run: StageRun, stage: str) -> StageRun:
    """``run`` with only ``stage``'s metric lines (a job that ran several stages)."""
    lines = [line for line in run.lines if (m := STEP_LINE.search(line)) is None or m["stage"] == stage]
    return StageRun(returncode=run.returncode, lines=lines, killed=run.killed, wall_s=run.wall_s)


EXIT_ABORT = "terminate called without an active exception"


def why_failed(run: StageRun) -> str:
    """The end of a failed job's output, preceded by the known cause when its signature shows."""
    tail = run.tail(60)
    if EXIT_ABORT in run.output and "committed: global_step" in run.output:
        return (
            f"a rank aborted ({EXIT_ABORT!r}, SIGABRT) at process exit after the stage committed: "
            "Backend.close destroys the process group while wrapped models kept by reference "
            "cycles still hold it (see test_no_garbage_model_holds_the_process_group_when_it_is_destroyed)\n" + tail
        )
    return tail


def start_process(cmd: list[str], env: dict[str, str] | None) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """Start ``cmd`` from the repo root in a session of its own (:func:`child_env` plus ``env``);
    a daemon thread appends its merged stdout/stderr lines to the returned list."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, lines, reader


def run_stage(
    spec_path: str,
    *,
    kill_when: Callable[[list[str]], bool] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 240.0,
    poll_s: float = 0.002,
) -> StageRun:
    """Run ``python -m trainer_core.run <spec_path>``; SIGKILL its process group once ``kill_when`` holds.

    The process is forked from the warm fork server (:func:`start_forked`) unless
    ``POSTTRAIN_TEST_FORK=0`` (then a subprocess, :func:`start_process`).

    Args:
        spec_path: the stage spec file.
        kill_when: polled every ``poll_s`` with the output lines so far; when it returns True the
            whole process group gets SIGKILL (no cleanup runs, as when a node dies). A
            :class:`KillPoint` also makes a forked stage stop itself at its line until the kill.
        env: extra environment variables for the child.
        timeout_s: kill and fail after this long.
        poll_s: polling interval.

    Raises:
        AssertionError: ``kill_when`` was given but the stage exited before it held.
        TimeoutError: the stage ran past ``timeout_s``.
    """
    t0 = time.monotonic()
    if forked.enabled():
        if isinstance(kill_when, KillPoint):
            env = {**(env or {}), forked.STOP_AT_ENV: kill_when.pattern}
        proc, lines, reader, done = start_forked("trainer_core.run", [spec_path], env)
        kill_group = proc.kill_group
    else:
        proc, lines, reader = start_process([sys.executable, "-m", "trainer_core.run", spec_path], env)
        done = None

        def kill_group() -> None:
            os.killpg(proc.pid, signal.SIGKILL)

    killed = False
    try:
        while proc.poll() is None:
            if kill_when is not None and (kill_when(lines) or (done is not None and proc.stopped())):
                kill_group()
                killed = True
                break
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{spec_path} ran past {timeout_s}s:\n" + "\n".join(lines[-40:]))
            time.sleep(poll_s)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_group()
            proc.wait()
        if done is not None:
            done.set()
        reader.join(timeout=30)
        if done is None:
            proc.stdout.close()
        else:
            os.unlink(proc.log_path)
    run = StageRun(returncode=proc.returncode, lines=lines, killed=killed, wall_s=time.monotonic() - t0)
    if kill_when is not None and not killed:
        raise AssertionError(f"{spec_path} exited (rc={run.returncode}) before the kill point:\n{run.tail()}")
    return run


def start_forked(
    module: str, args: list[str], env: dict[str, str] | None, lines: list[str] | None = None
) -> tuple[forked.ForkedProcess, list[str], threading.Thread, threading.Event]:
    """``python -m module args...`` (or ``python module args...`` for a ``.py`` path) forked from
    the warm fork server (:mod:`tests.integration.forked`), from the repo root, in a session of
    its own, with :func:`child_env` plus ``env``; a daemon thread appends its merged stdout/stderr
    lines to ``lines`` (default: a new list, returned) until the event is set."""
    forked.start_server(child_env())  # the server's own environment: a stage's, without per-run variables
    fd, log_path = tempfile.mkstemp(prefix="stage-", suffix=".log")
    os.close(fd)
    proc = forked.ForkedProcess(module, args, child_env(env), REPO_ROOT, log_path)
    lines = [] if lines is None else lines
    done = threading.Event()
    reader = threading.Thread(target=proc.read_lines, args=(lines, done), daemon=True)
    reader.start()
    return proc, lines, reader, done


def step_checkpoints(output_uri: str, step: int, committed: bool = True) -> list[str]:
    """URIs of the ``step-XXXXXXXX[-<attempt>]`` checkpoint directories of ``step`` under
    ``output_uri`` (only those with a manifest when ``committed``), by name."""
    ckpts = StageLayout(output_uri).checkpoints
    if not storage.exists(ckpts):
        return []
    names = sorted(n for n in storage.list_dirs(ckpts) if (parse_step_dirname(n) or (None,))[0] == step)
    uris = [join_uri(ckpts, n) for n in names]
    return [u for u in uris if storage.exists(join_uri(u, MANIFEST_NAME))] if committed else uris


def after_checkpoint(output_uri: str, step: int) -> Callable[[list[str]], bool]:
    """Kill condition: a checkpoint of ``step`` under ``output_uri`` is committed (manifest on storage)."""
    return lambda _lines: bool(step_checkpoints(output_uri, step))


@dataclass(frozen=True)
class KillPoint:
    """Kill condition: the stage wrote an output line matching ``pattern`` (``re.search``).

    Called with the output lines, as any ``kill_when``. :func:`run_stage` also hands the pattern
    to a forked stage, which stops itself right after writing the line
    (:class:`tests.integration.forked.StopAtLine`), so the kill lands there however loaded the
    machine is; a subprocess stage is killed when the polling sees the line.
    """

    pattern: str

    def __call__(self, lines: list[str]) -> bool:
        return any(re.search(self.pattern, line) for line in lines)


def after_step(stage: str, step: int) -> KillPoint:
    """Kill condition: the stage printed the metrics line of optimizer step ``step``."""
    return KillPoint(rf"^\[{re.escape(stage)}\] step {step}:")


def after_checkpoint_line(step: int) -> KillPoint:
    """Kill condition: the stage logged that its checkpoint of ``step`` is committed (the line
    follows the manifest's write; any attempt's directory of that step)."""
    return KillPoint(rf"checkpoint \S*/{step_dirname(step)}(-[0-9a-f]+)? committed")


def committed_steps(output_uri: str) -> list[int]:
    """Global steps of the checkpoints of ``output_uri`` that have a manifest, ascending (a step
    committed by two attempts listed once)."""
    ckpts = StageLayout(output_uri).checkpoints
    steps = set()
    for name in storage.list_dirs(ckpts):
        parsed = parse_step_dirname(name)
        if parsed is not None and storage.exists(join_uri(ckpts, name, MANIFEST_NAME)):
            steps.add(parsed[0])
    return sorted(steps)


def checkpoint_uri(output_uri: str, step: int) -> str:
    """The checkpoint directory of ``step`` under ``output_uri``: the (last by name) committed one,
    else the last one written, else where an attempt-less save would put it
    (``<output_uri>/checkpoints/step-XXXXXXXX``)."""
    found = step_checkpoints(output_uri, step) or step_checkpoints(output_uri, step, committed=False)
    return found[-1] if found else join_uri(StageLayout(output_uri).checkpoints, step_dirname(step))


def copy_checkpoint(output_uri: str, step: int, new_output_uri: str) -> str:
    """A fresh stage output holding only ``output_uri``'s ``step`` checkpoint; returns the copy's URI."""
    target = checkpoint_uri(new_output_uri, step)
    shutil.copytree(checkpoint_uri(output_uri, step), target)
    return target


def final_weights(output_uri: str) -> dict[str, torch.Tensor]:
    """The tensors of ``<output_uri>/final/model.safetensors`` (any storage)."""
    return safetensors.torch.load(storage.read_bytes(join_uri(StageLayout(output_uri).final, "model.safetensors")))


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every tensor bit-identical (same names, dtypes, shapes and values)."""
    assert sorted(actual) == sorted(expected)
    differ = [k for k in expected if actual[k].dtype != expected[k].dtype or not torch.equal(actual[k], expected[k])]
    assert not differ, f"{len(differ)}/{len(expected)} tensors differ, e.g. {differ[:5]}"


def assert_close_lines(actual: dict[int, dict[str, str]], expected: dict[int, dict[str, str]]) -> None:
    """Same steps, same metric names; every printed value (train and eval loss, grad norm, LR, DPO
    rewards ...) within :data:`PRINTED_REL` or :data:`PRINTED_ABS`; consumed samples equal."""
    assert sorted(actual) == sorted(expected)
    for step, values in expected.items():
        assert sorted(actual[step]) == sorted(values), step
        for key, value in values.items():
            got = actual[step][key]
            if key == "train/consumed_samples":
                assert got == value, (step, key)
            assert float(got) == pytest.approx(float(value), rel=PRINTED_REL, abs=PRINTED_ABS), (step, key, got, value)


@dataclass
class TinyPipeline:
    """Prepared data plus one uninterrupted run of every training stage: the references.

    Attributes:
        root: local directory holding everything.
        config: the tiny pipeline config.
        data_uri: prepare_data's final directory.
        baseline_uris: training stage -> output URI of its uninterrupted run.
        baseline_runs: training stage -> that run.
    """

    root: str
    config: PipelineConfig
    data_uri: str
    baseline_uris: dict[str, str] = field(default_factory=dict)
    baseline_runs: dict[str, StageRun] = field(default_factory=dict)

    def spec(self, stage: str, output_uri: str, writer_id: str | None = None) -> StageSpec:
        """The spec of ``stage`` writing to ``output_uri``; models come from the baselines.

        A relaunch after a kill passes the killed run's ``writer_id`` (what a retry of the same
        task run is meant to do), so the dead process's unexpired lease does not refuse it.
        """
        sft = self.baseline_uris.get("sft")
        inputs = stage_inputs(stage, self.data_uri, StageLayout(sft).final if sft else None)
        return build_spec(self.config, stage, RUN_ID, inputs, output_uri=output_uri, writer_id=writer_id)

    def write_spec(self, stage: str, output_uri: str, path: str, writer_id: str | None = None) -> str:
        """Write :meth:`spec` to the local ``path``; returns the path."""
        return write_spec(self.spec(stage, output_uri, writer_id), path)

    def run_baseline(self, stage: str) -> StageRun:
        """Run ``stage`` uninterrupted into ``<root>/baseline/<stage>`` and record it."""
        uri = os.path.join(self.root, "baseline", stage)
        run = run_stage(self.write_spec(stage, uri, os.path.join(self.root, "specs", f"baseline-{stage}.json")))
        assert run.returncode == 0, run.tail()
        self.baseline_uris[stage] = uri
        self.baseline_runs[stage] = run
        return run


# --- Multi-rank stage processes (torchrun) ----------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a torchrun rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(nproc: int, args: list[str], port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run`` on one node, ``nproc`` ranks, c10d rendezvous on loopback.

    Args:
        nproc: ranks (processes) to start.
        args: what each rank runs: ``["-m", module, ...]`` or ``[script, ...]``.
        port: rendezvous port; default: a free one.
    """
    endpoint = f"127.0.0.1:{port or free_port()}"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--max-restarts",
        "0",
        *args,
    ]


@dataclass(frozen=True)
class ProcInfo:
    """One row of ``/proc/<pid>/stat``: ``state`` is the one-letter state (``Z``: zombie);
    ``start_ticks`` the start time in clock ticks since boot (with ``pid``, a process's identity)."""

    pid: int
    ppid: int
    pgid: int
    state: str
    start_ticks: int

    @property
    def key(self) -> tuple[int, int]:
        """``(pid, start_ticks)``: unlike the pid alone, never reused by a later process."""
        return self.pid, self.start_ticks

    @property
    def alive(self) -> bool:
        """Running or sleeping; a zombie (dead, not yet reaped) counts as dead."""
        return self.state not in ("Z", "X")


def process_table() -> dict[int, ProcInfo]:
    """Every process visible in ``/proc`` (pid -> :class:`ProcInfo`)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        table[int(entry)] = ProcInfo(int(entry), int(fields[1]), int(fields[2]), fields[0], int(fields[19]))
    return table


def descendants(pid: int, table: dict[int, ProcInfo]) -> set[int]:
    """Pids of ``pid``'s children, their children, and so on (not ``pid`` itself)."""
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def env_rank(pid: int) -> int | None:
    """``RANK`` in the environment of process ``pid`` (None if unset or unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"RANK="):
                    return int(item[5:])
    except (OSError, ValueError):
        pass
    return None


@dataclass
class RanksRun(StageRun):
    """What one torchrun job did (``returncode``: torchrun's own exit status).

    Attributes:
        rank_pids: rank -> pid of its process (read from the ``RANK`` in its environment).
        job: ``(pid, start_ticks)`` of every process seen in the job while it ran: torchrun, the
            ranks, their children (see :attr:`ProcInfo.key`).
        survivors: ``/proc`` lines of processes still alive when torchrun exited that belong to
            the job (one of ``job``, or a later member of torchrun's or a rank's process group;
            torchrun starts every rank in a session of its own). The helper then kills them.
        kill_to_exit_s: seconds from the rank kill to torchrun's exit (None without a kill).
    """

    rank_pids: dict[int, int] = field(default_factory=dict)
    job: set[tuple[int, int]] = field(default_factory=set)
    survivors: list[str] = field(default_factory=list)
    kill_to_exit_s: float | None = None

    @property
    def job_pids(self) -> set[int]:
        return {pid for pid, _ in self.job}


def _job_members(run: RanksRun, launcher: ProcInfo) -> list[ProcInfo]:
    """Live processes of ``run``'s job: seen in it, or in the process group of torchrun
    (``launcher``) or of a rank and started after torchrun."""
    groups = {launcher.pid, *run.rank_pids.values()}
    return [
        info
        for info in process_table().values()
        if info.alive
        and info.pid != os.getpid()
        and (info.key in run.job or (info.pgid in groups and info.start_ticks >= launcher.start_ticks))
    ]


def run_ranks(
    args: list[str],
    nproc: int,
    *,
    kill_rank: int | None = None,
    kill_when: Callable[[list[str]], bool] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
    poll_s: float = 0.005,
    torchrun: bool = False,
) -> RanksRun:
    """Run ``args`` at ``nproc`` ranks under torchrun; optionally SIGKILL one rank (only it) mid-run.

    A job without a kill whose ranks only compute (``torchrun`` False) is started by
    :func:`run_ranks_forked` instead, unless ``POSTTRAIN_TEST_FORK=0``: its ranks are forked
    from the warm fork server with torchrun's environment. A kill, or ``torchrun=True``, runs
    the real torchrun (its agent, its rendezvous, its handling of a dead rank).

    torchrun runs in a session of its own, like :func:`run_stage`'s process. While it runs, the
    job's processes are recorded from ``/proc`` (ranks by their ``RANK``); when it exits, the
    ones still alive are recorded in ``survivors`` and killed.

    Args:
        args: what each rank runs (see :func:`torchrun_command`).
        nproc: ranks.
        kill_rank: the rank to SIGKILL once ``kill_when`` holds (the other ranks and torchrun are
            left to react on their own).
        kill_when: polled every ``poll_s`` with the output lines so far.
        env: extra environment variables.
        timeout_s: kill the whole job and fail after this long.
        poll_s: polling interval.
        torchrun: run the job under torchrun even without a kill.

    Raises:
        AssertionError: ``kill_when`` was given but the job exited before it held.
        TimeoutError: the job ran past ``timeout_s`` (everything in it is killed first).
    """
    assert (kill_rank is None) == (kill_when is None), "kill_rank and kill_when go together"
    if kill_rank is None and not torchrun and forked.enabled():
        return run_ranks_forked(args, nproc, env=env, timeout_s=timeout_s)
    t0 = time.monotonic()
    proc, lines, reader = start_process(torchrun_command(nproc, args), env)
    launcher = process_table()[proc.pid]  # alive (or a zombie) until waited for
    run = RanksRun(returncode=0, lines=lines, killed=False, wall_s=0.0, job={launcher.key})
    killed_at = None
    last_scan = 0.0
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if now - last_scan > 0.05 or len(run.rank_pids) < nproc:
                last_scan = now
                table = process_table()
                found = descendants(proc.pid, table)
                run.job |= {table[pid].key for pid in found}
                for pid in found - set(run.rank_pids.values()):
                    if table[pid].ppid == proc.pid and (rank := env_rank(pid)) is not None:
                        run.rank_pids[rank] = pid
            if kill_when is not None and not run.killed and kill_rank in run.rank_pids and kill_when(lines):
                os.kill(run.rank_pids[kill_rank], signal.SIGKILL)
                run.killed, killed_at = True, time.monotonic()
            if now - t0 > timeout_s:
                raise TimeoutError(f"torchrun {args} ran past {timeout_s}s:\n" + "\n".join(lines[-40:]))
            time.sleep(poll_s if len(run.rank_pids) == nproc else 0.01)
        if killed_at is not None:
            run.kill_to_exit_s = time.monotonic() - killed_at
        left = _job_members(run, launcher)
        run.survivors = [f"{p.pid} (ppid {p.ppid}, pgid {p.pgid}, state {p.state})" for p in left]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for info in _job_members(run, launcher):
            with contextlib.suppress(ProcessLookupError):
                os.kill(info.pid, signal.SIGKILL)
        reader.join(timeout=30)
        proc.stdout.close()
    run.returncode, run.wall_s = proc.returncode, time.monotonic() - t0
    if kill_when is not None and not run.killed:
        raise AssertionError(f"torchrun {args} exited (rc={run.returncode}) before the kill point:\n{run.tail()}")
    return run


def run_ranks_forked(
    args: list[str], nproc: int, *, env: dict[str, str] | None = None, timeout_s: float = 300.0, poll_s: float = 0.005
) -> RanksRun:
    """Run ``args`` (``["-m", module, ...]`` or ``[script, ...]``) at ``nproc`` ranks forked from
    the warm fork server (:mod:`tests.integration.forked`), each with the environment torchrun
    gives a rank on one node (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK``, ``ROLE_*``, ``MASTER_ADDR``/``MASTER_PORT``: rank 0 hosts the store).

    As torchrun does, a rank that exits non-zero fails the job (``returncode`` 1) and the others
    are killed. ``lines`` holds every rank's output lines as they were read.

    Raises:
        TimeoutError: the job ran past ``timeout_s`` (every rank is killed first).
    """
    module, rest = (args[1], args[2:]) if args[0] == "-m" else (args[0], args[1:])
    t0 = time.monotonic()
    port = str(free_port())
    lines: list[str] = []
    ranks: list[tuple[forked.ForkedProcess, threading.Thread, threading.Event]] = []
    run = RanksRun(returncode=0, lines=lines, killed=False, wall_s=0.0)
    try:
        for rank in range(nproc):
            rank_env = {
                **(env or {}),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": "0",
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(nproc),
                "ROLE_NAME": "default",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
            proc, _, reader, done = start_forked(module, rest, rank_env, lines=lines)
            ranks.append((proc, reader, done))
            run.rank_pids[rank] = proc.pid
        while True:
            codes = [proc.poll() for proc, _, _ in ranks]
            if any(code not in (None, 0) for code in codes):
                run.returncode = 1
                break
            if all(code == 0 for code in codes):
                break
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"ranks {args} ran past {timeout_s}s:\n" + "\n".join(lines[-40:]))
            time.sleep(poll_s)
    finally:
        for proc, reader, done in ranks:
            if proc.poll() is None:
                proc.kill_group()
                proc.wait(timeout=60)
            done.set()
            reader.join(timeout=30)
            os.unlink(proc.log_path)
    run.wall_s = time.monotonic() - t0
    return run


def run_stage_ranks(spec_path: str, nproc: int, **kwargs) -> RanksRun:
    """Run ``python -m trainer_core.run <spec_path>`` at ``nproc`` ranks under torchrun (see :func:`run_ranks`)."""
    return run_ranks(["-m", "trainer_core.run", spec_path], nproc, **kwargs)


def random_llama(pipeline: TinyPipeline, path: str, seed: int, **sizes: int) -> str:
    """A random Llama of ``sizes`` (``LlamaConfig`` arguments: widths, layers, heads) with the
    pipeline's tokenizer, saved at ``path`` once (an HF directory, as another run's SFT output
    would be), weights drawn from ``seed``. Returns ``path``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainer_core.data.prepared import load_tokenizer_from

    if not os.path.exists(os.path.join(path, "config.json")):
        tokenizer = load_tokenizer_from(pipeline.data_uri)
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            max_position_embeddings=256,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sizes,
        )
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def wider_teacher(pipeline: TinyPipeline, path: str) -> str:
    """A causal LM twice as wide as the tiny student with two layers (random weights, seed 7) and
    the pipeline's tokenizer (:func:`random_llama`): the distillation tests' teacher. Returns ``path``."""
    width = 2 * pipeline.config.model.init.hidden_size
    return random_llama(
        pipeline,
        path,
        7,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
