"""The opt-in stages of configs/demo-extended.yaml as real stage processes on the tiny pipeline:
prepare_data with ``data.kto`` and ``data.pretrain``, then pretrain, SFT from the pretrained
model (wired by the stage registry), and KTO from SFT.

- pretrain lowers its held-out loss and SFT starts from its output;
- KTO starts where its equation says (policy == reference: KL estimate 0, every example's loss
  1 - sigmoid(0) = 0.5), lowers its held-out loss, and separates the implied rewards of
  desirable and undesirable examples;
- its reference log-probs (of each completion and of its mismatched KL sequence) are committed;
- with LoRA its reference is the policy's disabled adapter: no reference model, same fixed point;
- at 2 ranks (DDP) the KL estimate is averaged over the ranks, as TRL's, and the stage runs from
  the same fixed point.
"""

from __future__ import annotations

import json
import os

import pytest

from trainer_core import storage
from trainer_core.checkpoint.manifest import read_manifest
from trainer_core.config import load_config
from trainer_core.registry import stage_inputs
from trainer_core.spec import build_spec
from trainer_core.storage import StageLayout, join_uri

from .helpers import RUN_ID, run_stage, run_stage_ranks, tiny_overrides, why_failed, write_spec

STAGES = ("prepare_data", "pretrain", "sft", "kto")
KTO = {
    "max_steps": 48,
    "micro_batch_size": 8,
    "learning_rate": 2e-3,
    "beta": 0.1,
    "eval_every": 24,
    "eval_max_batches": 8,
    "save_every": 24,
}


@pytest.fixture(scope="module")
def extended(tmp_path_factory):
    """stage -> (its run, its output URI), each stage run once to the end in pipeline order."""
    root = str(tmp_path_factory.mktemp("extended"))
    config = load_config(
        overrides={
            **tiny_overrides(),
            "storage.root": root,
            "stages": list(STAGES),
            "data.kto": {"uri": None},
            "data.pretrain": {"uri": None},
            # An SFT model that has learnt the task's format, and KTO steps enough to move the
            # held-out examples (each of its 384 examples is seen once).
            "sft.max_steps": 80,
            "sft.learning_rate": 3e-3,
            "sft.save_every": 80,
            "sft.eval_every": 40,
            **{f"kto.{k}": v for k, v in KTO.items()},
        }
    )
    outputs: dict[str, str] = {}
    runs = {}
    for stage in STAGES:
        output = os.path.join(root, stage)
        spec = build_spec(config, stage, RUN_ID, stage_inputs(config, stage, outputs), output_uri=output)
        run = run_stage(write_spec(spec, f"{output}.spec.json"))
        assert run.returncode == 0, why_failed(run)
        runs[stage] = (run, output, spec)
        outputs[stage] = StageLayout(output).final
    lora = load_config(base=config.model_dump(mode="json"), overrides={"kto.lora": {"enabled": True, "rank": 4}})
    output = os.path.join(root, "kto_lora")
    spec = build_spec(lora, "kto", RUN_ID, stage_inputs(lora, "kto", outputs), output_uri=output)
    run = run_stage(write_spec(spec, f"{output}.spec.json"))
    assert run.returncode == 0, why_failed(run)
    runs["kto_lora"] = (run, output, spec)
    ddp = load_config(
        base=config.model_dump(mode="json"),
        overrides={"kto.backend": {"name": "ddp", "nproc_per_node": 2}, "kto.max_steps": 4, "kto.eval_every": 4},
    )
    output = os.path.join(root, "kto_ddp")
    spec = build_spec(ddp, "kto", RUN_ID, stage_inputs(ddp, "kto", outputs), output_uri=output)
    run = run_stage_ranks(write_spec(spec, f"{output}.spec.json"), 2)
    assert run.returncode == 0, why_failed(run)
    runs["kto_ddp"] = (run, output, spec)
    return runs


def eval_metric(run, key: str) -> tuple[float, float]:
    """(``key`` before training, at the last evaluation), from the stage's printed eval lines."""
    evals = {step: float(m[key]) for step, m in run.step_metrics().items() if key in m}
    return evals[min(evals)], evals[max(evals)]


def test_prepare_data_commits_kto_and_pretrain_splits(extended):
    _, output, _ = extended["prepare_data"]
    manifest = read_manifest(StageLayout(output).final)
    assert {"kto/train", "kto/eval", "pretrain/train", "pretrain/eval"} <= set(manifest.extra["splits"])
    assert manifest.metrics["num_kto_train_desirable"] > 0
    assert manifest.metrics["num_kto_train"] - manifest.metrics["num_kto_train_desirable"] > 0
    assert manifest.extra["sources"]["kto"] == manifest.extra["sources"]["pretrain"] == "synthetic"


def test_pretrain_learns_and_sft_starts_from_it(extended):
    run, output, _ = extended["pretrain"]
    before, after = eval_metric(run, "eval/loss")
    assert after < before, (before, after)
    _, _, sft_spec = extended["sft"]
    assert sft_spec.inputs["model"] == StageLayout(output).final


def test_kto_starts_at_its_fixed_point_and_learns(extended):
    run, _, spec = extended["kto"]
    _, sft_output, _ = extended["sft"]
    assert spec.inputs["model"] == spec.inputs["reference"] == StageLayout(sft_output).final
    first = run.step_metrics()[1]
    assert float(first["train/loss"]) == pytest.approx(0.5, abs=1e-5)
    assert float(first["train/kl"]) == pytest.approx(0.0, abs=1e-5)
    steps = run.step_metrics()
    shares = [float(steps[step]["train/count/chosen"]) for step in range(1, KTO["max_steps"] + 1)]
    assert 0.3 < sum(shares) / len(shares) < 0.7, shares  # both labels are trained on
    before, after = eval_metric(run, "eval/loss")
    assert after < before, (before, after)
    last = steps[KTO["max_steps"]]
    assert float(last["eval/rewards/chosen"]) > float(last["eval/rewards/rejected"]), last


def test_kto_commits_reference_logprobs_of_both_sequences(extended):
    _, output, spec = extended["kto"]
    uri = StageLayout(output).artifact("reference")
    manifest = read_manifest(uri)
    assert (manifest.stage, manifest.config_hash) == ("kto", spec.fingerprint)
    values = json.loads(storage.read_bytes(join_uri(uri, "train.json")))
    assert values and all(len(v) == 2 and v[0] < 0 and v[1] < 0 for v in values.values())


def test_kto_with_lora_takes_the_disabled_adapter_as_reference(extended):
    run, output, _ = extended["kto_lora"]
    assert "reference: the policy with its LoRA adapter disabled" in run.output
    first = run.step_metrics()[1]
    assert float(first["train/loss"]) == pytest.approx(0.5, abs=1e-5)
    assert float(first["train/kl"]) == pytest.approx(0.0, abs=1e-5)
    assert read_manifest(StageLayout(output).artifact("reference")).stage == "kto"


def test_kto_at_two_ranks_averages_the_reference_point(extended):
    run, output, _ = extended["kto_ddp"]
    steps = run.step_metrics()
    assert float(steps[1]["train/loss"]) == pytest.approx(0.5, abs=1e-5)
    assert sorted(steps) == [0, 1, 2, 3, 4] and "eval/kl" in steps[4]
    assert read_manifest(StageLayout(output).final).world_size == 2
