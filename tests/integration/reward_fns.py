"""User reward functions named by import path in the RL integration tests
(``tests.integration.reward_fns:<name>``), written as a user writes one: see
:class:`trainer_core.training.rl.rewards.FunctionReward` for the calling convention."""

from __future__ import annotations


def short_and_answered(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """1 for a completion with a ``####`` answer line, minus 0.01 per 10 characters: batched, sync."""
    return [float("####" in c) - 0.001 * len(c) for c in completions]


def explodes_on_answer_lines(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """Raises on the first completion that has a ``####`` line (a bug in a user's function)."""
    for c in completions:
        if "####" in c:
            raise RuntimeError("cannot parse the answer line")
    return [0.0] * len(completions)
