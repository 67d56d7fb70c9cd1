"""The setup the GPU tests share: synthetic data prepared on CPU and the Qwen2.5-0.5B
architecture (``bench/bench_gpu.py``'s ``QWEN2_0_5B``, vocabulary 151,936) built from config,
random init, saved in bf16 with the project's tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from trainer_core.config import PipelineConfig, load_config
from trainer_core.spec import build_spec
from trainer_core.storage import StageLayout

REPO_ROOT = Path(__file__).resolve().parents[2]


def synthetic_task(root: Path, num_pairs: int, max_length_tokens: int) -> PipelineConfig:
    """The synthetic task (400 problems, ``num_pairs`` preference pairs, rows of at most
    ``max_length_tokens``, prompts of 128) prepared on CPU under ``<root>/storage``, seed 0, its
    tokenizer (2,048 tokens) trained by ``prepare_data`` (``model.init``)."""
    return load_config(
        None,
        overrides={
            "seed": 0,
            "storage.root": str(root / "storage"),
            "backend.device": "cpu",
            "tokenizer.vocab_size": 2048,
            "data.synthetic.num_problems": 400,
            "data.synthetic.num_pairs": num_pairs,
            "data.max_eval_rows": 16,
            "data.max_length_tokens": max_length_tokens,
            "data.max_prompt_length_tokens": 128,
        },
    )


def run_prepare_data(config: PipelineConfig, run_id: str) -> str:
    """Run ``config``'s ``prepare_data`` as run ``run_id`` in this process; returns its committed
    final directory."""
    from trainer_core.stages.runner import run_spec

    spec = build_spec(config, "prepare_data", run_id, {})
    run_spec(spec)
    return StageLayout(spec.output_uri).final


def prepare_qwen2(root: Path, run_id: str, num_pairs: int) -> tuple[PipelineConfig, str, str]:
    """Prepare the synthetic task (400 problems, ``num_pairs`` preference pairs) under ``root``
    and save the Qwen2.5-0.5B architecture to ``<root>/qwen2`` (built on CUDA).

    Returns:
        (the base config the stages override, prepare_data's final URI, the model directory).
    """
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    from bench_gpu import QWEN2_0_5B, build_qwen2

    from trainer_core.data.prepared import load_tokenizer_from

    base = synthetic_task(root, num_pairs, max_length_tokens=512)
    data_uri = run_prepare_data(base, run_id)
    model_dir = str(root / "qwen2")
    build_qwen2(model_dir, load_tokenizer_from(data_uri), QWEN2_0_5B, torch.device("cuda"), seed=0)
    return base, data_uri, model_dir
