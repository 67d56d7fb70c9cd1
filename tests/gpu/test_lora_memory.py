"""LoRA and QLoRA on one GPU, the Qwen2.5-0.5B architecture (vocabulary 151,936): peak memory.

- LoRA DPO with the reference as the policy's disabled adapter against the same DPO with a
  separate frozen reference model (``lora.reference_model: separate``): the disabled adapter
  holds one copy of the weights, so its peak is lower by about the model's bf16 size (~1 GiB
  for 0.5B parameters with tied embeddings).
- QLoRA SFT (``lora.quantize: 4bit``: bitsandbytes NF4 base, bf16 compute) against LoRA SFT on
  the bf16 base: the 4-bit base holds about a quarter of the weights' bytes. Skipped where
  bitsandbytes is not installed (it is not a dependency; install it on the GPU worker).

Each stage runs in this process as the pipeline runs it (``run_spec``, backend ``single`` on
CUDA, ``bf16-mixed``) for a few steps; the peak is ``torch.cuda.max_memory_allocated`` over the
run, after a reset. Printed: both peaks and their difference, which go to ``bench/README.md``.
Run: ``python -m pytest tests/gpu/test_lora_memory.py -m gpu -s``. Unverified until run on a GPU.
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


def peak_of(qwen2, tmp_path, stage: str, name: str, **overrides) -> int:
    """Run ``stage`` for :data:`STEPS` steps with LoRA and ``overrides``; its peak CUDA bytes."""
    from trainer_core.stages.runner import run_spec

    base, data_uri, model_dir = qwen2
    config = load_config(None, base=base.model_dump(mode="json"), overrides={
        "model.init": None, "model.name_or_path": model_dir, "model.dtype": "bfloat16",
        "backend.name": "single", "backend.device": "cuda", "backend.precision": "bf16-mixed",
        "lora.enabled": True, "lora.rank": 16, "lora.alpha": 32,
        f"{stage}.max_steps": STEPS, f"{stage}.micro_batch_size": 8, f"{stage}.save_every": 10**6,
        f"{stage}.eval_every": 10**6, f"{stage}.log_every": 1, **overrides,
    })
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


def test_lora_dpo_disabled_adapter_reference_saves_a_model_copy(qwen2, tmp_path):
    disabled = peak_of(qwen2, tmp_path, "dpo", "dpo-disabled")
    separate = peak_of(qwen2, tmp_path, "dpo", "dpo-separate", **{"lora.reference_model": "separate"})
    print(f"\nLoRA DPO r16, Qwen2.5-0.5B architecture, micro-batch 8, {torch.cuda.get_device_name()}: peak "
          f"{disabled / GIB:.2f} GiB with the disabled-adapter reference, {separate / GIB:.2f} GiB with a separate "
          f"reference ({(separate - disabled) / GIB:.2f} GiB saved)")
    assert separate - disabled > 0.5 * GIB


def test_qlora_sft_holds_the_base_in_4_bits(qwen2, tmp_path):
    pytest.importorskip("bitsandbytes")
    lora = peak_of(qwen2, tmp_path, "sft", "sft-lora")
    qlora = peak_of(qwen2, tmp_path, "sft", "sft-qlora", **{"lora.quantize": "4bit"})
    print(f"\nSFT r16, Qwen2.5-0.5B architecture, micro-batch 8, {torch.cuda.get_device_name()}: peak "
          f"{lora / GIB:.2f} GiB LoRA on the bf16 base, {qlora / GIB:.2f} GiB QLoRA (NF4 base)")
    assert qlora < lora
