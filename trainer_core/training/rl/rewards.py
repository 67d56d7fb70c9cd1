"""Reward functions of the online RL stages, behind one small Protocol.

Shape legend: N completions (the rows of a GRPO group are contiguous).

- :class:`VerifierReward`: 1 when the completion's final number equals the prompt's known
  answer (GSM8K-style exact match, :func:`~trainer_core.data.formats.answers_match`), plus a
  format bonus when it ends its reasoning with a ``#### <number>`` line.
- :class:`MathVerifyReward`: 1 when math-verify finds the completion's final answer
  mathematically equivalent to the known answer (``\\boxed{1/2}`` = ``0.5``), plus the same bonus.
- :class:`RewardModelReward`: the trained reward model's score of prompt + completion, read at
  the last non-padding token (``AutoModelForSequenceClassification`` does that with the
  model's ``pad_token_id``), without gradients.
- :class:`FunctionReward`: a user function named by import path, TRL's reward-function convention.
- :class:`WeightedReward`: a weighted sum of the above.

Every reward's output is checked by :func:`as_rewards` ([N], numeric, finite): a bad one fails
with :class:`RewardFunctionError` naming the reward and the sample, never a silent zero.
:func:`build_reward` picks one from a :class:`~trainer_core.config.RewardConfig` in the table
:data:`REWARD_BUILDERS`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import numbers
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from trainer_core.config import DataConfig, RewardConfig
from trainer_core.data.formats import answers_match, extract_generated_answer
from trainer_core.errors import ConfigError, PosttrainError
from trainer_core.generation.completions import reward_scores
from trainer_core.imports import import_object

FORMAT_LINE = re.compile(r"(?m)^\s*####\s*-?\$?\d[\d,]*(?:\.\d+)?\s*$")
"""A final-answer line: ``#### 42`` on a line of its own."""

ANSWER_KINDS = ("verifier", "math_verify")  # reward kinds that compare with the prompt's known answer

_SHOWN_CHARS = 200
"""Characters of a prompt or completion quoted in an error message."""


@dataclass(frozen=True)
class PromptItem:
    """One RL prompt.

    Attributes:
        messages: the chat turns (``[{"role", "content"}]``).
        input_ids: the prompt's token ids with the assistant generation prefix.
        answer: the known final answer (normalised), or None when not verifiable.
        row: the index of the prepared ``sft/train`` row it came from (its dataset completion:
            distill's ``lmbda``), or None (a prompt built elsewhere).
    """

    messages: list[dict]
    input_ids: list[int]
    answer: str | None
    row: int | None = None


class RewardFunction(Protocol):
    """Scores completions of prompts; never builds a graph."""

    def __call__(self, prompts: list[PromptItem], completions: list[str]) -> Tensor:
        """[N] float32 rewards of ``completions[i]`` as an answer to ``prompts[i]``."""


class RewardFunctionError(PosttrainError):
    """A reward raised, or returned a wrong shape, non-numbers, NaN or infinity.

    Bad input (exit 2, never retried): a deterministic reward fails the same way again. The
    message names the reward (a user function by its import path) and the sample.
    """


def prompt_text(item: PromptItem) -> str:
    """The content of the prompt's last user turn ("" when it has none)."""
    return next((m["content"] for m in reversed(item.messages) if m.get("role") == "user"), "")


def _shown(text: str) -> str:
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")


def _sample(prompts: list[PromptItem], completions: list[str], i: int) -> str:
    return f"sample {i} (prompt {_shown(prompt_text(prompts[i]))}, completion {_shown(completions[i])})"


def _reward_name(fn: object) -> str:
    return getattr(fn, "name", None) or getattr(fn, "__qualname__", None) or type(fn).__name__


