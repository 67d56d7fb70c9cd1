"""Reward functions: the verifier and math-verify by hand, user functions by import path, weighted
sums, and the reward model read at the last real token."""

from __future__ import annotations

import asyncio
import copy
import math
import threading

import pytest
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig

from tests.tiny import LLAMA_1X16
from trainer_core.config import DataConfig, RewardConfig
from trainer_core.data.tokenizer import render_chat, train_tokenizer
from trainer_core.errors import EXIT_BAD_INPUT, ConfigError
from trainer_core.training.rl.rewards import (
    FunctionReward,
    MathVerifyReward,
    PromptItem,
    RewardFunctionError,
    RewardModelReward,
    VerifierReward,
    WeightedReward,
    build_reward,
    has_answer_line,
    is_correct,
    needs_answers,
    needs_reward_model,
)

MESSAGES = [{"role": "user", "content": "Tom has 3 apples. He buys 5 more. How many apples does Tom have now?"}]
FUNCTIONS = "tests.unit.reward_functions"


def _prompt(answer: str | None = "8") -> PromptItem:
    return PromptItem(messages=MESSAGES, input_ids=[1, 2, 3], answer=answer)


def test_verifier_worked_values():
    """Answer 8, bonus 0.1: right + line -> 1.1; wrong + line -> 0.1; right without line -> 1.0; none -> 0."""
    completions = ["Tom has 3+5=<<3+5=8>>8 apples.\n#### 8", "Tom has 3+5=9 apples.\n#### 9", "it is 8", "no idea"]
    scores = VerifierReward(0.1)([_prompt()] * 4, completions)
    assert scores.dtype == torch.float32
    assert scores.tolist() == pytest.approx([1.1, 0.1, 1.0, 0.0])


def test_verifier_normalises_numbers_and_needs_answers():
    assert is_correct("#### 1,072", "1072") and is_correct("#### 72.0", "72")
    assert not is_correct("#### 72", None)
    assert has_answer_line("a\n#### 42\n") and not has_answer_line("#### forty-two")
    with pytest.raises(ValueError, match="known answers"):
        VerifierReward()([_prompt(None)], ["#### 1"])


def test_weighted_reward_sums_parts():
    """0.5 x verifier (1.1, 0.0) + 2 x constant 1 -> (2.55, 2.0)."""
    constant = lambda prompts, completions: torch.ones(len(completions))
    fn = WeightedReward([(0.5, VerifierReward(0.1)), (2.0, constant)])
    assert fn([_prompt()] * 2, ["#### 8", "?"]).tolist() == pytest.approx([2.55, 2.0])
    total, parts = fn.scored_parts([_prompt()] * 2, ["#### 8", "?"])
    assert total.tolist() == pytest.approx([2.55, 2.0])
    (other,) = set(parts) - {"verifier"}
    assert parts["verifier"].tolist() == pytest.approx([1.1, 0.0]) and parts[other].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError):
        WeightedReward([])


def test_build_reward_picks_the_configured_kind():
    assert isinstance(build_reward(RewardConfig(kind="verifier"), None), VerifierReward)
    with pytest.raises(ConfigError, match="reward model"):
        build_reward(RewardConfig(kind="reward_model"), None)
    constant = lambda prompts, completions: torch.full((len(completions),), 3.0)
    assert build_reward(RewardConfig(kind="reward_model"), lambda: constant) is constant
    weighted = build_reward(
        RewardConfig(kind="weighted", reward_model_weight=0.5, verifier_weight=1.0), lambda: constant
    )
    assert weighted([_prompt()], ["#### 8"]).tolist() == pytest.approx([1.5 + 1.1])


@pytest.fixture(scope="module")
def tiny_rm():
    texts = [render_chat(MESSAGES + [{"role": "assistant", "content": f"#### {i}"}]) for i in range(20)]
    tok = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        **LLAMA_1X16,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        num_labels=1,
    )
    model = AutoModelForSequenceClassification.from_config(config).eval()
    return model, tok


