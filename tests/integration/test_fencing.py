"""Fencing a stage attempt whose torchrun agent died while its ranks live on (issue 15).

torchrun starts each rank in a session of its own: SIGKILL the agent alone and the ranks live on.
Each rank's parent watchdog (``trainer_core/run.py``) ends it within a second, unless the rank
cannot run: here a 2-rank FSDP2 SFT (attempt A, launch id ``fence-a``) has its ranks frozen
(SIGSTOP, as a rank stuck in a slow storage write) while it writes a checkpoint, then loses its
agent, and the same stage is relaunched at once under the same ``writer_id`` (what a Prefect
retry of the task run does; attempt B, launch id ``fence-b``):

- A's ranks are alive (frozen) when B starts, after the watchdog's interval; B's rank 0 stops
  them (SIGKILL by A's launch id) before it takes the stage's lease, without waiting for A's
  lease to expire, so A never writes again;
- every checkpoint attempt-named and committed under ``checkpoints/`` verifies (sizes and
  SHA-256 of every file): no attempt wrote into another's files;
- B ends with the uninterrupted 2-rank run's weights, bit for bit.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from trainer_core.checkpoint.manifest import MANIFEST_NAME, parse_step_dirname, verify
from trainer_core.config import load_config
from trainer_core.processes import marked_pids
from trainer_core.run import PARENT_POLL_S
from trainer_core.spec import build_spec
from trainer_core.storage import StageLayout, join_uri

from .helpers import (
    RUN_ID,
    assert_same_weights,
    final_weights,
    run_stage_ranks,
    stage_inputs,
    start_process,
    step_checkpoints,
    torchrun_command,
    why_failed,
    write_spec,
)

STEPS, SAVE_EVERY, KILL_AT = 12, 2, 4
WRITER = "prefect-task-run:fencing-test"


def _checkpoint_under_way(output: str, step: int) -> bool:
    """A directory of ``step``'s checkpoint exists (being written, or just committed)."""
    return bool(step_checkpoints(output, step, committed=False))


@pytest.fixture(scope="module")
def runs(tiny_pipeline, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fencing"))
    overrides = {
        "backend.name": "fsdp2",
        "backend.nproc_per_node": 2,
        "sft.max_steps": STEPS,
        "sft.save_every": SAVE_EVERY,
        "sft.eval_every": SAVE_EVERY,
        "sft.keep_last_checkpoints": STEPS,
    }
    config = load_config(base=tiny_pipeline.config.model_dump(mode="json"), overrides=overrides)
    inputs = stage_inputs("sft", tiny_pipeline.data_uri, None)

    def spec_path(name: str) -> tuple[str, str]:
        output = os.path.join(root, name)
        spec = build_spec(config, "sft", RUN_ID, inputs, output_uri=output, writer_id=WRITER)
        return write_spec(spec, f"{output}.spec.json"), output

    path, baseline = spec_path("uninterrupted")
    uninterrupted = run_stage_ranks(path, 2)
    assert uninterrupted.returncode == 0, why_failed(uninterrupted)

    path, output = spec_path("fenced")
    agent, lines_a, reader_a = start_process(
        torchrun_command(2, ["-m", "trainer_core.run", path]), {"POSTTRAIN_LAUNCH_ID": "fence-a"}
    )
    deadline = time.monotonic() + 240
    while not _checkpoint_under_way(output, KILL_AT):
        assert agent.poll() is None, "attempt A ended before its checkpoint:\n" + "\n".join(lines_a[-40:])
        assert time.monotonic() < deadline, "no checkpoint of step 4:\n" + "\n".join(lines_a[-40:])
        time.sleep(0.005)
    ranks_a = marked_pids("fence-a")  # the agent and its ranks (all carry the launch id)
    for pid in ranks_a:
        if pid != agent.pid:
            os.kill(pid, signal.SIGSTOP)
    os.kill(agent.pid, signal.SIGKILL)  # the agent only: its ranks run in sessions of their own
    committed_at_kill = bool(step_checkpoints(output, KILL_AT))
    agent.wait()
    time.sleep(3 * PARENT_POLL_S)  # past the watchdog's interval: frozen, the ranks cannot act on it
    ranks_a = marked_pids("fence-a")

    relaunch, lines_b, reader_b = start_process(
        torchrun_command(2, ["-m", "trainer_core.run", path]), {"POSTTRAIN_LAUNCH_ID": "fence-b"}
    )
    left_a = []
    try:
        relaunch.wait(timeout=300)
        left_a = marked_pids("fence-a")
    finally:
        if relaunch.poll() is None:
            os.killpg(relaunch.pid, signal.SIGKILL)
            relaunch.wait()
        for pid in marked_pids("fence-a") + marked_pids("fence-b"):
            os.kill(pid, signal.SIGKILL)
    reader_a.join(timeout=10)
    reader_b.join(timeout=10)
    return {
        "baseline": baseline,
        "output": output,
        "ranks_a": ranks_a,
        "committed_at_kill": committed_at_kill,
        "lines_a": lines_a,
        "lines_b": lines_b,
        "returncode_b": relaunch.returncode,
        "left_a": left_a,
    }


def test_relaunch_stops_the_orphaned_ranks_and_takes_the_stage_over(runs):
    print(
        f"attempt A's ranks alive at the relaunch: {runs['ranks_a']}; step {KILL_AT} committed when the agent "
        f"was killed: {runs['committed_at_kill']}"
    )
    assert len(runs["ranks_a"]) == 2, "both ranks of attempt A must outlive their agent for this test to mean anything"
    assert runs["returncode_b"] == 0, "\n".join(runs["lines_b"][-60:])
    assert runs["left_a"] == []
    # A's ranks print into the same pipe after their agent died: they never reached the commit
    # of the stage's final output
    assert not any("stage sft committed" in line for line in runs["lines_a"]), "\n".join(runs["lines_a"][-20:])
    output_b = "\n".join(runs["lines_b"])
    assert "takes" in output_b and "over from attempt fencea" in output_b and "(launch fence-a) stopped" in output_b


def test_no_checkpoint_is_corrupted_and_attempts_wrote_apart(runs):
    ckpts = StageLayout(runs["output"]).checkpoints
    attempts, committed = set(), 0
    for name in os.listdir(ckpts):
        step, attempt = parse_step_dirname(name)
        attempts.add(attempt)
        if os.path.exists(os.path.join(ckpts, name, MANIFEST_NAME)):
            committed += 1
            assert verify(join_uri(ckpts, name)) == [], name
    assert attempts <= {"fencea", "fenceb"} and "fenceb" in attempts
    assert committed >= STEPS // SAVE_EVERY - KILL_AT // SAVE_EVERY


def test_the_relaunch_ends_with_the_uninterrupted_weights(runs):
    assert_same_weights(final_weights(runs["output"]), final_weights(runs["baseline"]))
