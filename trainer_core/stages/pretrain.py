"""Continued-pretraining stage: next-token loss on every token of packed raw text.

prepare_data joins the ``data.pretrain`` documents with EOS and cuts them into blocks of
``data.max_length_tokens`` (``pretrain/train``, ``pretrain/eval``); every token but a block's
first is a prediction target. SFT then starts from this stage's output (the stage registry).
The objective is :class:`~trainer_core.training.supervised.SFTObjective` with every token
counted: its loss is the mean next-token NLL, its eval metric the perplexity.
"""

from __future__ import annotations

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.stages.context import StageContext
from trainer_core.stages.sft import train_causal_lm


def run(ctx: StageContext) -> Manifest:
    """Train on the packed raw text and commit the model as an HF model directory."""
    return train_causal_lm(ctx, ctx.config.pretrain, "pretrain")
