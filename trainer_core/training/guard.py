"""The non-finite guard: NaN or infinity never reaches a checkpoint or a committed model.

Every loop checks each optimizer step's loss and gradient norm (values already reduced over the
ranks, so every rank decides alike) with :func:`step_is_finite`; the RL loop also checks each
rollout's rewards and advantages. The RL loop checks after each step; the supervised loop
(``training/loop.py``) keeps a step's values on the device and checks every step, in step order,
when it next reads the device (logging every ``log_every`` steps, evaluation, a checkpoint, the
end), so the check adds no host synchronisation to a step. A non-finite step is skipped (the
backend left weights and optimizer state untouched, see
``Backend.optimizer_step(skip_nonfinite=True)``) while the stage's ``max_nonfinite_steps`` allows,
and otherwise fails the stage with :class:`~trainer_core.errors.NonFiniteError` naming the stage,
the global step and the metric, before any checkpoint of that step is written (the supervised
loop may have run up to ``log_every`` - 1 more steps by then; none of them is checkpointed
either). ``stages/commit.py`` checks the final weights before it commits them.

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
    progress: TrainProgress,
    *,
    stage: str,
    global_step: int,
    max_nonfinite_steps: int,
    loss: float | Tensor,
    grad_norm: float | Tensor,
) -> bool:
    """Check one optimizer step: its loss and its gradient norm (both reduced over ranks), given as
    host floats (a tensor is read here, which waits for the device).

    A step whose gradient norm is NaN or infinite was skipped by the backend when the stage
    allows skipping (``Backend.optimizer_step(skip_nonfinite=True)``); a non-finite loss with a
    finite gradient norm was not skipped (the update happened), so it always fails the stage.

    Args:
        progress: the loop's progress; ``nonfinite_steps`` is incremented for a skipped step.
        stage: the stage name (for the message).
        global_step: the step the values belong to (for the message; an RL iteration takes
            several optimizer steps).
        max_nonfinite_steps: how many non-finite steps the stage may skip in all.
        loss: the step's loss.
        grad_norm: its gradient norm before clipping.

    Returns:
        True when both are finite; False for a skipped step (a warning says so).

    Raises:
        NonFiniteError: a non-finite value that was not, or may not be, skipped.
    """
    values = {"train/loss": float(loss), "train/grad_norm": float(grad_norm)}
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if not bad:
        return True
    shown = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
    skipped = "train/grad_norm" in bad and max_nonfinite_steps > 0
    if skipped:
        progress.nonfinite_steps += 1
    if not skipped or progress.nonfinite_steps > max_nonfinite_steps:
        raise NonFiniteError(
            f"stage {stage}: non-finite {shown} at global_step {global_step} (non-finite steps so far: "
            f"{progress.nonfinite_steps + (not skipped)}, allowed: {max_nonfinite_steps}); nothing of this step is "
            f"checkpointed or committed. " + HINT.format(stage=stage)
        )
    log.warning(
        "stage %s: non-finite %s at global_step %d: step skipped (%d of at most %d)",
        stage,
        shown,
        global_step,
        progress.nonfinite_steps,
        max_nonfinite_steps,
    )
    return False


def check_finite_metrics(metrics: dict[str, float], *, stage: str, global_step: int, what: str) -> None:
    """Fail when a logged metric (e.g. an evaluation's ``eval/loss``) is NaN or infinite.

    Raises:
        NonFiniteError: naming the metrics, the stage and the step; ``what`` says where they come from.
    """
    bad = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not math.isfinite(v)}
    if bad:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
        raise NonFiniteError(
            f"stage {stage}: non-finite {shown} at global_step {global_step} ({what}); nothing of this step is "
            f"checkpointed or committed. " + HINT.format(stage=stage)
        )


def finite_only(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` without its NaN and infinite values (what a skipped step leaves out of history)."""
    return {k: v for k, v in metrics.items() if not isinstance(v, float) or math.isfinite(v)}


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
    return sorted(name for name, t in state_dict.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
