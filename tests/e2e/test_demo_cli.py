"""``posttrain run configs/<demo config>`` as a user runs it: a child process, every stage of the
config at tiny sizes (``tests/tiny.py``), against the session's Prefect API. The last stdout line
is the summary URI and the summary it names says every stage completed
(``tests.e2e.stack.run_cli``).

Two runs: ``demo.yaml`` on the single backend (the session's shared ``demo_run``, which
``test_model_lifecycle`` also reads) and ``demo-extended.yaml`` with a backend a stage (FSDP2 and
ZeRO-3 at 2 ranks, LoRA on one process)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.e2e.stack import run_cli

STAGES = ("prepare_data", "sft", "reward_model", "score", "dpo", "ppo", "grpo", "evaluate")
TRAINED = ("sft", "reward_model", "dpo", "ppo", "grpo")

TWO_RANKS = {"nproc_per_node": 2}
EXTENDED_STAGES = ["prepare_data", "pretrain", "sft", "teacher", "reward_model", "dpo", "kto", "distill", "evaluate"]
"""demo-extended.yaml's stages with the reward model (trained from SFT, committed for evaluate)
added."""
TINY_TEACHER: dict[str, object] = {
    "teacher.max_steps": 4,
    "teacher.eval_every": 2,
    "teacher.save_every": 2,
    "teacher.model_init": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    },
    "distill.max_steps": 2,
    "distill.prompts_per_rollout": 2,
    "distill.num_mini_batches": 1,
    "distill.save_every": 2,
    "distill.generation.max_new_tokens": 8,
}
"""The teacher (twice the tiny student's width) and the distillation at tiny sizes."""
MIXED: dict[str, object] = {
    # A backend a stage of demo-extended.yaml (plus the reward model): full weights at 2 ranks on
    # FSDP2 (pretrain) and ZeRO-3 (SFT, loading FSDP2's commit; the reward model, committing its
    # gathered partitions with the score head), DPO training LoRA adapters on one process (merged
    # on commit), KTO on one process. The SFT and DPO steps on every backend, against the single
    # device, are compared in tests/integration (the RL stages at 2 ranks in test_rl_distributed);
    # an adapter committed over its base is tests/integration/test_lora.py's.
    "pretrain.backend": {"name": "fsdp2", **TWO_RANKS},
    "sft.backend": {"name": "deepspeed", "zero_stage": 3, **TWO_RANKS},
    "reward_model.backend": {"name": "deepspeed", "zero_stage": 3, **TWO_RANKS},
    "dpo.lora.enabled": True,
}
MIXED_BACKENDS = {
    "pretrain": ("fsdp2", 2),
    "sft": ("deepspeed", 2),
    "reward_model": ("deepspeed", 2),
    "dpo": ("single", 1),
    "kto": ("single", 1),
}
"""Stage -> (backend, world size) its manifest records in the mixed run."""


def check_demo_summary(summary: dict, root: Path, backends: dict[str, tuple[str, int]]) -> None:
    """Every demo stage ran; each training stage on its backend and world size, committing plain
    (LoRA: merged) weights; evaluate compared every policy with SFT; the MLflow store is the
    default one under the storage root."""
    assert set(summary["stages"]) == set(STAGES)
    assert summary["stages"]["sft"]["metrics"]["global_step"] == 4
    for name in TRAINED:
        final = Path(summary["stages"][name]["output_uri"])
        manifest = json.loads((final / "manifest.json").read_text())
        assert (manifest["backend"], manifest["world_size"]) == backends[name], name
        weights = final / "model.safetensors"
        assert weights.is_file()
        with safe_open(weights, "pt") as f:  # LoRA commits the merged model: plain keys only
            assert f.keys() and not [k for k in f.keys() if "lora_" in k], name
    assert summary["mlflow"]["tracking_uri"] == f"sqlite:///{root / 'mlflow.db'}"
    evaluated = summary["stages"]["evaluate"]["metrics"]
    for policy in ("dpo", "ppo", "grpo"):
        assert f"{policy}_vs_sft/win_rate" in evaluated
        gain = evaluated[f"{policy}/exact_match"] - evaluated["sft/exact_match"]
        assert evaluated[f"{policy}_vs_sft/exact_match_gain"] == pytest.approx(gain, abs=1e-9)
        assert evaluated[f"{policy}_vs_sft/exact_match_gain_se"] >= 0
    for rl in ("ppo", "grpo"):
        assert {"first/reward_mean", "reward_mean"} <= set(summary["stages"][rl]["metrics"])


def test_demo_config_through_the_cli(demo_run):
    """configs/demo.yaml on the single backend, score and evaluate through the static engine (the
    session's shared run, ``demo_run``)."""
    check_demo_summary(demo_run.summary, demo_run.root, {name: ("single", 1) for name in TRAINED})
    # PPO's reward is the reward model's score plus the verifier's (weights 1.0): each part logged
    ppo = demo_run.summary["stages"]["ppo"]["metrics"]
    assert ppo["reward_mean"] == pytest.approx(ppo["reward/reward_model"] + ppo["reward/verifier"], abs=1e-5)
    # Sampled answers: pass@1 is the mean accuracy of the 4 samples (avg@4), pass@4 at least that
    evaluated = demo_run.summary["stages"]["evaluate"]["metrics"]
    for policy in ("sft", "dpo", "ppo", "grpo"):
        one, four, avg = (evaluated[f"{policy}/{m}"] for m in ("pass_at_1", "pass_at_4", "avg_at_4"))
        assert (
            one == pytest.approx(avg, abs=1e-9) and 0 <= one <= four <= 1 and evaluated[f"{policy}/pass_at_4_se"] >= 0
        )
    # ... each problem's estimates are in the sample table, and the paired gains over SFT read them
    samples = [
        json.loads(line)
        for line in (Path(demo_run.summary["stages"]["evaluate"]["output_uri"]) / "samples.jsonl")
        .read_text()
        .splitlines()
    ]
    sampled = [row for row in samples if "sft_pass_at_4" in row]
    assert sampled
    for policy in ("sft", "grpo"):
        assert evaluated[f"{policy}/pass_at_4"] == pytest.approx(
            sum(row[f"{policy}_pass_at_4"] for row in sampled) / len(sampled), abs=1e-9
        )
    # lm-eval's held-out task: the harness's own scoring of each policy, and its results JSON kept
    final = Path(demo_run.summary["stages"]["evaluate"]["output_uri"])
    for policy in ("sft", "dpo", "ppo", "grpo"):
        strict = evaluated[f"{policy}/lm_eval/posttrain_heldout/exact_match_strict_match"]
        flexible = evaluated[f"{policy}/lm_eval/posttrain_heldout/exact_match_flexible_extract"]
        assert 0 <= strict <= 1 and 0 <= flexible <= 1
        results = json.loads((final / f"lm_eval_{policy}.json").read_text())
        assert results["results"]["posttrain_heldout"]["exact_match,flexible-extract"] == pytest.approx(flexible)
        assert results["results"]["posttrain_heldout"]["sample_len"] == len(samples) and "samples" not in results
    # ... each example's score in the harness's sample table, and its paired gain over SFT read from it
    harness = [json.loads(line) for line in (final / "lm_eval_samples.jsonl").read_text().splitlines()]
    metric = "lm_eval/posttrain_heldout/exact_match_flexible_extract"
    assert len(harness) == len(samples)
    for policy in ("sft", "grpo"):
        assert evaluated[f"{policy}/{metric}"] == pytest.approx(
            sum(r[f"{policy}_{metric}"] for r in harness) / len(harness)
        )
    gain = evaluated[f"grpo/{metric}"] - evaluated[f"sft/{metric}"]
    assert evaluated[f"grpo_vs_sft/{metric}_gain"] == pytest.approx(gain, abs=1e-9)
    assert evaluated[f"grpo_vs_sft/{metric}_gain_se"] >= 0
    gain = evaluated["grpo/pass_at_4"] - evaluated["sft/pass_at_4"]
    assert evaluated["grpo_vs_sft/pass_at_4_gain"] == pytest.approx(gain, abs=1e-9)
    assert evaluated["grpo_vs_sft/avg_at_4_gain_se"] >= 0


STAGE_OUTPUT = re.compile(
    r"^(\[\w+\] step \d+|stage \w+: |stage \w+ committed|Finished in state"  # step metrics, the task's own lines
    r"|\d{4}-\d\d-\d\d [\d:,]+ (INFO|WARNING|ERROR) (trainer_core|tasks)\.)"  # the trainer's own log records
)
"""A task log line's message that is stage output: a step's metrics, the task's lines about its
stage, the trainer's own log records. Anything else (a library's warning, a progress bar, a
blank line) is noise to an operator."""


def test_the_task_log_is_stage_output(demo_run):
    """At most 10% of a demo run's task log lines are not stage output (was 58 progress-bar lines,
    30 blank, 10 MLflow model-card warnings of 193: 55%)."""
    messages = [line.split(" - ", 1)[1] if " - " in line else "" for line in demo_run.log if "| Task run '" in line]
    noise = [m for m in messages if not STAGE_OUTPUT.match(m)]
    print(f"task log: {len(messages)} lines, {len(noise)} not stage output")
    assert messages and len(noise) <= 0.1 * len(messages), "\n".join(noise)
    assert not [m for m in messages if not m.strip() or "it/s]" in m], "blank lines or progress bars in the task log"


@pytest.mark.slow
def test_demo_extended_config_with_a_backend_a_stage_through_the_cli(prefect_api, tmp_path):
    """configs/demo-extended.yaml with a backend a stage (:data:`MIXED`): pretrain on raw text
    (FSDP2 at 2 ranks), SFT from it and the reward model from SFT (ZeRO-3 at 2 ranks; all under
    torchrun), DPO (LoRA, merged on commit) and KTO from SFT, a wider teacher distilled into SFT
    (:data:`TINY_TEACHER`), and evaluate comparing the six policies, in one run; each stage loads
    the model the previous backend committed."""
    sets = {
        "stages": EXTENDED_STAGES,
        "pretrain.max_steps": 4,
        "pretrain.eval_every": 2,
        "pretrain.save_every": 2,
        "kto.max_steps": 2,
        "kto.grad_accum_steps": 1,
        **TINY_TEACHER,
        **MIXED,
    }
    _, summary, _ = run_cli(prefect_api, tmp_path, "demo-extended.yaml", sets)
    stages = summary["stages"]
    assert set(stages) == set(EXTENDED_STAGES)
    assert stages["pretrain"]["metrics"]["global_step"] == 4 and stages["kto"]["metrics"]["global_step"] == 2
    sft_spec = json.loads((Path(stages["sft"]["output_uri"]).parents[2] / "specs" / "sft.json").read_text())
    assert sft_spec["inputs"]["model"] == stages["pretrain"]["output_uri"]
    for name, backend in MIXED_BACKENDS.items():
        final = Path(stages[name]["output_uri"])
        manifest = json.loads((final / "manifest.json").read_text())
        assert (manifest["backend"], manifest["world_size"]) == backend, name
        with safe_open(final / "model.safetensors", "pt") as f:  # LoRA commits the merged model: plain keys only
            assert f.keys() and not [k for k in f.keys() if "lora_" in k], name
    distill_spec = json.loads((Path(stages["distill"]["output_uri"]).parents[2] / "specs" / "distill.json").read_text())
    assert distill_spec["inputs"]["reference"] == stages["teacher"]["output_uri"]  # the teacher stage's model
    assert json.loads((Path(stages["teacher"]["output_uri"]) / "config.json").read_text())["hidden_size"] == 64
    for policy in ("pretrain", "sft", "teacher", "dpo", "kto", "distill"):
        assert f"{policy}/exact_match" in stages["evaluate"]["metrics"]
