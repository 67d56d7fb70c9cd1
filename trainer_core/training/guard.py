"""The non-finite guard: NaN or infinity never reaches a checkpoint or a committed model.

Every loop checks, after each optimizer step, that the step's loss and gradient norm are finite
(values already reduced over the ranks, so every rank decides alike); the RL loop also checks
each rollout's rewards and advantages. A non-finite step is skipped (the backend left weights
and optimizer state untouched, see ``Backend.optimizer_step(skip_nonfinite=True)``) while the
stage's ``max_nonfinite_steps`` allows, and otherwise fails the stage with
:class:`~trainer_core.errors.NonFiniteError` naming the stage, the global step and the metric,
before any checkpoint of that step is written. ``stages/context.py`` checks the final weights
before it commits them.

The skip follows Megatron-LM's and DeepSpeed's overflow handling of mixed precision (the
iteration is skipped, the batch consumed); unlike them the LR schedule advances as for any step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import Tensor

from trainer_core.checkpoint.train_state import TrainProgress
from trainer_core.errors import NonFiniteError

log = logging.getLogger(__name__)

HINT = (
    "lower {stage}.learning_rate or raise {stage}.warmup_steps (and check max_grad_norm and the data), or let "
    "{stage}.max_nonfinite_steps skip a few such steps"
)


def step_is_finite(
    progress: TrainProgress, *, stage: str, global_step: int, max_nonfinite_steps: int,
    metrics: dict[str, float | Tensor],
) -> bool:
    """Check one optimizer step's metrics (e.g. ``train/loss``, ``train/grad_norm``).

    Args:
        progress: the loop's progress; ``nonfinite_steps`` is incremented for a non-finite step.
        stage: the stage name (for the message).
        global_step: the step the values belong to (for the message; an RL iteration takes
            several optimizer steps).
        max_nonfinite_steps: how many non-finite steps the stage may skip in all.
        metrics: the step's values reduced over ranks (every rank passes the same ones).

    Returns:
        True when every value is finite; False for a skipped step (a warning says so).

    Raises:
        NonFiniteError: a non-finite value beyond ``max_nonfinite_steps`` skipped steps.
    """
    bad = {k: float(v) for k, v in metrics.items() if not math.isfinite(float(v))}
    if not bad:
        return True
    progress.nonfinite_steps += 1
    shown = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
    if progress.nonfinite_steps > max_nonfinite_steps:
        raise NonFiniteError(
            f"stage {stage}: non-finite {shown} at global_step {global_step} (non-finite steps so far: "
            f"{progress.nonfinite_steps}, allowed: {max_nonfinite_steps}); nothing of this step is checkpointed or "
            f"committed. " + HINT.format(stage=stage)
        )
    log.warning("stage %s: non-finite %s at global_step %d: step skipped (%d of at most %d)", stage, shown,
                global_step, progress.nonfinite_steps, max_nonfinite_steps)
    return False


def check_finite_tensors(
    tensors: dict[str, Tensor], *, stage: str, global_step: int, all_reduce_sum: Callable[[Tensor], Tensor]
) -> None:
    """Collective: fail when any element of ``tensors`` (this rank's) is NaN or infinite on any rank.

    Args:
        tensors: name -> tensor (e.g. ``rewards`` [N], ``advantages`` [N] or [N, T]).
        stage: the stage name (for the message).
        global_step: the step being prepared (for the message).
        all_reduce_sum: ``Backend.all_reduce_sum`` (every rank calls this with the same names).

    Raises:
        NonFiniteError: naming each tensor with non-finite elements and how many, over all ranks.
    """
    names = sorted(tensors)
    device = tensors[names[0]].device
    local = torch.stack([(~torch.isfinite(tensors[n].detach().float())).sum() for n in names]).float().to(device)
    counts = all_reduce_sum(local).tolist()
    bad = {n: int(c) for n, c in zip(names, counts) if c}
    if bad:
        shown = ", ".join(f"{n} ({c} non-finite values)" for n, c in bad.items())
        raise NonFiniteError(
            f"stage {stage}: non-finite {shown} at global_step {global_step}; nothing of this step is checkpointed "
            "or committed. Check the reward function and the reward model's outputs"
        )


def nonfinite_weights(state_dict: dict[str, Tensor]) -> list[str]:
    """Names of the floating-point tensors of ``state_dict`` holding NaN or infinity."""
    return sorted(
        name for name, t in state_dict.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())
    )
