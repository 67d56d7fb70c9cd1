"""Tool environments: the calculator's safe evaluator on hand-worked and hostile expressions, the
environment protocol (built-in, by import path, errors), and multi-turn rollouts through both
generation engines on a tiny seeded Llama and a BPE tokenizer trained here: the same tokens,
observation tokens fed in place of the sampled ones (log-prob 0, masked from every loss term,
attended to), and, when no tool is called, the single-turn rollout and gradient to the bit."""

from __future__ import annotations

import time

import pytest
import torch

from tests.tiny import tiny_llama
from trainer_core.config import RolloutGenerationConfig
from trainer_core.data.tokenizer import train_tokenizer
from trainer_core.errors import ConfigError
from trainer_core.generation.engines import HFEngine, StaticCacheEngine
from trainer_core.modeling.forwards.completion import Completions, completion_forward
from trainer_core.training.rl.environments import (
    CalculatorEnvironment,
    CalculatorError,
    EnvironmentProtocolError,
    EnvStep,
    ToolSession,
    format_number,
    load_environment,
    safe_arithmetic,
)
from trainer_core.training.rl.rewards import PromptItem

TEXTS = ["Tom has 3+5=<<3+5=8>>8 apples.", "Ann has 9-2=<<9-2=7>>7 pens.", "one plus two is three"]


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("48/2", 24),
        ("48+24", 72),
        ("3*(4+5)", 27),
        ("2**10", 1024),
        ("7/2", 3.5),
        ("-3+5", 2),
        ("12/60", 0.2),
        ("0.2*50", 10),
        ("1,000+1", 1001),
        ("18*.5", 9),
        ("7//2", 3),
        ("7%4", 3),
        ("3×4÷2", 6),
    ],
)
def test_safe_arithmetic_hand_worked(expression, value):
    assert safe_arithmetic(expression) == pytest.approx(value)


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("1/0", "division by zero"),
        ("5//0", "division by zero"),
        ("10**100", "exceeds"),
        ("9**9**9", "exceeds"),
        ("2**1000000", "exponent"),
        ("__import__('os').system('true')", "not arithmetic"),
        ("a+1", "not arithmetic"),
        ("'1'+'2'", "not arithmetic"),
        ("1 < 2", "not arithmetic"),
        ("(-8)**0.5", "not a real number"),
        ("", "empty"),
        ("1+" * 150 + "1", "longer than"),
        ("3 apples", "not arithmetic"),
        ("1e308*10", "exceeds"),
        ("[1][0]", "not arithmetic"),
    ],
)
def test_safe_arithmetic_refuses_hostile_expressions(expression, why):
    started = time.perf_counter()
    with pytest.raises(CalculatorError, match=why):
        safe_arithmetic(expression)
    assert time.perf_counter() - started < 1.0  # refused before computing, not after


def test_numbers_are_written_as_gsm8k_writes_them():
    assert [format_number(v) for v in (24, 24.0, 0.2, 5 / 3, -3.5, 10.00001)] == [
        "24",
        "24",
        "0.2",
        "1.6667",
        "-3.5",
        "10",
    ]


def test_the_calculator_answers_an_open_call_at_its_equals_sign():
    calc, prompt = CalculatorEnvironment(), PromptItem([{"role": "user", "content": "q"}], [1], "8")
    state = calc.reset(prompt)
    assert calc.find_call(state, "Tom has 3+5=") is None  # no "<<" open
    assert calc.find_call(state, "Tom has 3+5=<<") is None
    assert calc.find_call(state, "Tom has 3+5=<<3+5=") == "3+5"
    assert calc.find_call(state, "<<3+5=8>>8 and 2=") is None  # the "<<" was closed
    assert calc.step(state, "3+5") == EnvStep("8>>")
    assert calc.error_observation(CalculatorError("division by zero")) == "error: division by zero>>"


class Ticker:
    """A test environment: a call once the policy's turn has ``every`` characters; the observation
    is ``" [k]"`` (the call's number), reward 0.5 a call; the third call ends the episode."""

    name = "ticker"

    def __init__(self, every: int = 6, fail_on: int | None = None, sleep_s: float = 0.0) -> None:
        self.every, self.fail_on, self.sleep_s = every, fail_on, sleep_s

    def reset(self, prompt):
        return {"calls": 0}

    def find_call(self, state, text):
        return text if len(text) >= self.every else None

    def step(self, state, call):
        state["calls"] += 1
        if state["calls"] == self.fail_on:
            time.sleep(self.sleep_s)
            raise RuntimeError("tool broke")
        return EnvStep(f" [{state['calls']}]", reward=0.5, done=state["calls"] == 3)


