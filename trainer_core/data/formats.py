"""Adapters from raw record formats to the canonical examples the trainers read.

Formats (``DataSource.format``):

- ``prompt_completion``: ``{"prompt", "completion"}`` for SFT, ``{"prompt", "chosen", "rejected"}``
  for preference pairs. ``prompt`` is a string (one user turn) or a list of
  ``{"role", "content"}`` messages; ``completion``, ``chosen`` and ``rejected`` a string or a list
  of one assistant message (TRL's conversational prompt-completion and explicit-prompt
  preference formats).
- ``gsm8k``: ``{"question", "answer"}``; the answer is a worked solution ending in
  ``#### <number>`` (Cobbe et al. 2021, https://github.com/openai/grade-school-math).
- ``hh_rlhf``: ``{"chosen", "rejected"}``, each a whole dialogue of ``\\n\\nHuman: ...`` /
  ``\\n\\nAssistant: ...`` turns that share all but the last assistant reply (Bai et al. 2022,
  https://github.com/anthropics/hh-rlhf).
- ``kto``: ``{"prompt", "completion", "label"}``, one unpaired example; ``label`` true for a
  desirable completion, false for an undesirable one (TRL's unpaired preference format; prompt
  and completion as in ``prompt_completion``).
- ``messages``: ``{"messages": [{"role", "content"}, ...]}``, a conversation ending in an
  assistant turn (the chat format of Hugging Face datasets and TRL): for SFT the last assistant
  turn is the completion and the turns before it the prompt (earlier assistant replies counted
  in the loss with ``data.assistant_turns: all``; ``tool`` turns never), ending in a text reply;
  for evaluation its final answer is the answer. Messages may call tools (:data:`ROLES`).
  A preference pair as two such conversations, ``{"chosen": [...], "rejected": [...]}``, that
  share every turn but the last assistant reply (TRL's implicit-prompt conversational preference
  format); for KTO each side is one example.
- ``text``: raw text for continued pretraining, in a record field (``text`` unless the source
  names another), or one line of a plain-text file.

Canonical examples:

- SFT: ``{"prompt": str, "completion": str, "messages": [...], "answer": str | None}``;
  ``messages`` are the prompt turns as chat messages.
- preference: ``{"messages": [...], "chosen": str, "rejected": str}``.
- eval problem: ``{"messages": [...], "answer": str}``.
- KTO: ``{"messages": [...], "completion": str, "label": bool}``.
- text: ``{"text": str}``.

Each carries the input's ``"_source"`` (``file:line``) when it had one. Every error is a
:class:`~trainer_core.errors.DataError` naming that source and the offending field.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from trainer_core.data.tools import declared_tools, tool_call
from trainer_core.errors import DataError

FORMATS = ("prompt_completion", "gsm8k", "hh_rlhf", "kto", "messages", "text")
"""Concrete record formats (``"auto"`` resolves to one of these)."""

ROLES = ("system", "user", "assistant", "tool")
"""Chat roles a message may have. A ``tool`` message (a tool's output; optional ``name`` and
``tool_call_id`` strings) is never counted in a loss; an assistant message may carry
``tool_calls``, ``[{"type": "function", "function": {"name": str, "arguments": dict or JSON
string}}]`` (the chat format of transformers' templates), with empty or no ``content``."""

_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_HH_ROLE = {"Human": "user", "Assistant": "assistant"}
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


class DialogueParseError(DataError):
    """A field has the right type but its content cannot be parsed (e.g. an HH dialogue whose
    chosen and rejected versions do not share a prompt). Data-set noise rather than a schema
    error: callers may skip such a record and count it."""


def _where(record: dict) -> str:
    return str(record.get("_source", "<record>"))


def _field(record: dict, name: str, kind: type | tuple[type, ...] = str) -> Any:
    """``record[name]``, checked to be of type ``kind``."""
    if name not in record:
        keys = sorted(k for k in record if k != "_source")
        raise DataError(f"{_where(record)}: missing field '{name}' (record has {keys})")
    value = record[name]
    if not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise DataError(f"{_where(record)}: field '{name}' must be {want}, got {type(value).__name__}")
    return value


def _with_source(example: dict, record: dict) -> dict:
    if "_source" in record:
        example["_source"] = record["_source"]
    return example


def detect_format(record: dict) -> str:
    """The format of ``record`` from its keys.

    Returns:
        ``"gsm8k"`` (``question`` + ``answer``), ``"kto"`` (``prompt`` + ``completion`` +
        a boolean ``label``), ``"prompt_completion"`` (``prompt`` + ``completion``, or ``prompt`` +
        ``chosen`` + ``rejected``), ``"hh_rlhf"`` (``chosen`` + ``rejected`` without ``prompt``),
        ``"messages"`` (``messages``) or ``"text"`` (``text`` alone).

    Raises:
        DataError: the keys match no known format.
    """
    keys = set(record)
    if {"question", "answer"} <= keys:
        return "gsm8k"
    if {"prompt", "completion", "label"} <= keys and isinstance(record["label"], bool):
        return "kto"
    if "prompt" in keys and ("completion" in keys or {"chosen", "rejected"} <= keys):
        return "prompt_completion"
    if {"chosen", "rejected"} <= keys:
        return "messages" if isinstance(record["chosen"], list) else "hh_rlhf"
    if "messages" in keys:
        return "messages"
    if "text" in keys:
        return "text"
    shown = sorted(k for k in keys if k != "_source")
    raise DataError(
        f"{_where(record)}: cannot detect the record format from fields {shown}; expected "
        "question/answer (gsm8k), prompt/completion or prompt/chosen/rejected (prompt_completion), "
        "chosen/rejected dialogues (hh_rlhf), prompt/completion/label (kto), messages or chosen/rejected message "
        "lists (messages) or text (text)"
    )


def _resolve(record: dict, fmt: str) -> str:
    if not isinstance(record, dict):
        raise DataError(f"expected a record dict, got {type(record).__name__}")
    if fmt == "auto":
        return detect_format(record)
    if fmt not in FORMATS:
        raise DataError(f"{_where(record)}: unknown format {fmt!r}; expected one of {FORMATS} or 'auto'")
    return fmt


def _prompt_messages(record: dict, name: str = "prompt") -> list[dict[str, str]]:
    """The ``name`` field as chat messages (a string is one user turn)."""
    prompt = _field(record, name, (str, list))
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not prompt:
        raise DataError(f"{_where(record)}: field '{name}' is an empty message list")
    return [_message(record, f"{name}'[{i}]", m) for i, m in enumerate(prompt)]


def _message(record: dict, where: str, m: Any) -> dict[str, Any]:
    """One chat message, checked: role and content, and (see :data:`ROLES`) an assistant's
    ``tool_calls`` (JSON-string arguments parsed) or a tool's ``name`` / ``tool_call_id``.

    Raises:
        DataError: naming the source and ``field'[i]`` (``where``).
    """
    calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
    content = m.get("content") if isinstance(m, dict) else None
    if calls and content is None:
        content = ""
    if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(content, str)):
        raise DataError(
            f"{_where(record)}: field '{where} must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}"
        )
    message: dict[str, Any] = {"role": m["role"], "content": content}
    if calls:
        message["tool_calls"] = [
            tool_call(c, f"{_where(record)}: field '{where}['tool_calls'][{j}]") for j, c in enumerate(calls)
        ]
    if m["role"] == "tool":
        message |= {k: m[k] for k in ("name", "tool_call_id") if isinstance(m.get(k), str)}
    return message


