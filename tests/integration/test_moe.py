"""A mixture-of-experts model (Mixtral architecture built tiny from config: 2 blocks of 4
experts, top-2 routing) trained by the SFT stage, as real stage processes:

- at 2 ranks on FSDP2 (experts sharded with their block) it prints the single device's lines,
  the router load-balancing loss and the expert-usage statistics (counted on each rank, summed
  over ranks) included;
- the stage's MLflow run holds the per-block expert statistics;
- with ``moe.aux_loss_coef`` > 0 the router loss enters the training loss; with 0 it is only
  reported;
- a router temperature schedule takes its temperature from the step (logged), changes the
  routing of the training forwards, and leaves evaluation at step 0 as it was;
- over 100 steps, the router loss (0.1) leaves the experts more evenly used than none does: the
  mean expert-usage entropy of the last 25 steps is higher, same seed and data.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from mlflow import MlflowClient

from trainer_core.checkpoint.manifest import read_manifest
from trainer_core.config import load_config
from trainer_core.registry import stage_inputs
from trainer_core.spec import build_spec
from trainer_core.storage import StageLayout

from .helpers import RUN_ID, assert_close_lines, run_stage, run_stage_ranks, tiny_overrides, why_failed, write_spec

STEPS = 8
LONG_STEPS = 100
EXPERTS, LAYERS = 4, 2
MOE = {
    "model.init.architecture": "mixtral",
    "model.init.num_hidden_layers": LAYERS,
    "model.init.intermediate_size": 32,
    "model.init.num_local_experts": EXPERTS,
    "model.init.num_experts_per_tok": 2,
    "sft.max_steps": STEPS,
    "sft.global_batch_size": 8,
    "sft.micro_batch_size": 4,
    "sft.save_every": STEPS,
    "sft.eval_every": 4,
    "sft.moe.aux_loss_coef": 0.1,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (run, output URI): prepare_data, then SFT on one process (tracked in MLflow), at 2
    ranks on FSDP2, and on one process without the router loss."""
    root = str(tmp_path_factory.mktemp("moe"))
    config = load_config(overrides={**tiny_overrides(), **MOE, "storage.root": root})
    data = os.path.join(root, "data")
    prepared = run_stage(write_spec(build_spec(config, "prepare_data", RUN_ID, {}, output_uri=data), f"{data}.json"))
    assert prepared.returncode == 0, why_failed(prepared)
    inputs = stage_inputs(config, "sft", {"prepare_data": StageLayout(data).final})
    tracking_uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(tracking_uri)
    mlflow_run = client.create_run(client.create_experiment("moe")).info.run_id

    def run(name: str, overrides: dict, nproc: int = 1, **spec_kwargs):
        stage_config = load_config(base=config.model_dump(mode="json"), overrides=overrides)
        output = os.path.join(root, name)
        spec = build_spec(stage_config, "sft", RUN_ID, inputs, output_uri=output, **spec_kwargs)
        path = write_spec(spec, f"{output}.spec.json")
        result = run_stage(path) if nproc == 1 else run_stage_ranks(path, nproc)
        assert result.returncode == 0, why_failed(result)
        return result, output

    long = {"sft.max_steps": LONG_STEPS, "sft.save_every": LONG_STEPS, "sft.eval_every": LONG_STEPS}
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = {
            "single": pool.submit(run, "single", {}, tracking_uri=tracking_uri, mlflow_run_id=mlflow_run),
            "fsdp2": pool.submit(run, "fsdp2", {"backend.name": "fsdp2", "backend.nproc_per_node": 2}, 2),
            "no_aux": pool.submit(run, "no_aux", {"sft.moe.aux_loss_coef": 0.0}),
            "tempered": pool.submit(run, "tempered", {"sft.moe.router_temperature": {"start": 2.0, "steps": 4}}),
            "long_aux": pool.submit(run, "long_aux", long),
            "long_no_aux": pool.submit(run, "long_no_aux", {**long, "sft.moe.aux_loss_coef": 0.0}),
        }
        results = {name: job.result() for name, job in jobs.items()}
    results["mlflow"] = (client, mlflow_run)
    return results


