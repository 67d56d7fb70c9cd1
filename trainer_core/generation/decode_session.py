"""The decode loop's per-row hook (:class:`DecodeSession`), declared in the generation layer so that
the engines (:mod:`trainer_core.generation.engines`) need nothing of the RL environments whose
tool sessions implement it.

Shape legend: N rows (episodes), T completion columns.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class DecodeSession(Protocol):
    """A hook on the decode loop, one episode per row: what a multi-turn rollout's tool session
    (:class:`~trainer_core.training.rl.environments.ToolSession`) implements; an engine calls
    :meth:`after_step` after each decode step and :meth:`observation_mask` once at the end."""

    def after_step(self, tokens: Tensor, logprobs: Tensor, token: Tensor, finished: Tensor, column: int) -> None:
        """Act on decode step ``column`` (the column just recorded), in place on the engine's
        buffers: ``tokens`` [N, T] long and ``logprobs`` [N, T] float32 (the recorded columns),
        ``token`` [N] long (what the next step feeds: a forced observation token goes here),
        ``finished`` [N] bool."""

    def observation_mask(self, num_columns: int, device: torch.device) -> Tensor:
        """[N, num_columns] float, 1 = a token the session fed rather than the policy sampled."""