def _conversation(record: dict, name: str = "messages") -> tuple[list[dict[str, str]], str]:
    """(the turns before the last, the last assistant reply) of the conversation in field ``name``.

    Raises:
        DataError: the field is not a list of messages, does not end in an assistant turn, or
            has no turn before it.
    """
    if not isinstance(record.get(name), list):
        _field(record, name, list)
    messages = _prompt_messages(record, name)
    if messages[-1]["role"] != "assistant":
        raise DataError(
            f"{_where(record)}: field '{name}' must end with an assistant turn, got role {messages[-1]['role']!r} last"
        )
    if len(messages) < 2:
        raise DataError(f"{_where(record)}: field '{name}' has no turn before its assistant reply")
    if "tool_calls" in messages[-1]:
        raise DataError(
            f"{_where(record)}: field '{name}' ends with a tool call; the last assistant turn (the "
            "completion) must be text"
        )
    return messages[:-1], messages[-1]["content"]


def _reply(record: dict, name: str) -> str:
    """The ``name`` field as one reply: a string, or a list of exactly one assistant message
    (TRL's conversational completions), whose content it returns.

    Raises:
        DataError: another type, or a list that is not one assistant message.
    """
    value = _field(record, name, (str, list))
    if isinstance(value, str):
        return value
    if len(value) != 1:
        raise DataError(f"{_where(record)}: field '{name}' must hold one assistant message, got {len(value)} messages")
    message = _prompt_messages(record, name)[0]
    if message["role"] != "assistant":
        raise DataError(
            f"{_where(record)}: field '{name}' must hold an assistant message, got role {message['role']!r}"
        )
    return message["content"]


