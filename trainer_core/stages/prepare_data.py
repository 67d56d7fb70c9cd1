"""prepare_data stage: read, adapt, split and tokenise every data set; write Parquet + tokenizer.

Output directory (``<output_uri>/final``), committed by ``manifest.json`` written last; read by
:mod:`trainer_core.data.prepared`::

    sft/train.parquet, sft/eval.parquet
        prompt str, completion str, answer str|null, messages_json str,
        input_ids list<int32>, loss_mask list<int8> (1 = counted in the loss), num_tokens int32
    preference/train.parquet, preference/eval.parquet
        messages_json, chosen, rejected, chosen_input_ids, chosen_loss_mask,
        rejected_input_ids, rejected_loss_mask
    eval_problems.parquet
        messages_json, answer str, prompt_input_ids list<int32>
    kto/train.parquet, kto/eval.parquet          (only with data.kto set)
        messages_json, completion str, label bool (True = desirable), input_ids, loss_mask,
        kl_input_ids, kl_loss_mask (the prompt with the previous example's completion: the
        mismatched pair of KTO's reference-point KL estimate, as TRL builds it)
    pretrain/train.parquet, pretrain/eval.parquet  (only with data.pretrain set)
        input_ids list<int32> (documents joined by EOS, cut into blocks of max_length_tokens; a
        split's last block may be shorter), num_tokens int32; every token is a loss token
    tokenizer/   (save_pretrained files)

A source whose ``uri`` is None is replaced by the synthetic task (:mod:`trainer_core.data.synthetic`,
seeded by ``config.seed``); an eval source with ``uri`` None means the eval problems are the
held-out SFT rows that have a final answer. Each data set is split by a
``random.Random(config.seed)`` shuffle: ``eval_fraction`` of it (at least 1, at most
``max_eval_rows`` rows) is held out. Train rows whose prompt equals an eval problem's prompt
are dropped (counted). Pairs whose chosen and rejected token ids are identical after truncation,
and rows with no completion token left, are dropped (counted). HH-RLHF pairs whose dialogues do
not parse (a handful in the public data) are skipped and counted, unless more than
:data:`MAX_INVALID_FRACTION` of a data set is unparsable, which means a wrong format and is an error.
KTO examples made from preference pairs are split pair by pair (a pair's two completions stay in
one split), then shuffled with the seed. Pretrain documents are split before they are packed, and
documents that contain an eval problem's question are dropped (counted).
"""

from __future__ import annotations

import io
import json
import logging
import random
import statistics
import tempfile
from functools import partial
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from trainer_core.checkpoint.manifest import ArtifactWriter, Manifest
from trainer_core.config import DataSource, PipelineConfig
from trainer_core.data.formats import (
    DialogueParseError,
    detect_format,
    to_eval_problem,
    to_kto_examples,
    to_preference_example,
    to_sft_example,
    to_text_example,
)
from trainer_core.data.sources import read_records
from trainer_core.data.synthetic import make_preference_records, make_sft_records
from trainer_core.data.tokenizer import encode_chat, load_tokenizer, render_chat, train_tokenizer
from trainer_core.errors import ConfigError, DataError
from trainer_core.stages.context import StageContext

logger = logging.getLogger(__name__)

STAGE = "prepare_data"
MAX_INVALID_FRACTION = 0.05
"""Largest fraction of a data set's records that may fail to parse (and be skipped)."""


_IDS = pa.list_(pa.int32())
_MASK = pa.list_(pa.int8())
SFT_SCHEMA = pa.schema(
    [("prompt", pa.string()), ("completion", pa.string()), ("answer", pa.string()), ("messages_json", pa.string()),
     ("input_ids", _IDS), ("loss_mask", _MASK), ("num_tokens", pa.int32())]
)
PREFERENCE_SCHEMA = pa.schema(
    [("messages_json", pa.string()), ("chosen", pa.string()), ("rejected", pa.string()),
     ("chosen_input_ids", _IDS), ("chosen_loss_mask", _MASK), ("rejected_input_ids", _IDS),
     ("rejected_loss_mask", _MASK)]
)
EVAL_PROBLEMS_SCHEMA = pa.schema([("messages_json", pa.string()), ("answer", pa.string()), ("prompt_input_ids", _IDS)])
KTO_SCHEMA = pa.schema(
    [("messages_json", pa.string()), ("completion", pa.string()), ("label", pa.bool_()), ("input_ids", _IDS),
     ("loss_mask", _MASK), ("kl_input_ids", _IDS), ("kl_loss_mask", _MASK)]
)
PRETRAIN_SCHEMA = pa.schema([("input_ids", _IDS), ("num_tokens", pa.int32())])