def test_reward_model_scores_last_real_token_independent_of_batching(tiny_rm):
    """Short, long and middling completions scored two at a time (longest first: the long and the
    middling one together, the short one alone) come back in the given order, equal each scored
    alone, and equal the score head read at the last token of an unpadded forward."""
    model, tok = tiny_rm
    data = DataConfig(max_length_tokens=96, max_prompt_length_tokens=64)
    fn = RewardModelReward(model, tok, data, batch_size=2, device=torch.device("cpu"))
    completions = ["#### 1", "Tom has 3+5=<<3+5=8>>8 apples. Then more words.\n#### 8", "Tom has 8.\n#### 8"]
    together = fn([_prompt()] * 3, completions)
    alone = torch.cat([fn([_prompt()], [c]) for c in completions])
    assert torch.allclose(together, alone, atol=1e-5)
    ids = tok(render_chat(MESSAGES + [{"role": "assistant", "content": completions[0]}]), add_special_tokens=False)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids["input_ids"]])).last_hidden_state
        direct = model.score(hidden[0, -1]).item()
    assert together[0].item() == pytest.approx(direct, abs=1e-5)


def test_reward_model_nan_names_the_reward_and_sample(tiny_rm):
    """A score head of NaN weights makes every score NaN: an error naming the reward model and sample 0."""
    model, tok = tiny_rm
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.score.weight.fill_(math.nan)
    data = DataConfig(max_length_tokens=96, max_prompt_length_tokens=64)
    fn = RewardModelReward(broken, tok, data, batch_size=2, device=torch.device("cpu"))
    with pytest.raises(RewardFunctionError, match=r"reward reward_model returned nan for sample 0 .*'#### 1'"):
        fn([_prompt()] * 2, ["#### 1", "#### 2"])


# math-verify


def test_math_verify_worked_values():
    """Answer 42, bonus 0.1: '#### 42' -> 1.1; '#### 42.0' -> 1.1; boxed 42 -> 1.0 (no #### line);
    '#### 41' -> 0.1; the #### line wins over a later number -> 1.1; no answer -> 0."""
    completions = [
        "Tom has 40+2=42.\n#### 42",
        "#### 42.0",
        "The answer is \\boxed{42}",
        "Tom has 41.\n#### 41",
        "#### 42\nCheck: 3+5=8",
        "no idea",
    ]
    scores = MathVerifyReward(0.1)([_prompt("42")] * len(completions), completions)
    assert scores.dtype == torch.float32
    assert scores.tolist() == pytest.approx([1.1, 1.1, 1.0, 0.1, 1.1, 0.0])


def test_math_verify_equivalence_beyond_exact_match():
    """What math-verify calls equal and the exact-match verifier does not: 1/2 = 0.5 = \\frac{1}{2},
    1/3 = 0.333333 (6 decimals); and what it does not: 3.0000001 != 3."""
    fn, exact = MathVerifyReward(0.0), VerifierReward(0.0)
    cases = [
        ("0.5", "#### 1/2"),
        ("1/2", "#### 0.5"),
        ("0.5", "so \\boxed{\\frac{1}{2}}"),
        ("0.333333", "#### 1/3"),
        ("1072", "#### 1,072"),
    ]
    prompts, completions = [_prompt(a) for a, _ in cases], [c for _, c in cases]
    assert fn(prompts, completions).tolist() == [1.0] * len(cases)
    assert exact(prompts, completions).tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert fn([_prompt("3")], ["#### 3.0000001"]).tolist() == [0.0]


def test_math_verify_needs_answers():
    with pytest.raises(ValueError, match="math_verify reward needs known answers; prompts \\[1\\]"):
        MathVerifyReward()([_prompt("8"), _prompt(None)], ["#### 8", "#### 8"])


