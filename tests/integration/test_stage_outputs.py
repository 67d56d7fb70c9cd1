"""What the stages commit, and a step's independence from how its batch is cut.

- Every committed directory (prepare_data's output, each training stage's ``final/``, its
  newest checkpoint, DPO's reference log-probs) has a manifest listing exactly its files,
  each with the size and SHA-256 of the bytes on storage.
- Each training stage's ``final/`` loads with the ``transformers`` Auto classes as is.
- Micro-batch x accumulation equivalence: 4 examples x 1 micro-batch, 2 x 2 and 1 x 4 give
  the same per-step losses (the loop normalises by the units counted over the whole step).
  The length-bucketed sampler orders batches differently for different micro-batch sizes, so
  this runs :class:`~trainer_core.training.loop.TrainLoop` in-process on a sampler that cuts each
  4-example micro-batch of the real sampler into consecutive pieces (``in_process.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trainer_core import storage
from trainer_core.backends import build_backend
from trainer_core.checkpoint.manifest import MANIFEST_NAME, read_manifest, verify
from trainer_core.checkpoint.session import CheckpointSession, MetricsBuffer
from trainer_core.config import BackendConfig
from trainer_core.errors import EXIT_RESOURCE
from trainer_core.spec import build_spec
from trainer_core.storage import StageLayout, join_uri
from trainer_core.training.loop import BatchSource, TrainLoop

from .helpers import MAX_STEPS, TinyPipeline, checkpoint_uri, child_env, committed_steps, final_weights, write_spec
from .in_process import accumulation_run, stage_parts

FIXTURES = Path(__file__).resolve().parent / "fixtures"

COMMITTED_DIRS = [
    "prepare_data/final",
    *(f"{stage}/{what}" for stage in ("sft", "reward_model", "dpo") for what in ("final", "checkpoint")),
    "dpo/reference",
]


def _committed_dir(pipeline: TinyPipeline, name: str) -> str:
    stage, what = name.split("/")
    if stage == "prepare_data":
        return pipeline.data_uri
    output = pipeline.baseline_uris[stage]
    if what == "checkpoint":
        return checkpoint_uri(output, committed_steps(output)[-1])
    return StageLayout(output).final if what == "final" else join_uri(output, what)


@pytest.mark.parametrize("name", COMMITTED_DIRS)
def test_manifest_lists_every_file_with_its_sha256(tiny_pipeline, name):
    uri = _committed_dir(tiny_pipeline, name)
    manifest = read_manifest(uri)
    on_disk = storage.list_files(uri)
    listed = {entry.path: entry for entry in manifest.files}
    assert set(listed) == set(on_disk) - {MANIFEST_NAME}
    for path, entry in listed.items():
        data = storage.read_bytes(join_uri(uri, path))
        assert (entry.size_bytes, entry.sha256) == (len(data), hashlib.sha256(data).hexdigest()), path
    assert verify(uri, manifest) == []
    assert manifest.stage == name.split("/")[0]
    if name.endswith("/final") and not name.startswith("prepare_data"):
        assert manifest.global_step == MAX_STEPS


@pytest.mark.parametrize(
    ("stage", "auto_class"),
    [
        ("sft", AutoModelForCausalLM),
        ("reward_model", AutoModelForSequenceClassification),
        ("dpo", AutoModelForCausalLM),
    ],
)
def test_final_dir_loads_with_auto_classes(tiny_pipeline, stage, auto_class):
    output = tiny_pipeline.baseline_uris[stage]
    path = storage.materialize(StageLayout(output).final)
    model, info = auto_class.from_pretrained(path, output_loading_info=True)
    saved = {
        "config": json.loads(Path(path, "config.json").read_text()),
        "keys": sorted(final_weights(output)),
        "tied": getattr(model, "all_tied_weights_keys", None),
    }
    assert not info["missing_keys"] and not info["unexpected_keys"], (info, saved)
    tokenizer = AutoTokenizer.from_pretrained(path)
    encoded = tokenizer(["What is 3 + 4?", "Add 12 and 5."], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]).logits
    expected_shape = (2, 1) if stage == "reward_model" else (2, encoded["input_ids"].shape[1], len(tokenizer))
    assert tuple(logits.shape) == expected_shape and torch.isfinite(logits).all()
    state = model.state_dict()
    for name, tensor in final_weights(output).items():
        assert torch.equal(state[name], tensor), name
    if stage != "sft":  # trained away from its SFT starting point
        start = final_weights(tiny_pipeline.baseline_uris["sft"])
        assert any(not torch.equal(state[k], v) for k, v in start.items() if k in state)


EXAMPLES_PER_STEP = 4


def _train(parts, workdir: str, grad_accum_steps: int):
    """Six optimizer steps of 4 examples each, cut into ``grad_accum_steps`` micro-batches.

    Returns:
        ({global_step: logged metrics}, final weights).
    """
    make, objective, rows, lengths, collate = parts
    sampler, cfg = accumulation_run(lengths, EXAMPLES_PER_STEP, grad_accum_steps, 6)
    logged: dict[int, dict[str, float]] = {}
    backend = build_backend(BackendConfig(device="cpu"))
    loop = TrainLoop(
        model=backend.wrap(make()),
        backend=backend,
        objective=objective,
        batches=BatchSource(rows=rows, sampler=sampler, collate=collate, device=torch.device("cpu")),
        cfg=cfg,
        session=CheckpointSession(
            os.path.join(workdir, f"accum{grad_accum_steps}"),
            backend,
            metrics=MetricsBuffer(printer=lambda metrics, step: logged.setdefault(step, {}).update(metrics)),
        ),
    )
    loop.run()
    return logged, {k: v.detach().clone() for k, v in loop.model.state_dict().items()}


@pytest.mark.parametrize("stage", ["sft", "reward_model", "dpo"])
def test_micro_batch_times_accumulation_gives_the_same_steps(tiny_pipeline, tmp_path, stage):
    parts = stage_parts(stage, tiny_pipeline)
    reference_metrics, reference_weights = _train(parts, str(tmp_path), grad_accum_steps=1)
    for grad_accum_steps in (2, 4):
        metrics, weights = _train(parts, str(tmp_path), grad_accum_steps=grad_accum_steps)
        for step in range(1, 7):
            expected, actual = reference_metrics[step], metrics[step]
            assert actual["train/consumed_samples"] == expected["train/consumed_samples"] == step * EXAMPLES_PER_STEP
            for key in ("train/loss", "train/grad_norm"):
                assert actual[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), (grad_accum_steps, step, key)
        for name, tensor in reference_weights.items():
            torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_out_of_memory_is_a_resource_error_naming_the_stage_and_batch(tiny_pipeline, tmp_path):
    """A real allocation failure (the address space capped a little above what torch needs) ends
    the trainer with exit 3, the message naming the stage, its micro-batch size and what to lower."""
    config = tiny_pipeline.config.model_copy(deep=True)
    config.model.init.hidden_size, config.model.init.intermediate_size = 512, 8192
    config.sft.micro_batch_size = 512
    spec = build_spec(
        config, "sft", "oom", {"data": tiny_pipeline.data_uri, "model": "init"}, output_uri=str(tmp_path / "sft")
    )
    spec_path = write_spec(spec, tmp_path / "sft.json")
    out = subprocess.run(
        [sys.executable, str(FIXTURES / "oom_trainer.py"), spec_path, "1500"],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )
    assert out.returncode == EXIT_RESOURCE, out.stdout[-2000:] + out.stderr[-2000:]
    assert "error: stage sft at sft.micro_batch_size=512: out of memory" in out.stderr, out.stderr[-2000:]
    assert "lower the stage's micro_batch_size" in out.stderr
    assert not (tmp_path / "sft" / "final").exists()