def _messages_json(messages: list[dict[str, str]]) -> str:
    return json.dumps(messages, ensure_ascii=False)


def _adapt(records: list[dict], fmt: str, adapter: Callable[[dict, str], dict], name: str,
           metrics: dict[str, float]) -> list[dict]:
    """Apply ``adapter`` to every record; skip (and count) unparsable dialogues up to the limit."""
    if fmt == "auto":
        fmt = detect_format(records[0])
    examples, invalid = [], []
    for record in records:
        try:
            examples.append(adapter(record, fmt))
        except DialogueParseError as e:
            invalid.append(str(e))
    metrics[f"num_{name}_invalid"] = len(invalid)
    if invalid:
        logger.warning("%s: skipped %d unparsable records, e.g. %s", name, len(invalid), invalid[:3])
    if len(invalid) > MAX_INVALID_FRACTION * len(records):
        raise DataError(
            f"{name}: {len(invalid)} of {len(records)} records do not parse as format {fmt!r} "
            f"(more than {MAX_INVALID_FRACTION:.0%}); first: {invalid[0]}"
        )
    return examples


def _load(source: DataSource, name: str, config: PipelineConfig, metrics: dict[str, float]) -> list[dict]:
    """Canonical examples of the ``sft`` or ``preference`` data set (synthetic when uri is None)."""
    syn = config.data.synthetic
    if name == "sft":
        adapter: Callable[[dict, str], dict] = to_sft_example
        if source.uri is None:
            records = make_sft_records(syn.num_problems, config.seed, syn.max_operand)
            return _adapt(records, "gsm8k", adapter, name, metrics)
    else:
        adapter = to_preference_example
        if source.uri is None:
            records = make_preference_records(syn.num_pairs, config.seed, syn.max_operand)
            return _adapt(records, "prompt_completion", adapter, name, metrics)
    return _adapt(_read(source, name), source.format, adapter, name, metrics)


def _load_kto(source: DataSource, config: PipelineConfig, metrics: dict[str, float]) -> list[list[dict]]:
    """The KTO examples of each ``data.kto`` record (two of a preference pair); the synthetic
    preference pairs, unpaired, when its uri is None."""
    if source.uri is None:
        syn = config.data.synthetic
        records, fmt = make_preference_records(syn.num_pairs, config.seed, syn.max_operand), "prompt_completion"
    else:
        records, fmt = _read(source, "kto"), source.format
    return _adapt(records, fmt, to_kto_examples, "kto", metrics)


def _load_documents(source: DataSource, config: PipelineConfig, metrics: dict[str, float]) -> list[dict]:
    """The raw-text documents of ``data.pretrain``; the synthetic problems with their worked
    solutions (drawn with seed + 1) as plain text when its uri is None."""
    if source.uri is None:
        syn = config.data.synthetic
        records, fmt = make_sft_records(syn.num_problems, config.seed + 1, syn.max_operand), "gsm8k"
    else:
        records, fmt = _read(source, "pretrain"), source.format
    if fmt == "auto" and source.text_field in records[0]:
        fmt = "text"  # auto: the text field when the records have it, else the detected format rendered as text
    return _adapt(records, fmt, partial(to_text_example, field=source.text_field), "pretrain", metrics)


def _read(source: DataSource, name: str) -> list[dict]:
    """``read_records(source)``, its errors prefixed with the config field (``data.<name>.uri``)."""
    try:
        return read_records(source)
    except (ConfigError, DataError) as e:
        raise type(e)(f"data.{name}.uri: {e}") from e


def split_train_eval(examples: list[dict], seed: int, eval_fraction: float, max_eval_rows: int,
                     name: str = "data") -> tuple[list[dict], list[dict]]:
    """Shuffle with ``random.Random(seed)``; the first ``round(n * eval_fraction)`` rows (at least
    1, at most ``max_eval_rows``) are the eval split, the rest the train split.

    Raises:
        DataError: fewer than 2 examples.
    """
    if len(examples) < 2:
        raise DataError(f"{name}: {len(examples)} usable record(s); need at least 2 to hold out an eval split")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    num_eval = min(max_eval_rows, max(1, round(len(examples) * eval_fraction)), len(examples) - 1)
    return [examples[i] for i in order[num_eval:]], [examples[i] for i in order[:num_eval]]