_INT_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _as_floats(values: Any, n: int, who: str) -> Tensor:
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "biuf":
            raise RewardFunctionError(f"{who} returned an array of {values.dtype}; expected {n} floats")
        values = torch.from_numpy(values)
    if isinstance(values, Tensor):
        if values.is_complex() or not (values.is_floating_point() or values.dtype in _INT_DTYPES):
            raise RewardFunctionError(f"{who} returned a tensor of {values.dtype}; expected {n} floats")
        if values.dim() != 1 or values.numel() != n:
            raise RewardFunctionError(f"{who} returned a tensor of shape {list(values.shape)}; expected [{n}]")
        return values.detach().to("cpu", torch.float32)
    if not isinstance(values, (list, tuple)):
        raise RewardFunctionError(
            f"{who} returned {type(values).__name__}; expected a list of {n} floats or a [{n}] tensor"
        )
    if len(values) != n:
        raise RewardFunctionError(f"{who} returned {len(values)} values for {n} completions; expected {n}")
    floats = []
    for i, v in enumerate(values):
        if (isinstance(v, Tensor) and v.numel() == 1 and not v.is_complex()) or isinstance(v, np.generic):
            v = v.item()  # a one-element tensor, a numpy scalar (np.bool_, np.float32, ...)
        if not isinstance(v, numbers.Real):
            raise RewardFunctionError(
                f"{who} returned {type(v).__name__} {_shown(str(v))} at index {i}; expected {n} floats"
            )
        floats.append(float(v))
    return torch.tensor(floats, dtype=torch.float32)


def as_rewards(values: Any, who: str, prompts: list[PromptItem], completions: list[str]) -> Tensor:
    """A reward's output as [N] finite float32 on the CPU.

    Args:
        values: a [N] tensor or array, or a list / tuple of N real numbers (bools count as 0 / 1).
        who: the reward, for the message (``"reward reward_model"``, ``"reward function pkg.mod:fn"``).
        prompts: the N prompts scored (quoted in the message).
        completions: the N completions scored.

    Raises:
        RewardFunctionError: naming ``who``: not N values, a value that is not a real number (with
            its index), or NaN / infinity (with the index and the sample).
    """
    rewards = _as_floats(values, len(completions), who)
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        raise RewardFunctionError(
            f"{who} returned {rewards[i].item()} for {_sample(prompts, completions, i)}; "
            f"rewards must be finite ({len(bad)} of {len(completions)} were not)"
        )
    return rewards


def is_correct(completion: str, answer: str | None) -> bool:
    """Whether the completion's final number matches ``answer`` (None never matches)."""
    return answers_match(extract_generated_answer(completion), answer)


def has_answer_line(completion: str) -> bool:
    """Whether the completion has a ``#### <number>`` line."""
    return FORMAT_LINE.search(completion) is not None


def _require_answers(prompts: list[PromptItem], kind: str) -> None:
    missing = [i for i, p in enumerate(prompts) if p.answer is None]
    if missing:
        raise ValueError(f"{kind} reward needs known answers; prompts {missing[:5]} have none")


class VerifierReward:
    """Exact match of the final number (1 / 0) plus ``format_bonus`` for a ``#### n`` line.

    Args:
        format_bonus: added when :func:`has_answer_line` holds (>= 0).

    Raises:
        ValueError: a prompt has no known answer (call-time).

    Worked values (answer "6", bonus 0.1): "... #### 6" -> 1.1; "... #### 7" -> 0.1;
    "it is 6" -> 1.0; "no idea" -> 0.0.
    """

    name = "verifier"

    def __init__(self, format_bonus: float = 0.1) -> None:
        self.format_bonus = format_bonus

    def __call__(self, prompts: list[PromptItem], completions: list[str]) -> Tensor:
        _require_answers(prompts, "verifier")
        scores = [
            float(is_correct(c, p.answer)) + (self.format_bonus if has_answer_line(c) else 0.0)
            for p, c in zip(prompts, completions, strict=True)
        ]
        return torch.tensor(scores, dtype=torch.float32)


def _answer_text(completion: str) -> str:
    """What :class:`MathVerifyReward` parses: the first line after the last ``####``, else everything."""
    if "####" in completion:
        line = completion.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        if line:
            return line
    return completion


@functools.lru_cache(maxsize=65536)
def _parse_gold(answer: str, timeout_s: int | None) -> list:
    from math_verify import parse

    return parse(answer, extraction_mode="first_match", parsing_timeout=timeout_s)


