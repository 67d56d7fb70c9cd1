"""A Llama-3-8B-sized model trains SFT on one GPU: FSDP2, CPU offload, activation checkpointing.

The model is Llama-3-8B's architecture (hidden 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336,
vocabulary 128,256, RoPE base 500,000, untied head: 8.03B parameters), random init, built on the
GPU in bf16 and saved once with the project's tokenizer (trained by ``prepare_data`` on the
synthetic task; its ~2k entries use the bottom of the 128k vocabulary). The SFT stage then runs
as the pipeline runs it, ``run_spec`` in one torchrun rank (world size 1, NCCL), with
``backend.name=fsdp2``, ``cpu_offload``, ``activation_checkpointing``, for 3 optimizer steps of 8
rows. The stage's final commit is replaced by a record of its metrics: consolidating and saving
32 GB of fp32 weights (twice: staged, then copied) is not what this measures and would not fit
the GPU machine's 64 GiB disk beside the 16 GB initial model.

Reported (printed, and written to ``<tmp_path>/llama3_8b_fits.json``): peak GPU memory
(``torch.cuda.max_memory_allocated`` of the rank), the wall seconds of each step (between the
loop's metric lines, after ``torch.cuda.synchronize()``), the loop's forward / backward /
optimizer phase times, and the rank's peak host RSS. Asserted: 3 steps with finite losses and
gradient norms, peak GPU memory below 80 GiB.

Host memory decides what can run. With CPU offload the sharded weights, gradients and AdamW
state live in host memory, and the multi-tensor AdamW (``foreach``, what sharded parameters use)
allocates one more state-sized temporary (``sqrt(exp_avg_sq)``): ``bf16-mixed`` needs about
4 + 4 + 8 + 4 = 20 bytes a parameter (161 GB for 8B), pure ``bf16`` about 10 (80 GB). A 128 GiB
machine can hold only the second; each case is skipped, saying so, where the host has less
than :func:`host_bytes_needed` available.

Run: ``python -m pytest tests/gpu -m gpu -s`` (``bench/GPU.md``). Unverified until run on a GPU.
With ``cpu_offload`` the rank's process group is ``cpu:gloo,cuda:nccl``
(``trainer_core/backends/distributed.py``): the gradient-norm all-reduce of CPU-offloaded DTensor
gradients needs a CPU backend, as torchtitan and torchtune set it up.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

from tests.gpu.qwen2_setup import run_prepare_data, synthetic_task
from trainer_core.config import PipelineConfig, load_config
from trainer_core.spec import StageSpec, build_spec

pytestmark = pytest.mark.gpu

REPO_ROOT = Path(__file__).resolve().parents[2]

LLAMA3_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128_256,
    "rope_theta": 500_000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
"""Meta-Llama-3-8B's ``config.json`` sizes."""

NUM_STEPS = 3
MICRO_BATCH_SIZE = 8
GPU_LIMIT_BYTES = 80 * 2**30
HOST_BYTES_PER_PARAM = {"bf16-mixed": 4 + 4 + 8 + 4, "bf16": 2 + 2 + 4 + 2}
"""Host bytes a parameter under CPU offload: weights, gradients, AdamW's two moments, foreach's temporary."""
HOST_MARGIN_BYTES = 8 * 2**30
"""The rank's process, CUDA context, pinned staging, tokenizer and data beside the training state."""
RANK_TIMEOUT_S = 1800.0


def num_params(sizes: dict[str, Any]) -> int:
    """Parameters of a Llama of ``sizes`` (embedding, blocks, final norm, untied head)."""
    d, inner, vocab = sizes["hidden_size"], sizes["intermediate_size"], sizes["vocab_size"]
    kv = d // sizes["num_attention_heads"] * sizes["num_key_value_heads"]
    block = 2 * d * d + 2 * d * kv + 3 * d * inner + 2 * d
    head = 0 if sizes["tie_word_embeddings"] else vocab * d
    return vocab * d + sizes["num_hidden_layers"] * block + d + head


def host_bytes_needed(params: int, precision: str) -> int:
    """Host memory the offloaded training state needs at the optimizer step (module docstring)."""
    return params * HOST_BYTES_PER_PARAM[precision] + HOST_MARGIN_BYTES