def _eval_problems(config: PipelineConfig, sft_eval: list[dict], metrics: dict[str, float]) -> list[dict]:
    """Eval problems from ``data.eval`` (its first ``max_eval_rows``), else the held-out SFT rows with answers."""
    data = config.data
    if data.eval.uri is None:
        return [{"messages": ex["messages"], "answer": ex["answer"]} for ex in sft_eval if ex["answer"] is not None]
    records = _read(data.eval, "eval")
    fmt = detect_format(records[0]) if data.eval.format == "auto" else data.eval.format
    problems = [to_eval_problem(r, fmt) for r in records[: data.max_eval_rows]]
    metrics["num_eval_problems_read"] = len(records)
    return problems


def _decontaminate(examples: list[dict], problems: list[dict], name: str, metrics: dict[str, float]) -> list[dict]:
    """Drop train examples whose prompt messages equal an eval problem's."""
    held_out = {_messages_json(p["messages"]) for p in problems}
    kept = [ex for ex in examples if _messages_json(ex["messages"]) not in held_out]
    metrics[f"num_{name}_dropped_overlap"] = len(examples) - len(kept)
    return kept


def _decontaminate_documents(docs: list[dict], problems: list[dict], metrics: dict[str, float]) -> list[dict]:
    """Drop pretrain documents that contain the text of an eval problem's last user turn."""
    questions = {p["messages"][-1]["content"] for p in problems if p["messages"][-1]["content"].strip()}
    kept = [d for d in docs if not any(q in d["text"] for q in questions)]
    metrics["num_pretrain_train_dropped_overlap"] = len(docs) - len(kept)
    return kept


def _tokenizer_texts(splits: dict[str, list[dict]]) -> list[str]:
    """Training conversations, chat-rendered (special tokens included), and raw pretrain
    documents: the tokenizer-training corpus."""
    def chat(ex: dict, completion: str) -> str:
        return render_chat(ex["messages"] + [{"role": "assistant", "content": completion}])

    texts = [chat(ex, ex["completion"]) for ex in splits["sft/train"]]
    texts += [chat(ex, ex[side]) for ex in splits["preference/train"] for side in ("chosen", "rejected")]
    texts += [chat(ex, ex["completion"]) for ex in splits.get("kto/train", [])]
    texts += [doc["text"] for doc in splits.get("pretrain/train", [])]
    return texts


def _build_tokenizer(config: PipelineConfig, splits: dict[str, list[dict]]) -> Any:
    if config.model.init is not None:
        texts = _tokenizer_texts(splits)
        return train_tokenizer(texts, config.tokenizer.vocab_size, config.tokenizer.min_frequency)
    return load_tokenizer(config.model.name_or_path, trust_remote_code=config.model.trust_remote_code)


def _sft_table(tokenizer: Any, examples: list[dict], config: PipelineConfig, name: str,
               metrics: dict[str, float]) -> pa.Table:
    data, rows, dropped = config.data, [], 0
    for ex in examples:
        enc = encode_chat(tokenizer, ex["messages"], ex["completion"], data.max_length_tokens,
                          data.max_prompt_length_tokens)
        if not any(enc["loss_mask"]):
            dropped += 1
            continue
        rows.append({"prompt": ex["prompt"], "completion": ex["completion"], "answer": ex["answer"],
                     "messages_json": _messages_json(ex["messages"]), "input_ids": enc["input_ids"],
                     "loss_mask": enc["loss_mask"], "num_tokens": len(enc["input_ids"])})
    metrics[f"num_{name}_dropped_empty"] = dropped
    metrics[f"mean_{name}_tokens"] = statistics.fmean(r["num_tokens"] for r in rows) if rows else 0.0
    return _table(rows, SFT_SCHEMA, name)


def _preference_table(tokenizer: Any, examples: list[dict], config: PipelineConfig, name: str,
                      metrics: dict[str, float]) -> pa.Table:
    data, rows, identical, empty = config.data, [], 0, 0
    for ex in examples:
        enc = {side: encode_chat(tokenizer, ex["messages"], ex[side], data.max_length_tokens,
                                 data.max_prompt_length_tokens) for side in ("chosen", "rejected")}
        if not (any(enc["chosen"]["loss_mask"]) and any(enc["rejected"]["loss_mask"])):
            empty += 1
            continue
        if enc["chosen"]["input_ids"] == enc["rejected"]["input_ids"]:
            identical += 1
            continue
        row = {"messages_json": _messages_json(ex["messages"]), "chosen": ex["chosen"], "rejected": ex["rejected"]}
        for side in ("chosen", "rejected"):
            row[f"{side}_input_ids"], row[f"{side}_loss_mask"] = enc[side]["input_ids"], enc[side]["loss_mask"]
        rows.append(row)
    metrics[f"num_{name}_dropped_empty"] = empty
    metrics[f"num_{name}_dropped_identical"] = identical
    lengths = [len(r[f"{s}_input_ids"]) for r in rows for s in ("chosen", "rejected")]
    metrics[f"mean_{name}_tokens"] = statistics.fmean(lengths) if lengths else 0.0
    return _table(rows, PREFERENCE_SCHEMA, name)