class MathVerifyReward:
    """1 when math-verify finds the completion's answer equivalent to the known answer (else 0),
    plus ``format_bonus`` for a ``#### n`` line (:func:`has_answer_line`, as :class:`VerifierReward`).

    The text compared is the first line after the completion's last ``####`` when there is one
    (GSM8K's convention, as the verifier's), else the whole completion, where math-verify finds
    the answer itself (``\\boxed{}`` first, then "the answer is ...", then the last expression).
    Both sides are parsed with math-verify's default extraction (LaTeX and plain expressions), the
    gold with ``extraction_mode="first_match"`` as TRL's ``accuracy_reward`` does, and compared
    with ``verify(gold, answer)`` (gold first: it is not symmetric); numbers agree to 6 decimal
    places. A gold that math-verify cannot parse falls back to the verifier's exact match.

    Timeouts: math-verify bounds each parse and comparison with ``signal.alarm``, which only the
    main thread may set (on another thread ``parse`` raises ValueError). On the main thread this
    passes ``timeout_s``; on any other thread it passes ``parsing_timeout=None`` and
    ``timeout_seconds=None`` (no limit, no signal), so it works in any thread.

    Args:
        format_bonus: added when :func:`has_answer_line` holds (>= 0).
        timeout_s: seconds per parse / comparison on the main thread (whole seconds; None or 0: no
            limit). A parse that times out counts as no answer (0).

    Raises:
        ConfigError: the math-verify package is not installed (construction).
        ValueError: a prompt has no known answer (call-time).

    Worked values (answer "42", bonus 0.1): "... #### 42" -> 1.1; "#### 42.0" -> 1.1;
    "The answer is \\boxed{42}" -> 1.0; "... #### 41" -> 0.1; "#### 42\\nCheck: 3+5=8" -> 1.1
    (the ``####`` line wins); answer "0.5": "#### 1/2" -> 1.1, "\\boxed{\\frac{1}{2}}" -> 1.0.
    """

    name = "math_verify"

    def __init__(self, format_bonus: float = 0.1, timeout_s: int | None = 5) -> None:
        try:
            import math_verify  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                "reward.kind='math_verify' needs the math-verify package (pip install 'math-verify>=0.9')"
            ) from exc
        self.format_bonus, self.timeout_s = format_bonus, timeout_s

    def _timeout_s(self) -> int | None:
        return self.timeout_s if threading.current_thread() is threading.main_thread() else None

    def is_equivalent(self, completion: str, answer: str) -> bool:
        """Whether math-verify finds the completion's answer equivalent to ``answer``."""
        from math_verify import parse, verify

        timeout_s = self._timeout_s()
        gold = _parse_gold(answer, timeout_s)
        if not gold:
            return is_correct(completion, answer)
        predicted = parse(_answer_text(completion), parsing_timeout=timeout_s)
        return bool(predicted) and verify(gold, predicted, timeout_seconds=timeout_s)

    def __call__(self, prompts: list[PromptItem], completions: list[str]) -> Tensor:
        _require_answers(prompts, "math_verify")
        scores = [
            float(self.is_equivalent(c, p.answer)) + (self.format_bonus if has_answer_line(c) else 0.0)
            for p, c in zip(prompts, completions, strict=True)
        ]
        return torch.tensor(scores, dtype=torch.float32)


class RewardModelReward:
    """The reward model's score of each (prompt, completion), in batches, without gradients.

    Args:
        model: a frozen reward model: a sequence classifier with one label, or an implicit
            reward model (a causal LM; :func:`~trainer_core.modeling.forwards.rewards.sequence_rewards`).
        tokenizer: renders prompt + completion with the chat template.
        data: max lengths used to encode (as in training the reward model).
        batch_size: sequences per forward.
        device: where ``model`` is.

    Raises:
        RewardFunctionError: a score is NaN or infinite (call-time; names the sample).
    """

    name = "reward_model"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        data: DataConfig,
        batch_size: int,
        device: torch.device,
    ) -> None:
        self.model, self.tokenizer, self.data = model, tokenizer, data
        self.batch_size, self.device = batch_size, device

    def __call__(self, prompts: list[PromptItem], completions: list[str]) -> Tensor:
        messages = [p.messages for p in prompts]
        scores = reward_scores(
            self.model, self.tokenizer, messages, completions, self.data, self.batch_size, self.device
        )
        return as_rewards(scores, "reward reward_model", prompts, completions)


