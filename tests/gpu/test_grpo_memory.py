"""GRPO at the issue's size on one GPU: 16 prompts x 8 completions x 256 new tokens on the
Qwen2.5-0.5B architecture (vocabulary 151,936), peak memory under 40 GiB, the step's time split.

Before issue 13 this ran out of memory on an H100 (a float32 log-softmax over [N, T, V] for the
entropies: 18.5 GiB with 69.7 GiB in use). Now the completion tokens' log-probs and entropies
come from the chunked LM head (``trainer_core.modeling.forwards.completion.completion_forward``), the forwards over
the rollout batch go ``forward_micro_batch_size`` rows at a time, and the update is cut into
mini-batches and micro-batches.

The model is built from config (random init, bf16 weights saved once) with the project's
tokenizer trained by ``prepare_data`` on the synthetic task; a random model seldom samples EOS,
so almost every completion runs to the full 256 tokens (the worst case for memory). The GRPO
stage runs in this process as the pipeline runs it (``run_spec``, backend ``single`` on CUDA,
``bf16-mixed``, activation checkpointing), for 2 iterations; each iteration's metrics are
recorded from the loop and printed.

Asserted: 2 iterations, ``memory/peak_bytes`` under 40 GiB, the time split present
(``time/generation_s``, ``time/reward_s``, ``time/logprobs_s``, ``time/update_s``) and
``rollout/tokens_per_s`` positive. Run: ``python -m pytest tests/gpu/test_grpo_memory.py -m gpu -s``.
Passed on one H100 80GB for both engines on 2026-11-26 (peak 10.58 GiB), and with ``static`` on
2026-11-27 (10.57 GiB, sampling inside the CUDA graph; ``bench/GPU.md``).
"""

from __future__ import annotations

import json
import math
from unittest import mock

import pytest
import torch

from trainer_core.config import load_config
from trainer_core.spec import build_spec

pytestmark = pytest.mark.gpu

PEAK_LIMIT_BYTES = 40 * 2**30
PROMPTS, GROUP, NEW_TOKENS, ITERATIONS = 16, 8, 256, 2


def _record_emit(record: list[dict], original):
    def _emit(self, metrics):
        record.append({k: float(v) for k, v in metrics.items()})
        original(self, metrics)

    return _emit


@pytest.mark.parametrize("engine", ["static", "hf"])
def test_grpo_16x8x256_on_qwen2_0_5b_fits_40_gib(tmp_path, engine):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from trainer_core.stages.runner import run_spec
    from trainer_core.training.rl.trainer import RLTrainer

    from .qwen2_setup import prepare_qwen2

    base, data_uri, model_dir = prepare_qwen2(tmp_path, "gpu-grpo", num_pairs=20)
    torch.cuda.reset_peak_memory_stats()
    overrides = {
        "model.init": None,
        "model.name_or_path": model_dir,
        "model.dtype": "bfloat16",
        "backend.name": "single",
        "backend.device": "cuda",
        "backend.precision": "bf16-mixed",
        "backend.activation_checkpointing": True,
        "grpo.max_steps": ITERATIONS,
        "grpo.prompts_per_rollout": PROMPTS,
        "grpo.group_size": GROUP,
        "grpo.num_mini_batches": 4,
        "grpo.forward_micro_batch_size": 16,
        "grpo.learning_rate": 1e-6,
        "grpo.generation.max_new_tokens": NEW_TOKENS,
        "grpo.generation.engine": engine,
        "grpo.save_every": 10**6,
        "grpo.reward.kind": "verifier",
    }
    config = load_config(None, overrides=overrides, base=base.model_dump(mode="json"))
    spec = build_spec(
        config,
        "grpo",
        "gpu-grpo",
        {"data": data_uri, "model": model_dir, "reference": model_dir},
        output_uri=str(tmp_path / "grpo"),
    )
    record: list[dict] = []
    with mock.patch.object(RLTrainer, "_emit", _record_emit(record, RLTrainer._emit)):
        run_spec(spec)
    summary = [
        {k: v for k, v in m.items() if k.startswith(("time/", "rollout/", "memory/", "response_length"))}
        for m in record
    ]
    print(
        f"\nGRPO {PROMPTS}x{GROUP}x{NEW_TOKENS}, Qwen2.5-0.5B architecture, engine {engine}, "
        f"{torch.cuda.get_device_name()}:\n" + json.dumps(summary, indent=2)
    )
    assert len(record) == ITERATIONS
    for m in record:
        assert m["memory/peak_bytes"] < PEAK_LIMIT_BYTES, m["memory/peak_bytes"] / 2**30
        for key in ("time/generation_s", "time/reward_s", "time/logprobs_s", "time/update_s"):
            assert key in m and m[key] > 0, key
        assert m["rollout/tokens_per_s"] > 0 and math.isfinite(m["train/loss"])
