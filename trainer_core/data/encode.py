"""Tokenising staged examples into the prepared splits' record batches, one chunk at a time.

The columns of each prepared split (``SFT_SCHEMA`` ...) are documented in
:mod:`trainer_core.stages.prepare_data`. A :class:`ChunkEncoder` turns a chunk of example
indices of an :class:`~trainer_core.data.staging.ExampleStore` into one record batch and the
chunk's counts; prepare_data runs it in-process or in worker processes
(:mod:`trainer_core.data.parallel`), chunk by chunk in order, so the output is the same for any
number of processes. Token ids are int32, loss masks int8 (1 = counted in the loss).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from trainer_core.data.staging import ExampleStore
from trainer_core.data.tokenizer import encode_chat, render_chat

_IDS = pa.list_(pa.int32())
_MASK = pa.list_(pa.int8())
SFT_SCHEMA = pa.schema(
    [
        ("prompt", pa.string()),
        ("completion", pa.string()),
        ("answer", pa.string()),
        ("messages_json", pa.string()),
        ("input_ids", _IDS),
        ("loss_mask", _MASK),
        ("num_tokens", pa.int32()),
        ("tools_json", pa.string()),
    ]
)
PREFERENCE_SCHEMA = pa.schema(
    [
        ("messages_json", pa.string()),
        ("chosen", pa.string()),
        ("rejected", pa.string()),
        ("chosen_input_ids", _IDS),
        ("chosen_loss_mask", _MASK),
        ("rejected_input_ids", _IDS),
        ("rejected_loss_mask", _MASK),
    ]
)
EVAL_PROBLEMS_SCHEMA = pa.schema([("messages_json", pa.string()), ("answer", pa.string()), ("prompt_input_ids", _IDS)])
KTO_SCHEMA = pa.schema(
    [
        ("messages_json", pa.string()),
        ("completion", pa.string()),
        ("label", pa.bool_()),
        ("input_ids", _IDS),
        ("loss_mask", _MASK),
        ("kl_input_ids", _IDS),
        ("kl_loss_mask", _MASK),
    ]
)
PRETRAIN_SCHEMA = pa.schema([("input_ids", _IDS), ("num_tokens", pa.int32())])

SCHEMAS = {
    "sft": SFT_SCHEMA,
    "preference": PREFERENCE_SCHEMA,
    "kto": KTO_SCHEMA,
    "pretrain": PRETRAIN_SCHEMA,
    "eval_problems": EVAL_PROBLEMS_SCHEMA,
}
"""Prepared split schema per kind."""


@dataclass(frozen=True)
class Chunk:
    """One unit of work: rows ``indices`` of the store at ``store_path`` (a store of ``store_kind``),
    to be encoded as ``kind`` rows.

    ``kl_indices`` (kto only): for each row, the store index of the example whose completion
    makes its KL sequence (the previous example of the split, TRL's mismatched pairs).
    """

    kind: str
    store_path: str
    store_kind: str
    num_store_rows: int
    indices: np.ndarray
    kl_indices: np.ndarray | None = None

    def rows(self, indices: np.ndarray | None = None) -> list[dict]:
        """The staged examples at ``indices`` (default: this chunk's)."""
        store = ExampleStore(self.store_path, self.store_kind, self.num_store_rows)
        return store.take(self.indices if indices is None else indices)


@dataclass
class ChunkCounts:
    """What a chunk dropped and how many tokens it kept (summed over chunks by prepare_data).

    ``tokens``/``sequences``: for the mean tokens metric (per sequence; a pair counts its two sides).
    ``truncated_prompts``/``truncated_completions``: encodings whose prompt was cut to
    ``data.max_prompt_length_tokens`` (its last tokens kept) / whose completion was cut to fit
    ``data.max_length_tokens`` (a pair counts its two sides, a KTO row its KL encoding too).
    """

    rows: int = 0
    dropped_empty: int = 0
    dropped_identical: int = 0
    desirable: int = 0
    tokens: int = 0
    sequences: int = 0
    truncated_prompts: int = 0
    truncated_completions: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, other: ChunkCounts) -> None:
        """Sum ``other`` into this one (``extra`` is not summed)."""
        for name in (
            "rows",
            "dropped_empty",
            "dropped_identical",
            "desirable",
            "tokens",
            "sequences",
            "truncated_prompts",
            "truncated_completions",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def mean_tokens(self) -> float:
        """Mean tokens per sequence, as ``statistics.fmean`` of the lengths (0.0 without any)."""
        return self.tokens / self.sequences if self.sequences else 0.0


class ChunkEncoder:
    """Chunk -> (record batch of the prepared split, counts), with one tokenizer and length limits.

    Args:
        tokenizer: any HF tokenizer with a chat template.
        max_length: ``data.max_length_tokens``.
        max_prompt_length: ``data.max_prompt_length_tokens``.
        assistant_turns: ``data.assistant_turns``: the SFT rows' counted assistant turns
            (``"last"`` or ``"all"``); preference and KTO rows count their final reply only.
    """

    def __init__(self, tokenizer: Any, max_length: int, max_prompt_length: int, assistant_turns: str = "last") -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_prompt_length = max_prompt_length
        self.assistant_turns = assistant_turns

    def __call__(self, chunk: Chunk) -> tuple[pa.RecordBatch, ChunkCounts]:
        """Encode one chunk.

        Raises:
            ConfigError, DataError: as :func:`~trainer_core.data.tokenizer.encode_chat`.
        """
        build = {"sft": self._sft, "preference": self._preference, "kto": self._kto, "pretrain": self._pretrain_stream}[
            chunk.kind
        ]
        rows, counts = build(chunk)
        counts.rows = len(rows)
        return pa.RecordBatch.from_pylist(rows, schema=SCHEMAS[chunk.kind]), counts

    def _encode(
        self,
        messages: list[dict],
        completion: str | None,
        counts: ChunkCounts,
        assistant_turns: str = "last",
        tools: list[dict] | None = None,
    ) -> dict[str, list[int]]:
        """:func:`encode_chat` with the limits; a cut prompt or completion is counted in ``counts``."""
        cut: dict[str, int] = {}
        enc = encode_chat(
            self.tokenizer,
            messages,
            completion,
            self.max_length,
            self.max_prompt_length,
            truncated=cut,
            assistant_turns=assistant_turns,
            tools=tools,
        )
        counts.truncated_prompts += cut.get("prompt", 0)
        counts.truncated_completions += cut.get("completion", 0)
        return enc

    def _sft(self, chunk: Chunk) -> tuple[list[dict], ChunkCounts]:
        rows, counts = [], ChunkCounts()
        for ex in chunk.rows():
            tools = json.loads(ex["tools_json"]) if ex.get("tools_json") else None
            enc = self._encode(ex["messages"], ex["completion"], counts, self.assistant_turns, tools)
            if not any(enc["loss_mask"]):
                counts.dropped_empty += 1
                continue
            rows.append(
                {
                    "prompt": ex["prompt"],
                    "completion": ex["completion"],
                    "answer": ex["answer"],
                    "messages_json": ex["messages_json"],
                    "input_ids": enc["input_ids"],
                    "loss_mask": enc["loss_mask"],
                    "num_tokens": len(enc["input_ids"]),
                    "tools_json": ex.get("tools_json"),
                }
            )
            counts.tokens += len(enc["input_ids"])
            counts.sequences += 1
        return rows, counts

    def _preference(self, chunk: Chunk) -> tuple[list[dict], ChunkCounts]:
        rows, counts = [], ChunkCounts()
        for ex in chunk.rows():
            enc = {side: self._encode(ex["messages"], ex[side], counts) for side in ("chosen", "rejected")}
            if not (any(enc["chosen"]["loss_mask"]) and any(enc["rejected"]["loss_mask"])):
                counts.dropped_empty += 1
                continue
            if enc["chosen"]["input_ids"] == enc["rejected"]["input_ids"]:
                counts.dropped_identical += 1
                continue
            row = {"messages_json": ex["messages_json"], "chosen": ex["chosen"], "rejected": ex["rejected"]}
            for side in ("chosen", "rejected"):
                row[f"{side}_input_ids"], row[f"{side}_loss_mask"] = enc[side]["input_ids"], enc[side]["loss_mask"]
                counts.tokens += len(enc[side]["input_ids"])
                counts.sequences += 1
            rows.append(row)
        return rows, counts

    def _kto(self, chunk: Chunk) -> tuple[list[dict], ChunkCounts]:
        """KTO rows; a row's KL sequence is its prompt with ``kl_indices``' completion."""
        rows, counts = [], ChunkCounts()
        assert chunk.kl_indices is not None, "a kto chunk needs kl_indices"
        for ex, kl_ex in zip(chunk.rows(), chunk.rows(chunk.kl_indices)):
            enc = self._encode(ex["messages"], ex["completion"], counts)
            if not any(enc["loss_mask"]):
                counts.dropped_empty += 1
                continue
            kl = self._encode(ex["messages"], kl_ex["completion"], counts)
            rows.append(
                {
                    "messages_json": ex["messages_json"],
                    "completion": ex["completion"],
                    "label": ex["label"],
                    "input_ids": enc["input_ids"],
                    "loss_mask": enc["loss_mask"],
                    "kl_input_ids": kl["input_ids"],
                    "kl_loss_mask": kl["loss_mask"],
                }
            )
            counts.desirable += int(ex["label"])
            counts.tokens += len(enc["input_ids"])
            counts.sequences += 1
        return rows, counts

    def _pretrain_stream(self, chunk: Chunk) -> tuple[list[dict], ChunkCounts]:
        """The chunk's documents tokenised and each followed by EOS, as ONE row holding the token
        stream (prepare_data cuts the streams of consecutive chunks into blocks)."""
        texts = [doc["text"] for doc in chunk.rows()]
        eos = self.tokenizer.eos_token_id
        stream = [t for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"] for t in (*ids, eos)]
        return [{"input_ids": stream, "num_tokens": len(stream)}], ChunkCounts()


def render_texts(chunk: Chunk) -> list[str]:
    """The tokenizer-training texts of a chunk: each conversation chat-rendered with its
    completion (special tokens included; a preference pair gives chosen then rejected), or a
    raw document (``text`` stores)."""
    examples = chunk.rows()
    if chunk.store_kind == "text":
        return [ex["text"] for ex in examples]
    sides = ("chosen", "rejected") if chunk.store_kind == "preference" else ("completion",)
    return [
        render_chat(ex["messages"] + [{"role": "assistant", "content": ex[side]}]) for ex in examples for side in sides
    ]


def cut_blocks(stream: list[int], block: int) -> tuple[list[list[int]], list[int]]:
    """Full blocks of ``block`` tokens from the front of ``stream``, and the remainder."""
    num_full = len(stream) // block
    return [stream[i * block : (i + 1) * block] for i in range(num_full)], stream[num_full * block :]
