"""Two nodes simulated on one machine: a 2-node x 2-rank FSDP2 SFT run as two node processes,
``python -m tasks.launch.process SPEC --node-rank N`` (what each pod of the Kubernetes Indexed Job
runs), meeting at a c10d rendezvous on loopback:

- the 4-rank job prints the single device's lines (the same 16 examples a step);
- node 1's torchrun agent (only it; its ranks run in sessions of their own) SIGKILLed after
  the first checkpoint: both nodes end non-zero, no rank of either is left running, and the
  same two commands launched again resume from the newest committed checkpoint and finish with
  the uninterrupted 4-rank run's weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from trainer_core.checkpoint.manifest import read_manifest
from trainer_core.config import load_config
from trainer_core.spec import build_spec
from trainer_core.storage import StageLayout

from .helpers import (
    REPO_ROOT,
    RUN_ID,
    StageRun,
    after_checkpoint,
    assert_close_lines,
    child_env,
    committed_steps,
    descendants,
    final_weights,
    free_port,
    process_table,
    run_stage,
    stage_inputs,
    why_failed,
    write_spec,
)

STEPS, SAVE_EVERY = 8, 4
NODE_TIMEOUT_S = 300.0
KILL_TO_EXIT_S = 90.0
"""How long node 0 may take to fail once node 1 is gone (its ranks see the broken collective)."""


@dataclass
class Job:
    """Both nodes of one launch: their merged output lines and exit codes."""

    nodes: list[subprocess.Popen]
    lines: list[list[str]]

    def run(self) -> StageRun:
        """The job as one run: node 0's lines (rank 0 prints the metrics), the worst exit code."""
        codes = [p.returncode for p in self.nodes]
        return StageRun(returncode=max(codes, key=abs), lines=self.lines[0] + self.lines[1], killed=False, wall_s=0.0)


def launch_nodes(spec_path: str) -> Job:
    """Start node 0 and node 1 of the spec's job, each in a session of its own."""
    nodes, lines = [], []
    for rank in (0, 1):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tasks.launch.process", spec_path, "--node-rank", str(rank)],
            cwd=REPO_ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        out: list[str] = []
        os.set_blocking(proc.stdout.fileno(), False)
        nodes.append(proc)
        lines.append(out)
    return Job(nodes, lines)


def pump(job: Job) -> None:
    """Move whatever the nodes printed into ``job.lines``."""
    for proc, out in zip(job.nodes, job.lines):
        while True:
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line.rstrip("\n"))


def torchrun_agent(node: subprocess.Popen) -> int | None:
    """The pid of the torchrun agent a node's ``tasks.launch.process`` process started (None before it has)."""
    table = process_table()
    for pid in descendants(node.pid, table):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"torch.distributed.run" in cmdline and table[pid].ppid == node.pid:
            return pid
    return None


def wait(job: Job, timeout_s: float, kill_node1_when=None) -> float | None:
    """Wait for both nodes; SIGKILL node 1's torchrun agent (only that process) once
    ``kill_node1_when()`` holds. Returns the seconds from that kill to node 0's exit (None
    without a kill)."""
    t0, killed_at, node0_exit = time.monotonic(), None, None
    while any(p.poll() is None for p in job.nodes):
        pump(job)
        if kill_node1_when is not None and killed_at is None and kill_node1_when():
            agent = torchrun_agent(job.nodes[1])
            assert agent is not None, "node 1 has no torchrun agent"
            os.kill(agent, signal.SIGKILL)
            killed_at = time.monotonic()
        if node0_exit is None and job.nodes[0].poll() is not None:
            node0_exit = time.monotonic()
        if time.monotonic() - t0 > timeout_s:
            for p in job.nodes:
                os.killpg(p.pid, signal.SIGKILL)
            raise TimeoutError("\n".join(job.lines[0][-40:] + job.lines[1][-40:]))
        time.sleep(0.01)
    pump(job)
    if node0_exit is None:
        node0_exit = time.monotonic()
    return None if killed_at is None else node0_exit - killed_at


