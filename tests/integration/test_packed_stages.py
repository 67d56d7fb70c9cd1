"""Packed micro-batches (``max_tokens_per_micro_batch``) through the real stage processes.

On the tiny pipeline's data and SFT model (``tiny_pipeline``):

- SFT, reward model and DPO train packed to their last step on the single device, with finite
  losses, and commit a final model;
- a packed SFT run SIGKILLed after a checkpoint resumes to the uninterrupted run's weights,
  bit for bit (the packed sampler's position is exact across epochs);
- at 2 gloo ranks, DDP (SFT) and FSDP2 (DPO) print the single device's packed losses step for
  step: micro-batch i of a step goes to rank i % 2, so 2 ranks x 1 micro-batch read what one
  device reads as 2 accumulated micro-batches, and the head runs inside the wrapped forward.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from trainer_core.config import load_config
from trainer_core.spec import build_spec
from trainer_core.storage import StageLayout

from .helpers import (
    DEMO_CONFIG,
    MAX_STEPS,
    RUN_ID,
    after_checkpoint_line,
    assert_same_weights,
    final_weights,
    run_stage,
    run_stage_ranks,
    stage_inputs,
    tiny_overrides,
    write_spec,
)

BUDGETS = {"sft": 192, "reward_model": 384, "dpo": 384}
"""Tokens per micro-batch: two or more rows of at most 96 tokens (a pair: up to 192)."""

PRINTED_REL, PRINTED_ABS = 1e-3, 1e-5
"""Printed losses of 2 ranks vs 1 device: reduction order differs (as tests/integration/test_backends.py)."""


def _spec(pipeline, root: str, stage: str, name: str, writer_id: str | None = None, **overrides) -> str:
    settings = {**tiny_overrides(), "storage.root": root, f"{stage}.max_tokens_per_micro_batch": BUDGETS[stage]}
    if stage != "dpo":
        settings[f"{stage}.grad_accum_steps"] = 2
    settings.update(overrides)
    config = load_config(str(DEMO_CONFIG), overrides=settings)
    sft = StageLayout(pipeline.baseline_uris["sft"]).final if stage != "sft" else None
    output = os.path.join(root, name)
    spec = build_spec(
        config, stage, RUN_ID, stage_inputs(stage, pipeline.data_uri, sft), output_uri=output, writer_id=writer_id
    )
    return write_spec(spec, os.path.join(root, "specs", f"{name}.json"))


def _train_metrics(run) -> dict[int, dict[str, str]]:
    """The printed metrics of the optimizer steps (step 0 holds the evaluation before training)."""
    return {step: values for step, values in run.step_metrics().items() if "train/loss" in values}


@pytest.fixture(scope="module")
def packed_runs(tiny_pipeline, tmp_path_factory):
    """Every run of the module, two at a time: ``name -> StageRun``, plus output URIs."""
    root = str(tmp_path_factory.mktemp("packed"))
    jobs = {
        "sft": lambda: run_stage(_spec(tiny_pipeline, root, "sft", "sft")),
        "reward_model": lambda: run_stage(_spec(tiny_pipeline, root, "reward_model", "reward_model")),
        "dpo": lambda: run_stage(_spec(tiny_pipeline, root, "dpo", "dpo")),
        "sft-killed": lambda: run_stage(
            _spec(tiny_pipeline, root, "sft", "sft-resumed", writer_id="packed-writer"),
            kill_when=after_checkpoint_line(8),
        ),
        "sft-ddp": lambda: run_stage_ranks(
            _spec(
                tiny_pipeline,
                root,
                "sft",
                "sft-ddp",
                **{"sft.grad_accum_steps": 1, "sft.backend": {"name": "ddp", "nproc_per_node": 2}},
            ),
            2,
        ),
        "dpo-fsdp2": lambda: run_stage_ranks(
            _spec(
                tiny_pipeline,
                root,
                "dpo",
                "dpo-fsdp2",
                **{"dpo.grad_accum_steps": 1, "dpo.backend": {"name": "fsdp2", "nproc_per_node": 2}},
            ),
            2,
        ),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        runs = {name: f.result() for name, f in futures.items()}
    runs["sft-resumed"] = run_stage(_spec(tiny_pipeline, root, "sft", "sft-resumed", writer_id="packed-writer"))
    return root, runs


@pytest.mark.parametrize("stage", ["sft", "reward_model", "dpo"])
def test_packed_stage_trains_to_the_end(packed_runs, stage):
    root, runs = packed_runs
    run = runs[stage]
    assert run.returncode == 0, run.tail()
    metrics = _train_metrics(run)
    assert sorted(metrics) == list(range(1, MAX_STEPS + 1)), run.tail()
    assert all(math.isfinite(float(m["train/loss"])) for m in metrics.values())
    assert StageLayout(os.path.join(root, stage)).final and final_weights(os.path.join(root, stage))


def test_packed_sft_resumes_bit_exact_after_a_kill(packed_runs):
    root, runs = packed_runs
    assert runs["sft-killed"].killed and runs["sft-resumed"].returncode == 0, runs["sft-resumed"].tail()
    assert any("resum" in line.lower() for line in runs["sft-resumed"].lines), runs["sft-resumed"].tail()
    assert_same_weights(final_weights(os.path.join(root, "sft-resumed")), final_weights(os.path.join(root, "sft")))


@pytest.mark.parametrize(("stage", "name"), [("sft", "sft-ddp"), ("dpo", "dpo-fsdp2")])
def test_two_ranks_print_the_single_devices_packed_losses(packed_runs, stage, name):
    _, runs = packed_runs
    run, single = runs[name], runs[stage]
    assert run.returncode == 0, run.tail(60)
    got, want = _train_metrics(run), _train_metrics(single)
    assert sorted(got) == sorted(want) == list(range(1, MAX_STEPS + 1))
    for step, values in want.items():
        assert float(got[step]["train/loss"]) == pytest.approx(
            float(values["train/loss"]), rel=PRINTED_REL, abs=PRINTED_ABS
        ), (step, got[step], values)
