"""The three library examples in ``examples/`` run as users run them, on tiny models, and do what
their docstrings say: a Tier 1 loop learns and commits; Tier 2 runs DPO from a YAML; a custom
``Objective`` trains in ``TrainLoop`` and a second run resumes instead of training again."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from trainer_core.checkpoint.manifest import read_manifest

ROOT = Path(__file__).resolve().parents[2]
ENV_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_example(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **ENV_THREADS, "MLFLOW_TRACKING_URI": ""},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_custom_sft_loop_from_tier_1_primitives(tmp_path):
    out = run_example("examples/custom_sft_loop.py", str(tmp_path / "model"), "--steps", "30")
    losses = [float(m[1]) for m in re.finditer(r"^step \d+: loss=([\d.]+)$", out, flags=re.M)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 1.0, out
    manifest = read_manifest(str(tmp_path / "model"))
    assert manifest.global_step == 30 and "model.safetensors" in {f.path for f in manifest.files}


def test_dpo_from_yaml_with_the_tier_2_factory(tmp_path):
    out = run_example(
        "examples/dpo_from_yaml.py",
        f"storage.root={tmp_path}",
        "sft.max_steps=10",
        "dpo.max_steps=4",
        "dpo.eval_every=4",
    )
    assert [m[1] for m in re.finditer(r"^(\w+): committed at global_step", out, flags=re.M)] == [
        "prepare_data",
        "sft",
        "dpo",
    ]
    dpo = read_manifest(str(tmp_path / "runs" / "dpo-example" / "stages" / "dpo" / "final"))
    assert dpo.global_step == 4 and "eval/rewards/accuracies" in dpo.metrics
    assert dpo.extra["inputs"]["model"] == str(tmp_path / "runs" / "dpo-example" / "stages" / "sft" / "final")


def test_a_custom_objective_in_the_loop_trains_then_resumes(tmp_path):
    first = run_example("examples/custom_objective.py", str(tmp_path))
    assert "resumed: False" in first
    end = re.search(r"global_step 40: eval/loss ([\d.]+) \(first ([\d.]+)\)", first)
    assert end is not None and float(end[1]) < float(end[2]), first
    second = run_example("examples/custom_objective.py", str(tmp_path))
    assert "resumed: True" in second and end[0] in second
    assert "train/loss" not in second  # nothing left to train
