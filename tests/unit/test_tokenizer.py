"""Tokenizer training, save/reload, chat template, and encode_chat's loss mask and truncation."""

from __future__ import annotations

import os
import uuid

import pytest
import transformers

from trainer_core import storage
from trainer_core.data.synthetic import make_sft_records
from trainer_core.data.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    encode_chat,
    load_tokenizer,
    render_chat,
    train_tokenizer,
)
from trainer_core.errors import ConfigError, DataError

CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""A Qwen-style ChatML template (eos = <|im_end|>), for a non-native chat format."""


def _conversation(r: dict) -> list[dict[str, str]]:
    return [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return make_sft_records(400, 0, 20)


@pytest.fixture(scope="module")
def tok(records):
    return train_tokenizer((render_chat(_conversation(r)) for r in records), vocab_size=600, min_frequency=2)


def test_special_tokens_padding_and_template(tok):
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS.values())) == [0, 1, 2, 3, 4]
    assert (tok.pad_token, tok.pad_token_id, tok.eos_token, tok.eos_token_id) == ("<|pad|>", 0, "<|end|>", 1)
    assert tok.padding_side == "right" and tok.chat_template == CHAT_TEMPLATE
    assert 256 + len(SPECIAL_TOKENS) < len(tok) <= 600
    # special tokens are atomic and never part of a learned merge
    assert {t for t in tok.get_vocab() if "<|" in t or "|>" in t} == set(SPECIAL_TOKENS.values())
    assert tok.convert_ids_to_tokens(tok("<|user|>\nhi<|end|>", add_special_tokens=False)["input_ids"])[0] == "<|user|>"


def test_byte_level_round_trip_of_unseen_text(tok):
    text = "Tom has 3 apples. Zoë paid 12€ — ok? 😀\n\tdone"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok("", add_special_tokens=False)["input_ids"] == []


def test_chat_template_rendering(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    expected = "<|system|>\nBe brief.<|end|>\n<|user|>\n2+2?<|end|>\n"
    assert tok.apply_chat_template(msgs, tokenize=False) == expected == render_chat(msgs)
    gen = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert gen == expected + "<|assistant|>\n" == render_chat(msgs, add_generation_prompt=True)
    with pytest.raises(DataError, match="unknown chat role: function"):
        render_chat([{"role": "function", "content": "x"}])


def test_save_and_reload_with_auto_tokenizer(tok, tmp_path, records):
    tok.save_pretrained(tmp_path)
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = render_chat(_conversation(records[0]))
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert (again.pad_token_id, again.eos_token_id, again.padding_side) == (0, 1, "right")
    assert again.chat_template == CHAT_TEMPLATE
    loaded = load_tokenizer(str(tmp_path))
    msgs = _conversation(records[1])[:1]
    assert encode_chat(loaded, msgs, "x", 64, 32) == encode_chat(tok, msgs, "x", 64, 32)


def test_load_tokenizer_from_memory_uri(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    base = f"memory://tok-{uuid.uuid4().hex}"
    for name in os.listdir(tmp_path):
        storage.upload_file(str(tmp_path / name), f"{base}/{name}")
    storage.write_bytes(f"{base}/model.safetensors", b"not needed for a tokenizer")
    loaded = load_tokenizer(base)
    assert loaded("Tom has 3 apples")["input_ids"] == tok("Tom has 3 apples")["input_ids"]


def test_load_tokenizer_sets_pad_and_template_when_missing(tok, tmp_path):
    bare = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<|end|>")
    assert bare.pad_token is None and not bare.chat_template
    bare.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token == "<|end|>"
    assert loaded.chat_template == CHAT_TEMPLATE


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))


def test_train_tokenizer_needs_texts():
    with pytest.raises(DataError, match="no training texts"):
        train_tokenizer([], 300, 2)


def test_encode_chat_masks_only_the_completion(tok, records):
    r = records[0]
    msgs = [{"role": "user", "content": r["question"]}]
    enc = encode_chat(tok, msgs, r["answer"], max_length=256, max_prompt_length=192)
    ids, mask = enc["input_ids"], enc["loss_mask"]
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    num_prompt = mask.index(1)
    assert all(mask[num_prompt:]) and not any(mask[:num_prompt])  # one prompt block, then the completion
    assert tok.decode(ids[:num_prompt]) == render_chat(msgs, add_generation_prompt=True)
    assert tok.decode(ids[num_prompt:]) == r["answer"] + "<|end|>\n"
    assert tok.eos_token_id in ids[num_prompt:]
    assert ids == tok(render_chat(_conversation(r)), add_special_tokens=False)["input_ids"]


def test_encode_chat_truncation(tok, records):
    msgs = [{"role": "user", "content": " ".join(r["question"] for r in records[:5])}]
    full = encode_chat(tok, msgs, records[0]["answer"], max_length=4096, max_prompt_length=4000)
    num_prompt = full["loss_mask"].index(1)
    enc = encode_chat(tok, msgs, records[0]["answer"], max_length=48, max_prompt_length=20)
    assert len(enc["input_ids"]) == 48
    assert enc["input_ids"][:20] == full["input_ids"][num_prompt - 20 : num_prompt]  # the LAST prompt tokens
    assert enc["input_ids"][20:] == full["input_ids"][num_prompt : num_prompt + 28]  # completion cut to fit
    assert enc["loss_mask"] == [0] * 20 + [1] * 28
    truncated: dict[str, int] = {}
    assert encode_chat(tok, msgs, records[0]["answer"], 48, 20, truncated=truncated) == enc
    assert encode_chat(tok, msgs, records[0]["answer"], 4096, 20, truncated=truncated)["loss_mask"].count(1) > 28
    assert encode_chat(tok, msgs, records[0]["answer"], 4096, 4000, truncated=truncated) == full
    assert truncated == {"prompt": 2, "completion": 1}  # counted only when something was cut


def test_encode_chat_prompt_only(tok):
    msgs = [{"role": "user", "content": "Tom has 3 apples."}]
    enc = encode_chat(tok, msgs, None, max_length=64, max_prompt_length=8)
    full = tok(render_chat(msgs, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    assert enc == {"input_ids": full[-8:], "loss_mask": [0] * 8}
    assert tok.decode(enc["input_ids"]).endswith("<|assistant|>\n")


def test_encode_chat_bad_limits(tok):
    with pytest.raises(ConfigError, match="max_prompt_length < max_length"):
        encode_chat(tok, [{"role": "user", "content": "x"}], "y", max_length=8, max_prompt_length=8)


def test_encode_chat_with_a_chatml_tokenizer(tok, tmp_path):
    """Any HF chat tokenizer: a ChatML template whose eos is <|im_end|>."""
    backend = train_tokenizer(["<|im_start|>user\nhello<|im_end|>\n"] * 4, 300, 1).backend_tokenizer
    chatml = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    chatml.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    chatml.chat_template = CHATML
    enc = encode_chat(chatml, [{"role": "user", "content": "hello"}], "hi there", 64, 32)
    num_prompt = enc["loss_mask"].index(1)
    assert chatml.decode(enc["input_ids"][:num_prompt]) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert chatml.decode(enc["input_ids"][num_prompt:]) == "hi there<|im_end|>\n"


def test_template_that_is_not_prefix_stable_is_rejected(tok):
    odd = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<|end|>")
    odd.chat_template = CHAT_TEMPLATE.replace("'<|assistant|>\\n'", "'<|assistant|>\\nThinking...'")
    with pytest.raises(ConfigError, match="does not start with the rendered prompt"):
        encode_chat(odd, [{"role": "user", "content": "x"}], "y", 64, 32)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tom has 3 apples."},
    {"role": "assistant", "content": "3+2=5"},
    {"role": "user", "content": "And then?"},
]


def test_encode_chat_counts_every_assistant_turn(tok):
    """``assistant_turns="all"``: the earlier reply's text and end of turn are counted, as the final
    completion's are; headers, system and user turns are not. The ids are those of the whole
    rendering, and ``"last"`` counts the final reply alone."""
    enc = encode_chat(tok, CONVERSATION, "7", max_length=128, max_prompt_length=96, assistant_turns="all")
    ids, mask = enc["input_ids"], enc["loss_mask"]
    whole = render_chat(CONVERSATION + [{"role": "assistant", "content": "7"}])
    assert ids == tok(whole, add_special_tokens=False)["input_ids"]
    counted = [tok.decode([i]) for i, m in zip(ids, mask) if m]
    assert "".join(counted) == "3+2=5<|end|>\n" + "7<|end|>\n"
    spans = [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]]
    assert len(spans) == 3  # counted, not, counted to the end
    assert tok.decode(ids[: spans[0]]) == render_chat(CONVERSATION[:2], add_generation_prompt=True)
    last = encode_chat(tok, CONVERSATION, "7", max_length=128, max_prompt_length=96)
    assert last["input_ids"] == ids
    assert "".join(tok.decode([i]) for i, m in zip(ids, last["loss_mask"]) if m) == "7<|end|>\n"


CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3+2"}}}
TOOL_CONVERSATION = [
    {"role": "user", "content": "Tom has 3 apples and gets 2."},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "calculator", "content": "5"},
]


def test_encode_chat_never_counts_a_tool_output(tok):
    """A tool conversation with ``assistant_turns="all"``: the assistant's tool call (its text and
    end of turn) and the final reply are counted, the tool's output (a user turn holding
    ``<tool_response>``) is not; the ids are those of the whole rendering, which transformers'
    own rendering of the template equals (``tojson`` included: nothing HTML-escaped)."""
    enc = encode_chat(tok, TOOL_CONVERSATION, "He has 5.", 256, 192, assistant_turns="all")
    ids, mask = enc["input_ids"], enc["loss_mask"]
    whole = render_chat(TOOL_CONVERSATION + [{"role": "assistant", "content": "He has 5."}])
    assert whole == tok.apply_chat_template(
        TOOL_CONVERSATION + [{"role": "assistant", "content": "He has 5."}], tokenize=False
    )
    assert ids == tok(whole, add_special_tokens=False)["input_ids"]
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+2"}}\n</tool_call><|end|>\n'
    assert "".join(tok.decode([i]) for i, m in zip(ids, mask) if m) == call + "He has 5.<|end|>\n"
    response = "<|user|>\n<tool_response>\n5\n</tool_response><|end|>\n"
    assert response in whole and response not in "".join(tok.decode([i]) for i, m in zip(ids, mask) if m)
    assert render_chat([{"role": "assistant", "content": "a", "tool_calls": [CALL, CALL]}]).count("\n<tool_call>") == 2


def test_encode_chat_all_turns_truncates_the_prompt_from_the_left(tok):
    """A cut prompt keeps its last tokens and their mask: the earlier reply stays counted."""
    full = encode_chat(tok, CONVERSATION, "7", 128, 96, assistant_turns="all")
    num_prompt = len(full["input_ids"]) - full["loss_mask"][::-1].index(0)
    cut = encode_chat(tok, CONVERSATION, "7", 128, 16, assistant_turns="all")
    assert cut["input_ids"][:16] == full["input_ids"][num_prompt - 16 : num_prompt]
    assert cut["loss_mask"][:16] == full["loss_mask"][num_prompt - 16 : num_prompt]
    assert any(cut["loss_mask"][:16])


def test_encode_chat_all_turns_refuses_a_template_that_drops_earlier_replies(tok):
    """A template that renders only the last assistant reply (as reasoning templates drop earlier
    thinking) cannot count every turn: a ConfigError naming the turn and the way out."""
    dropping = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<|end|>")
    dropping.chat_template = CHAT_TEMPLATE.replace(
        "message['content']", "(message['content'] if message['role'] != 'assistant' or loop.last else '')"
    )
    with pytest.raises(ConfigError, match=r"assistant turn 2 \(messages\[2\]\).*data.assistant_turns to 'last'"):
        encode_chat(dropping, CONVERSATION, "7", 128, 96, assistant_turns="all")
    with pytest.raises(ValueError, match="assistant_turns must be 'last' or 'all'"):
        encode_chat(tok, CONVERSATION, "7", 128, 96, assistant_turns="every")


def test_synthetic_answers_are_short(records):
    texts = [render_chat(_conversation(r)) for r in make_sft_records(2000, 1, 20)]
    tok = train_tokenizer(texts, vocab_size=2048, min_frequency=2)
    lengths = [len(tok(r["answer"], add_special_tokens=False)["input_ids"]) for r in records]
    assert max(lengths) <= 70 and sum(lengths) / len(lengths) < 50
