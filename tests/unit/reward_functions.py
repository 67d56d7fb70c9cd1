"""Example user reward functions for ``FunctionReward`` tests (import path ``tests.unit.reward_functions:<name>``)."""

from __future__ import annotations

import asyncio
import math

import torch

NOT_A_FUNCTION = 3


def length_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """0.01 per character of the completion: "abc" -> 0.03."""
    return [0.01 * len(c) for c in completions]


def answer_echo_reward(prompts, completions, *, answers, messages, **kwargs) -> torch.Tensor:
    """1 where the completion equals the answer (a [N] tensor), + 0.5 where the prompt is the
    last user message's content and ``messages`` ends with that user turn."""
    return torch.tensor(
        [
            float(c == a) + 0.5 * (p == m[-1]["content"] and m[-1]["role"] == "user")
            for p, c, a, m in zip(prompts, completions, answers, messages, strict=True)
        ]
    )


async def async_length_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """As :func:`length_reward`, after yielding to the event loop."""
    await asyncio.sleep(0)
    return [0.01 * len(c) for c in completions]


def raises_on_boom(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """1.0 each, but raises when a completion contains "boom"."""
    for c in completions:
        if "boom" in c:
            raise ValueError(f"cannot score {c!r}")
    return [1.0] * len(completions)


def nan_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """NaN for a completion containing "nan", else 1.0."""
    return [math.nan if "nan" in c else 1.0 for c in completions]


def wrong_length_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """One value too many."""
    return [1.0] * (len(completions) + 1)


def string_reward(prompts: list[str], completions: list[str], **kwargs) -> list[str]:
    """Strings, not numbers."""
    return ["1.0"] * len(completions)


def two_args_reward(prompts: list[str], completions: list[str]) -> list[float]:
    """Takes no keyword arguments: cannot be called with ``answers=`` / ``messages=``."""
    return [1.0] * len(completions)


def numpy_scalars_reward(prompts: list[str], completions: list[str], **kwargs) -> list:
    """NumPy scalars, as ``[np.str_(a) == b ...]`` comparisons give: a bool, then a float32."""
    import numpy as np

    return [np.bool_("8" in c) if i % 2 == 0 else np.float32(0.25) for i, c in enumerate(completions)]
