"""Tokenizers: train a small byte-level BPE, load a pretrained one, encode chats with a loss mask.

:func:`encode_chat` works with any Hugging Face tokenizer that has a chat template: the prompt
is rendered with ``add_generation_prompt=True``, the full conversation with the completion
appended as an assistant message, and the completion is the difference of the two texts, so
the loss mask is 1 exactly on the completion tokens, end-of-turn tokens included (the model
learns to stop). Lists of token ids here are plain Python ``list[int]``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import tempfile
from typing import Any, Iterable

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainer_core.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

SPECIAL_TOKENS: dict[str, str] = {
    "pad": "<|pad|>",
    "eos": "<|end|>",
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
}
"""Special tokens of a trained tokenizer, in id order (pad = 0, eos = 1, then the role headers)."""

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|system|>\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>' + eos_token + '\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' + eos_token + '\\n' }}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] | default([], true) %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- eos_token + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)
"""Jinja chat template: ``<|role|>\\n{content}<|end|>\\n`` per message, then ``<|assistant|>\\n``
with ``add_generation_prompt``. ``eos_token`` is the tokenizer's, so this also serves as the
fallback template of a loaded tokenizer that has none. Tool use as Qwen2.5's and Hermes'
templates write it: the declared ``tools`` (``apply_chat_template(tools=...)``: JSON schemas) in a
first system turn ``# Tools\n<tools>\n{schema}\n...</tools>``, one JSON object a line; an
assistant message's ``tool_calls`` follow its content (after a newline,
when there is content), one ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
each, newline-separated; and a ``tool`` message is a
user turn ``<tool_response>\\n{content}\\n</tool_response>``."""

_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS.values()))
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (GPT-2 style) with :data:`SPECIAL_TOKENS` and :data:`CHAT_TEMPLATE`.

    The 256 byte symbols are always in the vocabulary, so any text can be encoded.

    Args:
        texts: training texts (chat-rendered, special tokens included: they are kept whole).
        vocab_size: target vocabulary size including special tokens; at least
            256 + len(SPECIAL_TOKENS) entries come out whatever the target.
        min_frequency: minimum count of a pair for a merge.

    Returns:
        A fast tokenizer with pad/eos set, ``padding_side="right"`` and the chat template;
        ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip it.

    Raises:
        ConfigError: ``vocab_size`` or ``min_frequency`` below 1.
        DataError: ``texts`` is empty.
    """
    if vocab_size < 1 or min_frequency < 1:
        raise ConfigError(f"tokenizer: vocab_size and min_frequency must be >= 1, got {vocab_size}, {min_frequency}")
    specials = list(SPECIAL_TOKENS.values())
    if vocab_size < 256 + len(specials):
        logger.warning("tokenizer.vocab_size=%d is below the byte alphabet; using %d", vocab_size, 256 + len(specials))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    num_texts = 0

    def pieces() -> Iterable[str]:  # the text between special tokens, so no merge learns their parts
        nonlocal num_texts
        for text in texts:
            num_texts += 1
            yield from (p for p in _SPECIAL_RE.split(text) if p)

    tok.train_from_iterator(pieces(), trainer)
    if num_texts == 0:
        raise DataError("train_tokenizer: no training texts")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL_TOKENS["pad"],
        eos_token=SPECIAL_TOKENS["eos"],
        padding_side="right",
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def _raise_template_error(message: str) -> None:
    raise DataError(f"chat template: {message}")


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    """The ``tojson`` filter of transformers' chat templates (``json.dumps``, nothing escaped)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=4)
def _compiled_template(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    env.filters["tojson"] = _tojson  # transformers' own (Jinja's escapes HTML characters)
    return env.from_string(template)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """:data:`CHAT_TEMPLATE` rendered with the trained tokenizer's eos, without a tokenizer.

    Equals ``tokenizer.apply_chat_template(messages, add_generation_prompt=...,
    tokenize=False)`` for a tokenizer from :func:`train_tokenizer`; used to make its training texts.

    Raises:
        DataError: a message has a role other than system / user / assistant / tool.
    """
    return _compiled_template(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt, eos_token=SPECIAL_TOKENS["eos"]
    )


def _local_tokenizer_dir(uri: str, tmp: str) -> str:
    """Copy the non-weight files of the directory ``uri`` into ``tmp``."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    base = path.rstrip("/")
    files = [f for f in fs.find(base) if not f.endswith(_WEIGHT_SUFFIXES)]
    if not files:
        raise FileNotFoundError(uri)
    for f in files:
        local = os.path.join(tmp, *f[len(base) :].lstrip("/").split("/"))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        fs.get_file(f, local)
    return tmp


