"""Environments for multi-turn rollouts: tools the policy calls while it generates.

An :class:`Environment` watches each row's text as the policy writes it. When the text so far
ends with a complete tool call (:meth:`Environment.find_call`), the environment answers
(:meth:`Environment.step`): its observation's tokens are fed to the model after the policy's,
generation continues after them with the same KV cache, and those tokens are the environment's,
not the policy's: masked from the policy loss, the log-probs, the KL and the advantages'
normalisation (``Generated.observation_mask``; :mod:`trainer_core.training.rl.rollout`).

The engines drive a :class:`ToolSession` after every decode step
(:meth:`~trainer_core.generation.engines.GenerationEngine.generate`, ``session=``): every row
samples a token each step (so the random draws, and with them bit-exact resume and the two
engines' equality, do not depend on the tools), and a row that owes observation tokens has its
sampled token replaced by the next of them, log-prob 0.

Built in (:data:`ENVIRONMENTS`): ``calculator``, GSM8K's convention (Cobbe et al. 2021,
"Training Verifiers to Solve Math Word Problems", section 2 and appendix C: when the model
writes ``<<expr=`` the calculator appends ``result>>``), with :func:`safe_arithmetic` (an AST
walk, never ``eval``). A user's environment is named by import path (``package.module:Class``).
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from trainer_core.config.generation import environment_name_problem
from trainer_core.errors import ConfigError, PosttrainError
from trainer_core.imports import import_object
from trainer_core.training.rl.rewards import PromptItem


class EnvironmentProtocolError(PosttrainError):
    """An environment broke its protocol (wrong types, a NaN reward): the stage fails, naming the
    environment and the sample."""


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one tool call.

    Attributes:
        observation: text fed to the model after the call (the tool's output), tokenised without
            special tokens and cut to the session's ``max_observation_tokens``.
        reward: added to the episode's reward (summed over its calls; 0.0 for a plain tool).
        done: the episode ends after the observation (the row stops generating).
    """

    observation: str
    reward: float = 0.0
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """A tool environment (the multi-turn rollout's other party).

    Methods:
        reset(prompt): start an episode for one prompt row (:class:`PromptItem`); returns the
            episode's state (any object; ``None`` is fine), passed back to the two others.
        find_call(state, text): the tool call completed at the end of ``text``, the policy's turn
            so far (everything it wrote since the last observation), or None. Called after every
            policy token, so it must be cheap.
        step(state, call): answer ``call`` (:class:`EnvStep`). Raising (or running past the
            session's ``tool_timeout_s``) is a tool error: its message becomes the observation
            (``error_observation`` when the environment defines it) and ``env/tool_errors`` counts
            it; the stage goes on.

    Optional: ``error_observation(error) -> str``; ``bind_tokenizer(tokenizer)``, called by each
    :class:`ToolSession` before its episodes (an environment that renders with the chat template).
    """

    def reset(self, prompt: PromptItem) -> Any: ...

    def find_call(self, state: Any, text: str) -> str | None: ...

    def step(self, state: Any, call: str) -> EnvStep: ...


# --- the calculator ------------------------------------------------------------------------------


class CalculatorError(ValueError):
    """An expression :func:`safe_arithmetic` refuses or cannot evaluate (the message says why)."""


MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15
MAX_EXPONENT = 64

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def safe_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic ``expression``: numbers, ``+ - * / // % **``, unary signs and
    parentheses (``×`` read as ``*``, ``÷`` as ``/``, thousands commas dropped), by a walk
    of Python's AST: nothing is executed.

    Limits: at most :data:`MAX_EXPRESSION_CHARS` characters, exponents of at most
    :data:`MAX_EXPONENT` in magnitude, every intermediate value at most :data:`MAX_MAGNITUDE` in
    magnitude (so ``9**9**9`` is refused at its inner power, before it is computed).

    Raises:
        CalculatorError: anything else (names, calls, attributes, strings, comparisons), a syntax
            error, division by zero, a limit exceeded, a result that is not finite.
    """
    text = expression.strip().replace("×", "*").replace("÷", "/").replace(",", "")
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not arithmetic: {expression!r}") from exc
    return _evaluate(tree.body, expression)


def _checked(value: float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"a value exceeds {MAX_MAGNITUDE:g} in magnitude")
    return value


def _evaluate(node: ast.AST, expression: str) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand, expression)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, expression), _evaluate(node.right, expression)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} exceeds {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as exc:
            raise CalculatorError("division by zero") from exc
        except OverflowError as exc:
            raise CalculatorError("result is not finite") from exc
        if isinstance(value, complex):
            raise CalculatorError("result is not a real number")
        return _checked(value)
    raise CalculatorError(f"not arithmetic: {expression!r}")


def format_number(value: float) -> str:
    """``value`` as GSM8K's annotations write it: an integral value without a decimal point,
    else at most 4 decimals without trailing zeros (``24``, ``0.2``, ``1.6667``)."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.4f}".rstrip("0").rstrip(".")