class NaNReward(Ticker):
    def step(self, state, call):
        return EnvStep("x", reward=float("nan"))


class BrokenFinder(Ticker):
    def find_call(self, state, text):
        raise KeyError("oops")


def test_environments_load_by_name_and_import_path_with_clear_errors():
    assert isinstance(load_environment("calculator"), CalculatorEnvironment)
    env = load_environment("tests.unit.test_environments:Ticker", {"every": 3})
    assert type(env).__name__ == "Ticker" and env.every == 3  # (pytest imports this file under another name)
    for name, why in [
        ("abacus", "not a built-in environment"),
        ("no.such.module:X", "cannot import module"),
        ("tests.unit.test_environments:Nope", "has no attribute"),
        ("tests.unit.test_environments:PromptItem", "cannot build it"),
    ]:
        with pytest.raises(ConfigError, match=why):
            load_environment(name, where="grpo.environment.name")
    with pytest.raises(ConfigError, match="cannot build it with"):
        load_environment("tests.unit.test_environments:Ticker", {"bogus": 1})
    with pytest.raises(ConfigError, match="lacks reset, find_call or step"):
        load_environment("tests.unit.test_environments:TEXTS.copy")


def test_an_environment_name_that_names_none_is_refused_at_load():
    """A name neither built in nor an import path fails when the config loads (the RL stages' and
    evaluate's environment), naming the field; the built-in names are the loader's."""
    from trainer_core.config import load_config
    from trainer_core.config.generation import BUILTIN_ENVIRONMENTS
    from trainer_core.training.rl.environments import ENVIRONMENTS

    assert BUILTIN_ENVIRONMENTS == tuple(sorted(ENVIRONMENTS))
    for field in ("grpo.environment", "evaluate.environment"):
        with pytest.raises(ConfigError, match=rf"{field}\.name: Value error, 'abacus': not a built-in environment"):
            load_config(overrides={field: {"name": "abacus"}})
    load_config(overrides={"grpo.environment": {"name": "calculator"}, "ppo.environment": {"name": "a.b:C"}})


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS * 20, 128, 1)


@pytest.fixture(scope="module")
def policy(tokenizer):
    model = tiny_llama(tokenizer, attn_implementation="sdpa")
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id].zero_()  # EOS rare: long turns, several calls a row
    return model


