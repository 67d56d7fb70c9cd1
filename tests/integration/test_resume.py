"""Save -> SIGKILL -> resume gives the run that was never interrupted, bit for bit.

Each scenario launches a training stage as a real process, SIGKILLs its process group at a
chosen point (right after a checkpoint is committed, or after a random optimizer step),
optionally damages the newest checkpoint the way a dying writer or a bad disk would, and
launches the same spec again. The relaunch must resume from the newest *valid* checkpoint,
print the same per-step metrics as the uninterrupted baseline run for every step after it,
and commit final weights equal to the baseline's in every bit.

The scenarios run two at a time (one CPU thread each) in a module fixture; each test reads
the outcome of its scenario.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import boto3
import pytest

from trainer_core import storage
from trainer_core.checkpoint.manifest import MANIFEST_NAME
from trainer_core.config import StorageConfig
from trainer_core.storage import join_uri

from . import forked
from .helpers import (
    MAX_STEPS,
    KillPoint,
    StageRun,
    TinyPipeline,
    after_checkpoint_line,
    after_step,
    assert_same_weights,
    checkpoint_uri,
    committed_steps,
    final_weights,
    run_stage,
)


def drop_manifest(ckpt_dir: str) -> None:
    """A kill between the shards and the commit: every file is there but ``manifest.json``."""
    os.remove(os.path.join(ckpt_dir, MANIFEST_NAME))


def flip_byte(ckpt_dir: str) -> None:
    """Bit rot: one byte in the middle of the weights (tensor data, past the header) inverted."""
    path = os.path.join(ckpt_dir, "model.safetensors")
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        f.seek(0)
        f.write(data)


DAMAGES: dict[str, Callable[[str], None] | None] = {
    "intact": None,
    "uncommitted": drop_manifest,
    "corrupt": flip_byte,
}


@dataclass(frozen=True)
class Scenario:
    """How to interrupt one stage.

    Attributes:
        stage: the training stage.
        kill_after: ``("checkpoint", N)``: SIGKILL once the stage logs that ``step-N`` is
            committed (its manifest is on storage); ``("step", N)``: once the metrics line of step
            N is printed. A forked stage stops itself at that line until the kill
            (:class:`~tests.integration.helpers.KillPoint`).
        variants: names in :data:`DAMAGES`; each resumes its own copy of the killed output.
        on_s3: the stage's output lives on the moto S3 server instead of a local directory.
    """

    stage: str
    kill_after: tuple[str, int]
    variants: tuple[str, ...] = ("intact",)
    on_s3: bool = False

    def kill_when(self) -> KillPoint:
        what, step = self.kill_after
        return after_checkpoint_line(step) if what == "checkpoint" else after_step(self.stage, step)


RANDOM_KILLS = {
    (stage, seed): random.Random(seed).randint(1, MAX_STEPS - 1) for stage, seed in [("sft", 0), ("sft", 1), ("dpo", 2)]
}
"""Kill-after-step for a few seeds: sft seed 0 lands between checkpoints, sft seed 1 before
the first one, dpo seed 2 before the first one but after the reference log-probs are committed."""

SCENARIOS: dict[str, Scenario] = {
    # Longest first: the scenarios run two at a time in this order.
    "sft-checkpoint8": Scenario("sft", ("checkpoint", 8), variants=("intact", "uncommitted", "corrupt")),
    "dpo-checkpoint4": Scenario("dpo", ("checkpoint", 4)),
    "reward_model-checkpoint8": Scenario("reward_model", ("checkpoint", 8)),
    "sft-s3-checkpoint4": Scenario("sft", ("checkpoint", 4), on_s3=True),
    **{
        f"{stage}-seed{seed}-step{step}": Scenario(stage, ("step", step))
        for (stage, seed), step in RANDOM_KILLS.items()
    },
}


@dataclass
class Resumed:
    """One killed-then-relaunched stage.

    Attributes:
        stage: the training stage.
        output_uri: where the relaunch wrote (a copy of the killed run's output when damaged).
        killed: the run that was killed.
        committed_at_kill: steps of the checkpoints committed when it died.
        resume_step: the step the relaunch must resume from (0: it must start over).
        resume_state: ``trainer_state.json`` of that checkpoint, read before the relaunch.
        resumed: the relaunch.
        resume_uri: that checkpoint's directory, found before the relaunch (which writes its own
            attempt's directories and may purge this one).
        damaged_uri: the checkpoint directory damaged before the relaunch (None: none).
    """

    stage: str
    output_uri: str
    killed: StageRun
    committed_at_kill: list[int]
    resume_step: int
    resume_state: dict | None
    resumed: StageRun
    resume_uri: str | None = None
    damaged_uri: str | None = None


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _s3_output(endpoint: str) -> tuple[str, dict[str, str]]:
    """A fresh bucket on the moto server; returns (output URI, the stage process's S3 env)."""
    storage.configure(StorageConfig(endpoint_url=endpoint, region="us-east-1"))
    bucket = f"resume-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
    )
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/stages/sft", {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}


def kill_and_resume(
    pipeline: TinyPipeline, scenario: Scenario, workdir: str, output_uri: str, env: dict[str, str] | None
) -> dict[str, Resumed]:
    """Run ``scenario``: kill the stage once, then relaunch it once per damage variant."""
    stage, writer_id = scenario.stage, f"itest-{uuid.uuid4().hex[:8]}"
    spec = pipeline.write_spec(stage, output_uri, os.path.join(workdir, "killed.json"), writer_id)
    killed = run_stage(spec, kill_when=scenario.kill_when(), env=env, poll_s=0.02 if env else 0.002)
    committed = committed_steps(output_uri)
    outcomes = {}
    for variant in scenario.variants:
        uri = output_uri
        if len(scenario.variants) > 1:
            uri = os.path.join(workdir, variant)
            shutil.copytree(output_uri, uri)
        valid, damaged = list(committed), None
        if DAMAGES[variant] is not None:
            damaged = checkpoint_uri(uri, valid.pop())
            DAMAGES[variant](damaged)
        resume_step = valid[-1] if valid else 0
        state, resume_uri = None, checkpoint_uri(uri, resume_step) if resume_step else None
        if resume_step:
            state = json.loads(storage.read_bytes(join_uri(resume_uri, "trainer_state.json")))
        spec = pipeline.write_spec(stage, uri, os.path.join(workdir, f"{variant}.json"), writer_id)
        resumed = run_stage(spec, env=env)
        outcomes[variant] = Resumed(stage, uri, killed, committed, resume_step, state, resumed, resume_uri, damaged)
    return outcomes


def _requested_scenarios(request: pytest.FixtureRequest) -> list[str]:
    """Scenarios named by the selected tests of this module (so ``-k`` runs only what it needs)."""
    wanted = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is request.module and callspec and "scenario" in callspec.params:
            wanted.add(callspec.params["scenario"])
    return [name for name in SCENARIOS if name in wanted]


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest, tiny_pipeline: TinyPipeline, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future]]:
    """Scenario name -> future of its :func:`kill_and_resume` result, two scenarios at a time."""
    futures = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name in _requested_scenarios(request):
            scenario = SCENARIOS[name]
            workdir = str(tmp_path_factory.mktemp(name))
            output_uri, env = os.path.join(workdir, "killed"), None
            if scenario.on_s3:
                output_uri, env = _s3_output(request.getfixturevalue("s3_server"))
            futures[name] = pool.submit(kill_and_resume, tiny_pipeline, scenario, workdir, output_uri, env)
        yield futures