def _kto_table(tokenizer: Any, examples: list[dict], config: PipelineConfig, name: str,
               metrics: dict[str, float]) -> pa.Table:
    """KTO rows; example i's KL sequence is its prompt with example i - 1's completion (the
    first takes the last's), TRL's mismatched pairs (``KTOTrainer._prepare_dataset``)."""
    data, rows, empty = config.data, [], 0
    for i, ex in enumerate(examples):
        enc = encode_chat(tokenizer, ex["messages"], ex["completion"], data.max_length_tokens,
                          data.max_prompt_length_tokens)
        if not any(enc["loss_mask"]):
            empty += 1
            continue
        kl = encode_chat(tokenizer, ex["messages"], examples[i - 1]["completion"], data.max_length_tokens,
                         data.max_prompt_length_tokens)
        rows.append({"messages_json": _messages_json(ex["messages"]), "completion": ex["completion"],
                     "label": ex["label"], "input_ids": enc["input_ids"], "loss_mask": enc["loss_mask"],
                     "kl_input_ids": kl["input_ids"], "kl_loss_mask": kl["loss_mask"]})
    metrics[f"num_{name}_dropped_empty"] = empty
    metrics[f"num_{name}_desirable"] = sum(r["label"] for r in rows)
    metrics[f"mean_{name}_tokens"] = statistics.fmean(len(r["input_ids"]) for r in rows) if rows else 0.0
    return _table(rows, KTO_SCHEMA, name)


def _pretrain_table(tokenizer: Any, docs: list[dict], config: PipelineConfig, name: str,
                    metrics: dict[str, float]) -> pa.Table:
    """Documents tokenised, each followed by EOS, joined and cut into blocks of
    ``max_length_tokens`` (the last block keeps the remainder when it has 2 tokens or more)."""
    if not docs:
        raise DataError(f"{name}: no documents left (after the held-out split and the decontamination; see the "
                        "dropped counts)")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("the tokenizer has no eos_token: pretrain documents cannot be separated")
    stream = [t for ids in tokenizer([d["text"] for d in docs], add_special_tokens=False)["input_ids"]
              for t in (*ids, eos)]
    block = config.data.max_length_tokens
    rows = [{"input_ids": stream[i : i + block], "num_tokens": len(stream[i : i + block])}
            for i in range(0, len(stream), block) if len(stream) - i >= 2]
    metrics[f"num_{name}_documents"] = len(docs)
    metrics[f"num_{name}_tokens"] = sum(r["num_tokens"] for r in rows)
    return _table(rows, PRETRAIN_SCHEMA, name)


def _problems_table(tokenizer: Any, problems: list[dict], config: PipelineConfig,
                    metrics: dict[str, float]) -> pa.Table:
    data, rows = config.data, []
    for p in problems:
        ids = encode_chat(tokenizer, p["messages"], None, data.max_length_tokens, data.max_prompt_length_tokens)
        rows.append({"messages_json": _messages_json(p["messages"]), "answer": p["answer"],
                     "prompt_input_ids": ids["input_ids"]})
    metrics["mean_eval_problems_prompt_tokens"] = (
        statistics.fmean(len(r["prompt_input_ids"]) for r in rows) if rows else 0.0
    )
    if not rows:
        logger.warning("no eval problems (no held-out row has a '#### <answer>'); exact-match eval is skipped")
    return pa.Table.from_pylist(rows, schema=EVAL_PROBLEMS_SCHEMA)


def _table(rows: list[dict], schema: pa.Schema, name: str) -> pa.Table:
    if not rows:
        raise DataError(f"{name}: no rows left after tokenising and dropping (see the dropped counts)")
    return pa.Table.from_pylist(rows, schema=schema)


