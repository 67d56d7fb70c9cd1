"""Acceptance of the distributed backends: ddp, fsdp2, DeepSpeed ZeRO-2 and ZeRO-3 at 2 gloo ranks on CPU.

The single-device backend is the numerical reference. At 2 ranks a step reads one micro-batch
of 4 per rank; on one device it reads the same 8 examples as 2 accumulated micro-batches of 4
(the loop gives micro-batch i of a step to rank i % world_size and divides the loss by the
units counted over every rank). So:

- tracking: SFT and DPO stages at 2 ranks print the single device's losses, step for step
  (SFT through ``global_batch_size=8``, DPO through explicit ``grad_accum_steps``);
- micro-batch x accumulation: on every backend, 4 x 1 and 2 x 2 per rank give the losses of
  the single device (in-process ``TrainLoop``s over a sampler that cuts micro-batches in two);
- elastic: an FSDP2 (DCP) checkpoint of 2 ranks resumes at 1 rank and one of 1 rank at 2,
  continuing the uninterrupted run's losses;
- replica validation: a replica one ulp off fails the save on every rank, naming the
  component and the rank, and commits nothing;
- a rank SIGKILLed mid-run fails the torchrun job at once, leaves no process behind, and a
  relaunch of the same spec resumes from the last checkpoint to the uninterrupted run's end;
- exit: no garbage wrapped model still holds the process group when the job destroys it (one
  that does aborts the rank at interpreter exit now and then).

Stage runs go through torchrun (``helpers.run_ranks``). The tracking runs start the ranks once
per backend for both stages (``fixtures/backend_stages.py``: start-up dominates a tiny stage);
the elastic and kill scenarios run ``python -m trainer_core.run`` as the stage tasks do. Every
run is started once, two at a time, by the module fixture :func:`runs`.
"""

from __future__ import annotations

import json
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from trainer_core.backends import build_backend
from trainer_core.checkpoint.manifest import find_latest, read_manifest
from trainer_core.config import BackendConfig, PipelineConfig, TrainStageConfig, load_config
from trainer_core.data.batching import BucketedBatchSampler
from trainer_core.checkpoint.session import CheckpointSession, MetricsBuffer
from trainer_core.training.loop import BatchSource, TrainLoop
from trainer_core.spec import build_spec
from trainer_core.storage import StageLayout

from .helpers import (
    REPO_ROOT,
    RUN_ID,
    RanksRun,
    StageRun,
    TinyPipeline,
    after_checkpoint,
    assert_close_lines,
    checkpoint_uri,
    committed_steps,
    copy_checkpoint,
    final_weights,
    process_table,
    run_ranks,
    run_stage,
    run_stage_ranks,
    stage_inputs,
    stage_lines,
    why_failed,
    write_spec,
)
from .in_process import stage_parts