def _conversation_pair(record: dict) -> dict:
    """``{"messages", "chosen", "rejected"}`` of two conversations sharing all but their last reply.

    Raises:
        DataError: a side is not a conversation ending in an assistant reply (as
            :func:`_conversation`), or the two differ before it.
    """
    (prompt, chosen), (rejected_prompt, rejected) = _conversation(record, "chosen"), _conversation(record, "rejected")
    if rejected_prompt != prompt:
        raise DataError(
            f"{_where(record)}: fields 'chosen'/'rejected' do not share all turns but the last assistant reply"
        )
    return {"messages": prompt, "chosen": chosen, "rejected": rejected}


def messages_to_text(messages: list[dict[str, Any]]) -> str:
    """Plain-text rendering of chat messages (``Role: content`` paragraphs; a tool call as
    ``[name(arguments)]``), for display."""

    def text(m: dict[str, Any]) -> str:
        calls = [
            f"[{c['function']['name']}({json.dumps(c['function']['arguments'])})]" for c in m.get("tool_calls", [])
        ]
        return " ".join(t for t in (m["content"], *calls) if t)

    return "\n\n".join(f"{m['role'].capitalize()}: {text(m)}" for m in messages)


def parse_hh_dialogue(text: str, where: str, field: str) -> list[dict[str, str]]:
    """Split an HH-RLHF dialogue into chat messages.

    Turns start at ``\\n\\nHuman:`` / ``\\n\\nAssistant:``; content is stripped; consecutive turns
    of the same role (a few HH rows have them) are merged, joined by a blank line.

    Raises:
        DialogueParseError: no turns at all, or text before the first marker.
    """
    parts = _HH_TURN.split(text)
    if len(parts) < 3:
        raise DialogueParseError(f"{where}: field '{field}' has no '\\n\\nHuman:'/'\\n\\nAssistant:' turns")
    if parts[0].strip():
        raise DialogueParseError(f"{where}: field '{field}' has text before the first 'Human:'/'Assistant:' turn")
    messages: list[dict[str, str]] = []
    for i in range(1, len(parts), 2):
        role, content = _HH_ROLE[parts[i]], parts[i + 1].strip()
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{content}".strip()
        else:
            messages.append({"role": role, "content": content})
    return messages


def _hh_pair(record: dict) -> dict:
    where = _where(record)
    chosen = parse_hh_dialogue(_field(record, "chosen"), where, "chosen")
    rejected = parse_hh_dialogue(_field(record, "rejected"), where, "rejected")
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        if turns[-1]["role"] != "assistant":
            raise DialogueParseError(f"{where}: field '{name}': the last turn is not an assistant reply")
    prompt = chosen[:-1]
    if prompt != rejected[:-1]:
        raise DialogueParseError(
            f"{where}: fields 'chosen'/'rejected' do not share all turns but the last assistant reply"
        )
    if not prompt or prompt[-1]["role"] != "user":
        raise DialogueParseError(f"{where}: field 'chosen': the prompt turns must end with a Human turn")
    return {"messages": prompt, "chosen": chosen[-1]["content"], "rejected": rejected[-1]["content"]}


