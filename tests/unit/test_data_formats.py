"""Format detection, adapters (hand-made and real rows), answer extraction and matching."""

from __future__ import annotations

import json

import pytest

from tests.shared_data import GSM8K, HH, needs_shared_data
from trainer_core.config import DataSource
from trainer_core.data.formats import (
    DialogueParseError,
    answers_match,
    detect_format,
    extract_generated_answer,
    final_answer,
    is_verifiable_answer,
    parse_hh_dialogue,
    to_eval_problem,
    to_kto_examples,
    to_preference_example,
    to_sft_example,
)
from trainer_core.data.sources import read_records
from trainer_core.errors import DataError


GSM = {"question": "Tom has 3 apples. He buys 5. How many?", "answer": "3+5=<<3+5=8>>8\n#### 8", "_source": "f.jsonl:7"}
HH_ROW = {
    "chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke.\n\nAssistant: Why did the chicken...",
    "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke.\n\nAssistant: No.",
    "_source": "hh.jsonl:3",
}


@pytest.mark.parametrize(
    ("record", "fmt"),
    [
        ({"question": "q", "answer": "a"}, "gsm8k"),
        ({"prompt": "p", "completion": "c"}, "prompt_completion"),
        ({"prompt": "p", "chosen": "a", "rejected": "b"}, "prompt_completion"),
        ({"chosen": "a", "rejected": "b"}, "hh_rlhf"),
        ({"messages": []}, "messages"),
        ({"chosen": [], "rejected": []}, "messages"),
    ],
)
def test_detect_format(record, fmt):
    assert detect_format(record) == fmt


def test_detect_format_unknown_names_source_and_fields():
    with pytest.raises(DataError, match=r"x.jsonl:2: cannot detect .* \['body'\]"):
        detect_format({"body": "t", "_source": "x.jsonl:2"})


def test_gsm8k_sft_example_keeps_worked_answer():
    ex = to_sft_example(GSM, "gsm8k")
    assert ex == {
        "prompt": GSM["question"],
        "completion": GSM["answer"],
        "messages": [{"role": "user", "content": GSM["question"]}],
        "answer": "8",
        "_source": "f.jsonl:7",
    }
    assert to_sft_example(GSM, "auto") == ex


def test_prompt_completion_sft_example_string_and_message_prompts():
    ex = to_sft_example({"prompt": "p", "completion": "c"}, "prompt_completion")
    assert ex == {"prompt": "p", "completion": "c", "messages": [{"role": "user", "content": "p"}], "answer": None}
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    ex = to_sft_example({"prompt": msgs, "completion": "c"})
    assert ex["messages"] == msgs and ex["prompt"] == "System: s\n\nUser: u"
    assert to_sft_example({"prompt": "p", "completion": "so\n#### 1,500"})["answer"] == "1500"


CHAT = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u1"},
    {"role": "assistant", "content": "a1"},
    {"role": "user", "content": "u2"},
    {"role": "assistant", "content": "a2\n#### 7"},
]


def test_messages_sft_example_and_eval_problem():
    """A conversation: the last assistant turn is the completion, the turns before it (the earlier
    reply included) the prompt; its final answer the eval problem's."""
    ex = to_sft_example({"messages": CHAT, "_source": "c.jsonl:1"})
    assert ex == {
        "prompt": "System: s\n\nUser: u1\n\nAssistant: a1\n\nUser: u2",
        "completion": "a2\n#### 7",
        "messages": CHAT[:-1],
        "answer": "7",
        "_source": "c.jsonl:1",
    }
    assert to_eval_problem({"messages": CHAT}) == {"messages": CHAT[:-1], "answer": "7"}
    with pytest.raises(DataError, match="format 'messages' has no preference pairs"):
        to_preference_example({"messages": CHAT})


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        (CHAT[:-1], r"c:2: field 'messages' must end with an assistant turn, got role 'user' last"),
        (CHAT[-1:], r"c:2: field 'messages' has no turn before its assistant reply"),
        ([], r"c:2: field 'messages' is an empty message list"),
        ("hello", r"c:2: field 'messages' must be list, got str"),
        ([{"role": "bot", "content": "x"}, CHAT[-1]], r"c:2: field 'messages'\[0\] must be"),
    ],
)
def test_messages_errors_name_source_and_field(messages, pattern):
    with pytest.raises(DataError, match=pattern):
        to_sft_example({"messages": messages, "_source": "c:2"}, "messages")


USER = [{"role": "user", "content": "2+2?"}]


