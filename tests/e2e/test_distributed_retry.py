"""Acceptance: one rank of a 2-rank stage dies; the task fails cleanly and Prefect's retry
resumes from the last checkpoint.

Under a real Prefect API, the SFT stage of a flow runs at 2 ranks (``fsdp2``, gloo on CPU)
under ``torchrun``. Right after its step-4 checkpoint is committed, rank 1 alone is
SIGKILLed (as when one GPU worker dies). torchrun stops rank 0, the task run fails naming
the dead rank, no process of that attempt is left alive, and the retry resumes from the
checkpoint: steps 1-4 each ran once, MLflow holds one ``train/loss`` per step.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter
from pathlib import Path

from mlflow import MlflowClient

from test_retry_resume import (
    KILL_AT,
    MAX_STEPS,
    FlowInThread,
    checkpoint_manifest,
    pipeline_config,
    single_thread_trainers,  # noqa: F401  (fixture)
    task_log_lines,
    task_runs_of,
    wait_for,
)
from tests.processes import alive
from trainer_core.checkpoint.lease import LEASE_NAME
from trainer_core.checkpoint.manifest import MANIFEST_NAME
from trainer_core.storage import RunLayout

_RESUMED = re.compile(r"resumed from \S+ at global_step (\d+)")
_STEP_LINE = re.compile(r"\[sft\] step (\d+): train/")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("PPid:"))


def _children(ppid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if _parent(int(entry)) == ppid:
                    out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, StopIteration):
                continue
    return out


def test_one_rank_killed_fails_the_attempt_and_the_retry_resumes(prefect_api, tmp_path, single_thread_trainers):  # noqa: F811
    root, run_id = tmp_path / "out", "retry-fsdp2"
    config = pipeline_config(
        root, ["prepare_data", "sft"], **{"backend.name": "fsdp2", "backend.nproc_per_node": 2, "backend.device": "cpu"}
    )
    stage_dir = Path(RunLayout(str(root), run_id).stage("sft").output)
    checkpoint = checkpoint_manifest(stage_dir, KILL_AT)
    flow = FlowInThread(config, run_id)
    wait_for(checkpoint, 400, flow.done)
    rank0 = json.loads((stage_dir / LEASE_NAME).read_text())["pid"]  # rank 0 holds the lease
    agent = _parent(rank0)  # the torchrun agent
    ranks = _children(agent)
    assert rank0 in ranks and len(ranks) == 2, (agent, ranks)
    (rank1,) = [p for p in ranks if p != rank0]
    os.kill(rank1, signal.SIGKILL)
    print(f"flow with one rank killed: {flow.join(timeout_s=500):.1f}s")

    # The killed attempt left nothing behind: agent and both ranks are gone.
    assert [p for p in (agent, rank0, rank1) if alive(p)] == []

    state = flow.state
    assert state.is_completed(), state.message
    sft = state.result()["stages"]["sft"]
    assert sft["status"] == "completed" and sft["metrics"]["global_step"] == MAX_STEPS
    assert sft["metrics"]["resumed"] == 1.0
    task_runs = task_runs_of(state.state_details.flow_run_id)
    assert {name: t.run_count for name, t in task_runs.items()} == {"prepare_data": 1, "sft": 2}

    lines = task_log_lines(task_runs["sft"].id, "stage sft committed")
    failure = [line for line in lines if "rank 1" in line and ("SIGKILL" in line or "signal" in line)]
    assert failure, "the failed attempt should name the killed rank"
    # Every rank logs its resume; rank 0's lines carry torchrun's "[default0]:" prefix.
    resumed = [(i, int(m[1])) for i, line in enumerate(lines) if (m := _RESUMED.search(line))]
    assert len(resumed) == 2 and len({step for _, step in resumed}) == 1, [line for line in lines if "resum" in line]
    at, resume_step = resumed[0]
    assert resume_step >= KILL_AT
    steps = [int(m[1]) for line in lines if (m := _STEP_LINE.search(line))]
    retry_steps = [int(m[1]) for line in lines[at:] if (m := _STEP_LINE.search(line))]
    assert retry_steps == list(range(resume_step + 1, MAX_STEPS + 1))
    assert all(steps.count(s) == 1 for s in range(1, resume_step + 1)), steps

    manifest = json.loads((Path(sft["output_uri"]) / MANIFEST_NAME).read_text())
    assert (manifest["backend"], manifest["world_size"]) == ("fsdp2", 2)
    history = MlflowClient(state.result()["mlflow"]["tracking_uri"]).get_metric_history(
        sft["mlflow_run_id"], "train/loss"
    )
    assert dict(sorted(Counter(m.step for m in history).items())) == {s: 1 for s in range(1, MAX_STEPS + 1)}
