"""The Qwen2 architectures the GPU benchmarks build from config (random init), shared by
``bench_gpu.py``, ``bench_generation.py`` and ``bench_rl_forward.py`` (through ``bench_gpu``).

A module of its own, importing nothing, so that ``bench_generation.py`` (which imports it as
``bench.qwen2_sizes``, the checkout on its path) has them without pulling in ``bench_gpu.py``'s
stage machinery.
"""

from __future__ import annotations

from typing import Any

QWEN2_0_5B: dict[str, Any] = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151_936,
    "max_position_embeddings": 32_768,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
"""Qwen2.5-0.5B's architecture (its ``config.json``), random init: 494M parameters."""

TINY_QWEN2: dict[str, Any] = {
    **QWEN2_0_5B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
}
"""``--tiny``: the same family at smoke-test size (CPU)."""