def host_memory_available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (0 where unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


# --- the stage's inputs (test process) -----------------------------------------------------------


def save_random_model(sizes: dict[str, Any], tokenizer: Any, model_dir: Path, device: torch.device) -> int:
    """A seeded, randomly initialised Llama of ``sizes`` built on ``device`` in bf16 (16 GB for 8B:
    no fp32 copy on the host), saved with ``tokenizer`` to ``model_dir``; returns its parameters."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **sizes,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return count


def sft_spec(
    base: PipelineConfig,
    data_uri: str,
    model_dir: str,
    output_uri: str,
    precision: str,
    device: str = "cuda",
    cpu_offload: bool = True,
) -> StageSpec:
    """The SFT stage on ``fsdp2`` at one rank: 3 steps of 8 rows, offload and checkpointing on,
    evaluation (one micro-batch) before the first step and after the last, no step checkpoints."""
    settings = {
        "model.init": None,
        "model.name_or_path": model_dir,
        "model.dtype": "bfloat16",
        "backend.name": "fsdp2",
        "backend.device": device,
        "backend.nproc_per_node": 1,
        "backend.precision": precision,
        "backend.cpu_offload": cpu_offload,
        "backend.activation_checkpointing": True,
        "sft.max_steps": NUM_STEPS,
        "sft.micro_batch_size": MICRO_BATCH_SIZE,
        "sft.grad_accum_steps": 1,
        "sft.warmup_steps": 1,
        "sft.learning_rate": 1e-5,
        "sft.eval_every": NUM_STEPS,
        "sft.eval_max_batches": 1,
        "sft.save_every": 10**6,
        "sft.log_every": 1,
    }
    config = load_config(None, overrides=settings, base=base.model_dump(mode="json"))
    return build_spec(config, "sft", "gpu-8b", {"data": data_uri, "model": model_dir}, output_uri=output_uri)


def rank_env() -> dict[str, str]:
    """The rank's environment: the repo importable, every core for the CPU optimizer step."""
    threads = str(os.cpu_count() or 1)
    return {
        "PYTHONPATH": str(REPO_ROOT),
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }


def run_one_rank(spec: StageSpec, workdir: Path, timeout_s: float = RANK_TIMEOUT_S) -> dict[str, Any]:
    """Run this file as the stage's one torchrun rank (see :func:`main`); returns what it recorded.

    Raises:
        AssertionError: the rank failed (its output's tail is in the message).
    """
    from tests.integration.helpers import run_ranks, write_spec

    spec_path = write_spec(spec, workdir / "spec.json")
    out = workdir / "rank0.json"
    job = run_ranks([str(Path(__file__)), spec_path, str(out)], 1, env=rank_env(), timeout_s=timeout_s, torchrun=True)
    assert job.returncode == 0, job.tail(80)
    return json.loads(out.read_text())


def report(record: dict[str, Any]) -> dict[str, Any]:
    """Step times (seconds between metric lines), losses, peak memory in GiB."""
    ends = [record["train_start_s"]] + [s["end_s"] for s in record["steps"]]
    step_s = [b - a for a, b in itertools.pairwise(ends)]
    return {
        "precision": record["precision"],
        "device": record["device"],
        "num_params": record["num_params"],
        "steps": len(record["steps"]),
        "step_s": step_s,
        "median_step_s": statistics.median(step_s),
        "losses": [s["train/loss"] for s in record["steps"]],
        "grad_norms": [s["train/grad_norm"] for s in record["steps"]],
        "phase_s": [{k: s.get(f"time/{k}_s") for k in ("forward", "backward", "optimizer")} for s in record["steps"]],
        "peak_gpu_allocated_gib": record["peak_allocated_bytes"] / 2**30,
        "peak_gpu_reserved_gib": record["peak_reserved_bytes"] / 2**30,
        "peak_host_rss_gib": record["host_peak_rss_bytes"] / 2**30,
    }


# --- the test -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory):
    """Prepared data and the saved random 8B model (deleted after the module: 16 GB)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    root = tmp_path_factory.mktemp("llama3-8b")
    free = shutil.disk_usage(root).free
    if free < 24 * 2**30:
        pytest.skip(f"needs 24 GiB of free disk under {root} for the 16 GB model, has {free / 2**30:.1f}")
    from trainer_core.data.prepared import load_tokenizer_from

    base = synthetic_task(root, num_pairs=20, max_length_tokens=256)
    data_uri = run_prepare_data(base, "gpu-8b")
    model_dir = root / "model"
    try:
        count = save_random_model(LLAMA3_8B, load_tokenizer_from(data_uri), model_dir, torch.device("cuda"))
        yield SimpleNamespace(base=base, data_uri=data_uri, model_dir=str(model_dir), num_params=count)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_llama3_8b_sft_steps_fit_one_gpu(llama3_8b, precision, tmp_path):
    """3 SFT steps of the 8B model on one GPU with fsdp2 + CPU offload + activation checkpointing:
    finite losses and gradient norms, peak GPU memory under 80 GiB; peak memory and step times
    printed and written to ``llama3_8b_fits.json``."""
    assert llama3_8b.num_params == num_params(LLAMA3_8B) == 8_030_261_248
    need, available = host_bytes_needed(llama3_8b.num_params, precision), host_memory_available_bytes()
    if available < need:
        pytest.skip(
            f"{precision} with CPU offload needs ~{need / 2**30:.0f} GiB of host memory "
            f"({HOST_BYTES_PER_PARAM[precision]} B/param + margin); {available / 2**30:.0f} GiB available"
        )
    spec = sft_spec(llama3_8b.base, llama3_8b.data_uri, llama3_8b.model_dir, str(tmp_path / "sft"), precision)
    result = report(run_one_rank(spec, tmp_path))
    (tmp_path / "llama3_8b_fits.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\nLlama-3-8B SFT, fsdp2 + cpu_offload + activation checkpointing, {precision}:\n"
        + json.dumps(result, indent=2)
    )
    assert result["steps"] == NUM_STEPS
    assert all(math.isfinite(v) for v in result["losses"] + result["grad_norms"]), result
    assert result["peak_gpu_allocated_gib"] * 2**30 < GPU_LIMIT_BYTES, result


# --- the rank (torchrun runs this file) -----------------------------------------------------------


def timed_post_init(record: dict[str, Any], original):
    """Wrap ``TrainLoop.__post_init__`` so its metric printer stamps each step's end (after a
    device sync) with the step's logged metrics, and the start of training (the step-0 evaluation)."""

    def __post_init__(self):
        original(self)
        inner = self.metrics.printer

        def printer(metrics, step):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = time.perf_counter()
            if "train/loss" in metrics:
                record["steps"].append({"global_step": step, "end_s": now, **metrics})
            elif step == 0 and "eval/loss" in metrics:
                record["train_start_s"] = now
            if inner is not None:
                inner(metrics, step)

        self.metrics.printer = printer

    return __post_init__