def _prompts(tokenizer):
    texts = ["Tom has", "Ann has 9-2=", "one plus two", "Tom"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    padded = torch.tensor([[tokenizer.pad_token_id] * (width - len(i)) + i for i in ids])
    items = [PromptItem([{"role": "user", "content": t}], i, None) for t, i in zip(texts, ids)]
    return padded, (padded != tokenizer.pad_token_id).float(), items


def _rollout(engine, tokenizer, env, seed: int, temperature: float = 1.0, **limits):
    ids, mask, items = _prompts(tokenizer)
    session = None
    if env is not None:
        settings = {"max_tool_calls": 8, "max_observation_tokens": 32, "tool_timeout_s": 5.0, **limits}
        session = ToolSession(env, tokenizer, items, eos_id=tokenizer.eos_token_id, **settings)
    gen = RolloutGenerationConfig(max_new_tokens=40, temperature=temperature)
    out = engine.generate(
        ids,
        mask,
        gen,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(seed),
        session=session,
    )
    return out, session


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_both_engines_give_the_same_multi_turn_rollouts(policy, tokenizer, temperature):
    """Sampled (the same draws) and greedy: identical tokens, masks and observation masks through
    the ``hf`` and ``static`` engines; the log-probs equal to float rounding, 0 on observations."""
    for seed in (0, 1):
        hf, hf_session = _rollout(HFEngine(policy), tokenizer, Ticker(), seed, temperature)
        static, _ = _rollout(StaticCacheEngine(policy, "cpu", compile=False), tokenizer, Ticker(), seed, temperature)
        assert torch.equal(hf.completion_ids, static.completion_ids)
        assert torch.equal(hf.completion_mask, static.completion_mask)
        assert torch.equal(hf.observation_mask, static.observation_mask)
        torch.testing.assert_close(hf.logprobs, static.logprobs, rtol=0, atol=1e-5)
        observed = hf.observation_mask > 0
        assert observed.any() and (hf.logprobs[observed] == 0).all()
        assert (hf.policy_mask + hf.observation_mask == hf.completion_mask).all()
        calls = hf_session.stats()["tool_calls"]
        assert max(calls) >= 2 and hf_session.rewards().tolist() == [0.5 * c for c in calls]


def test_observations_are_the_environments_tokens_after_each_call(policy, tokenizer):
    """Each row's observed tokens spell the calls' observations in order; a row whose third call
    ended the episode stops with an EOS the environment fed; ``max_tool_calls`` and
    ``max_observation_tokens`` are honoured."""
    out, session = _rollout(HFEngine(policy), tokenizer, Ticker(every=4), 0)
    eos = tokenizer.eos_token_id
    assert 3.0 in session.stats()["tool_calls"]  # an episode that the environment ended
    for row in range(out.completion_ids.shape[0]):
        observed = out.completion_ids[row][out.observation_mask[row] > 0].tolist()
        calls = int(session.stats()["tool_calls"][row])
        want = [t for k in range(1, calls + 1) for t in tokenizer.encode(f" [{k}]", add_special_tokens=False)]
        assert observed[: len(want)] == want
        if calls == 3:
            assert observed == want + [eos] and out.completion_ids[row][int(out.completion_mask[row].sum()) - 1] == eos
    capped, capped_session = _rollout(
        HFEngine(policy), tokenizer, Ticker(every=4), 0, max_tool_calls=1, max_observation_tokens=1
    )
    assert capped_session.stats()["tool_calls"] == [1.0] * 4
    assert capped.observation_mask.sum(1).tolist() == [1.0] * 4


def test_a_tool_that_raises_or_hangs_is_observed_and_counted_not_fatal(policy, tokenizer):
    out, session = _rollout(HFEngine(policy), tokenizer, Ticker(fail_on=1), 0)
    text = tokenizer.decode(out.completion_ids[0][out.observation_mask[0] > 0])
    assert "error: RuntimeError: tool broke" in text and session.stats()["tool_errors"] == [1.0] * 4
    _, slow = _rollout(
        HFEngine(policy), tokenizer, Ticker(fail_on=1, sleep_s=0.3), 0, tool_timeout_s=0.05, max_observation_tokens=64
    )
    assert slow.stats()["tool_errors"] == [1.0] * 4


def test_a_protocol_violation_fails_naming_the_environment_and_the_row(policy, tokenizer):
    with pytest.raises(
        EnvironmentProtocolError,
        match=r"environment 'ticker' broke its protocol on row 0 "
        r"\(prompt 'Tom has'\): step.*reward nan",
    ):
        _rollout(HFEngine(policy), tokenizer, NaNReward(), 0)
    with pytest.raises(EnvironmentProtocolError, match=r"on row 0 .*find_call raised KeyError"):
        _rollout(HFEngine(policy), tokenizer, BrokenFinder(), 0)


def test_observation_tokens_are_attended_to_and_not_scored(policy, tokenizer):
    """The log-probs of a multi-turn completion: 0 on observation tokens; on the policy's tokens,
    those of one forward over the whole sequence (the observations in its context)."""
    out, _ = _rollout(HFEngine(policy), tokenizer, Ticker(), 0)
    ids, mask, _ = _prompts(tokenizer)
    with torch.no_grad():
        turns = completion_forward(
            policy,
            Completions(ids, mask, out.completion_ids, out.policy_mask, observation_mask=out.observation_mask),
            temperature=1.0,
        )
        whole = completion_forward(
            policy, Completions(ids, mask, out.completion_ids, out.completion_mask), temperature=1.0
        )
    observed = out.observation_mask > 0
    assert (turns.logprobs[observed] == 0).all() and (whole.logprobs[observed] != 0).all()
    mine = out.policy_mask > 0
    torch.testing.assert_close(turns.logprobs[mine], whole.logprobs[mine], rtol=0, atol=1e-6)
    torch.testing.assert_close(turns.logprobs[mine], out.logprobs[mine], rtol=0, atol=1e-5)


class Silent(Ticker):
    def find_call(self, state, text):
        return None


def test_without_a_tool_call_the_rollout_and_gradient_are_the_single_turn_ones(policy, tokenizer):
    single, _ = _rollout(HFEngine(policy), tokenizer, None, 0)
    multi, session = _rollout(HFEngine(policy), tokenizer, Silent(), 0)
    assert torch.equal(single.completion_ids, multi.completion_ids) and torch.equal(single.logprobs, multi.logprobs)
    assert multi.observation_mask.sum() == 0 and session.stats()["tool_calls"] == [0.0] * 4
    ids, mask, _ = _prompts(tokenizer)
    grads = []
    for completions in (
        Completions(ids, mask, single.completion_ids, single.completion_mask),
        Completions(ids, mask, multi.completion_ids, multi.policy_mask, observation_mask=multi.observation_mask),
    ):
        policy.zero_grad()
        advantages = torch.linspace(-1, 1, 4)[:, None]
        (completion_forward(policy, completions, temperature=1.0).logprobs * advantages).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]))
    policy.zero_grad()
    assert torch.equal(grads[0], grads[1])