FIXTURES = REPO_ROOT / "tests" / "integration" / "fixtures"
BACKENDS: dict[str, dict[str, Any]] = {
    "ddp": {"backend.name": "ddp"},
    "fsdp2": {"backend.name": "fsdp2"},
    "deepspeed-2": {"backend.name": "deepspeed", "backend.zero_stage": 2},
    "deepspeed-3": {"backend.name": "deepspeed", "backend.zero_stage": 3},
}
STAGES = ("sft", "dpo")
STEPS = 20
SAVE_EVERY = 4
MICRO_BATCH_SIZE = 4
FLOAT_REL = 1e-5
"""Tolerance on unrounded float32 losses and grad norms of 6 steps summed in another order
(across ranks, micro-batches or shards); measured <= 1.2e-6."""
STATE_FILES: dict[str, set[str]] = {
    "ddp": {"model.safetensors", "optimizer.pt"},
    "fsdp2": {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"},
    "deepspeed-2": {
        "deepspeed/state/mp_rank_00_model_states.pt",
        *(f"deepspeed/state/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)),
    },
    "deepspeed-3": {
        f"deepspeed/state/zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")
    },
}
"""Model and optimizer files of a 2-rank checkpoint, by backend: one replicated copy (ddp), a
DCP shard per rank (fsdp2), optimizer partitions per rank (ZeRO-2) and model partitions too (ZeRO-3)."""
COMMON_FILES = {"metrics.json", "rank-00000/rng.pt", "rank-00001/rng.pt", "scheduler.pt", "trainer_state.json"}
KILL_TO_EXIT_S = 20.0
"""A job with a dead rank must end within this (torchrun polls its ranks every 0.1 s; a hang
would last the 600 s collective timeout)."""


def stage_config(pipeline: TinyPipeline, backend: str, nproc: int) -> PipelineConfig:
    """The tiny pipeline's config for 20-step SFT and DPO on ``backend`` at ``nproc`` ranks.

    ``backend`` is ``single`` or a key of :data:`BACKENDS`.

    A step reads 8 examples (pairs) whatever the world size: SFT sets ``global_batch_size=8``;
    DPO sets ``grad_accum_steps`` to 2 on one process and 1 at 2 ranks.
    """
    overrides: dict[str, Any] = {
        "backend.name": backend,
        "backend.nproc_per_node": nproc,
        "backend.device": "cpu",
        **BACKENDS.get(backend, {}),
        "sft.global_batch_size": 2 * MICRO_BATCH_SIZE,
        "sft.weight_decay": 0.1,  # two param groups that differ (decay / no decay), on every backend
        "dpo.grad_accum_steps": 2 // nproc,
    }
    for stage in STAGES:
        overrides.update(
            {
                f"{stage}.max_steps": STEPS,
                f"{stage}.save_every": SAVE_EVERY,
                f"{stage}.eval_every": SAVE_EVERY,
                f"{stage}.micro_batch_size": MICRO_BATCH_SIZE,
                f"{stage}.keep_last_checkpoints": STEPS,
            }
        )
    return load_config(base=pipeline.config.model_dump(mode="json"), overrides=overrides)


def write_stage_spec(
    pipeline: TinyPipeline, stage: str, backend: str, nproc: int, output_uri: str, writer_id: str | None = None
) -> str:
    """Write the spec of ``stage`` on ``backend`` next to ``output_uri``; returns its path."""
    sft_model = StageLayout(pipeline.baseline_uris["sft"]).final
    spec = build_spec(
        stage_config(pipeline, backend, nproc),
        stage,
        RUN_ID,
        stage_inputs(stage, pipeline.data_uri, sft_model),
        output_uri=output_uri,
        writer_id=writer_id,
    )
    return write_spec(spec, f"{output_uri}.spec.json")


# --- the runs, each started once ------------------------------------------------------------


@dataclass
class Stages:
    """One job: SFT then DPO on one backend at 2 ranks (``backend_stages.py``), or one stage on one device."""

    job: StageRun
    output_uris: dict[str, str]

    def run(self, stage: str) -> StageRun:
        return stage_lines(self.job, stage)


@dataclass
class Resume:
    """A stage resumed from a checkpoint: the run, where it resumed from, and its output."""

    run: StageRun
    checkpoint: str
    step: int
    output_uri: str


@dataclass
class Killed:
    """A job whose rank 1 was SIGKILLed after a checkpoint, and the relaunch of the same spec."""

    killed: RanksRun
    committed_at_kill: list[int]
    relaunch: Resume


class Runs:
    """Every run this module looks at, started once on first need, two at a time.

    A job that needs another's result (elastic resume needs the FSDP2 run's checkpoints) waits
    on it; :func:`runs` submits such dependencies first, so a waiting worker never blocks them.
    """

    def __init__(self, pipeline: TinyPipeline, root: str) -> None:
        self.pipeline, self.root = pipeline, root
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="runs")
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()

    def submit(self, key: str) -> Future:
        with self._lock:
            if key not in self._futures:
                kind, _, arg = key.partition(":")
                self._futures[key] = self._pool.submit(getattr(self, f"_{kind}"), arg)
            return self._futures[key]

    def result(self, key: str) -> Any:
        return self.submit(key).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _single(self, stage: str) -> Stages:
        output = self._dir(f"single-{stage}")
        run = run_stage(write_stage_spec(self.pipeline, stage, "single", 1, output))
        assert run.returncode == 0, why_failed(run)
        return Stages(run, {stage: output})

    def _stages(self, backend: str) -> Stages:
        outputs = {stage: self._dir(f"{backend}-{stage}") for stage in STAGES}
        specs = [write_stage_spec(self.pipeline, stage, backend, 2, outputs[stage]) for stage in STAGES]
        job = run_ranks([str(FIXTURES / "backend_stages.py"), *specs], 2)
        assert job.returncode == 0, why_failed(job)
        return Stages(job, outputs)

    def _accum(self, _: str) -> dict:
        out = self._dir("accum/results.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        args = ["--root", self.pipeline.root, "--data", self.pipeline.data_uri, "--out", out, *BACKENDS]
        job = run_ranks([str(FIXTURES / "backend_accum.py"), *args], 2)
        assert job.returncode == 0, why_failed(job)
        with open(out) as f:
            return json.load(f)

    def _resume(self, name: str, nproc: int, from_output: str, step: int, backend: str = "fsdp2") -> Resume:
        output = self._dir(name)
        ckpt = copy_checkpoint(from_output, step, output)
        run = run_stage_ranks(write_stage_spec(self.pipeline, "sft", backend, nproc, output), nproc)
        assert run.returncode == 0, why_failed(run)
        return Resume(run, ckpt, step, output)

    def _elastic(self, _: str) -> dict[str, Resume]:
        """FSDP2 SFT: the 2-rank run's step-8 checkpoint resumed at 1 rank; that run's step-12 at 2."""
        two = self.result("stages:fsdp2").output_uris["sft"]
        to_one = self._resume("elastic-2to1", 1, two, 8)
        to_two = self._resume("elastic-1to2", 2, to_one.output_uri, 12)
        return {"2to1": to_one, "1to2": to_two}

    def _elastic_ds(self, backend: str) -> dict[str, Resume]:
        """DeepSpeed SFT (``deepspeed-2`` or ``-3``): the 2-rank run's step-8 checkpoint resumed at
        1 rank; for ZeRO-3 (parameters partitioned too) also that run's step-12 resumed at 2."""
        two = self.result(f"stages:{backend}").output_uris["sft"]
        to_one = self._resume(f"elastic-{backend}-2to1", 1, two, 8, backend)
        if backend != "deepspeed-3":
            return {"2to1": to_one}
        return {"2to1": to_one, "1to2": self._resume(f"elastic-{backend}-1to2", 2, to_one.output_uri, 12, backend)}

    def _kill(self, _: str) -> Killed:
        """DDP SFT: rank 1 SIGKILLed once the step-4 checkpoint is committed, then the same spec again."""
        output = self._dir("kill-ddp-sft")
        spec = write_stage_spec(self.pipeline, "sft", "ddp", 2, output, writer_id=f"itest-{uuid.uuid4().hex[:8]}")
        killed = run_stage_ranks(spec, 2, kill_rank=1, kill_when=after_checkpoint(output, SAVE_EVERY), timeout_s=180)
        committed = committed_steps(output)
        step = committed[-1] if committed else 0
        resume_from = checkpoint_uri(output, step)  # before the relaunch, whose purge may remove it
        relaunch = run_stage_ranks(spec, 2)
        return Killed(killed, committed, Resume(relaunch, resume_from, step, output))

    def _replica(self, _: str) -> dict[str, Any]:
        out = self._dir("replica")
        os.makedirs(out, exist_ok=True)
        job = run_ranks([str(FIXTURES / "backend_replica.py"), out], 2)
        assert job.returncode == 0, why_failed(job)
        outcomes = {}
        for rank in (0, 1):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                outcomes[rank] = json.load(f)
        return {"outcomes": outcomes, "output": out}


NEEDS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "test_stage_losses_track_single_device": lambda p: [f"stages:{p['backend']}", f"single:{p['stage']}"],
    "test_micro_batch_times_accumulation_on_every_backend": lambda p: ["accum"],
    "test_fsdp2_checkpoint_resumes_at_another_world_size": lambda p: ["stages:fsdp2", "elastic"],
    "test_deepspeed_checkpoint_resumes_at_another_world_size": lambda p: [
        f"stages:{p['backend']}",
        f"elastic_ds:{p['backend']}",
    ],
    "test_desynchronised_replica_fails_the_save_on_every_rank": lambda p: ["replica"],
    "test_killed_rank_ends_the_job_and_relaunch_resumes": lambda p: ["stages:ddp", "kill"],
    "test_no_garbage_model_holds_the_process_group_when_it_is_destroyed": lambda p: [f"stages:{p['backend']}"],
}
ORDER = [
    "stages:fsdp2",
    "single:sft",
    "single:dpo",
    "stages:ddp",
    "kill",
    "elastic",
    "stages:deepspeed-3",
    "stages:deepspeed-2",
    "elastic_ds:deepspeed-2",
    "elastic_ds:deepspeed-3",
    "accum",
    "replica",
]
"""Submission order: longest chains first, every dependency before what waits on it."""


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tiny_pipeline: TinyPipeline, tmp_path_factory) -> Iterator[Runs]:
    """The runs the selected tests of this module need, submitted at once in :data:`ORDER`."""
    wanted: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is request.module and item.originalname in NEEDS:
            params = getattr(getattr(item, "callspec", None), "params", {})
            wanted.update(NEEDS[item.originalname](params))
    store = Runs(tiny_pipeline, str(tmp_path_factory.mktemp("backends")))
    for key in sorted(wanted, key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER)):
        store.submit(key)
    yield store
    store.close()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_stage_losses_track_single_device(runs, backend, stage):
    """Steps 0-20 at 2 ranks (micro_batch_size 4, 1 micro-batch per rank per step) print the
    train and eval losses of the single device (micro_batch_size 4, 2 micro-batches per step)
    within rel 1e-3 (:data:`~tests.integration.helpers.PRINTED_REL`; measured: the same strings),
    and its other metrics (grad norm, LR, DPO rewards) within rel 1e-3 or abs 1e-5
    (:data:`~tests.integration.helpers.PRINTED_ABS`). The run really was distributed: both ranks
    joined, and the final manifest records the backend at 2 ranks."""
    stages, single = runs.result(f"stages:{backend}"), runs.result(f"single:{stage}")
    expected = single.run(stage).step_metrics()
    assert sorted(expected) == list(range(STEPS + 1))
    assert_close_lines(stages.run(stage).step_metrics(), expected)
    assert all(f"rank {r}/2 on cpu (gloo)" in stages.job.output for r in (0, 1))
    manifest = read_manifest(StageLayout(stages.output_uris[stage]).final)
    name = BACKENDS[backend]["backend.name"]
    assert (manifest.backend, manifest.world_size, manifest.global_step) == (name, 2, STEPS)
    checkpoint = read_manifest(checkpoint_uri(stages.output_uris[stage], STEPS))
    files = {f.path for f in checkpoint.files if not f.path.endswith(".py")}  # DeepSpeed adds its recovery scripts
    assert files == COMMON_FILES | STATE_FILES[backend]