def assert_exact_resume(outcome: Resumed, pipeline: TinyPipeline) -> None:
    """The relaunch resumed where it had to and reproduced the baseline run exactly."""
    killed, resumed = outcome.killed, outcome.resumed
    baseline = pipeline.baseline_runs[outcome.stage].step_metrics()
    assert killed.returncode == -signal.SIGKILL
    # Up to the kill, the killed run printed what the baseline printed.
    for step, values in killed.step_metrics().items():
        assert values.items() <= baseline[step].items(), f"killed run diverged at step {step}"
    assert resumed.returncode == 0, resumed.tail()
    if outcome.resume_step:
        ckpt = outcome.resume_uri
        assert f"resumed from {ckpt} at global_step {outcome.resume_step}" in resumed.output, resumed.tail()
        expected = {step: values for step, values in baseline.items() if step > outcome.resume_step}
    else:
        assert "resumed from" not in resumed.output
        expected = baseline
    assert resumed.step_metrics() == expected
    if outcome.stage == "dpo":  # the reference model is not run again
        assert "reusing reference log-probs" in resumed.output, resumed.tail()
    assert_same_weights(final_weights(outcome.output_uri), final_weights(pipeline.baseline_uris[outcome.stage]))


@pytest.mark.parametrize("scenario", [name for name, s in SCENARIOS.items() if s.kill_after[0] == "checkpoint"])
def test_sigkill_after_checkpoint_then_resume_is_bit_exact(outcomes, tiny_pipeline, scenario):
    outcome = outcomes[scenario].result()["intact"]
    kill_step = SCENARIOS[scenario].kill_after[1]
    # a forked stage stops itself at the commit's line; a subprocess may get further before the kill
    assert outcome.resume_step == kill_step if forked.enabled() else outcome.resume_step >= kill_step
    assert_exact_resume(outcome, tiny_pipeline)


@pytest.mark.parametrize("scenario", [name for name, s in SCENARIOS.items() if s.kill_after[0] == "step"])
def test_sigkill_at_random_step_then_resume_is_bit_exact(outcomes, tiny_pipeline, scenario):
    """Wherever the kill lands; killed before the first checkpoint, the relaunch starts over."""
    assert_exact_resume(outcomes[scenario].result()["intact"], tiny_pipeline)


def _skip_warning(outcome: Resumed) -> str:
    skipped = outcome.damaged_uri
    lines = [line for line in outcome.resumed.lines if "WARNING" in line and f"skipping checkpoint {skipped}:" in line]
    assert lines, f"no warning about skipping {skipped}:\n{outcome.resumed.tail()}"
    return lines[0]


@pytest.mark.parametrize(
    ("scenario", "damage", "reason"),
    [
        ("sft-checkpoint8", "uncommitted", "no manifest.json"),
        ("sft-checkpoint8", "corrupt", "sha256 mismatch model.safetensors"),
    ],
    ids=["without_manifest", "with_corrupt_weights"],
)
def test_resume_falls_back_past_damaged_checkpoint(outcomes, tiny_pipeline, scenario, damage, reason):
    """The newest checkpoint damaged (:data:`DAMAGES`): the relaunch warns that it skips it, naming
    ``reason``, and resumes bit-exactly from the one before."""
    outcome = outcomes[scenario].result()[damage]
    assert len(outcome.committed_at_kill) >= 2 and outcome.resume_step == outcome.committed_at_kill[-2]
    assert reason in _skip_warning(outcome)
    assert_exact_resume(outcome, tiny_pipeline)


@pytest.mark.parametrize("scenario", ["reward_model-checkpoint8"])
def test_reward_model_resume_point_is_inside_a_later_epoch(outcomes, scenario):
    """The scenario above is only as strong as its resume point: mid-way through epoch >= 1."""
    position = outcomes[scenario].result()["intact"].resume_state["progress"]
    assert position["epoch"] >= 1 and position["batch_index"] > 0, position
