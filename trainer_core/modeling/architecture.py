"""What posttrain reads of a model's architecture: its repeated transformer blocks.

The blocks are what FSDP2 shards one by one, activation checkpointing recomputes and LoRA
adapts by default; found from the model's own ``_no_split_modules`` (what Hugging Face's device
map and accelerate's FSDP wrapping use), not from a table of architectures.
"""

from __future__ import annotations

from torch import nn


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (to shard, checkpoint, compile): modules whose class is in ``_no_split_modules``.

    Falls back to the children of the first ``nn.ModuleList`` found (``model.layers``).
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if blocks:
        return blocks
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            return list(m)
    return []