def single_device_reference(pipeline: TinyPipeline, stage: str, workdir: str) -> dict[int, dict[str, float]]:
    """In-process single device: 6 steps of 2 stock micro-batches of 4 (what 2 ranks read at once)."""
    make, objective, rows, lengths, collate = stage_parts(stage, pipeline)
    cfg = TrainStageConfig(
        max_steps=6,
        micro_batch_size=4,
        grad_accum_steps=2,
        learning_rate=3e-3,
        warmup_steps=2,
        eval_every=1000,
        save_every=1000,
        async_save=False,
    )
    backend = build_backend(BackendConfig(device="cpu"))
    logged: dict[int, dict[str, float]] = {}
    TrainLoop(
        model=backend.wrap(make()),
        backend=backend,
        objective=objective,
        batches=BatchSource(rows, BucketedBatchSampler(lengths, 4, seed=0, drop_last=True), collate, backend.device),
        cfg=cfg,
        session=CheckpointSession(
            workdir,
            backend,
            metrics=MetricsBuffer(
                printer=lambda metrics, step: logged.setdefault(step, {}).update(
                    {k: float(v) for k, v in metrics.items()}
                )
            ),
        ),
    ).run()
    return logged


def test_micro_batch_times_accumulation_on_every_backend(runs, tiny_pipeline, tmp_path):
    """At 2 ranks, 4 x 1 and 2 x 2 (micro_batch_size x grad_accum_steps per rank) give the single
    device's 6 steps of 8 examples, and each other's, on every backend: train loss, grad norm and
    the eval loss after the last step (i.e. the same weights) within rel 1e-5 (:data:`FLOAT_REL`)."""
    results = runs.result("accum")
    assert sorted(results) == sorted(BACKENDS)
    for stage in STAGES:
        expected = single_device_reference(tiny_pipeline, stage, str(tmp_path / stage))
        for backend, by_stage in results.items():
            assert sorted(by_stage[stage]) == ["2x2", "4x1"]
            for cut, logged in by_stage[stage].items():
                logged = {int(step): values for step, values in logged.items()}
                assert sorted(logged) == sorted(expected) == list(range(7)), (backend, cut)
                for step, values in expected.items():
                    if step:
                        assert logged[step]["train/consumed_samples"] == values["train/consumed_samples"] == 8 * step
                    for key in ("train/loss", "train/grad_norm", "eval/loss"):
                        if key in values:
                            where = (stage, backend, cut, step, key)
                            assert logged[step][key] == pytest.approx(values[key], rel=FLOAT_REL), where
                            other = by_stage[stage]["4x1"][str(step)][key]
                            assert logged[step][key] == pytest.approx(other, rel=FLOAT_REL), where


