"""Acceptance: failed stages retry from their last checkpoint; a second writer of a stage is
refused. (A re-run of a finished run trains nothing: ``test_model_lifecycle.py``, on the session's
finished demo run.)

Under a real Prefect API (the session's ``prefect_api``), a real MLflow sqlite store under
``tmp_path`` and real trainer processes, with the tiny config of the integration tests.

- The SFT trainer of a flow run is SIGKILLed (its whole process group, as when a node dies)
  right after its step-4 checkpoint is committed. The Prefect retry of the task run resumes
  from that checkpoint: steps 1-4 run once, MLflow holds one ``train/loss`` per step, and
  the final weights equal those of an uninterrupted run, bit for bit.
- A trainer started on a stage whose lease a live writer holds exits with code 2 and names
  the lease. The trainer waits ``ttl + 5`` = 35 s for a live lease to lapse before it gives
  up (``StageLease.acquire``; the ttl is not configurable), so that test takes ~45 s.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterTaskRunId

from flows.pipeline import post_training_pipeline
from tests.integration.helpers import (
    DEMO_CONFIG,
    assert_same_weights,
    final_weights,
    run_stage,
    tiny_overrides,
    write_spec,
)
from trainer_core.checkpoint.lease import LEASE_NAME, StageLease
from trainer_core.checkpoint.manifest import MANIFEST_NAME, step_dirname
from trainer_core.config import PipelineConfig, load_config
from trainer_core.errors import EXIT_BAD_INPUT
from trainer_core.spec import StageSpec, build_spec
from trainer_core.storage import RunLayout, StageLayout

MAX_STEPS = 12
SAVE_EVERY = 4
KILL_AT = 4
"""The SFT trainer is killed once the checkpoint of this step is committed."""

_RESUMED = re.compile(r"resumed from \S+ at global_step (\d+)")
_STEP_LINE = re.compile(r"^\[sft\] step (\d+): train/")
"""A training step's metrics line (an evaluation prints ``[sft] step N: eval/...``)."""


def pipeline_config(root: Path, stages: list[str], **extra: object) -> PipelineConfig:
    """The tiny integration-test config writing under ``root`` (MLflow: ``<root>/mlflow.db``)."""
    overrides = {
        **tiny_overrides(),
        "storage.root": str(root),
        "stages": stages,
        "launch.retries": 2,
        "launch.retry_delay_s": 1,
        "launch.timeout_s": 300,
        "sft.max_steps": MAX_STEPS,
        "sft.save_every": SAVE_EVERY,
        "sft.log_every": 1,
        **extra,
    }
    return load_config(str(DEMO_CONFIG), overrides=overrides)


@pytest.fixture
def single_thread_trainers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers inherit the test's environment: one compute thread each (as the integration
    helpers launch them, so float reductions match bit for bit), no MLflow server from outside."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def checkpoint_manifest(stage_dir: Path, step: int) -> Path:
    """The manifest path pattern of the stage's checkpoint of ``step`` (any attempt's directory,
    ``step-XXXXXXXX-<attempt>``), for :func:`wait_for`."""
    return stage_dir / "checkpoints" / f"{step_dirname(step)}*" / MANIFEST_NAME


def wait_for(path: Path, deadline_s: float, done: threading.Event, poll_s: float = 0.01) -> None:
    """Poll until ``path`` (a glob pattern allowed) exists; fail if ``done`` is set first or
    ``deadline_s`` passes."""
    end = time.monotonic() + deadline_s
    while not any(Path("/").glob(str(path).lstrip("/"))):
        if done.is_set():
            raise AssertionError(f"the flow ended before {path} appeared")
        if time.monotonic() > end:
            raise AssertionError(f"{path} did not appear within {deadline_s}s")
        time.sleep(poll_s)


class FlowInThread:
    """``post_training_pipeline(config=config, run_id=run_id)`` run in a daemon thread, started at
    once: ``done`` is set when it returns or raises; ``state`` is then its final state."""

    def __init__(self, config: PipelineConfig, run_id: str):
        self.done = threading.Event()
        self.state = None
        self.started_s = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(config, run_id), name="flow", daemon=True)
        self._thread.start()

    def _run(self, config: PipelineConfig, run_id: str) -> None:
        try:
            self.state = post_training_pipeline(config=config, run_id=run_id, return_state=True)
        finally:
            self.done.set()

    def join(self, timeout_s: float) -> float:
        """Wait for the flow (failing if it runs past ``timeout_s``); the seconds since it started."""
        self._thread.join(timeout=timeout_s)
        assert not self._thread.is_alive(), "the flow did not finish"
        return time.monotonic() - self.started_s


def kill_trainer(stage_dir: Path) -> int:
    """SIGKILL the process group of the trainer holding ``<stage_dir>/lease.json``; its pid."""
    pid = json.loads((stage_dir / LEASE_NAME).read_text())["pid"]
    assert os.getpgid(pid) == pid, "the trainer should lead its own process group"
    os.killpg(pid, signal.SIGKILL)
    return pid


def task_runs_of(flow_run_id) -> dict:
    """Task run name -> task run, for one flow run."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {t.name: t for t in runs}


def task_log_lines(task_run_id, last_line: str, timeout_s: float = 30.0) -> list[str]:
    """Messages of a task run's logs in time order, read once ``last_line`` has arrived
    (the flow process ships logs to the API in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        messages: list[str] = []
        with get_client(sync_client=True) as client:
            while page := client.read_logs(
                log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])),
                offset=len(messages),
                limit=200,
            ):
                messages += [log.message for log in page]
        if any(last_line in m for m in messages) or time.monotonic() > deadline:
            return messages
        time.sleep(0.5)