class CalculatorEnvironment:
    """GSM8K's calculator: on ``<<expr=`` (an open ``<<`` and the ``=`` just written) it appends
    ``result>>``, as in the dataset's annotations (``48/2 = <<48/2=24>>24``).

    A tool call fires when the policy's turn so far ends with ``=`` after a ``<<`` that no ``>>``
    closed. A BPE token that carries ``=`` together with what follows (``=-``) ends the text
    past the ``=``: that call does not fire, and the policy's own text stands (a byte-level BPE
    with GPT-2's pre-tokenisation, as the demo's, keeps ``=`` apart from digits). Errors (division
    by zero, non-arithmetic text) are observed as ``error: <why>>>``. Reward: 0.
    """

    name = "calculator"

    def reset(self, prompt: PromptItem) -> None:
        return None

    def find_call(self, state: Any, text: str) -> str | None:
        if not text.endswith("="):
            return None
        start = text.rfind("<<")
        if start < 0 or ">>" in text[start:]:
            return None
        return text[start + 2 : -1]

    def step(self, state: Any, call: str) -> EnvStep:
        return EnvStep(format_number(safe_arithmetic(call)) + ">>")

    def error_observation(self, error: BaseException) -> str:
        return f"error: {error}>>"


# --- a user's Python functions as tools, in the chat template's tool-call format ----------------

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_RESULT = "\x00tool-result\x00"