def recorded_commit(record: dict[str, Any]):
    """Stand-in for ``commit_final`` in ``stages/sft.py``: record the final metrics and the peaks
    instead of consolidating and saving the model; ``run_spec`` reads only ``global_step``."""

    def commit_final(ctx, metrics, *, model=None, files=None, extra=None):
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        record["final_metrics"] = metrics
        record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated() if cuda else 0
        record["peak_reserved_bytes"] = torch.cuda.max_memory_reserved() if cuda else 0
        record["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        record["precision"] = ctx.backend.precision
        record["device"] = torch.cuda.get_device_name() if cuda else "cpu"
        record["num_params"] = sum(p.numel() for p in model.parameters()) if model is not None else 0
        return SimpleNamespace(global_step=int(metrics["global_step"]))

    return commit_final


def main(argv: list[str]) -> int:
    """``test_8b_fits.py SPEC OUT``: run the SFT stage of ``SPEC`` with its final commit replaced
    (:func:`recorded_commit`); rank 0 writes what it recorded to ``OUT`` (JSON)."""
    from trainer_core.spec import read_spec
    from trainer_core.stages import sft
    from trainer_core.stages.runner import run_spec
    from trainer_core.training.loop import TrainLoop

    spec_path, out = argv
    record: dict[str, Any] = {"steps": [], "train_start_s": None}
    with (
        mock.patch.object(TrainLoop, "__post_init__", timed_post_init(record, TrainLoop.__post_init__)),
        mock.patch.object(sft, "commit_final", recorded_commit(record)),
    ):
        run_spec(read_spec(spec_path))
    if os.environ.get("RANK", "0") == "0":
        Path(out).write_text(json.dumps(record, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main(sys.argv[1:]))