def to_sft_example(record: dict, fmt: str = "auto") -> dict:
    """Canonical SFT example ``{"prompt", "completion", "messages", "answer"}`` (messages: plus
    ``"tools"`` when the record declares tools, :func:`~trainer_core.data.tools.declared_tools`).

    gsm8k: prompt = question, completion = the whole worked answer (``#### n`` included),
    answer = :func:`final_answer` of it. prompt_completion: answer = :func:`final_answer` of the
    completion (None without ``####``). hh_rlhf: the shared dialogue is the prompt, the chosen
    reply the completion, answer None. messages: the last assistant turn is the completion, the
    turns before it the prompt (``prompt`` their text rendering), answer as prompt_completion.

    Raises:
        DataError: unknown format, missing field or wrong type (names the source and field);
            :class:`DialogueParseError` for an unparsable HH dialogue.
    """
    fmt = _resolve(record, fmt)
    if fmt == "gsm8k":
        question, answer = _field(record, "question"), _field(record, "answer")
        messages = [{"role": "user", "content": question}]
        example = {"prompt": question, "completion": answer, "messages": messages, "answer": final_answer(answer)}
    elif fmt == "prompt_completion":
        messages = _prompt_messages(record)
        completion = _reply(record, "completion")
        example = {
            "prompt": messages_to_text(messages) if len(messages) > 1 else messages[0]["content"],
            "completion": completion,
            "messages": messages,
            "answer": final_answer(completion),
        }
    elif fmt == "hh_rlhf" or (fmt == "messages" and "messages" not in record and "chosen" in record):
        pair = _hh_pair(record) if fmt == "hh_rlhf" else _conversation_pair(record)
        example = {
            "prompt": messages_to_text(pair["messages"]),
            "completion": pair["chosen"],
            "messages": pair["messages"],
            "answer": None,
        }
    elif fmt == "messages":
        messages, completion = _conversation(record)
        example = {
            "prompt": messages_to_text(messages) if len(messages) > 1 else messages[0]["content"],
            "completion": completion,
            "messages": messages,
            "answer": final_answer(completion),
        }
        if tools := declared_tools(record.get("tools"), f"{_where(record)}: field 'tools'"):
            example["tools"] = tools
    else:
        raise DataError(f"{_where(record)}: format {fmt!r} has no SFT examples (prompt and completion)")
    return _with_source(example, record)


def to_preference_example(record: dict, fmt: str = "auto") -> dict:
    """Canonical preference pair ``{"messages", "chosen", "rejected"}``.

    hh_rlhf: both dialogues are parsed into turns; the shared prefix (ending with a Human turn)
    is the prompt and the two final assistant replies are chosen / rejected.
    prompt_completion: ``{"prompt", "chosen", "rejected"}``, the replies strings or one
    assistant message each. messages: ``{"chosen": [...], "rejected": [...]}`` conversations
    sharing all turns but the last assistant reply.

    Raises:
        DataError: unknown or SFT-only format, missing field or wrong type, conversations that
            do not share their turns before the last reply;
            :class:`DialogueParseError` when the dialogues do not share a prompt or do not end
            with an assistant reply.
    """
    fmt = _resolve(record, fmt)
    if fmt == "hh_rlhf":
        pair = _hh_pair(record)
    elif fmt == "prompt_completion":
        pair = {
            "messages": _prompt_messages(record),
            "chosen": _reply(record, "chosen"),
            "rejected": _reply(record, "rejected"),
        }
    elif fmt == "messages" and "messages" not in record:
        pair = _conversation_pair(record)
    else:
        raise DataError(f"{_where(record)}: format {fmt!r} has no preference pairs (fields 'chosen'/'rejected')")
    return _with_source(pair, record)


def to_kto_examples(record: dict, fmt: str = "auto") -> list[dict]:
    """Canonical unpaired KTO examples ``{"messages", "completion", "label"}`` of one record.

    kto: the record's one example (``label`` must be a JSON boolean). Preference pairs
    (prompt_completion with chosen/rejected, hh_rlhf, messages as chosen/rejected
    conversations) give two examples, as TRL's
    ``unpair_preference_dataset``: the chosen completion desirable (``label`` True), the rejected
    one undesirable.

    Raises:
        DataError: a format without preference labels, a missing field or a wrong type (names the
            source and field); :class:`DialogueParseError` for an unparsable HH dialogue.
    """
    fmt = _resolve(record, fmt)
    if fmt == "kto":
        example = {
            "messages": _prompt_messages(record),
            "completion": _reply(record, "completion"),
            "label": _field(record, "label", bool),
        }
        return [_with_source(example, record)]
    if fmt not in ("prompt_completion", "hh_rlhf", "messages"):
        raise DataError(
            f"{_where(record)}: format {fmt!r} has no desirable/undesirable labels (kto records or "
            "chosen/rejected pairs)"
        )
    pair = to_preference_example(record, fmt)
    return [
        _with_source({"messages": pair["messages"], "completion": pair[side], "label": side == "chosen"}, record)
        for side in ("chosen", "rejected")
    ]