def test_math_verify_works_off_the_main_thread():
    """math-verify's default (signal) timeout fails in a worker thread; the reward does not, and agrees."""
    from math_verify import parse

    results: dict[str, object] = {}

    def work() -> None:
        results["scores"] = MathVerifyReward(0.1)([_prompt("42")] * 2, ["#### 42", "#### 41"]).tolist()
        try:
            parse("#### 42")
        except ValueError as exc:
            results["default"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert results["scores"] == pytest.approx([1.1, 0.1])
    assert "threaded environment" in str(results["default"])


# user functions


def test_function_reward_sync_batched():
    """length_reward: 0.01 per character -> 'abc' 0.03, 'hello' 0.05; answer_echo_reward sees the
    last user turn as the prompt, the answers and the messages: '8' (answer 8) -> 1.5, '9' -> 0.5."""
    scores = FunctionReward(f"{FUNCTIONS}:length_reward")([_prompt()] * 2, ["abc", "hello"])
    assert scores.dtype == torch.float32 and scores.shape == (2,)
    assert scores.tolist() == pytest.approx([0.03, 0.05])
    echo = FunctionReward(f"{FUNCTIONS}:answer_echo_reward")
    assert echo([_prompt("8"), _prompt("8")], ["8", "9"]).tolist() == pytest.approx([1.5, 0.5])


def test_function_reward_async_with_and_without_a_running_loop():
    fn = FunctionReward(f"{FUNCTIONS}:async_length_reward")
    assert fn([_prompt()] * 2, ["abc", "hello"]).tolist() == pytest.approx([0.03, 0.05])

    async def inside_a_loop() -> list[float]:
        asyncio.get_running_loop()  # a loop runs in this thread while the reward is called
        return fn([_prompt()], ["abcd"]).tolist()

    assert asyncio.run(inside_a_loop()) == pytest.approx([0.04])


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("tests.unit.no_such_module:fn", "cannot import module 'tests.unit.no_such_module'"),
        (f"{FUNCTIONS}:no_such_function", "has no attribute 'no_such_function'"),
        (f"{FUNCTIONS}:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is a int, not a function"),
        (f"{FUNCTIONS}:two_args_reward", "must accept \\(prompts, completions, \\*, answers, messages\\)"),
        (f"{FUNCTIONS}.length_reward", "must be 'package.module:function'"),
    ],
)
def test_function_reward_load_errors_name_the_field_and_path(path, expected):
    with pytest.raises(ConfigError, match=expected) as info:
        FunctionReward(path)
    assert f"reward.function={path!r}" in str(info.value)


def test_function_reward_that_raises_names_the_first_failing_sample():
    """The batch raises; sample 2 is the first to raise alone: its index, prompt and completion are named."""
    fn = FunctionReward(f"{FUNCTIONS}:raises_on_boom")
    completions = ["fine", "ok", "it went boom here", "boom again"]
    with pytest.raises(RewardFunctionError) as info:
        fn([_prompt()] * 4, completions)
    message = str(info.value)
    assert message.startswith(f"reward function {FUNCTIONS}:raises_on_boom raised ValueError")
    assert "sample 2 (prompt 'Tom has 3 apples." in message and "completion 'it went boom here'" in message
    assert isinstance(info.value.__cause__, ValueError) and "it went boom here" in str(info.value.__cause__)
    assert info.value.exit_code == EXIT_BAD_INPUT


def test_function_reward_error_truncates_long_samples():
    long = "boom " + "x" * 1000
    with pytest.raises(RewardFunctionError, match="sample 0") as info:
        FunctionReward(f"{FUNCTIONS}:raises_on_boom")([_prompt()], [long])
    assert "x" * 190 in str(info.value) and "x" * 300 not in str(info.value)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("nan_reward", "returned nan for sample 1 \\(prompt 'Tom has .*, completion 'is nan here'\\)"),
        ("wrong_length_reward", "returned 3 values for 2 completions; expected 2"),
        ("string_reward", "returned str '1.0' at index 0; expected 2 floats"),
    ],
)
def test_function_reward_bad_outputs_name_the_function(name, expected):
    with pytest.raises(RewardFunctionError, match=f"^reward function {FUNCTIONS}:{name} {expected}"):
        FunctionReward(f"{FUNCTIONS}:{name}")([_prompt()] * 2, ["fine", "is nan here"])


# weighted sums and the registry


class _OneValue:
    name = "short"

    def __call__(self, prompts: list[PromptItem], completions: list[str]) -> torch.Tensor:
        return torch.ones(1)