def _said(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_trl_conversational_formats_give_the_canonical_examples():
    """TRL's conversational dataset formats (huggingface.co/docs/trl/dataset_formats): explicit-
    and implicit-prompt preference, unpaired preference and prompt-completion, each the same
    canonical example as its string form."""
    pair = {"messages": USER, "chosen": "4", "rejected": "5"}
    explicit = {"prompt": USER, "chosen": _said("4"), "rejected": _said("5")}
    implicit = {"chosen": USER + _said("4"), "rejected": USER + _said("5")}
    assert to_preference_example(explicit) == pair == to_preference_example(implicit)
    assert to_preference_example({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) == pair
    assert (
        to_kto_examples(implicit)
        == to_kto_examples(explicit)
        == [{"messages": USER, "completion": "4", "label": True}, {"messages": USER, "completion": "5", "label": False}]
    )
    assert to_kto_examples({"prompt": USER, "completion": _said("5"), "label": False}) == [
        {"messages": USER, "completion": "5", "label": False}
    ]
    assert to_sft_example({"prompt": USER, "completion": _said("4\n#### 4")}) == {
        "prompt": "2+2?",
        "completion": "4\n#### 4",
        "messages": USER,
        "answer": "4",
    }
    assert to_eval_problem({"prompt": USER, "completion": _said("#### 4")}) == {"messages": USER, "answer": "4"}
    assert to_sft_example(implicit)["completion"] == "4"


@pytest.mark.parametrize(
    ("record", "pattern"),
    [
        (
            {"prompt": USER, "chosen": _said("4") + _said("5"), "rejected": "5"},
            r"p:4: field 'chosen' must hold one assistant message, got 2 messages",
        ),
        (
            {"prompt": USER, "chosen": USER, "rejected": "5"},
            r"p:4: field 'chosen' must hold an assistant message, got role 'user'",
        ),
        ({"prompt": USER, "chosen": 4, "rejected": "5"}, r"p:4: field 'chosen' must be str or list, got int"),
        (
            {"chosen": USER + _said("4"), "rejected": [{"role": "user", "content": "3+3?"}, *_said("5")]},
            r"p:4: fields 'chosen'/'rejected' do not share all turns but the last assistant reply",
        ),
        (
            {"chosen": USER + _said("4"), "rejected": USER},
            r"p:4: field 'rejected' must end with an assistant turn, got role 'user' last",
        ),
    ],
)
def test_conversational_pair_errors_name_source_and_field(record, pattern):
    with pytest.raises(DataError, match=pattern):
        to_preference_example({**record, "_source": "p:4"})


def test_tool_conversations_keep_their_calls_and_outputs():
    """A conversation with tool use (transformers' chat format): the assistant's ``tool_calls`` (a
    JSON-string ``arguments`` parsed, no ``content`` read as empty) and the ``tool`` turn's name
    are kept for the chat template; the last assistant turn is the completion."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "3+2"}'}}
    record = {
        "messages": [
            {"role": "user", "content": "3+2?"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": "5", "extra": 1},
            {"role": "assistant", "content": "#### 5"},
        ]
    }
    ex = to_sft_example(record)
    parsed = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3+2"}}}
    assert ex["messages"] == [
        {"role": "user", "content": "3+2?"},
        {"role": "assistant", "content": "", "tool_calls": [parsed]},
        {"role": "tool", "content": "5", "name": "calculator"},
    ]
    assert (ex["completion"], ex["answer"]) == ("#### 5", "5")
    assert ex["prompt"] == 'User: 3+2?\n\nAssistant: [calculator({"expression": "3+2"})]\n\nTool: 5'


@pytest.mark.parametrize(
    ("message", "pattern"),
    [
        (
            {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]},
            r"t:1: field 'messages'\[1\]\['tool_calls'\]\[0\] must be \{'function'",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
            r"t:1: field 'messages'\[1\]\['tool_calls'\]\[0\] arguments: invalid JSON",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]},
            r"must be \{'function': \{'name': str, 'arguments': object\}\}",
        ),
        ({"role": "tool"}, r"t:1: field 'messages'\[1\] must be \{'role'"),
    ],
)
def test_tool_message_errors_name_source_and_field(message, pattern):
    record = {
        "messages": [{"role": "user", "content": "q"}, message, {"role": "assistant", "content": "a"}],
        "_source": "t:1",
    }
    with pytest.raises(DataError, match=pattern):
        to_sft_example(record)


def test_a_conversation_ending_in_a_tool_call_has_no_completion():
    call = {"function": {"name": "f", "arguments": {}}}
    with pytest.raises(DataError, match=r"t:2: field 'messages' ends with a tool call"):
        to_sft_example(
            {
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]}],
                "_source": "t:2",
            }
        )


def test_hh_sft_example_uses_chosen_reply():
    ex = to_sft_example(HH_ROW, "hh_rlhf")
    assert ex["completion"] == "Why did the chicken..." and ex["messages"][-1] == {
        "role": "user",
        "content": "Tell me a joke.",
    }


@pytest.mark.parametrize(
    ("record", "fmt", "pattern"),
    [
        ({"question": "q", "_source": "a.jsonl:4"}, "gsm8k", r"a.jsonl:4: missing field 'answer'"),
        (
            {"question": 3, "answer": "#### 1", "_source": "a.jsonl:5"},
            "gsm8k",
            r"a.jsonl:5: field 'question' must be str, got int",
        ),
        ({"prompt": "p", "_source": "b:1"}, "prompt_completion", r"b:1: missing field 'completion'"),
        (
            {"prompt": [{"role": "bot", "content": "x"}], "completion": "c", "_source": "b:2"},
            "prompt_completion",
            r"b:2: field 'prompt'\[0\] must be",
        ),
        ({"prompt": [], "completion": "c", "_source": "b:3"}, "prompt_completion", r"b:3: field 'prompt' is an empty"),
        ({"question": "q", "answer": "a"}, "csv", r"unknown format 'csv'"),
    ],
)
def test_sft_errors_name_source_and_field(record, fmt, pattern):
    with pytest.raises(DataError, match=pattern):
        to_sft_example(record, fmt)


def test_hh_preference_example_splits_shared_prefix():
    ex = to_preference_example(HH_ROW)
    assert ex == {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        "chosen": "Why did the chicken...",
        "rejected": "No.",
        "_source": "hh.jsonl:3",
    }


def test_prompt_chosen_rejected_preference_example():
    ex = to_preference_example({"prompt": "2+2?", "chosen": "4", "rejected": "5"})
    assert ex == {"messages": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "5"}


@pytest.mark.parametrize(
    ("chosen", "rejected", "pattern"),
    [
        ("\n\nHuman: a\n\nAssistant: x", "\n\nHuman: b\n\nAssistant: y", r"do not share"),
        (
            "\n\nHuman: a\n\nAssistant: x\n\nHuman: more",
            "\n\nHuman: a\n\nAssistant: y",
            r"'chosen': the last turn is not",
        ),
        ("\n\nAssistant: x", "\n\nAssistant: y", r"must end with a Human turn"),
        ("preamble\n\nHuman: a\n\nAssistant: x", "\n\nHuman: a\n\nAssistant: y", r"'chosen' has text before"),
        ("no markers at all", "\n\nHuman: a\n\nAssistant: y", r"'chosen' has no"),
    ],
)
def test_unparsable_hh_dialogues(chosen, rejected, pattern):
    with pytest.raises(DialogueParseError, match=rf"hh:9: .*{pattern}"):
        to_preference_example({"chosen": chosen, "rejected": rejected, "_source": "hh:9"}, "hh_rlhf")


def test_preference_schema_errors_are_plain_data_errors():
    with pytest.raises(DataError, match=r"hh:1: field 'rejected' must be str") as info:
        to_preference_example(
            {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": None, "_source": "hh:1"}, "hh_rlhf"
        )
    assert not isinstance(info.value, DialogueParseError)
    with pytest.raises(DataError, match="has no preference pairs"):
        to_preference_example(GSM, "gsm8k")


def test_consecutive_same_role_turns_are_merged():
    turns = parse_hh_dialogue("\n\nHuman: a\n\nAssistant: b\n\nAssistant: c", "w", "chosen")
    assert turns == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\n\nc"}]


def test_eval_problem():
    assert to_eval_problem(GSM) == {
        "messages": [{"role": "user", "content": GSM["question"]}],
        "answer": "8",
        "_source": "f.jsonl:7",
    }
    assert to_eval_problem({"prompt": "p", "completion": "so #### 12"})["answer"] == "12"
    with pytest.raises(DataError, match=r"g:1: field 'answer' has no final answer"):
        to_eval_problem({"question": "q", "answer": "no marker", "_source": "g:1"})
    with pytest.raises(DataError, match="no verifiable answers"):
        to_eval_problem(HH_ROW)


@pytest.mark.parametrize(
    ("record", "field"),
    [
        ({"question": "q", "answer": "36+36=72\n#### seventy-two"}, "answer"),
        ({"prompt": "q", "completion": "so #### 72 apples"}, "completion"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "#### n/a"}]}, "messages"),
    ],
)
def test_eval_answer_that_is_not_a_number_is_refused(record, field):
    """Evaluation extracts a number from what the model writes and compares it numerically, so a
    gold ``#### seventy-two`` could never match: refused as the eval file is read, naming the
    record's source and the field (GSM8K's answers are all numbers)."""
    with pytest.raises(
        DataError,
        match=rf"^e.jsonl:3: field '{field}': the final answer after '####' is '[^']+', "
        "not a number",
    ):
        to_eval_problem({**record, "_source": "e.jsonl:3"})


def test_is_verifiable_answer():
    assert all(is_verifiable_answer(a) for a in ("72", "1,072", "-4", "0.5", "$ 5.", "1e3"))
    assert not any(is_verifiable_answer(a) for a in ("seventy-two", "72apples", "18%", "NaN", "Infinity", "", None))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x\n#### 72", "72"),
        ("#### 1,000", "1000"),
        ("a #### 3 #### $ 5.", "5"),
        ("#### -4\nextra line", "-4"),
        ("#### 0.5", "0.5"),
        ("no marker 5", None),
        ("####   ", None),
    ],
)
def test_final_answer(text, expected):
    assert final_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Tom has 3+5=<<3+5=8>>8 apples.\n#### 8<|end|>", "8"),
        ("#### 1,234 apples", "1234"),
        ("so 3 plus 4 is 7.", "7"),
        ("it is -2.50 dollars", "-2.50"),
        ("#### none, but 12 before", "12"),
        ("no digits here", None),
    ],
)
def test_extract_generated_answer(text, expected):
    assert extract_generated_answer(text) == expected


@pytest.mark.parametrize(
    ("pred", "gold", "match"),
    [
        ("72", "72", True),
        ("72.0", "72", True),
        ("1,000", "1000", True),
        ("$5.", "5", True),
        ("7", "8", False),
        (None, "8", False),
        ("abc", "abc", True),
        ("abc", "abd", False),
        ("0.50", "0.5", True),
    ],
)
def test_answers_match(pred, gold, match):
    assert answers_match(pred, gold) is match


@needs_shared_data
def test_real_gsm8k_rows():
    records = read_records(DataSource(uri=str(GSM8K), max_rows=5))
    examples = [to_sft_example(r) for r in records]
    assert examples[0]["answer"] == "72" and examples[0]["completion"].endswith("#### 72")
    assert examples[0]["prompt"].startswith("Natalia sold clips")
    assert [to_eval_problem(r)["answer"] for r in records] == [ex["answer"] for ex in examples]
    assert all(ex["answer"] is not None and answers_match(ex["answer"], ex["answer"]) for ex in examples)


@needs_shared_data
def test_real_hh_row_prefix_split():
    (record,) = read_records(DataSource(uri=str(HH), max_rows=1))
    ex = to_preference_example(record)
    assert [m["role"] for m in ex["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert ex["messages"][0]["content"] == "what are some pranks with a pen i can do?"
    assert ex["messages"][-1]["content"] == "okay some of these do not have anything to do with pens"
    assert ex["chosen"].startswith("No, sorry!  All of these involve a pen")
    assert ex["rejected"].startswith("There are lots of funny things you can do with pens")
    assert record["chosen"].endswith(ex["chosen"]) and record["rejected"].endswith(ex["rejected"])


@needs_shared_data
def test_every_real_hh_row_parses():
    records = read_records(DataSource(uri=str(HH)))
    examples = [to_preference_example(r, "hh_rlhf") for r in records]
    assert len(examples) == 2000
    assert all(ex["messages"][-1]["role"] == "user" for ex in examples)


def test_the_tools_column_declares_a_conversations_tools():
    """``tools``: function schemas as a list or a JSON string of one, a bare ``{"name", ...}``
    wrapped as ``{"type": "function", "function": ...}``; bad ones name the item."""
    schema = {"name": "add", "parameters": {"type": "object"}}
    record = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}
    assert "tools" not in to_sft_example(record) and "tools" not in to_sft_example({**record, "tools": []})
    want = [{"type": "function", "function": schema}]
    assert to_sft_example({**record, "tools": [schema]})["tools"] == want
    assert to_sft_example({**record, "tools": json.dumps(want)})["tools"] == want
    for tools, why in [
        ({"name": "add"}, "expected a list of function schemas, got dict"),
        ([{"function": {}}], r"'tools'\[0\] must be"),
        (["add"], r"'tools'\[0\] must be"),
        ("[not json", "'tools': invalid JSON"),
        ('{"name": "add"}', "expected a list of function schemas"),
    ]:
        with pytest.raises(DataError, match=why):
            to_sft_example({**record, "tools": tools})
