"""The learning-rate schedule of every training stage: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math
from functools import partial

import torch

from trainer_core.config import OptimizerStageConfig

__all__ = ["build_scheduler", "cosine_with_min_lr_lambda"]


def cosine_with_min_lr_lambda(
    current_step: int, *, num_warmup_steps: int, num_training_steps: int, min_lr_rate: float
) -> float:
    """The learning-rate multiplier at ``current_step``: linear warmup from 0 over
    ``num_warmup_steps``, then a half cosine from 1 down to ``min_lr_rate`` at
    ``num_training_steps``.

    transformers' ``get_cosine_with_min_lr_schedule_with_warmup`` lambda (``optimization.py``,
    ``_get_cosine_schedule_with_warmup_lr_lambda`` with ``num_cycles=0.5``), restated: importing
    ``transformers.optimization`` imports its trainer utilities and with them peft (and
    bitsandbytes where installed), seconds in every stage process that trains without LoRA.
    ``tests/unit/test_loop.py`` checks it against transformers' scheduler step by step.
    """
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerStageConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` x peak
    (:func:`cosine_with_min_lr_lambda`, as transformers' scheduler of that name)."""
    lr_lambda = partial(
        cosine_with_min_lr_lambda,
        num_warmup_steps=min(cfg.warmup_steps, cfg.max_steps),
        num_training_steps=cfg.max_steps,
        min_lr_rate=cfg.min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