class FunctionToolsEnvironment:
    """A user's Python functions as tools, called as chat templates that declare tools write a
    call (Qwen2.5's and Hermes' format, the project's template's too): the policy writes
    ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``; the function runs with
    those keyword arguments and its result (a str, else its JSON) comes back as the template
    renders a ``tool`` message, ending the assistant's turn and opening the next one (for the
    project's template ``<|end|>\n<|user|>\n<tool_response>\n{result}\n</tool_response><|end|>\n
    <|assistant|>\n``). Llama 3's bare-JSON calls are not read.

    Args:
        functions: import paths ``package.module:function``; a tool is named by its function's
            ``__name__``.

    Raises:
        ConfigError: a path that does not name a callable; (:meth:`bind_tokenizer`) a chat
            template that does not write tool calls and tool messages this way.
    """

    name = "functions"

    def __init__(self, functions: list[str]) -> None:
        if not functions:
            raise ConfigError("environment 'functions' needs kwargs.functions: ['package.module:function', ...]")
        self.functions: dict[str, Callable[..., Any]] = {}
        for path in functions:
            fn = import_object(path, "environment.kwargs.functions", "function")
            if not callable(fn):
                raise ConfigError(f"environment.kwargs.functions: {path!r} is a {type(fn).__name__}, not a function")
            self.functions[fn.__name__] = fn
        self.response: str | None = None

    def bind_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Read from ``tokenizer``'s chat template what follows a tool call: the text between an
        assistant turn's last ``</tool_call>`` and the next assistant turn's first token, around
        a tool message."""
        call = {"type": "function", "function": {"name": "f", "arguments": {}}}
        turns = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        before = tokenizer.apply_chat_template(turns, tokenize=False)
        after = tokenizer.apply_chat_template(
            turns + [{"role": "tool", "name": "f", "content": _RESULT}], add_generation_prompt=True, tokenize=False
        )
        end = before.rfind(TOOL_CALL_CLOSE) + len(TOOL_CALL_CLOSE)
        if end < len(TOOL_CALL_CLOSE) or not after.startswith(before[:end]) or _RESULT not in after[end:]:
            raise ConfigError(
                "environment 'functions': the tokenizer's chat template does not write a tool call as "
                f"{TOOL_CALL_OPEN}...{TOOL_CALL_CLOSE} followed by the tool's message"
            )
        self.response = after[end:]

    def reset(self, prompt: PromptItem) -> None:
        return None

    def find_call(self, state: Any, text: str) -> str | None:
        if not text.endswith(TOOL_CALL_CLOSE):
            return None
        start = text.rfind(TOOL_CALL_OPEN)
        return None if start < 0 else text[start + len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)].strip()

    def step(self, state: Any, call: str) -> EnvStep:
        request = json.loads(call)
        if not (isinstance(request, dict) and isinstance(request.get("arguments", {}), dict)):
            raise ValueError(f"a tool call is {{'name': str, 'arguments': object}}, got {call!r}")
        fn = self.functions.get(request.get("name"))
        if fn is None:
            raise ValueError(f"unknown tool {request.get('name')!r}; tools: {sorted(self.functions)}")
        result = fn(**request.get("arguments", {}))
        return EnvStep(self._observed(result if isinstance(result, str) else json.dumps(result)))

    def error_observation(self, error: BaseException) -> str:
        return self._observed(f"error: {type(error).__name__}: {error}")

    def _observed(self, content: str) -> str:
        if self.response is None:
            raise RuntimeError("environment 'functions' used before bind_tokenizer")
        return self.response.replace(_RESULT, content)


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {
    "calculator": CalculatorEnvironment,
    "functions": FunctionToolsEnvironment,
}
"""Built-in environments by name."""


def load_environment(
    name: str, kwargs: dict[str, Any] | None = None, *, where: str = "environment.name"
) -> Environment:
    """The environment ``name`` (:data:`ENVIRONMENTS`, or ``package.module:Class``), built with
    ``kwargs``.

    Raises:
        ConfigError: an unknown name, a module or attribute that cannot be imported, a
            constructor that rejects ``kwargs``, an object without ``reset``/``find_call``/``step``.
    """
    factory: Any = ENVIRONMENTS.get(name)
    if factory is None:
        problem = environment_name_problem(name)  # refused at load too (EnvironmentConfig)
        if problem:
            raise ConfigError(f"{where}={name!r}: {problem}")
        factory = import_object(name, where, "Class")
    try:
        env = factory(**(kwargs or {}))
    except TypeError as exc:
        raise ConfigError(f"{where}={name!r}: cannot build it with {kwargs or {}}: {exc}") from exc
    if not isinstance(env, Environment):
        raise ConfigError(f"{where}={name!r}: {type(env).__name__} lacks reset, find_call or step")
    return env


# --- the session: one rollout's episodes, driven by the engine ------------------------------------


@dataclass
class _Episode:
    state: Any
    text: str = ""
    queue: list[int] = field(default_factory=list)
    calls: int = 0
    errors: int = 0
    observation_tokens: int = 0
    reward: float = 0.0


class ToolSession:
    """One rollout's episodes, one per row: after every decode step (:meth:`after_step`) it
    appends each row's new token to its turn's text, asks the environment for a call, answers
    it, and feeds owed observation tokens in place of the sampled ones.

    Args:
        env: the environment.
        tokenizer: decodes the policy's tokens (one at a time: a byte-level BPE token that holds
            part of a multi-byte character shows as U+FFFD, which no ASCII tool call contains)
            and encodes observations (no special tokens).
        prompts: [N] the row's prompt (:meth:`Environment.reset` of each).
        max_tool_calls: calls per episode; later calls are not looked for.
        max_observation_tokens: an observation is cut to this many tokens.
        tool_timeout_s: a call running longer is a tool error (its thread is left to finish).
        eos_id: fed after the observation of an episode that ``done`` ended.

    Raises:
        EnvironmentProtocolError: (call-time) a ``step`` that returns something other than an
            :class:`EnvStep` with a str observation, a finite float reward and a bool ``done``,
            or a ``find_call`` that returns something other than a str or None; the message
            names the environment and the row's prompt.
    """

    def __init__(
        self,
        env: Environment,
        tokenizer: PreTrainedTokenizerBase,
        prompts: list[PromptItem],
        *,
        max_tool_calls: int,
        max_observation_tokens: int,
        tool_timeout_s: float,
        eos_id: int,
    ) -> None:
        self.env, self.tokenizer, self.prompts = env, tokenizer, prompts
        self.max_tool_calls, self.max_observation_tokens = max_tool_calls, max_observation_tokens
        self.tool_timeout_s, self.eos_id = tool_timeout_s, eos_id
        bind = getattr(env, "bind_tokenizer", None)
        if bind is not None:  # an environment that renders with the chat template
            bind(tokenizer)
        self.episodes = [_Episode(env.reset(p)) for p in prompts]
        self._observed: list[list[int]] = [[] for _ in prompts]  # columns of observation tokens
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @classmethod
    def configured(
        cls, env: Environment, limits: Any, tokenizer: PreTrainedTokenizerBase, prompts: list[PromptItem]
    ) -> ToolSession:
        """A session of ``prompts`` with ``limits`` (an ``EnvironmentConfig``) and the
        tokenizer's EOS."""
        return cls(
            env,
            tokenizer,
            prompts,
            max_tool_calls=limits.max_tool_calls,
            max_observation_tokens=limits.max_observation_tokens,
            tool_timeout_s=limits.tool_timeout_s,
            eos_id=tokenizer.eos_token_id,
        )

    @property
    def env_name(self) -> str:
        return getattr(self.env, "name", None) or type(self.env).__name__

    def _violation(self, row: int, what: str) -> EnvironmentProtocolError:
        messages = self.prompts[row].messages
        prompt = messages[-1].get("content", "") if messages else ""
        return EnvironmentProtocolError(
            f"environment {self.env_name!r} broke its protocol on row {row} (prompt {prompt[:120]!r}): {what}"
        )

    def _call(self, row: int, call: str) -> EnvStep:
        """The environment's answer to ``call``; a raise or a timeout becomes an error observation."""
        episode = self.episodes[row]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tool")
        future = self._pool.submit(self.env.step, episode.state, call)
        try:
            step = future.result(timeout=self.tool_timeout_s)
        except concurrent.futures.TimeoutError:
            self._pool.shutdown(wait=False)  # the hung call keeps its thread; later calls get a new one
            self._pool = None
            return self._error(row, TimeoutError(f"tool call timed out after {self.tool_timeout_s:g} s"))
        except Exception as exc:  # noqa: BLE001 - any tool failure is observed, never fatal
            return self._error(row, exc)
        if not isinstance(step, EnvStep) or not isinstance(step.observation, str) or not isinstance(step.done, bool):
            raise self._violation(
                row, f"step({call!r}) returned {step!r}, not an EnvStep(observation: str, reward: float, done: bool)"
            )
        if not isinstance(step.reward, (int, float)) or not math.isfinite(step.reward):
            raise self._violation(row, f"step({call!r}) returned reward {step.reward!r}, not a finite number")
        return step

    def _error(self, row: int, error: BaseException) -> EnvStep:
        self.episodes[row].errors += 1
        describe = getattr(self.env, "error_observation", None)
        text = describe(error) if describe is not None else f"error: {type(error).__name__}: {error}"
        return EnvStep(str(text))

    def after_step(self, tokens: Tensor, logprobs: Tensor, token: Tensor, finished: Tensor, column: int) -> None:
        """Act on decode step ``column`` (the column just recorded), in place on the engine's
        buffers: ``tokens`` [N, T] long and ``logprobs`` [N, T] float32 (the recorded columns),
        ``token`` [N] long (what the next step feeds), ``finished`` [N] bool."""
        fed = token.tolist()
        ended = finished.tolist()
        for row, episode in enumerate(self.episodes):
            if episode.queue:
                forced = episode.queue.pop(0)
                tokens[row, column] = forced
                logprobs[row, column] = 0.0
                token[row] = forced
                finished[row] = forced == self.eos_id
                self._observed[row].append(column)
                continue
            if ended[row]:
                continue
            episode.text += self.tokenizer.decode([fed[row]])
            if episode.calls >= self.max_tool_calls:
                continue
            try:
                call = self.env.find_call(episode.state, episode.text)
            except Exception as exc:  # a bug in the environment, not a tool's failure: the stage fails
                raise self._violation(row, f"find_call raised {type(exc).__name__}: {exc}") from exc
            if call is None:
                continue
            if not isinstance(call, str):
                raise self._violation(row, f"find_call returned {call!r}, not a str or None")
            step = self._call(row, call)
            episode.calls += 1
            episode.reward += float(step.reward)
            ids = self.tokenizer.encode(step.observation, add_special_tokens=False)[: self.max_observation_tokens]
            episode.observation_tokens += len(ids)
            episode.queue = ids + ([self.eos_id] if step.done else [])
            episode.text = ""

    def observation_mask(self, num_columns: int, device: torch.device) -> Tensor:
        """[N, num_columns] float, 1 = a token the environment fed (an observation, or the EOS
        after a ``done``)."""
        mask = torch.zeros(len(self.episodes), num_columns, dtype=torch.float32)
        for row, columns in enumerate(self._observed):
            kept = [c for c in columns if c < num_columns]
            if kept:
                mask[row, kept] = 1.0
        return mask.to(device)

    def rewards(self) -> Tensor:
        """[N] float32: each episode's summed step rewards."""
        return torch.tensor([e.reward for e in self.episodes], dtype=torch.float32)

    def stats(self) -> dict[str, list[float]]:
        """Per-episode counts: ``tool_calls``, ``tool_errors``, ``observation_tokens``."""
        return {
            "tool_calls": [float(e.calls) for e in self.episodes],
            "tool_errors": [float(e.errors) for e in self.episodes],
            "observation_tokens": [float(e.observation_tokens) for e in self.episodes],
        }

    def close(self) -> None:
        """Let go of the tool thread (a hung call's thread finishes on its own)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
