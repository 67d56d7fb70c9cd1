"""LoRA and QLoRA on one GPU, the Qwen2.5-0.5B architecture (vocabulary 151,936): peak memory.

- LoRA SFT (r 16, the frozen base in bf16) against full fine-tuning (fp32 weights under
  ``bf16-mixed``, AdamW state for every weight): under half the peak (issue 39's acceptance).
- QLoRA SFT (``lora.quantize: 4bit``: bitsandbytes NF4 base, bf16 compute) against LoRA SFT on
  the bf16 base: the 4-bit base holds about a quarter of the weights' bytes; its merged commit
  is a plain model.
- LoRA DPO with the reference as the policy's disabled adapter against a separate frozen
  reference model (``lora.reference_model: separate``): the same peak, since the reference
  log-probs are computed before training and the separate model is freed before the first
  step (measured on an H100 on 2026-11-28: 6.42 GiB both, ``bench/GPU.md``).

Each stage runs in this process as the pipeline runs it (``run_spec``, backend ``single`` on
CUDA, ``bf16-mixed``) for a few steps; the peak is ``torch.cuda.max_memory_allocated`` over the
run, after a reset. Printed: the peaks, which go to ``bench/GPU.md``.
Run: ``python -m pytest tests/gpu/test_lora_memory.py -m gpu -s``. The SFT cases are unverified
until run on a GPU (the 2026-11-28 run failed at QLoRA's commit, fixed since).
"""

from __future__ import annotations

import pytest
import torch

from trainer_core.config import load_config
from trainer_core.spec import build_spec

pytestmark = pytest.mark.gpu

STEPS = 4
GIB = 2**30


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """Prepared synthetic data and the Qwen2.5-0.5B architecture saved in bf16: (base config, data URI, model dir)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from .qwen2_setup import prepare_qwen2

    qwen2 = prepare_qwen2(tmp_path_factory.mktemp("lora-gpu"), "gpu-lora", num_pairs=400)
    torch.cuda.empty_cache()
    return qwen2


def peak_of(qwen2, tmp_path, stage: str, name: str, lora: bool = True, **overrides) -> int:
    """Run ``stage`` for :data:`STEPS` steps (LoRA r16 on a bf16 base, or full fine-tuning on
    fp32 weights) with ``overrides``; its peak CUDA bytes."""
    from trainer_core.stages.runner import run_spec

    base, data_uri, model_dir = qwen2
    tuning = (
        {"lora.enabled": True, "lora.rank": 16, "lora.alpha": 32, "model.dtype": "bfloat16"}
        if lora
        else {"lora.enabled": False, "model.dtype": "float32"}
    )
    config = load_config(
        None,
        base=base.model_dump(mode="json"),
        overrides={
            "model.init": None,
            "model.name_or_path": model_dir,
            "backend.name": "single",
            "backend.device": "cuda",
            "backend.precision": "bf16-mixed",
            **tuning,
            f"{stage}.max_steps": STEPS,
            f"{stage}.micro_batch_size": 8,
            f"{stage}.save_every": 10**6,
            f"{stage}.eval_every": 10**6,
            f"{stage}.log_every": 1,
            **overrides,
        },
    )
    inputs = {"data": data_uri, "model": model_dir}
    if stage == "dpo":
        inputs["reference"] = model_dir
    spec = build_spec(config, stage, "gpu-lora", inputs, output_uri=str(tmp_path / name))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    manifest = run_spec(spec)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    assert manifest.global_step == STEPS
    return peak


def test_lora_and_qlora_sft_peaks_against_full_fine_tuning(qwen2, tmp_path):
    full = peak_of(qwen2, tmp_path, "sft", "sft-full", lora=False)
    lora = peak_of(qwen2, tmp_path, "sft", "sft-lora")
    print(
        f"\nSFT, Qwen2.5-0.5B architecture, micro-batch 8, {torch.cuda.get_device_name()}: peak "
        f"{full / GIB:.2f} GiB full fine-tuning (fp32 weights), {lora / GIB:.2f} GiB LoRA r16 (bf16 base)"
    )
    qlora = None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        print("QLoRA not run: bitsandbytes is not installed")
    else:
        qlora = peak_of(qwen2, tmp_path, "sft", "sft-qlora", **{"lora.quantize": "4bit"})
        print(f"{qlora / GIB:.2f} GiB QLoRA r16 (NF4 base)")
    assert lora < 0.5 * full
    assert qlora is None or qlora < lora


def test_lora_dpo_reference_choice_does_not_change_the_peak(qwen2, tmp_path):
    disabled = peak_of(qwen2, tmp_path, "dpo", "dpo-disabled")
    separate = peak_of(qwen2, tmp_path, "dpo", "dpo-separate", **{"lora.reference_model": "separate"})
    print(
        f"\nLoRA DPO r16, Qwen2.5-0.5B architecture, micro-batch 8, {torch.cuda.get_device_name()}: peak "
        f"{disabled / GIB:.2f} GiB with the disabled-adapter reference, {separate / GIB:.2f} GiB with a separate "
        f"reference"
    )
    assert abs(separate - disabled) < 0.1 * GIB