def test_weighted_reward_checks_each_part():
    """A part returning NaN or the wrong shape is named in the error, not summed."""
    nan_part = lambda prompts, completions: torch.tensor([1.0, math.nan])
    with pytest.raises(
        RewardFunctionError,
        match=r"reward test_weighted_reward_checks_each_part\.<locals>\.<lambda> returned nan for sample 1",
    ):
        WeightedReward([(1.0, VerifierReward()), (1.0, nan_part)])([_prompt()] * 2, ["#### 8", "?"])
    with pytest.raises(RewardFunctionError, match="reward short returned a tensor of shape \\[1\\]; expected \\[2\\]"):
        WeightedReward([(1.0, _OneValue())])([_prompt()] * 2, ["#### 8", "?"])


def test_weighted_by_weights_with_function_and_math_verify():
    """1 x math_verify (answer 0.5, bonus 0.1) + 0.5 x length (0.01/char): '#### 1/2' -> 1.0 + 0.5 x 0.08
    = 1.04; '#### 0.5' -> 1.1 + 0.04 = 1.14; '#### 0.7' -> 0.1 + 0.04 = 0.14. No reward model needed."""
    cfg = RewardConfig(
        kind="weighted", weights={"math_verify": 1.0, "function": 0.5}, function=f"{FUNCTIONS}:length_reward"
    )
    fn = build_reward(cfg, None)
    assert isinstance(fn, WeightedReward)
    scores = fn([_prompt("0.5")] * 3, ["#### 1/2", "#### 0.5", "#### 0.7"])
    assert scores.tolist() == pytest.approx([1.04, 1.14, 0.14])


def test_build_reward_every_kind():
    assert isinstance(build_reward(RewardConfig(kind="math_verify"), None), MathVerifyReward)
    fn = build_reward(RewardConfig(kind="function", function=f"{FUNCTIONS}:length_reward"), None)
    assert isinstance(fn, FunctionReward) and fn.path == f"{FUNCTIONS}:length_reward"
    with pytest.raises(ConfigError, match="reward.function='tests.unit.reward_functions:missing'"):
        build_reward(RewardConfig(kind="function", function=f"{FUNCTIONS}:missing"), None)
    with_rm = RewardConfig(
        kind="weighted", weights={"reward_model": 1.0, "function": 1.0}, function=f"{FUNCTIONS}:length_reward"
    )
    with pytest.raises(ConfigError, match="needs a reward model"):
        build_reward(with_rm, None)
    constant = lambda prompts, completions: torch.full((len(completions),), 3.0)
    assert build_reward(with_rm, lambda: constant)([_prompt()], ["abc"]).tolist() == pytest.approx([3.03])


@pytest.mark.parametrize(
    ("cfg", "reward_model", "answers"),
    [
        ({"kind": "reward_model"}, True, False),
        ({"kind": "verifier"}, False, True),
        ({"kind": "math_verify"}, False, True),
        ({"kind": "function", "function": "m:f"}, False, False),
        ({"kind": "weighted"}, True, True),
        ({"kind": "weighted", "weights": {"function": 1.0}, "function": "m:f"}, False, False),
        ({"kind": "weighted", "weights": {"reward_model": 1.0, "function": 1.0}, "function": "m:f"}, True, False),
        ({"kind": "weighted", "weights": {"math_verify": 1.0}}, False, True),
        ({"kind": "weighted", "weights": {"reward_model": 0.5, "verifier": 1.0}}, True, True),
    ],
)
def test_needs_reward_model_and_answers(cfg, reward_model, answers):
    config = RewardConfig(**cfg)
    assert needs_reward_model(config) is reward_model
    assert needs_answers(config) is answers


def test_function_reward_accepts_numpy_scalars():
    fn = FunctionReward(f"{FUNCTIONS}:numpy_scalars_reward")
    got = fn([_prompt()] * 3, ["#### 8", "x", "#### 9"])
    assert got.tolist() == [1.0, 0.25, 0.0] and got.dtype == torch.float32