def launched_ranks(launch_marker: str) -> list[str]:
    """Live processes whose command line names the spec of this job (its ranks and agents)."""
    alive = []
    for pid, info in process_table().items():
        if not info.alive or pid == os.getpid():
            continue
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if launch_marker in cmdline:
            alive.append(f"{pid}: {cmdline}")
    return alive


@pytest.fixture(scope="module")
def runs(tiny_pipeline, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("two-nodes"))
    batch = {
        "sft.global_batch_size": 16,
        "sft.micro_batch_size": 4,
        "sft.max_steps": STEPS,
        "sft.save_every": SAVE_EVERY,
        "sft.eval_every": SAVE_EVERY,
        "sft.keep_last_checkpoints": STEPS,
    }
    base = tiny_pipeline.config.model_dump(mode="json")
    inputs = stage_inputs("sft", tiny_pipeline.data_uri, None)

    def spec_path(name: str, overrides: dict) -> tuple[str, str]:
        config = load_config(base=base, overrides={**batch, **overrides})
        output = os.path.join(root, name)
        return write_spec(build_spec(config, "sft", RUN_ID, inputs, output_uri=output), f"{output}.spec.json"), output

    single_path, _ = spec_path("single", {})
    single = run_stage(single_path)
    assert single.returncode == 0, why_failed(single)
    out = {"single": single}
    for name in ("nodes", "killed"):
        nodes = {
            "backend.name": "fsdp2",
            "backend.nnodes": 2,
            "backend.nproc_per_node": 2,
            "backend.rdzv_endpoint": f"127.0.0.1:{free_port()}",
            "backend.rdzv_id": f"two-nodes-{name}",
        }
        path, output = spec_path(name, nodes)
        job = launch_nodes(path)
        if name == "nodes":
            wait(job, NODE_TIMEOUT_S)
            out["nodes"] = (job, output)
            continue
        first_checkpoint = after_checkpoint(output, SAVE_EVERY)
        kill_to_exit = wait(job, NODE_TIMEOUT_S, kill_node1_when=lambda: first_checkpoint([]))
        left = launched_ranks(path)
        committed = committed_steps(output)
        relaunch = launch_nodes(path)
        wait(relaunch, NODE_TIMEOUT_S)
        out["killed"] = (job, kill_to_exit, left, committed, relaunch, output)
    return out


def test_two_nodes_track_the_single_device(runs):
    job, output = runs["nodes"]
    assert [p.returncode for p in job.nodes] == [0, 0], why_failed(job.run())
    assert_close_lines(job.run().step_metrics(), runs["single"].step_metrics())
    manifest = read_manifest(StageLayout(output).final)
    assert (manifest.backend, manifest.world_size, manifest.global_step) == ("fsdp2", 4, STEPS)


def test_killed_node_fails_both_nodes_and_the_relaunch_resumes(runs):
    job, kill_to_exit, left, committed, relaunch, output = runs["killed"]
    print(
        f"node exits {[p.returncode for p in job.nodes]}, node 0 failed {kill_to_exit:.1f} s after the kill, "
        f"committed {committed}"
    )
    assert job.nodes[1].returncode not in (0, None), "node 1 must fail once its agent is gone"
    assert job.nodes[0].returncode not in (0, None), "node 0 must fail once node 1 is gone"
    assert kill_to_exit is not None and kill_to_exit < KILL_TO_EXIT_S, kill_to_exit
    assert left == [], left  # no rank of either node outlives the failed job
    assert committed and committed[-1] < STEPS
    assert [p.returncode for p in relaunch.nodes] == [0, 0], why_failed(relaunch.run())
    assert f"at global_step {committed[-1]}" in relaunch.run().output
    finished, uninterrupted = final_weights(output), final_weights(runs["nodes"][1])
    assert sorted(finished) == sorted(uninterrupted)
    assert all(torch.equal(finished[k], uninterrupted[k]) for k in uninterrupted)
