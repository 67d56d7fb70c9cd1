"""The DPO stage with the other losses of the family (``dpo.loss_type``), as real stage processes
on the tiny pipeline's SFT model:

- IPO starts where its equation says (policy == reference: loss 1 / (4 beta^2) = 25 at beta 0.1);
- SimPO and ORPO are reference-free: no reference log-probs are computed or committed, and the
  stage says so; ORPO logs its NLL and odds-ratio terms;
- every loss lowers its held-out loss from before training to the end (eval at steps 0 and 8).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from trainer_core import storage
from trainer_core.config import load_config
from trainer_core.spec import build_spec
from trainer_core.storage import StageLayout

from .helpers import RUN_ID, TinyPipeline, run_stage, stage_inputs, why_failed, write_spec

STEPS = 8
# Each loss alone (the demo's DPO adds RPO's NLL term, rpo_alpha 2.0, which ORPO refuses).
LOSSES = {
    "ipo": {"dpo.beta": 0.1},
    "simpo": {"dpo.beta": 2.0, "dpo.simpo_gamma": 0.5},
    "orpo": {"dpo.beta": 0.1},
    "hinge": {"dpo.beta": 0.1},
    "robust": {"dpo.beta": 0.1, "dpo.label_smoothing": 0.1},
}


@pytest.fixture(scope="module")
def runs(tiny_pipeline: TinyPipeline, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("preference"))
    sft = StageLayout(tiny_pipeline.baseline_uris["sft"]).final

    def run(loss_type: str):
        config = load_config(
            base=tiny_pipeline.config.model_dump(mode="json"),
            overrides={
                "dpo.loss_type": loss_type,
                "dpo.max_steps": STEPS,
                "dpo.eval_every": STEPS,
                "dpo.log_every": 1,
                "dpo.learning_rate": 1e-3,
                "dpo.rpo_alpha": 0.0,
                **LOSSES[loss_type],
            },
        )
        output = os.path.join(root, loss_type)
        spec = build_spec(config, "dpo", RUN_ID, stage_inputs("dpo", tiny_pipeline.data_uri, sft), output_uri=output)
        result = run_stage(write_spec(spec, f"{output}.spec.json"))
        assert result.returncode == 0, why_failed(result)
        return result, output

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {loss: pool.submit(run, loss) for loss in LOSSES}
        yield {loss: f.result() for loss, f in futures.items()}


def eval_losses(run) -> tuple[float, float]:
    """(held-out loss before training, at the last step), from the stage's printed lines."""
    evals = {step: float(m["eval/loss"]) for step, m in run.step_metrics().items() if "eval/loss" in m}
    return evals[min(evals)], evals[STEPS]


def test_ipo_starts_at_its_fixed_point(runs):
    run, _ = runs["ipo"]
    assert float(run.step_metrics()[1]["train/loss"]) == pytest.approx(25.0, rel=1e-3)


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_load_no_reference(runs, loss_type):
    run, output = runs[loss_type]
    assert f"loss_type {loss_type} is reference-free" in run.output
    assert not storage.exists(StageLayout(output).artifact("reference"))
    assert "computing reference log-probs" not in run.output
    if loss_type == "orpo":
        assert {"train/nll_loss", "train/log_odds_ratio"} <= set(run.step_metrics()[1])
    _, dpo_like = runs["ipo"]
    assert storage.exists(StageLayout(dpo_like).artifact("reference"))


@pytest.mark.parametrize("loss_type", list(LOSSES))
def test_every_loss_lowers_its_held_out_loss(runs, loss_type):
    before, after = eval_losses(runs[loss_type][0])
    assert after < before, (loss_type, before, after)