def test_sft_killed_after_a_checkpoint_is_retried_and_resumes_from_it(prefect_api, tmp_path, single_thread_trainers):
    root, run_id = tmp_path / "out", "retry-sft"
    config = pipeline_config(root, ["prepare_data", "sft"])
    stage_dir = Path(RunLayout(str(root), run_id).stage("sft").output)
    data_final = Path(RunLayout(str(root), run_id).stage("prepare_data").final)
    checkpoint = checkpoint_manifest(stage_dir, KILL_AT)

    def uninterrupted_sft() -> StageSpec:
        """The same SFT run, never killed, on the flow's prepared data (the reference)."""
        wait_for(data_final / MANIFEST_NAME, 300, flow.done)
        spec = build_spec(
            config,
            "sft",
            run_id,
            {"data": str(data_final), "model": "init"},
            output_uri=str(tmp_path / "uninterrupted"),
        )
        run = run_stage(write_spec(spec, tmp_path / "uninterrupted.json"))
        assert run.returncode == 0, run.tail()
        return spec

    flow = FlowInThread(config, run_id)
    with ThreadPoolExecutor(max_workers=1) as pool:
        reference = pool.submit(uninterrupted_sft)
        wait_for(checkpoint, 300, flow.done)
        killed_pid = kill_trainer(stage_dir)
        flow_s = flow.join(timeout_s=400)
        reference_spec = reference.result()
    print(f"flow with one killed SFT attempt: {flow_s:.1f}s (trainer pid {killed_pid} killed)")

    state = flow.state
    assert state.is_completed(), state.message
    summary = state.result()
    sft = summary["stages"]["sft"]
    assert summary["status"] == "completed" and sft["status"] == "completed"
    assert sft["metrics"]["global_step"] == MAX_STEPS and sft["metrics"]["resumed"] == 1.0

    task_runs = task_runs_of(state.state_details.flow_run_id)
    assert {name: t.run_count for name, t in task_runs.items()} == {"prepare_data": 1, "sft": 2}

    # The second attempt resumed from the checkpoint the first one committed, and did not
    # redo the steps before it: each of steps 1-4 ran once, the retry's first step is 5.
    lines = task_log_lines(task_runs["sft"].id, "stage sft committed")
    resumed = [(i, int(m[1])) for i, line in enumerate(lines) if (m := _RESUMED.search(line))]
    assert len(resumed) == 1, [line for line in lines if "resum" in line]
    at, resume_step = resumed[0]
    assert resume_step >= KILL_AT and f"{step_dirname(resume_step)}" in lines[at]
    steps = [int(m[1]) for line in lines if (m := _STEP_LINE.match(line))]
    retry_steps = [int(m[1]) for line in lines[at:] if (m := _STEP_LINE.match(line))]
    assert retry_steps == list(range(resume_step + 1, MAX_STEPS + 1))
    assert all(steps.count(s) == 1 for s in range(1, resume_step + 1)), steps

    assert_same_weights(final_weights(str(stage_dir)), final_weights(reference_spec.output_uri))

    # MLflow: both attempts logged into the stage's one run, which holds every step's loss
    # exactly once (step -> number of values logged at it).
    mlflow = MlflowClient(summary["mlflow"]["tracking_uri"])
    spec = json.loads((root / "runs" / run_id / "specs" / "sft.json").read_text())
    assert spec["mlflow_run_id"] == sft["mlflow_run_id"]
    assert mlflow.get_run(sft["mlflow_run_id"]).info.status == "FINISHED"
    history = mlflow.get_metric_history(sft["mlflow_run_id"], "train/loss")
    assert dict(sorted(Counter(m.step for m in history).items())) == {s: 1 for s in range(1, MAX_STEPS + 1)}


def test_a_second_writer_of_a_stage_is_refused_while_the_lease_is_live(tmp_path, single_thread_trainers):
    root, run_id = tmp_path / "out", "two-writers"
    # The second writer waits its own lease TTL + 5 s for the holder's lease before refusing:
    # 3 s here (30 s by default), while the holder renews its 6 s lease every 2 s.
    config = pipeline_config(root, ["prepare_data"], **{"launch.lease_ttl_s": 3.0})
    output_uri = RunLayout(str(root), run_id).stage("prepare_data").output
    holder = StageLease(output_uri, owner="test-holder", ttl_s=6.0)
    holder.acquire(wait_s=0)
    try:
        spec = build_spec(config, "prepare_data", run_id, {}, output_uri=output_uri, writer_id="second-writer")
        run = run_stage(write_spec(spec, tmp_path / "second.json"), timeout_s=180)
        lease = json.loads((Path(output_uri) / LEASE_NAME).read_text())
        assert not holder.lost.is_set()
    finally:
        holder.release()
    print(f"second writer refused after {run.wall_s:.1f}s")
    assert run.returncode == EXIT_BAD_INPUT, run.tail()
    assert f"{Path(output_uri) / LEASE_NAME} is held by test-holder" in run.output, run.tail()
    assert lease["owner"] == "test-holder"
    assert not Path(StageLayout(output_uri).final).exists()
