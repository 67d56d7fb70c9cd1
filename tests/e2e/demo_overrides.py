"""The overrides of a demo run of a few seconds against the e2e stack's MLflow server, shared by
``test_deployment.py`` (runs through the deployment) and ``test_k8s_stage.py`` (a Kubernetes
stage in the flow).
"""

from __future__ import annotations

from pathlib import Path

from tests.tiny import TINY_MODEL


def tiny_demo(root: Path, tracking_uri: str) -> dict:
    """``overrides`` for a demo run of a few seconds: prepare_data and 3 SFT steps of the tiny Llama
    (``tests.tiny.TINY_MODEL``, with one key-value head of two) on a smaller synthetic task."""
    return {
        **TINY_MODEL,
        "storage.root": str(root),
        "tracking.tracking_uri": tracking_uri,
        "stages": "prepare_data,sft",
        "data.synthetic.num_problems": 60,
        "data.synthetic.num_pairs": 40,
        "model.init.num_attention_heads": 2,
        "model.init.num_key_value_heads": 1,
        "sft.max_steps": 3,
        "sft.micro_batch_size": 4,
        "sft.warmup_steps": 0,
        "sft.eval_every": 3,
        "sft.eval_max_batches": 1,
        "sft.save_every": 3,
        "launch.retries": 0,
    }