def test_fsdp2_at_two_ranks_tracks_the_single_device(runs):
    (single, _), (ranks, output) = runs["single"], runs["fsdp2"]
    expected = single.step_metrics()
    assert "train/moe/entropy" in expected[STEPS] and "train/moe/layer1/expert3_share" in expected[STEPS]
    assert_close_lines(ranks.step_metrics(), expected)
    manifest = read_manifest(StageLayout(output).final)
    assert (manifest.backend, manifest.world_size, manifest.global_step) == ("fsdp2", 2, STEPS)


def test_expert_statistics_are_consistent(runs):
    single, _ = runs["single"]
    for step, metrics in single.step_metrics().items():
        if step == 0:
            continue
        for layer in range(LAYERS):
            shares = [float(metrics[f"train/moe/layer{layer}/expert{e}_share"]) for e in range(EXPERTS)]
            assert sum(shares) == pytest.approx(1.0, abs=1e-3)
            assert float(metrics[f"train/moe/layer{layer}/min_share"]) == pytest.approx(min(shares), abs=1e-4)
            assert float(metrics[f"train/moe/layer{layer}/max_share"]) == pytest.approx(max(shares), abs=1e-4)
            entropy = -sum(p * math.log(p) for p in shares if p > 0)
            assert float(metrics[f"train/moe/layer{layer}/entropy"]) == pytest.approx(entropy, abs=2e-3)
            assert entropy <= math.log(EXPERTS) + 1e-6
        assert float(metrics["train/moe/aux_loss"]) >= 2.0 - 1e-3  # top-2 Switch loss: 2 when perfectly balanced


def test_mlflow_run_holds_the_per_block_expert_statistics(runs):
    client, run_id = runs["mlflow"]
    keys = set(client.get_run(run_id).data.metrics)
    for layer in range(LAYERS):
        assert {f"train/moe/layer{layer}/{name}" for name in ("entropy", "min_share", "max_share")} <= keys
        assert {f"train/moe/layer{layer}/expert{e}_share" for e in range(EXPERTS)} <= keys
    history = client.get_metric_history(run_id, "train/moe/entropy")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))


def test_router_loss_enters_the_training_loss_only_with_a_coefficient(runs):
    (with_aux, _), (without, _) = runs["single"], runs["no_aux"]
    first, plain = with_aux.step_metrics()[1], without.step_metrics()[1]
    # same weights and batch at step 1: the losses differ by 0.1 x the router loss, which both report
    aux = float(plain["train/moe/aux_loss"])
    assert float(first["train/moe/aux_loss"]) == pytest.approx(aux, rel=1e-3)
    assert float(first["train/loss"]) - float(plain["train/loss"]) == pytest.approx(0.1 * aux, rel=2e-2)


def test_router_temperature_follows_its_schedule(runs):
    (plain, _), (tempered, _) = runs["single"], runs["tempered"]
    steps, base = tempered.step_metrics(), plain.step_metrics()
    assert [float(steps[s]["train/moe/router_temperature"]) for s in range(1, STEPS + 1)] == pytest.approx(
        [2.0, 1.75, 1.5, 1.25, 1.0, 1.0, 1.0, 1.0]
    )
    assert "train/moe/router_temperature" not in base[1]
    assert float(steps[0]["eval/loss"]) == pytest.approx(float(base[0]["eval/loss"]), rel=1e-6)  # temperature 1
    # flatter routing probabilities from step 1 on: the router loss (mean probability x share) moves
    assert steps[1]["train/moe/aux_loss"] != base[1]["train/moe/aux_loss"]
    assert any(steps[s]["train/loss"] != base[s]["train/loss"] for s in range(1, STEPS + 1))


def test_router_loss_balances_the_experts_over_100_steps(runs):
    def late_entropy(run) -> float:
        steps = run.step_metrics()
        return sum(float(steps[s]["train/moe/entropy"]) for s in range(LONG_STEPS - 24, LONG_STEPS + 1)) / 25

    balanced, free = late_entropy(runs["long_aux"][0]), late_entropy(runs["long_no_aux"][0])
    print(
        f"mean expert-usage entropy, steps 76-100: aux_loss_coef 0.1 {balanced:.4f}, 0 {free:.4f} "
        f"(uniform {math.log(EXPERTS):.4f})"
    )
    assert balanced > free