def assert_resumed_like_uninterrupted(
    resume, backend: str, world_size: int, expected_lines: dict, expected_weights: dict[str, torch.Tensor], name: str
) -> None:
    """``resume`` (a run resumed at ``world_size`` ranks from the other world size's checkpoint)
    says where it resumed, prints the uninterrupted run's lines after that step (rel 1e-3), commits
    at ``world_size`` and ends with the uninterrupted run's weights (float32, rtol 1e-4)."""
    source = read_manifest(resume.checkpoint)
    assert (source.backend, source.world_size) == (backend, 3 - world_size)
    assert f"resumed from {resume.checkpoint} at global_step {resume.step}" in resume.run.output, resume.run.tail()
    after = {step: values for step, values in expected_lines.items() if step > resume.step}
    assert_close_lines(resume.run.step_metrics(), after)
    final = read_manifest(StageLayout(resume.output_uri).final)
    assert (final.backend, final.world_size, final.global_step) == (backend, world_size, STEPS)
    weights = final_weights(resume.output_uri)
    assert sorted(weights) == sorted(expected_weights)
    for key, tensor in expected_weights.items():
        torch.testing.assert_close(weights[key], tensor, rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")


def test_fsdp2_checkpoint_resumes_at_another_world_size(runs):
    """A DCP checkpoint written by 2 ranks resumes at 1 rank (``global_batch_size`` keeps the
    batch: 2 micro-batches a step instead of 1 per rank), and one written by that 1-rank run
    resumes at 2: both print the uninterrupted 2-rank run's losses after the resume point
    (rel 1e-3, :data:`~tests.integration.helpers.PRINTED_REL`) and end with its weights (float32,
    rtol 1e-4)."""
    uninterrupted = runs.result("stages:fsdp2")
    expected_lines = uninterrupted.run("sft").step_metrics()
    expected_weights = final_weights(uninterrupted.output_uris["sft"])
    elastic = runs.result("elastic")
    for name, world_size in (("2to1", 1), ("1to2", 2)):
        resume = elastic[name]
        assert_resumed_like_uninterrupted(resume, "fsdp2", world_size, expected_lines, expected_weights, name)
        no_rng = f"checkpoint {resume.checkpoint} has no RNG state for rank 1 (written by 1 ranks)"
        assert (no_rng in resume.run.output) == (world_size == 2)  # a new rank keeps its seeded generator


@pytest.mark.parametrize("backend", ["deepspeed-2", "deepspeed-3"])
def test_deepspeed_checkpoint_resumes_at_another_world_size(runs, backend):
    """A ZeRO-2 or ZeRO-3 checkpoint written by 2 ranks resumes at 1 rank through DeepSpeed's
    universal checkpoint (``global_batch_size`` keeps the batch), and for ZeRO-3 the 1-rank run's
    checkpoint resumes at 2 again: each prints the uninterrupted 2-rank run's losses after the
    resume point (rel 1e-3) and ends with its weights (float32, rtol 1e-4). SFT runs with
    ``weight_decay`` 0.1, so the no-decay group's settings must survive the load. Before
    ``untie_step_counts``, ZeRO-3's 2 -> 1 resume failed this at step 12 (eval perplexity 105.5
    against 105.1)."""
    uninterrupted = runs.result(f"stages:{backend}")
    expected_lines = uninterrupted.run("sft").step_metrics()
    expected_weights = final_weights(uninterrupted.output_uris["sft"])
    for name, resume in runs.result(f"elastic_ds:{backend}").items():
        world_size = 1 if name == "2to1" else 2
        converted = (
            f"ZeRO partitions of {3 - world_size} ranks, this run has {world_size}: "
            "loading it as a universal checkpoint"
        )
        assert converted in resume.run.output, resume.run.tail()
        assert_resumed_like_uninterrupted(
            resume, "deepspeed", world_size, expected_lines, expected_weights, f"{backend} {name}"
        )


def test_desynchronised_replica_fails_the_save_on_every_rank(runs):
    """DDP at 2 ranks (``fixtures/backend_replica.py``): replicas in sync commit; one weight one
    ulp off on rank 1 fails the save with ReplicaMismatchError on both ranks naming
    ``model.safetensors`` and rank 1, and no manifest is written; a scheduler one step ahead
    names ``scheduler.pt``; with validation off the drifted state is committed (rank 0's)."""
    result = runs.result("replica")
    outcomes, output = result["outcomes"], result["output"]
    for rank in (0, 1):
        got = outcomes[rank]
        assert got["in_sync"] == {"committed": 1, "world_size": 2}
        assert got["unvalidated"] == {"committed": 4, "world_size": 2}
        for case, component in (("weight_ulp", "model.safetensors"), ("scheduler_ahead", "scheduler.pt")):
            error = got[case]
            assert error["error"] == "ReplicaMismatchError" and error["component"] == component, (rank, case, error)
            checksums = error["checksums"]
            assert len(checksums) == 2 and checksums[0] != checksums[1]
            expected = f"replicated state {component!r} differs across ranks: rank(s) [1] disagree with rank 0"
            assert expected in error["message"]
            assert error == outcomes[0][case]  # every rank raised the same error
    assert committed_steps(output) == [1, 4]
    assert not any(os.path.exists(os.path.join(checkpoint_uri(output, step), "manifest.json")) for step in (2, 3))
    latest = find_latest(StageLayout(output).checkpoints)
    assert latest is not None and latest[1].global_step == 4


def test_killed_rank_ends_the_job_and_relaunch_resumes(runs):
    """DDP SFT at 2 ranks: rank 1 (only it) SIGKILLed after the first checkpoint. torchrun exits
    non-zero within :data:`KILL_TO_EXIT_S`, and no process of the job (torchrun, ranks, their
    process groups) is left. The same spec launched again resumes from the newest committed
    checkpoint and prints the uninterrupted run's lines (rel 1e-3) up to its final weights (bit for bit)."""
    outcome = runs.result("kill")
    killed, relaunch = outcome.killed, outcome.relaunch
    assert killed.killed and killed.returncode != 0, killed.tail()
    assert killed.kill_to_exit_s is not None and killed.kill_to_exit_s < KILL_TO_EXIT_S, killed.kill_to_exit_s
    assert sorted(killed.rank_pids) == [0, 1]
    assert killed.survivors == [], killed.survivors
    alive = {info.key for info in process_table().values() if info.alive}
    assert not killed.job & alive, sorted(killed.job & alive)
    uninterrupted = runs.result("stages:ddp")
    expected = uninterrupted.run("sft").step_metrics()
    for step, values in killed.step_metrics().items():  # up to the kill: the same run
        assert values == expected[step], step
    assert outcome.committed_at_kill and outcome.committed_at_kill[0] == SAVE_EVERY
    assert relaunch.step == outcome.committed_at_kill[-1] < STEPS
    assert relaunch.run.returncode == 0, why_failed(relaunch.run)
    assert f"resumed from {relaunch.checkpoint} at global_step {relaunch.step}" in relaunch.run.output
    after = {step: values for step, values in expected.items() if step > relaunch.step}
    assert_close_lines(relaunch.run.step_metrics(), after)
    final, reference = final_weights(relaunch.output_uri), final_weights(uninterrupted.output_uris["sft"])
    assert sorted(final) == sorted(reference)
    assert all(torch.equal(final[k], reference[k]) for k in reference)


AT_DESTROY = re.compile(r"rank (\d+): wrapped models at destroy_process_group: live (\{.*\}) unreachable (\{.*\})")


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_no_garbage_model_holds_the_process_group_when_it_is_destroyed(runs, backend):
    """A trainer process ends by destroying the process group (``Backend.close``, called by
    ``run_spec``).
    A wrapped model that is garbage by then (DDP and FSDP2 modules sit in reference cycles) but
    not yet collected still holds the group; finalised at interpreter exit, it aborts the rank
    now and then (``terminate called without an active exception``, SIGABRT after the final
    commit, so the job fails). ``fixtures/backend_stages.py`` ends through the same function and
    counts, at that moment, the wrapped models that a ``gc.collect()`` frees: there must be none.
    DeepSpeed engines stay reachable (DeepSpeed's own hooks hold them) and are not counted."""
    job = runs.result(f"stages:{backend}").job
    found = {int(m[1]): (json.loads(m[2]), json.loads(m[3])) for line in job.lines if (m := AT_DESTROY.search(line))}
    assert sorted(found) == [0, 1], job.tail()
    unreachable = {rank: garbage for rank, (_, garbage) in found.items()}
    assert unreachable == {0: {}, 1: {}}, f"wrapped models (live, unreachable) per rank at destroy: {found}"
