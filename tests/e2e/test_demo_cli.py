"""``posttrain run configs/demo.yaml`` as a user runs it: a child process, every stage of the
demo config with tiny sizes, against the session's Prefect API. The last stdout line is the
summary URI and the summary it names says every stage completed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.e2e.stack import TINY_DEMO

REPO = Path(__file__).resolve().parents[2]

BACKENDS = {
    # score and evaluate generate through the static engine here (the other cases: transformers' generate)
    "single": ["score.generation.engine=static", "evaluate.generation.engine=static"],
    # The fixed points of the interface, verbatim: every training stage at 2 ranks.
    "fsdp2": ["backend.name=fsdp2", "backend.nproc_per_node=2"],
    "deepspeed-zero3": ["backend.name=deepspeed", "backend.zero_stage=3", "backend.nproc_per_node=2"],
    # configs/demo-lora.yaml: LoRA on every training stage, on one process.
    "single-lora": [],
}
CONFIGS = {"single-lora": "demo-lora.yaml"}


def run_cli(prefect_api: str, tmp_path: Path, config: str, sets: list[str]) -> tuple[list[str], dict]:
    """``posttrain run configs/<config>`` with :data:`~tests.e2e.stack.TINY_DEMO` and ``sets`` as ``--set`` overrides,
    writing under ``tmp_path/out``; returns its stdout lines and the summary it names, after
    checking that the run and every stage of it completed."""
    root = tmp_path / "out"
    args = [str(REPO / "configs" / config), "--run-id", "demo-cli", "--set", f"storage.root={root}"]
    for item in [f"{key}={value}" for key, value in TINY_DEMO.items()] + sets:
        args += ["--set", item]
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "run", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "run id: demo-cli"
    uri = lines[-1]
    assert uri == str(root / "runs" / "demo-cli" / "summary.json")
    summary = json.loads(Path(uri).read_text())
    assert summary["run_id"] == "demo-cli" and summary["status"] == "completed"
    for name, entry in summary["stages"].items():
        assert entry["status"] == "completed", (name, entry)
        assert (Path(entry["output_uri"]) / "manifest.json").is_file()
        assert f"{name}: completed -> {entry['output_uri']}" in lines
    return lines, summary


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_demo_config_through_the_cli(prefect_api, tmp_path, backend):
    root = tmp_path / "out"
    _, summary = run_cli(prefect_api, tmp_path, CONFIGS.get(backend, "demo.yaml"), BACKENDS[backend])
    stages = ("prepare_data", "sft", "reward_model", "score", "dpo", "ppo", "grpo", "evaluate")
    assert set(summary["stages"]) == set(stages)
    assert summary["stages"]["sft"]["metrics"]["global_step"] == 4
    world_size = 2 if "backend.nproc_per_node=2" in BACKENDS[backend] else 1
    for name in ("sft", "reward_model", "dpo", "ppo", "grpo"):
        manifest = json.loads((Path(summary["stages"][name]["output_uri"]) / "manifest.json").read_text())
        assert (manifest["backend"], manifest["world_size"]) == (backend.split("-")[0], world_size), name
        final = Path(summary["stages"][name]["output_uri"])
        if backend == "single-lora" and name == "sft":  # merge_on_commit false: the adapter, over base/
            assert manifest["extra"]["adapter"] == {"format": "peft", "base_model": str(final / "base")}
            assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
            final = final / "base"
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


@pytest.mark.slow
def test_demo_extended_config_through_the_cli(prefect_api, tmp_path):
    """configs/demo-extended.yaml: pretrain on raw text, SFT from it, DPO and KTO from SFT, and
    evaluate comparing the four policies."""
    sets = ["pretrain.max_steps=4", "pretrain.eval_every=2", "pretrain.save_every=2", "kto.max_steps=2",
            "kto.grad_accum_steps=1"]
    _, summary = run_cli(prefect_api, tmp_path, "demo-extended.yaml", sets)
    stages = summary["stages"]
    assert set(stages) == {"prepare_data", "pretrain", "sft", "dpo", "kto", "evaluate"}
    assert stages["pretrain"]["metrics"]["global_step"] == 4 and stages["kto"]["metrics"]["global_step"] == 2
    sft_spec = json.loads((Path(stages["sft"]["output_uri"]).parents[2] / "specs" / "sft.json").read_text())
    assert sft_spec["inputs"]["model"] == stages["pretrain"]["output_uri"]
    for policy in ("pretrain", "sft", "dpo", "kto"):
        assert f"{policy}/exact_match" in stages["evaluate"]["metrics"]
    assert (Path(stages["kto"]["output_uri"]) / "model.safetensors").is_file()