def to_text_example(record: dict, fmt: str = "auto", field: str = "text") -> dict:
    """Canonical raw-text document ``{"text"}`` of one record, for continued pretraining.

    text (and ``auto`` when the record has ``field``): the record's ``field``. gsm8k: question and
    worked answer, one per line;
    prompt_completion with a completion: prompt and completion likewise (a prompt given as
    messages is rendered by :func:`messages_to_text`).

    Raises:
        DataError: a missing field or a wrong type (names the source and field), or a format
            without a text rendering (preference pairs, kto).
    """
    if fmt == "text" or (fmt == "auto" and field in record):
        return _with_source({"text": _field(record, field)}, record)
    fmt = _resolve(record, fmt)
    if fmt == "gsm8k":
        return _with_source({"text": f"{_field(record, 'question')}\n{_field(record, 'answer')}"}, record)
    if fmt == "prompt_completion" and "completion" in record:
        messages = _prompt_messages(record)
        prompt = messages[0]["content"] if len(messages) == 1 else messages_to_text(messages)
        return _with_source({"text": f"{prompt}\n{_reply(record, 'completion')}"}, record)
    raise DataError(
        f"{_where(record)}: format {fmt!r} has no raw-text rendering (use text, gsm8k or prompt/completion records)"
    )


def to_eval_problem(record: dict, fmt: str = "auto") -> dict:
    """Canonical eval problem ``{"messages", "answer"}`` with a verifiable final answer.

    gsm8k: the question and the number after ``####``. prompt_completion: the prompt and the
    final answer of the completion (which must contain ``#### n``). messages: the turns before
    the last assistant reply, and that reply's final answer. The final answer must be a number
    (:func:`is_verifiable_answer`): evaluation extracts a number from what the model writes, so
    no other answer could ever match.

    Raises:
        DataError: missing field, wrong type, no ``#### <answer>`` in the answer/completion, or
            a final answer that is not a number (``#### seventy-two``); each names the source and
            the field.
    """
    fmt = _resolve(record, fmt)
    if fmt == "gsm8k":
        messages, field = [{"role": "user", "content": _field(record, "question")}], "answer"
        reply = _field(record, field)
    elif fmt == "prompt_completion":
        messages, field = _prompt_messages(record), "completion"
        reply = _reply(record, field)
    elif fmt == "messages":
        (messages, reply), field = _conversation(record), "messages"
    else:
        raise DataError(f"{_where(record)}: format {fmt!r} has no verifiable answers for evaluation")
    answer = final_answer(reply)
    if answer is None:
        raise DataError(f"{_where(record)}: field '{field}' has no final answer after '####'")
    if not is_verifiable_answer(answer):
        raise DataError(
            f"{_where(record)}: field '{field}': the final answer after '####' is {answer!r}, not a "
            "number; exact-match evaluation compares the number a model writes with it, so it could "
            "never match (write the number alone, e.g. '#### 72')"
        )
    return _with_source({"messages": messages, "answer": answer}, record)


def normalize_answer(text: str) -> str:
    """Strip whitespace, remove commas, spaces and ``$``, drop one trailing ``.``."""
    out = re.sub(r"[\s,$]", "", text)
    return out[:-1] if out.endswith(".") else out


def final_answer(text: str) -> str | None:
    """The normalised answer after the last ``####`` (its first line), or None if absent/empty.

    >>> final_answer("48+24=<<48+24=72>>72\\n#### 1,072")
    '1072'
    """
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    answer = normalize_answer(tail.split("\n", 1)[0]) if tail else ""
    return answer or None


def extract_generated_answer(text: str) -> str | None:
    """The answer a model wrote: the first number after the last ``####``, else the last number.

    Returns:
        The normalised number, or None when the text holds no number.
    """
    if "####" in text:
        found = _NUMBER.search(text.rsplit("####", 1)[1])
        if found:
            return normalize_answer(found.group())
    numbers = _NUMBER.findall(text)
    return normalize_answer(numbers[-1]) if numbers else None


def _as_number(text: str) -> Decimal | None:
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def is_verifiable_answer(answer: str | None) -> bool:
    """Whether a gold answer can ever match a generated one: a finite number after
    :func:`normalize_answer` (``"1,072"``, ``"-4"``, ``"0.5"``), as :func:`extract_generated_answer`
    only ever gives numbers and :func:`answers_match` compares them numerically.

    >>> is_verifiable_answer("1,072"), is_verifiable_answer("seventy-two")
    (True, False)
    """
    return answer is not None and _as_number(normalize_answer(answer)) is not None


def answers_match(pred: str | None, gold: str | None) -> bool:
    """Whether ``pred`` equals ``gold`` after :func:`normalize_answer`; numerically when both
    are numbers (``"72.0"`` matches ``"72"``). None never matches."""
    if pred is None or gold is None:
        return False
    p, g = normalize_answer(pred), normalize_answer(gold)
    pn, gn = _as_number(p), _as_number(g)
    if pn is not None and gn is not None:
        return pn == gn
    return p == g