def load_tokenizer(local_dir_or_name: str, trust_remote_code: bool = False) -> transformers.PreTrainedTokenizerBase:
    """Load a tokenizer (local directory, hub id, or fsspec URI of an HF-format directory).

    A tokenizer without a pad token gets pad = eos; one without a chat template gets
    :data:`CHAT_TEMPLATE`. ``padding_side`` is set to ``"right"`` (collation pads explicitly).

    Raises:
        ConfigError: the tokenizer cannot be loaded, or has neither a pad nor an eos token.
    """
    try:
        if "://" in local_dir_or_name and not local_dir_or_name.startswith("file://"):
            with tempfile.TemporaryDirectory(prefix="posttrain-tok-") as tmp:
                local = _local_tokenizer_dir(local_dir_or_name, tmp)
                tok = transformers.AutoTokenizer.from_pretrained(local, trust_remote_code=trust_remote_code)
        else:
            path = local_dir_or_name.removeprefix("file://")
            tok = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise ConfigError(
                f"tokenizer {local_dir_or_name!r} needs code from its repository: set "
                "model.trust_remote_code: true if you trust it"
            ) from e
        raise ConfigError(f"cannot load tokenizer from {local_dir_or_name!r}: {e}") from e
    except OSError as e:
        raise ConfigError(
            f"cannot load tokenizer from {local_dir_or_name!r} (model.name_or_path): {str(e).splitlines()[0]}"
        ) from e
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ConfigError(f"tokenizer {local_dir_or_name!r} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    if not tok.chat_template:
        logger.warning("tokenizer %s has no chat template; using the built-in one", local_dir_or_name)
        tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "right"
    return tok


def _ids(tokenizer: transformers.PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_chat(
    tokenizer: transformers.PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    completion: str | None,
    max_length: int,
    max_prompt_length: int,
    truncated: dict[str, int] | None = None,
    assistant_turns: str = "last",
    tools: list[dict] | None = None,
) -> dict[str, list[int]]:
    """Token ids of a chat prompt (plus an assistant completion) and the loss mask.

    Args:
        tokenizer: any HF tokenizer with a chat template.
        messages: prompt turns ``[{"role", "content"}]`` (earlier assistant replies included).
        completion: the assistant reply; None encodes the prompt alone (for generation).
        max_length: max tokens of prompt + completion; the completion is cut to fit.
        max_prompt_length: max prompt tokens; a longer prompt keeps its LAST tokens.
        truncated: when given, ``truncated["prompt"]`` / ``["completion"]`` count (from 0) a cut prompt / completion.
        assistant_turns: ``"last"``: only ``completion`` is counted; ``"all"``: the replies in
            ``messages`` too, end of turn included (as TRL's ``assistant_only_loss``).
        tools: declared tools (JSON schemas), rendered in the prompt as ``apply_chat_template(tools=...)``.

    Returns:
        ``{"input_ids": list[int], "loss_mask": list[int]}`` of equal length; loss_mask is
        1 = counted in the loss (completion tokens, end-of-turn included), 0 on the rest.

    Raises:
        ConfigError: ``max_prompt_length`` is not below ``max_length``, the template renders the
            conversation so that it does not start with the rendered prompt, or (``"all"``) it
            renders an earlier assistant turn so that the conversation does not extend it (a
            template that drops earlier replies); ValueError: an unknown ``assistant_turns``.
    """
    if not 0 < max_prompt_length < max_length:
        raise ConfigError(f"need 0 < max_prompt_length < max_length, got {max_prompt_length}, {max_length}")
    prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, tools=tools)
    prompt_ids, prompt_mask = _encode_prompt(tokenizer, messages, prompt_text, assistant_turns, tools)
    if len(prompt_ids) > max_prompt_length:
        prompt_ids, prompt_mask = prompt_ids[-max_prompt_length:], prompt_mask[-max_prompt_length:]
        if truncated is not None:
            truncated["prompt"] = truncated.get("prompt", 0) + 1
    if completion is None:
        return {"input_ids": prompt_ids, "loss_mask": prompt_mask}
    full_text = tokenizer.apply_chat_template(
        messages + [{"role": "assistant", "content": completion}], tokenize=False, tools=tools
    )
    if not full_text.startswith(prompt_text):
        raise ConfigError(
            "the tokenizer's chat template renders prompt + completion so that it does not start with the "
            "rendered prompt (generation prompt differs from the assistant header); cannot mask the prompt"
        )
    completion_ids = _ids(tokenizer, full_text[len(prompt_text) :])
    if len(completion_ids) > max_length - len(prompt_ids):
        completion_ids = completion_ids[: max_length - len(prompt_ids)]
        if truncated is not None:
            truncated["completion"] = truncated.get("completion", 0) + 1
    return {
        "input_ids": prompt_ids + completion_ids,
        "loss_mask": prompt_mask + [1] * len(completion_ids),
    }


def _encode_prompt(
    tokenizer: transformers.PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    prompt_text: str,
    assistant_turns: str,
    tools: list[dict] | None = None,
) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of the rendered prompt: nothing counted (``"last"``) or each earlier
    assistant reply (``"all"``, :func:`_prompt_segments`).

    Raises:
        ValueError: an unknown ``assistant_turns``; ConfigError: as :func:`_prompt_segments`.
    """
    if assistant_turns == "last":
        ids = _ids(tokenizer, prompt_text)
        return ids, [0] * len(ids)
    if assistant_turns != "all":
        raise ValueError(f"assistant_turns must be 'last' or 'all', got {assistant_turns!r}")
    prompt_ids, prompt_mask = [], []
    for text, counted in _prompt_segments(tokenizer, messages, prompt_text, tools):
        ids = _ids(tokenizer, text)
        prompt_ids += ids
        prompt_mask += [counted] * len(ids)
    return prompt_ids, prompt_mask


def _prompt_segments(
    tokenizer: transformers.PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    prompt_text: str,
    tools: list[dict] | None = None,
) -> list[tuple[str, int]]:
    """``prompt_text`` cut into ``(text, counted)`` pieces: 1 for each assistant reply of
    ``messages`` (the text its turn adds after its generation prompt), 0 between them.

    Raises:
        ConfigError: a turn's rendering is not a prefix of the next one's (the template rewrites
            or drops an earlier reply), naming the turn.
    """
    pieces, start = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False, tools=tools)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False, tools=tools)
        if not (through.startswith(before) and prompt_text.startswith(through) and len(before) >= start):
            raise ConfigError(
                f"the tokenizer's chat template renders the conversation so that it does not extend its assistant "
                f"turn {i} (messages[{i}]) as rendered alone (a template that rewrites or drops earlier replies); "
                "cannot count every assistant turn: set data.assistant_turns to 'last'"
            )
        pieces += [(before[start:], 0), (through[len(before) :], 1)]
        start = len(through)
    pieces.append((prompt_text[start:], 0))
    return [(text, counted) for text, counted in pieces if text]