def test_score_and_evaluate_generation_feeds_the_tool_through_either_engine(policy, tokenizer):
    """``generate_completions`` with sessions (``evaluate.environment``): "hf" samples through the
    ``hf`` engine instead of ``generate``, the same greedy texts as "static", each holding the
    calls' observations."""
    from trainer_core.config import GenerationConfig
    from trainer_core.generation.completions import generate_completions

    _, _, items = _prompts(tokenizer)
    prompts = [i.input_ids for i in items]
    texts, sessions = {}, []

    def session_for(start, stop):
        sessions.append(
            ToolSession(
                Ticker(),
                tokenizer,
                items[start:stop],
                max_tool_calls=8,
                max_observation_tokens=32,
                tool_timeout_s=5.0,
                eos_id=tokenizer.eos_token_id,
            )
        )
        return sessions[-1]

    for engine in ("hf", "static"):
        gen = GenerationConfig(max_new_tokens=40, temperature=0.0, batch_size=3, engine=engine)
        texts[engine] = generate_completions(
            policy, tokenizer, prompts, gen, torch.device("cpu"), 0, session_for=session_for
        )
    assert texts["hf"] == texts["static"] and len(sessions) == 4  # 2 batches an engine
    assert all("[1]" in t for t in texts["hf"])
    assert [len(s.episodes) for s in sessions] == [3, 1, 3, 1]


def add(a: float, b: float) -> float:
    """A user's function, a tool of ``FunctionToolsEnvironment`` in these tests."""
    return a + b


def test_users_functions_are_tools_called_in_the_chat_templates_format(tokenizer):
    """The policy's ``<tool_call>`` JSON runs the function; the observation is what the chat template
    writes after that call for a ``tool`` message, up to the next assistant turn, so that the
    conversation reads as the template renders it; a bad call is observed as its error."""
    env = load_environment("functions", {"functions": ["tests.unit.test_environments:add"]})
    with pytest.raises(RuntimeError, match="before bind_tokenizer"):
        env.step(None, '{"name": "add", "arguments": {"a": 1, "b": 1}}')
    ToolSession(
        env,
        tokenizer,
        [],
        max_tool_calls=1,
        max_observation_tokens=8,
        tool_timeout_s=1.0,
        eos_id=tokenizer.eos_token_id,
    )  # a session binds the tokenizer
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    turns = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    rendered = tokenizer.apply_chat_template(turns, tokenize=False)
    prompt = tokenizer.apply_chat_template(turns[:1], add_generation_prompt=True, tokenize=False)
    written = rendered[len(prompt) : rendered.rfind("</tool_call>") + len("</tool_call>")]  # what the policy writes
    request = env.find_call(None, written)
    assert request == '{"name": "add", "arguments": {"a": 2, "b": 3}}' and env.find_call(None, written[:-1]) is None
    observed = env.step(None, request).observation
    whole = tokenizer.apply_chat_template(
        turns + [{"role": "tool", "name": "add", "content": "5"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt + written + observed == whole
    assert "<tool_response>\nerror: ValueError: unknown tool 'mul'" in env.error_observation(
        ValueError("unknown tool 'mul'")
    )
    with pytest.raises(ValueError, match="unknown tool 'mul'"):
        env.step(None, '{"name": "mul", "arguments": {}}')
    with pytest.raises(ConfigError, match="is a dict, not a function"):
        load_environment("functions", {"functions": ["tests.unit.test_environments:ENVIRONMENT_KWARGS"]})


ENVIRONMENT_KWARGS = {"not": "a function"}


def test_an_rl_prompt_declares_its_conversations_tools(tokenizer):
    """``prompt_ids`` with ``tools`` (an SFT row's ``tools_json``, as the RL stages load their
    prompts): the chat template's tools block, then the conversation, then the generation prompt."""
    from trainer_core.config import DataConfig
    from trainer_core.generation.completions import prompt_ids

    schema = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "2+3?"}]
    data = DataConfig(max_length_tokens=400, max_prompt_length_tokens=300)
    ids = prompt_ids(tokenizer, messages, data, [schema])
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(
        messages, tools=[schema], add_generation_prompt=True, tokenize=False
    )
    assert "<tools>" in tokenizer.decode(ids) and "<tools>" not in tokenizer.decode(
        prompt_ids(tokenizer, messages, data)
    )