_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _background_loop() -> asyncio.AbstractEventLoop:
    """One event loop per process, running in a daemon thread (as TRL's GRPOTrainer runs async rewards)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="reward-async-loop", daemon=True).start()
        return _loop


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _resolve(result: Any) -> Any:
    """``result``, or what it resolves to when it is awaitable (run on :func:`_background_loop`)."""
    if not inspect.isawaitable(result):
        return result
    return asyncio.run_coroutine_threadsafe(_awaited(result), _background_loop()).result()


def _import_function(path: str) -> Callable:
    where = f"reward.function={path!r}"
    obj = import_object(path, "reward.function", "function")
    attr = path.partition(":")[2]
    if not callable(obj):
        raise ConfigError(f"{where}: {attr!r} is a {type(obj).__name__}, not a function")
    try:
        inspect.signature(obj).bind(["p"], ["c"], answers=[None], messages=[[]])
    except TypeError as exc:
        raise ConfigError(
            f"{where}: {attr!r} must accept (prompts, completions, *, answers, messages) or "
            f"(prompts, completions, **kwargs): {exc}"
        ) from exc
    except ValueError:
        pass  # no signature to check (a builtin): the call will tell
    return obj


class FunctionReward:
    """A user's reward function, named by import path, called in TRL's reward-function convention.

    The function is imported once, at construction, and called once per rollout batch::

        def reward_func(prompts: list[str], completions: list[str], *, answers: list[str | None],
                        messages: list[list[dict]], **kwargs) -> Sequence[float] | Tensor

    - ``prompts[i]``: the content of the last user turn of prompt i (plain text, not the chat
      template's rendering).
    - ``completions[i]``: the decoded completion i (special tokens skipped, whitespace stripped).
      N of each; the G completions of a GRPO group are contiguous rows, so ``prompts`` repeats.
    - ``answers[i]``: the prompt's known final answer, normalised (``"1072"``), or None.
    - ``messages[i]``: the prompt's chat turns ``[{"role", "content"}]`` (copies; no completion).
    - Returns N finite real numbers: a list or tuple (bools count 0 / 1), or a [N] tensor or
      array. None (TRL's "no reward for this sample") is not allowed.
    - Declare ``**kwargs`` to be safe from keyword arguments added later (as TRL passes every
      dataset column as a keyword list).
    - An ``async def`` function (any callable returning an awaitable) is awaited on one event loop
      per process that runs in a daemon thread (as TRL's GRPOTrainer does), so it works whether or
      not an event loop is running in the calling thread, and loop-bound clients stay usable.

    The rewards come back as [N] float32 on the CPU.

    Args:
        path: ``"package.module:function"`` (``function`` may be dotted: ``module:obj.method``).

    Raises:
        ConfigError: naming ``reward.function`` and ``path`` (construction): the module cannot be
            imported, has no such attribute, it is not callable, or it cannot take the arguments.
        RewardFunctionError: naming ``path`` (call-time): the function raised (the batch is then
            re-run one sample at a time to find the first failing one: its index, prompt and
            completion are in the message, its exception chained); it returned NaN or infinity
            (the index and the sample); not N values, or a value that is not a real number.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fn = _import_function(path)
        self.name = f"function {path}"

    def _call(self, prompts: list[PromptItem], completions: list[str]) -> Any:
        result = self.fn(
            [prompt_text(p) for p in prompts],
            list(completions),
            answers=[p.answer for p in prompts],
            messages=[[dict(m) for m in p.messages] for p in prompts],
        )
        return _resolve(result)

    def _first_failure(
        self, prompts: list[PromptItem], completions: list[str], batch_exc: Exception
    ) -> tuple[str, Exception]:
        """The message and exception of the first sample that fails alone (else of the batch)."""
        for i in range(len(completions)):
            try:
                self._call(prompts[i : i + 1], completions[i : i + 1])
            except Exception as exc:  # noqa: BLE001 - the user's function: any failure is reported
                return f"{type(exc).__name__}: {_shown(str(exc))} on {_sample(prompts, completions, i)}", exc
        return (
            f"{type(batch_exc).__name__}: {_shown(str(batch_exc))} on a batch of {len(completions)} "
            "completions, but on none of them alone"
        ), batch_exc

    def __call__(self, prompts: list[PromptItem], completions: list[str]) -> Tensor:
        try:
            values = self._call(prompts, completions)
        except Exception as exc:  # noqa: BLE001 - the user's function: any failure is reported
            message, cause = self._first_failure(prompts, completions, exc)
            raise RewardFunctionError(f"reward {self.name} raised {message}") from cause
        return as_rewards(values, f"reward {self.name}", prompts, completions)


class WeightedReward:
    """``sum_k weight_k * reward_k``, each part's output checked by :func:`as_rewards`.

    Args:
        parts: (weight, reward function) pairs; a part's ``name`` attribute (else its type) names it
            in errors.

    Raises:
        ValueError: ``parts`` is empty.
        RewardFunctionError: a part returned a wrong shape, non-numbers, NaN or infinity (call-time).
    """

    def __init__(self, parts: list[tuple[float, RewardFunction]]) -> None:
        if not parts:
            raise ValueError("a weighted reward needs at least one part")
        self.parts = parts

    def __call__(self, prompts: list[PromptItem], completions: list[str]) -> Tensor:
        return self.scored_parts(prompts, completions)[0]

    def scored_parts(self, prompts: list[PromptItem], completions: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
        """(the weighted sum [N] float32, each part's unweighted [N] score by its name's first word,
        e.g. ``reward_model``, ``verifier``), so that the RL stages log each (``reward/<name>``)."""
        scores = [
            as_rewards(fn(prompts, completions), f"reward {_reward_name(fn)}", prompts, completions)
            for _, fn in self.parts
        ]
        total = sum((weight * score for (weight, _), score in zip(self.parts, scores)), torch.zeros(len(completions)))
        return total, {_reward_name(fn).split(" ")[0]: score for (_, fn), score in zip(self.parts, scores)}


REWARD_BUILDERS: dict[str, Callable[[RewardConfig, Callable[[], RewardFunction]], RewardFunction]] = {
    "reward_model": lambda cfg, load_reward_model: load_reward_model(),
    "verifier": lambda cfg, load_reward_model: VerifierReward(cfg.format_bonus),
    "math_verify": lambda cfg, load_reward_model: MathVerifyReward(cfg.format_bonus),
    "function": lambda cfg, load_reward_model: FunctionReward(cfg.function),
}
"""Reward kind -> builder of its function from the config and the reward model's loader."""


def reward_weights(cfg: RewardConfig) -> dict[str, float]:
    """The reward kinds ``cfg`` sums, with their weights: ``{kind: 1.0}`` for a single kind; for
    'weighted', ``cfg.weights``, or by default ``reward_model_weight`` x RM + ``verifier_weight`` x verifier."""
    if cfg.kind != "weighted":
        return {cfg.kind: 1.0}
    if cfg.weights is not None:
        return dict(cfg.weights)
    return {"reward_model": cfg.reward_model_weight, "verifier": cfg.verifier_weight}


def needs_reward_model(cfg: RewardConfig) -> bool:
    """Whether the reward reads a trained reward model ('reward_model', or a weighted sum with it)."""
    return "reward_model" in reward_weights(cfg)


def needs_answers(cfg: RewardConfig) -> bool:
    """Whether the reward needs prompts with known answers (verifier or math_verify, alone or weighted)."""
    return any(kind in ANSWER_KINDS for kind in reward_weights(cfg))


def build_reward(cfg: RewardConfig, load_reward_model: Callable[[], RewardFunction] | None) -> RewardFunction:
    """The reward function of ``cfg``, from :data:`REWARD_BUILDERS`.

    Args:
        cfg: the stage's reward config.
        load_reward_model: builds the :class:`RewardModelReward` (called only when needed).

    Raises:
        ConfigError: the reward needs a reward model and ``load_reward_model`` is None; the
            function of ``reward.function`` cannot be loaded (see :class:`FunctionReward`);
            math-verify is not installed.
    """
    weights = reward_weights(cfg)
    if "reward_model" in weights and load_reward_model is None:
        raise ConfigError(f"reward.kind={cfg.kind!r} needs a reward model (run reward_model or set reward_model_from)")
    built = {kind: REWARD_BUILDERS[kind](cfg, load_reward_model) for kind in weights}
    if cfg.kind != "weighted":
        return built[cfg.kind]
    return WeightedReward([(weight, built[kind]) for kind, weight in weights.items()])
