"""CPU smoke run of ``bench/gpu_acceptance.py``: both parts at ``--tiny`` size, run once, read by every test.

The acceptance run itself needs a GPU (``bench/GPU.md``). Here each part runs its CPU pieces
(part A: every ``bench_gpu.py`` case, the project's side and TRL's; part B: GRPO against TRL's
``GRPOTrainer``, or the project alone where TRL is not installed, then ``bench_rl_forward.py``)
as the GPU machine runs them, as a subprocess, and the JSON each
part writes is read back. Not a speed check: that every piece ran, reported its numbers and
landed in the part's table.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "bench" / "gpu_acceptance.py"
HAVE_TRL = importlib.util.find_spec("trl") is not None


@pytest.fixture(scope="module")
def acceptance(tmp_path_factory) -> dict[str, dict]:
    """Both parts' ``gpu_acceptance_<part>.json``, from one ``--part all`` CPU run."""
    out = tmp_path_factory.mktemp("gpu-acceptance")
    flags = ["--part", "all", "--device", "cpu", "--tiny", "--synthetic", "--results-dir", str(out)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *flags, *([] if HAVE_TRL else ["--no-trl"])],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "GPU acceptance, part A" in done.stdout and "GPU acceptance, part B" in done.stdout
    return {part: json.loads((out / f"gpu_acceptance_{part}.json").read_text()) for part in ("A", "B")}


def test_part_a_runs_every_supervised_case(acceptance):
    (piece,) = acceptance["A"]["pieces"]  # compile is a CUDA-only piece
    assert piece["name"] == "supervised" and piece["rc"] == 0
    payload = piece["result"]
    assert set(payload["cases"]) == {"sft_mb16", "sft_mb64", "sft_budget", "dpo_mb8"}
    for name, case in payload["cases"].items():
        project = case["project"]
        assert project["examples_per_s" if name.startswith("dpo") else "tokens_per_s"] > 0
        assert project["timed_steps"] == 2 and 0 < project["mfu"] < 1
        assert project["peak_memory_bytes"] is None  # no CUDA
        assert (case["trl"] is not None) == HAVE_TRL
    assert payload["model"]["num_layers"] == 2 and payload["model"]["matmul_params"] > 0
    budget = payload["cases"]["sft_budget"]
    assert budget["settings"]["max_tokens_per_micro_batch"] == 1024
    assert budget["project"]["padding_share"] == 0.0  # packed: no padding computed
    assert budget["project"]["tokens"] <= 2 * 1024
    assert payload["cases"]["dpo_mb8"]["project"]["reference_pairs"] > 0
    assert any(line.startswith("sft_budget") and "MFU" in line for line in acceptance["A"]["table"])


@pytest.mark.skipif(not HAVE_TRL, reason="TRL (the bench extra) is not installed")
def test_part_a_runs_trl_on_every_supervised_case(acceptance):
    """``bench_gpu.py``'s TRL side: each case's tokens/s (pairs/s) and MFU on the same token ids,
    and a ratio row per target."""
    payload = acceptance["A"]["pieces"][0]["result"]
    for name, case in payload["cases"].items():
        trl = case["trl"]
        assert trl["examples_per_s" if name.startswith("dpo") else "tokens_per_s"] > 0 and trl["tokens"] > 0
        assert trl["timed_steps"] == 2 and 0 < trl["mfu"] < 1 and trl["model_flops_per_s"] > 0
        assert trl["peak_memory_bytes"] is None  # no CUDA
    assert payload["cases"]["sft_mb16"]["trl"]["same_token_ids_as_project"] is True
    metrics = [r["metric"] for r in payload["rows"]]
    assert any("MFU" in m for m in metrics) and any("pairs/s" in m for m in metrics)
    assert all(r["ratio"] > 0 for r in payload["rows"])


def test_part_b_times_grpo_iterations(acceptance):
    piece, _ = acceptance["B"]["pieces"]  # the LoRA memory and engine tests are CUDA-only pieces
    assert piece["name"] == "grpo" and piece["rc"] == 0
    result = piece["result"]["result"]
    for side in ("project", "trl") if HAVE_TRL else ("project",):
        timed = result[side]
        assert len(timed["iterations"]) == 3 and timed["timed_iterations"] == 2
        assert 0 < timed["completion_tokens"] <= 2 * 2 * 8  # prompts x group x new tokens
        assert timed["tokens_per_s"] > 0 and 0 < timed["rollout_s"] < timed["iteration_s"]
    assert (result["trl"] is not None) == HAVE_TRL
    assert any(line.startswith("GRPO iteration completion tokens/s") for line in acceptance["B"]["table"])
    assert acceptance["B"]["settings"]["device"] == "cpu"


def test_part_b_compares_padded_and_padding_free_rl_forwards(acceptance):
    """The last piece of part B: both phases of the RL forwards, padding-free against padded on
    each CPU attention implementation (equal log-probs), and longest-first micro-batches against
    row order, which leave less padding."""
    piece = acceptance["B"]["pieces"][-1]
    assert piece["name"] == "rl-forward" and piece["rc"] == 0
    result = piece["result"]["result"]
    for attn in ("sdpa", "eager"):
        assert result[attn]["max_abs_logprob_diff"] < 1e-4
        for layout in ("padded", "padding_free"):
            assert result[attn][layout]["logprobs_s"] > 0 and result[attn][layout]["update_s"] > 0
    assert result["padding_share"]["longest_first"] < result["padding_share"]["row_order"]
    metrics = [r["metric"] for r in piece["result"]["rows"]]
    assert "sdpa: padding-free | padded update tokens/s" in metrics
    assert "sdpa: padded, longest first | row order log-probs tokens/s" in metrics
    assert any(line.startswith("sdpa: padding-free | padded log-probs") for line in acceptance["B"]["table"])