def _parquet_bytes(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    return buffer.getvalue()


def _splits(config: PipelineConfig, metrics: dict[str, float]) -> dict[str, list[dict]]:
    """Canonical examples of every split, decontaminated against the eval problems."""
    data = config.data
    sft = _load(data.sft, "sft", config, metrics)
    pref = _load(data.preference, "preference", config, metrics)
    sft_train, sft_eval = split_train_eval(sft, config.seed, data.eval_fraction, data.max_eval_rows, "sft")
    pref_train, pref_eval = split_train_eval(pref, config.seed, data.eval_fraction, data.max_eval_rows, "preference")
    problems = _eval_problems(config, sft_eval, metrics)
    splits = {
        "sft/train": _decontaminate(sft_train, problems, "sft_train", metrics),
        "sft/eval": sft_eval,
        "preference/train": _decontaminate(pref_train, problems, "preference_train", metrics),
        "preference/eval": pref_eval,
        "eval_problems": problems,
    }
    if data.kto is not None:
        kto = _load_kto(data.kto, config, metrics)
        kto_train, kto_eval = split_train_eval(kto, config.seed, data.eval_fraction, data.max_eval_rows, "kto")
        for split, groups in (("train", kto_train), ("eval", kto_eval)):
            examples = [ex for group in groups for ex in group]
            random.Random(config.seed).shuffle(examples)  # a pair's two sides apart: mismatched KL neighbours
            splits[f"kto/{split}"] = examples
        splits["kto/train"] = _decontaminate(splits["kto/train"], problems, "kto_train", metrics)
    if data.pretrain is not None:
        docs = _load_documents(data.pretrain, config, metrics)
        docs_train, docs_eval = split_train_eval(docs, config.seed, data.eval_fraction, data.max_eval_rows, "pretrain")
        splits["pretrain/train"] = _decontaminate_documents(docs_train, problems, metrics)
        splits["pretrain/eval"] = docs_eval
    return splits


def _tables(tokenizer: Any, splits: dict[str, list[dict]], config: PipelineConfig,
            metrics: dict[str, float]) -> dict[str, pa.Table]:
    tables = {}
    for name in ("sft/train", "sft/eval"):
        tables[name] = _sft_table(tokenizer, splits[name], config, name.replace("/", "_"), metrics)
    for name in ("preference/train", "preference/eval"):
        tables[name] = _preference_table(tokenizer, splits[name], config, name.replace("/", "_"), metrics)
    tables["eval_problems"] = _problems_table(tokenizer, splits["eval_problems"], config, metrics)
    for name, build in (("kto/train", _kto_table), ("kto/eval", _kto_table),
                        ("pretrain/train", _pretrain_table), ("pretrain/eval", _pretrain_table)):
        if name in splits:
            tables[name] = build(tokenizer, splits[name], config, name.replace("/", "_"), metrics)
    for name, table in tables.items():
        metrics[f"num_{name.replace('/', '_')}"] = table.num_rows
    return tables


def _source_names(config: PipelineConfig) -> dict[str, str]:
    data = config.data
    return {
        "sft": data.sft.uri or "synthetic",
        "preference": data.preference.uri or "synthetic",
        "eval": data.eval.uri or "held-out sft rows",
        **{name: getattr(data, name).uri or "synthetic" for name in ("kto", "pretrain") if getattr(data, name)},
    }


def run(ctx: StageContext) -> Manifest:
    """Prepare every data set of the config and commit them under ``<output_uri>/final``.

    Returns:
        The committed manifest; ``metrics`` hold row counts per split, dropped counts, mean
        tokens and the vocabulary size.

    Raises:
        DataError: a missing / malformed data file or record, too many unparsable records, or a
            split left empty.
        ConfigError: the tokenizer cannot be loaded or its chat template is unusable.
    """
    config = ctx.config
    metrics: dict[str, float] = {}
    splits = _splits(config, metrics)
    tokenizer = _build_tokenizer(config, splits)
    metrics["vocab_size"] = len(tokenizer)
    tables = _tables(tokenizer, splits, config, metrics)
    writer = ArtifactWriter(ctx.layout.final, overwrite=True)
    for name, table in tables.items():
        writer.write_bytes(f"{name}.parquet", _parquet_bytes(table))
    with tempfile.TemporaryDirectory(prefix="posttrain-tokenizer-") as local:
        tokenizer.save_pretrained(local)
        writer.write_dir(local, prefix="tokenizer")
    extra = {
        "splits": list(tables),
        "sources": _source_names(config),
        "tokenizer_trained": config.model.init is not None,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "max_length_tokens": config.data.max_length_tokens,
        "max_prompt_length_tokens": config.data.max_prompt_length_tokens,
    }
    manifest = writer.commit(kind="final", stage=STAGE, run_id=ctx.spec.run_id, config_hash=ctx.fingerprint,
                             metrics={k: float(v) for k, v in metrics.items()}, extra=extra)
    logger.info("prepare_data committed %s: %s", writer.uri, {k: v for k, v in metrics.items() if k.startswith("num_")})
    return manifest
