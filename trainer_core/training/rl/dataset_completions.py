"""GKD's mixture of on-policy and dataset completions (``distill.lmbda``).

Agarwal et al. 2024 (GKD, Algorithm 1; TRL's ``GKDTrainer``, ``lmbda``): each step draws
``u ~ U(0, 1)``; with ``u <= lambda`` the student samples the completions it trains on, otherwise
the step trains on the dataset's completions of its prompts (supervised KD: the divergence to the
teacher's distribution at every token of the reference answer). Here the draw is made per RL
iteration from ``(seed, global_step)`` alone, so every rank takes the same branch (sharded forwards
run in lockstep) and a resumed run draws what an uninterrupted one draws without saved state;
the dataset's completion of a prompt is the rest of the prepared ``sft/train`` row it came from
(:attr:`~trainer_core.training.rl.rewards.PromptItem.row`), cut at its first loss token as the
ptx term cuts it (:func:`~trainer_core.training.rl.ptx.collate_demonstrations`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from trainer_core.errors import ConfigError
from trainer_core.generation.engines import Generated
from trainer_core.training.rl.batches import SampledRound
from trainer_core.training.rl.ptx import collate_demonstrations
from trainer_core.training.rl.rewards import PromptItem


def on_policy_iteration(lmbda: float, seed: int, global_step: int) -> bool:
    """Whether the iteration after ``global_step`` samples its completions (probability
    ``lmbda``) rather than taking the dataset's; a function of the arguments alone (the same on
    every rank and after a resume). ``lmbda`` 1 is always True, 0 always False."""
    return random.Random(f"lmbda:{seed}:{global_step}").random() < lmbda


def check_dataset_rows(stage: str, lmbda: float, rows: Sequence[dict] | None) -> None:
    """Refuse dataset completions (``lmbda`` < 1) without the rows they come from.

    Raises:
        ConfigError: ``lmbda`` < 1 and ``rows`` is None or empty (the stages pass the prepared
            ``sft/train`` rows; a library caller passes them as ``RLTrainer(demonstrations=...)``).
    """
    if lmbda < 1 and not rows:
        raise ConfigError(
            f"{stage}.lmbda={lmbda} trains on the dataset's completions and got no sft/train rows "
            "(library: RLTrainer(demonstrations=...)); set lmbda to 1 or pass them"
        )


def dataset_round(items: Sequence[PromptItem], rows: Sequence[dict], pad_id: int, device: torch.device) -> SampledRound:
    """This rank's prompts ``items`` with their dataset completions, shaped as a sampling round.

    Each item's row ``rows[item.row]`` is cut at its first loss token; the completion's loss tokens
    are the policy's (counted), its other tokens observations (attended to, not counted), and the
    engine log-probs are 0 (nothing was sampled: no importance weights, no engine comparison).
    ``texts`` are empty and ``scores`` 0: the reward is not computed on the dataset's answers.

    Returns:
        A :class:`SampledRound` of ``len(items)`` rows: prompt ids [N, P] long left-padded and
        prompt mask [N, P] float; completion ids [N, T] long, mask [N, T] float (real tokens),
        observation mask [N, T] float or None.

    Raises:
        ValueError: an item without ``row`` (a prompt not built from the prepared rows).
        ConfigError: a row without a completion (:func:`~trainer_core.training.rl.ptx.split_demonstration`).
    """
    missing = [i for i, item in enumerate(items) if item.row is None]
    if missing:
        raise ValueError(f"dataset completions need each prompt's sft/train row; prompt {missing[0]} has none")
    batch = collate_demonstrations([rows[item.row] for item in items], pad_id, device)
    counted = batch.completion_mask.float()
    observed = None if batch.observation_mask is None else batch.observation_mask.float()
    real = counted if observed is None else counted + observed
    generated = Generated(batch.completion_ids, real, torch.zeros_like(counted), observed)
    return SampledRound(
        list(items),
        batch.prompt_ids,
        batch.prompt_mask.float(),
        generated,
        [""] * len(items),
        torch.zeros(len(items), device=device),
    )
