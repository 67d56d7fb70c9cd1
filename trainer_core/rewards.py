"""Reward functions of the online RL stages, behind one small Protocol.

Shape legend: N completions.

- :class:`VerifierReward`: 1 when the completion's final number equals the prompt's known
  answer (GSM8K-style exact match, :func:`~trainer_core.data.formats.answers_match`), plus a
  format bonus when it ends its reasoning with a ``#### <number>`` line.
- :class:`RewardModelReward`: the trained reward model's score of prompt + completion, read at
  the last non-padding token (``AutoModelForSequenceClassification`` does that with the
  model's ``pad_token_id``), without gradients.
- :class:`WeightedReward`: a weighted sum of the above.

:func:`build_reward` picks one from a :class:`~trainer_core.config.RewardConfig`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from trainer_core.config import DataConfig, RewardConfig
from trainer_core.data.formats import answers_match, extract_generated_answer
from trainer_core.errors import ConfigError
from trainer_core.generation import reward_scores

FORMAT_LINE = re.compile(r"(?m)^\s*####\s*-?\$?\d[\d,]*(?:\.\d+)?\s*$")
"""A final-answer line: ``#### 42`` on a line of its own."""


@dataclass(frozen=True)
class PromptItem:
    """One RL prompt.

    Attributes:
        messages: the chat turns (``[{"role", "content"}]``).
        input_ids: the prompt's token ids with the assistant generation prefix.
        answer: the known final answer (normalised), or None when not verifiable.
    """

    messages: list[dict]
    input_ids: list[int]
    answer: str | None


class RewardFunction(Protocol):
    """Scores completions of prompts; never builds a graph."""

    def __call__(self, prompts: list[PromptItem], completions: list[str]) -> Tensor:
        """[N] float32 rewards of ``completions[i]`` as an answer to ``prompts[i]``."""


def is_correct(completion: str, answer: str | None) -> bool:
    """Whether the completion's final number matches ``answer`` (None never matches)."""
    return answers_match(extract_generated_answer(completion), answer)


def has_answer_line(completion: str) -> bool:
    """Whether the completion has a ``#### <number>`` line."""
    return FORMAT_LINE.search(completion) is not None


class VerifierReward:
    """Exact match of the final number (1 / 0) plus ``format_bonus`` for a ``#### n`` line.

    Args:
        format_bonus: added when :func:`has_answer_line` holds (>= 0).

    Raises:
        ValueError: a prompt has no known answer (call-time).

    Worked values (answer "6", bonus 0.1): "... #### 6" -> 1.1; "... #### 7" -> 0.1;
    "it is 6" -> 1.0; "no idea" -> 0.0.
    """

    def __init__(self, format_bonus: float = 0.1) -> None:
        self.format_bonus = format_bonus

    def __call__(self, prompts: list[PromptItem], completions: list[str]) -> Tensor:
        missing = [i for i, p in enumerate(prompts) if p.answer is None]
        if missing:
            raise ValueError(f"verifier reward needs known answers; prompts {missing[:5]} have none")
        scores = [
            float(is_correct(c, p.answer)) + (self.format_bonus if has_answer_line(c) else 0.0)
            for p, c in zip(prompts, completions, strict=True)
        ]
        return torch.tensor(scores, dtype=torch.float32)


class RewardModelReward:
    """The reward model's scalar score of each (prompt, completion), in batches, without gradients.

    Args:
        model: a frozen sequence-classification model with one label.
        tokenizer: renders prompt + completion with the chat template.
        data: max lengths used to encode (as in training the reward model).
        batch_size: sequences per forward.
        device: where ``model`` is.
    """

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, data: DataConfig, batch_size: int,
                 device: torch.device) -> None:
        self.model, self.tokenizer, self.data = model, tokenizer, data
        self.batch_size, self.device = batch_size, device

    def __call__(self, prompts: list[PromptItem], completions: list[str]) -> Tensor:
        messages = [p.messages for p in prompts]
        scores = reward_scores(self.model, self.tokenizer, messages, completions, self.data, self.batch_size, self.device)
        return torch.tensor(scores, dtype=torch.float32)


class WeightedReward:
    """``sum_k weight_k * reward_k``.

    Args:
        parts: (weight, reward function) pairs.

    Raises:
        ValueError: ``parts`` is empty.
    """

    def __init__(self, parts: list[tuple[float, RewardFunction]]) -> None:
        if not parts:
            raise ValueError("a weighted reward needs at least one part")
        self.parts = parts

    def __call__(self, prompts: list[PromptItem], completions: list[str]) -> Tensor:
        total = torch.zeros(len(completions), dtype=torch.float32)
        for weight, fn in self.parts:
            total += weight * fn(prompts, completions)
        return total


def needs_reward_model(cfg: RewardConfig) -> bool:
    """Whether the reward kind reads a trained reward model."""
    return cfg.kind in ("reward_model", "weighted")


def needs_answers(cfg: RewardConfig) -> bool:
    """Whether the reward kind needs prompts with known answers."""
    return cfg.kind in ("verifier", "weighted")


def build_reward(cfg: RewardConfig, load_reward_model: Callable[[], RewardFunction] | None) -> RewardFunction:
    """The reward function of ``cfg``.

    Args:
        cfg: the stage's reward config.
        load_reward_model: builds the :class:`RewardModelReward` (called only when needed).

    Raises:
        ConfigError: the kind needs a reward model and ``load_reward_model`` is None.
    """
    verifier = VerifierReward(cfg.format_bonus)
    if not needs_reward_model(cfg):
        return verifier
    if load_reward_model is None:
        raise ConfigError(f"reward.kind={cfg.kind!r} needs a reward model (run reward_model or set reward_model_from)")
    learned = load_reward_model()
    if cfg.kind == "reward_model":
        return learned
    return WeightedReward([(cfg.reward_model_weight, learned), (cfg.verifier_weight, verifier)])
