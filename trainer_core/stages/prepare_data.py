"""prepare_data stage: read, adapt, split and tokenise every data set; write Parquet + tokenizer.

Output directory (``<output_uri>/final``), committed by ``manifest.json`` written last; read by
:mod:`trainer_core.data.prepared`. Each split ``<name>`` is written as Parquet shards
``<name>/part-00000.parquet``, ... (:mod:`trainer_core.data.shards`); its columns::

    sft/train, sft/eval
        prompt str, completion str, answer str|null, messages_json str,
        input_ids list<int32>, loss_mask list<int8> (1 = counted in the loss), num_tokens int32,
        tools_json str|null (a conversation's declared tools, rendered in its prompt and in the
        RL stages' prompts)
    preference/train, preference/eval
        messages_json, chosen, rejected, chosen_input_ids, chosen_loss_mask,
        rejected_input_ids, rejected_loss_mask
    eval_problems
        messages_json, answer str, prompt_input_ids list<int32>
    kto/train, kto/eval          (only with data.kto set)
        messages_json, completion str, label bool (True = desirable), input_ids, loss_mask,
        kl_input_ids, kl_loss_mask (the prompt with the previous example's completion: the
        mismatched pair of KTO's reference-point KL estimate, as TRL builds it)
    pretrain/train, pretrain/eval  (only with data.pretrain set)
        input_ids list<int32> (documents joined by EOS, cut into blocks of max_length_tokens; a
        split's last block may be shorter), num_tokens int32; every token is a loss token
    tokenizer/   (save_pretrained files)

A source whose ``uri`` is None is replaced by the synthetic task (:mod:`trainer_core.data.synthetic`,
seeded by ``config.seed``); an eval source with ``uri`` None means the eval problems are the
held-out SFT rows whose final answer is a number (``#### 72``: evaluation compares numbers). Each
data set is split by a ``random.Random(config.seed)`` shuffle: ``eval_fraction`` of it (at least
1, at most ``max_eval_rows`` rows) is held out. Train rows whose prompt equals an eval problem's prompt
are dropped (counted). Pairs whose chosen and rejected token ids are identical after truncation,
and rows with no completion token left, are dropped (counted). HH-RLHF pairs whose dialogues do
not parse (a handful in the public data) are skipped and counted, unless more than
:data:`MAX_INVALID_FRACTION` of a data set is unparsable, which means a wrong format and is an error.
KTO examples made from preference pairs are split pair by pair (a pair's two completions stay in
one split), then shuffled with the seed. Pretrain documents are split before they are packed, and
documents that contain an eval problem's question are dropped (counted). A split left with no
rows is a ``DataError`` that gives these counts (records read, rows held out, rows dropped by
reason); it commits nothing and leaves no ``final/`` directory behind.

Memory stays bounded whatever the data's size: each data set is read once as a stream and its
canonical examples staged in a local Arrow file (:mod:`trainer_core.data.staging`); the split
works on indices (the same rows, in the same order, as shuffling the whole list did); the
tokenizer's training texts and the tokenised rows are made chunk by chunk
(:data:`CHUNK_ROWS` rows), in ``data.num_proc`` worker processes when it is above 1
(:mod:`trainer_core.data.parallel`), and written in order, so the output does not depend on
``num_proc``.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

from trainer_core import storage
from trainer_core.checkpoint.lease import LeaseLostError
from trainer_core.checkpoint.manifest import ArtifactWriter, Manifest
from trainer_core.config import DataSource, PipelineConfig
from trainer_core.data.encode import (  # noqa: F401 - the schemas are part of this stage's documented output
    EVAL_PROBLEMS_SCHEMA,
    KTO_SCHEMA,
    PREFERENCE_SCHEMA,
    PRETRAIN_SCHEMA,
    SCHEMAS,
    SFT_SCHEMA,
    Chunk,
    ChunkCounts,
    ChunkEncoder,
    cut_blocks,
    render_texts,
)
from trainer_core.data.formats import (
    detect_format,
    is_verifiable_answer,
    to_eval_problem,
    to_kto_examples,
    to_preference_example,
    to_sft_example,
    to_text_example,
)
from trainer_core.data.parallel import ChunkMap
from trainer_core.data.shards import ShardWriter
from trainer_core.data.sources import iter_records
from trainer_core.data.staging import (  # noqa: F401 - MAX_INVALID_FRACTION: documented here
    MAX_INVALID_FRACTION,
    ExampleStore,
    group_examples,
    mask_containing,
    mask_in,
    messages_json,
    shuffled,
    split_order,
    stage_examples,
)
from trainer_core.data.synthetic import iter_preference_records, iter_sft_records
from trainer_core.data.tokenizer import encode_chat, load_tokenizer, train_tokenizer
from trainer_core.errors import ConfigError, DataError
from trainer_core.stages.context import StageContext

logger = logging.getLogger(__name__)

STAGE = "prepare_data"
CHUNK_ROWS = 2048
"""Examples per unit of tokenising work (and per Parquet row group of the output)."""


@dataclass
class Split:
    """A data set's staged examples and its split: row indices into ``store``, in output order."""

    store: ExampleStore
    train: np.ndarray
    eval: np.ndarray


def _read(source: DataSource, name: str) -> Iterator[dict]:
    """``iter_records(source)``, its errors prefixed with the config field (``data.<name>.uri``)."""
    try:
        yield from iter_records(source)
    except (ConfigError, DataError) as e:
        raise type(e)(f"data.{name}.uri: {e}") from e


def _text_format(field: str, record: dict) -> str:
    """``auto`` for pretrain: the text field when the records have it, else the detected format."""
    return "text" if field in record else detect_format(record)


def _stage(name: str, source: DataSource, config: PipelineConfig, tmp: str, metrics: dict[str, float]) -> ExampleStore:
    """Stream data set ``name`` (the synthetic task when its uri is None) into a local store."""
    syn, seed = config.data.synthetic, config.seed
    synthetic: dict[str, Callable[[], Iterator[dict]]] = {
        "sft": lambda: iter_sft_records(
            syn.num_problems, seed, syn.max_operand, syn.annotation_fraction, syn.annotation_unit
        ),
        "preference": lambda: iter_preference_records(syn.num_pairs, seed, syn.max_operand),
        "kto": lambda: iter_preference_records(syn.num_pairs, seed, syn.max_operand),
        "pretrain": lambda: iter_sft_records(syn.num_problems, seed + 1, syn.max_operand),  # problems as plain text
    }
    adapters: dict[str, tuple[Callable, str, str]] = {  # adapter, store kind, synthetic records' format
        "sft": (to_sft_example, "sft", "gsm8k"),
        "preference": (to_preference_example, "preference", "prompt_completion"),
        "kto": (to_kto_examples, "kto", "prompt_completion"),
        "pretrain": (partial(to_text_example, field=source.text_field), "text", "gsm8k"),
    }
    adapter, kind, synthetic_format = adapters[name]
    if source.uri is None:
        records, fmt = synthetic[name](), synthetic_format
    else:
        records, fmt = _read(source, name), source.format
    resolve = partial(_text_format, source.text_field) if name == "pretrain" else None
    return stage_examples(records, fmt, adapter, name, kind, f"{tmp}/{name}.arrow", metrics, resolve)


def split_train_eval(
    examples: list[dict], seed: int, eval_fraction: float, max_eval_rows: int, name: str = "data"
) -> tuple[list[dict], list[dict]]:
    """Shuffle with ``random.Random(seed)``; the first ``round(n * eval_fraction)`` rows (at least
    1, at most ``max_eval_rows``) are the eval split, the rest the train split
    (:func:`~trainer_core.data.staging.split_order` on a list).

    Raises:
        DataError: fewer than 2 examples.
    """
    train, held_out = split_order(len(examples), seed, eval_fraction, max_eval_rows, name)
    return [examples[i] for i in train], [examples[i] for i in held_out]


def _eval_problems(config: PipelineConfig, sft: Split, metrics: dict[str, float]) -> list[dict]:
    """Eval problems from ``data.eval`` (its first ``max_eval_rows``), else the held-out SFT rows
    whose final answer is a number (:func:`~trainer_core.data.formats.is_verifiable_answer`)."""
    data = config.data
    if data.eval.uri is None:
        held_out = [ex for ex in sft.store.take(sft.eval) if ex["answer"] is not None]
        problems = [
            {"messages": ex["messages"], "answer": ex["answer"]}
            for ex in held_out
            if is_verifiable_answer(ex["answer"])
        ]
        if len(problems) < len(held_out):
            logger.warning(
                "%d held-out sft rows have a final answer after '####' that is not a number (e.g. %r): "
                "they are not eval problems",
                len(held_out) - len(problems),
                next(ex["answer"] for ex in held_out if not is_verifiable_answer(ex["answer"])),
            )
        return problems
    fmt, problems, num_read = data.eval.format, [], 0
    for record in _read(data.eval, "eval"):
        fmt = detect_format(record) if fmt == "auto" else fmt
        if num_read < data.max_eval_rows:
            problems.append(to_eval_problem(record, fmt))
        num_read += 1
    metrics["num_eval_problems_read"] = num_read
    return problems


def _decontaminate(split: Split, problems: list[dict], name: str, metrics: dict[str, float]) -> None:
    """Drop train examples whose prompt messages equal an eval problem's."""
    overlap = mask_in(split.store, "messages_json", {messages_json(p["messages"]) for p in problems})
    kept = split.train[~overlap[split.train]]
    metrics[f"num_{name}_dropped_overlap"] = len(split.train) - len(kept)
    split.train = kept


def _decontaminate_documents(docs: Split, problems: list[dict], metrics: dict[str, float]) -> None:
    """Drop pretrain documents that contain the text of an eval problem's last user turn."""
    questions = {p["messages"][-1]["content"] for p in problems if p["messages"][-1]["content"].strip()}
    kept = docs.train[~mask_containing(docs.store, "text", questions)[docs.train]]
    metrics["num_pretrain_train_dropped_overlap"] = len(docs.train) - len(kept)
    docs.train = kept


def _kto_split(store: ExampleStore, config: PipelineConfig) -> Split:
    """KTO examples split record by record (a pair's two sides stay together), then each split's
    examples shuffled with the seed (a pair's sides apart: mismatched KL neighbours)."""
    data = config.data
    groups = len(store.group_starts) - 1
    train, held_out = split_order(groups, config.seed, data.eval_fraction, data.max_eval_rows, "kto")
    train, held_out = group_examples(store, train), group_examples(store, held_out)
    return Split(store, train[shuffled(len(train), config.seed)], held_out[shuffled(len(held_out), config.seed)])


def _splits(config: PipelineConfig, tmp: str, metrics: dict[str, float]) -> tuple[dict[str, Split], list[dict]]:
    """Every data set staged and split (train decontaminated against the eval problems), and the
    eval problems."""
    data = config.data
    sets: dict[str, Split] = {}
    for name in ("sft", "preference"):
        store = _stage(name, getattr(data, name), config, tmp, metrics)
        sets[name] = Split(store, *split_order(len(store), config.seed, data.eval_fraction, data.max_eval_rows, name))
    problems = _eval_problems(config, sets["sft"], metrics)
    _decontaminate(sets["sft"], problems, "sft_train", metrics)
    _decontaminate(sets["preference"], problems, "preference_train", metrics)
    if data.kto is not None:
        sets["kto"] = _kto_split(_stage("kto", data.kto, config, tmp, metrics), config)
        _decontaminate(sets["kto"], problems, "kto_train", metrics)
    if data.pretrain is not None:
        store = _stage("pretrain", data.pretrain, config, tmp, metrics)
        sets["pretrain"] = Split(
            store, *split_order(len(store), config.seed, data.eval_fraction, data.max_eval_rows, "pretrain")
        )
        _decontaminate_documents(sets["pretrain"], problems, metrics)
    for name, split in sets.items():
        if not len(split.train):
            raise _empty_split_error(f"{name}/train", split, _source_names(config)[name], metrics)
    return sets, problems


_DROP_REASONS = {
    "dropped_overlap": "that overlap an eval problem (decontamination)",
    "dropped_identical": "whose chosen and rejected token ids are identical (after truncation)",
    "dropped_empty": "with no completion token left after truncation to data.max_length_tokens",
}
"""Why prepare_data drops rows, by the suffix of the metric that counts them
(``num_<set>_<split>_<suffix>``)."""


def _empty_split_error(name: str, split: Split, source: str, metrics: dict[str, float]) -> DataError:
    """The error for split ``name`` (``sft/train``) left with no rows: the records read from
    ``source``, the examples held out and kept for training, and the rows dropped for each reason
    counted so far (:data:`_DROP_REASONS`)."""
    set_name, key, store = name.split("/")[0], name.replace("/", "_"), split.store
    num_records = len(store) if store.group_starts is None else len(store.group_starts) - 1
    invalid = int(metrics.get(f"num_{set_name}_invalid", 0))
    num_train = len(split.train) + int(metrics.get(f"num_{set_name}_train_dropped_overlap", 0))
    read = f"{num_records + invalid} records read from {source}" + (
        f" ({invalid} unparsable, skipped)" if invalid else ""
    )
    drops = [
        f"{int(metrics[f'num_{key}_{suffix}'])} {why}"
        for suffix, why in _DROP_REASONS.items()
        if f"num_{key}_{suffix}" in metrics
    ]
    return DataError(
        f"{name}: no rows left: {read} gave {len(store)} examples, {len(split.eval)} held out for "
        f"{set_name}/eval and {num_train} for {set_name}/train; dropped from {name}: "
        f"{', '.join(drops) or 'none'}"
    )


def _chunks(
    kind: str, store: ExampleStore, indices: np.ndarray, kl_indices: np.ndarray | None = None
) -> Iterator[Chunk]:
    for a in range(0, len(indices), CHUNK_ROWS):
        kl = None if kl_indices is None else kl_indices[a : a + CHUNK_ROWS]
        yield Chunk(kind, store.path, store.kind, len(store), indices[a : a + CHUNK_ROWS], kl)


def _build_tokenizer(config: PipelineConfig, sets: dict[str, Split]) -> Any:
    """A BPE trained on the train splits' chat-rendered conversations and raw documents (texts
    rendered chunk by chunk, in ``num_proc`` processes), or the model's own tokenizer."""
    if config.model.init is None:
        return load_tokenizer(config.model.name_or_path, trust_remote_code=config.model.trust_remote_code)
    with ChunkMap(render_texts, config.data.num_proc) as pool:
        chunks = (
            chunk
            for name in ("sft", "preference", "kto", "pretrain")
            if name in sets
            for chunk in _chunks(name, sets[name].store, sets[name].train)
        )
        texts = (text for batch in pool.map(chunks) for text in batch)
        return train_tokenizer(texts, config.tokenizer.vocab_size, config.tokenizer.min_frequency)


def _write_rows(pool: ChunkMap, out: ShardWriter, chunks: Iterator[Chunk]) -> ChunkCounts:
    total = ChunkCounts()
    for batch, counts in pool.map(chunks):
        out.write(batch)
        total.add(counts)
    return total


def _write_examples(
    pool: ChunkMap, out: ShardWriter, split: Split, which: str, kind: str, metrics: dict[str, float]
) -> int:
    """Tokenise one split of an SFT, preference or KTO data set; returns its rows."""
    indices = getattr(split, which)
    kl = np.roll(indices, 1) if kind == "kto" else None  # example i's KL completion: example i - 1's
    counts = _write_rows(pool, out, _chunks(kind, split.store, indices, kl))
    name = out.name.replace("/", "_")
    metrics[f"num_{name}_dropped_empty"] = counts.dropped_empty
    if kind == "preference":
        metrics[f"num_{name}_dropped_identical"] = counts.dropped_identical
    if kind == "kto":
        metrics[f"num_{name}_desirable"] = counts.desirable
    metrics[f"mean_{name}_tokens"] = counts.mean_tokens()
    metrics[f"num_{name}_truncated_prompts"] = counts.truncated_prompts
    metrics[f"num_{name}_truncated_completions"] = counts.truncated_completions
    cut = [
        text
        for n, text in (
            (
                counts.truncated_prompts,
                f"{counts.truncated_prompts} prompts to data.max_prompt_length_tokens (their last tokens kept)",
            ),
            (counts.truncated_completions, f"{counts.truncated_completions} completions to data.max_length_tokens"),
        )
        if n
    ]
    if cut:
        logger.warning("%s: of %d encoded sequences, cut %s", out.name, counts.sequences, " and ".join(cut))
    return out.close()


def _write_documents(
    pool: ChunkMap, out: ShardWriter, split: Split, which: str, tokenizer: Any, block: int, metrics: dict[str, float]
) -> int:
    """Pretrain documents tokenised, each followed by EOS, joined and cut into blocks of ``block``
    tokens (the last block keeps the remainder when it has 2 tokens or more); returns the blocks."""
    indices, name = getattr(split, which), out.name.replace("/", "_")
    if tokenizer.eos_token_id is None:
        raise ConfigError("the tokenizer has no eos_token: pretrain documents cannot be separated")
    carry: list[int] = []
    num_tokens = 0
    for batch, _ in pool.map(_chunks("pretrain", split.store, indices)):
        blocks, carry = cut_blocks(carry + batch.column("input_ids")[0].as_py(), block)
        _write_blocks(out, blocks)
        num_tokens += sum(len(b) for b in blocks)
    if len(carry) >= 2:
        _write_blocks(out, [carry])
        num_tokens += len(carry)
    metrics[f"num_{name}_documents"] = len(indices)
    metrics[f"num_{name}_tokens"] = num_tokens
    return out.close()


def _write_blocks(out: ShardWriter, blocks: list[list[int]]) -> None:
    rows = [{"input_ids": b, "num_tokens": len(b)} for b in blocks]
    out.write(pa.RecordBatch.from_pylist(rows, schema=PRETRAIN_SCHEMA))


def _write_problems(
    out: ShardWriter, tokenizer: Any, problems: list[dict], config: PipelineConfig, metrics: dict[str, float]
) -> int:
    data, rows = config.data, []
    for p in problems:
        ids = encode_chat(tokenizer, p["messages"], None, data.max_length_tokens, data.max_prompt_length_tokens)
        rows.append(
            {"messages_json": messages_json(p["messages"]), "answer": p["answer"], "prompt_input_ids": ids["input_ids"]}
        )
    metrics["mean_eval_problems_prompt_tokens"] = (
        sum(len(r["prompt_input_ids"]) for r in rows) / len(rows) if rows else 0.0
    )
    if not rows:
        logger.warning("no eval problems (no held-out row has a '#### <answer>'); exact-match eval is skipped")
    out.write(pa.RecordBatch.from_pylist(rows, schema=EVAL_PROBLEMS_SCHEMA))
    return out.close()


def _write_splits(
    writer: ArtifactWriter,
    tokenizer: Any,
    sets: dict[str, Split],
    problems: list[dict],
    config: PipelineConfig,
    tmp: str,
    metrics: dict[str, float],
) -> list[str]:
    """Tokenise and write every split, in order; returns their names.

    Raises:
        DataError: a split left with no rows.
    """
    data = config.data
    encoder = ChunkEncoder(tokenizer, data.max_length_tokens, data.max_prompt_length_tokens, data.assistant_turns)
    num_rows: dict[str, int] = {}
    with ChunkMap(encoder, data.num_proc) as pool:
        for set_name in ("sft", "preference", "eval_problems", "kto", "pretrain"):
            if set_name == "eval_problems":
                out = ShardWriter(writer, set_name, EVAL_PROBLEMS_SCHEMA, tmp)
                num_rows[set_name] = _write_problems(out, tokenizer, problems, config, metrics)
                continue
            if set_name not in sets:
                continue
            for which in ("train", "eval"):
                name = f"{set_name}/{which}"
                out = ShardWriter(writer, name, SCHEMAS[set_name], tmp)
                if set_name == "pretrain":
                    rows = _write_documents(
                        pool, out, sets[set_name], which, tokenizer, data.max_length_tokens, metrics
                    )
                else:
                    rows = _write_examples(pool, out, sets[set_name], which, set_name, metrics)
                if not rows:
                    raise _empty_split_error(name, sets[set_name], _source_names(config)[set_name], metrics)
                num_rows[name] = rows
    for name, rows in num_rows.items():
        metrics[f"num_{name.replace('/', '_')}"] = rows
    return list(num_rows)


def _source_names(config: PipelineConfig) -> dict[str, str]:
    data = config.data
    return {
        "sft": data.sft.uri or "synthetic",
        "preference": data.preference.uri or "synthetic",
        "eval": data.eval.uri or "held-out sft rows",
        **{name: getattr(data, name).uri or "synthetic" for name in ("kto", "pretrain") if getattr(data, name)},
    }


@contextlib.contextmanager
def _discarded_on_failure(writer: ArtifactWriter) -> Iterator[None]:
    """Remove ``writer``'s uncommitted directory when the body fails (best-effort: a failed removal
    is logged), so that no ``final/`` without a manifest is left behind; except when this attempt
    lost the stage's lease, as the directory is then the new owner's."""
    try:
        yield
    except LeaseLostError:
        raise
    except Exception:
        logger.info("removing the uncommitted %s", writer.uri)
        storage.remove(writer.uri)
        raise


def _commit(
    ctx: StageContext, writer: ArtifactWriter, tokenizer: Any, splits: list[str], metrics: dict[str, float]
) -> Manifest:
    """Write the manifest of ``writer``'s directory (after the fence check) and return it."""
    config = ctx.config
    extra = {
        "splits": splits,
        "sources": _source_names(config),
        "tokenizer_trained": config.model.init is not None,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "max_length_tokens": config.data.max_length_tokens,
        "max_prompt_length_tokens": config.data.max_prompt_length_tokens,
    }
    ctx.check_fence(f"the manifest of {writer.uri}")
    return writer.commit(
        kind="final",
        stage=STAGE,
        run_id=ctx.spec.run_id,
        config_hash=ctx.fingerprint,
        metrics={k: float(v) for k, v in metrics.items()},
        extra=extra,
    )


def run(ctx: StageContext) -> Manifest:
    """Prepare every data set of the config and commit them under ``<output_uri>/final``.

    A train split that the decontamination empties fails before ``final/`` is opened; a failure
    after it is opened removes the uncommitted directory (:func:`_discarded_on_failure`).

    Returns:
        The committed manifest; ``metrics`` hold row counts per split, dropped counts, mean
        tokens and the vocabulary size.

    Raises:
        DataError: a missing / malformed data file or record, too many unparsable records, or a
            split left empty (the message gives the records read and the rows dropped, by reason).
        ConfigError: the tokenizer cannot be loaded or its chat template is unusable.
    """
    config = ctx.config
    metrics: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="posttrain-prepare-") as tmp:
        sets, problems = _splits(config, tmp, metrics)
        tokenizer = _build_tokenizer(config, sets)
        metrics["vocab_size"] = len(tokenizer)
        ctx.check_fence(f"the prepared data {ctx.layout.final}")
        writer = ArtifactWriter(ctx.layout.final, overwrite=True)
        with _discarded_on_failure(writer):
            splits = _write_splits(writer, tokenizer, sets, problems, config, tmp, metrics)
            tokenizer.save_pretrained(f"{tmp}/tokenizer")
            writer.write_dir(f"{tmp}/tokenizer", prefix="tokenizer")
            manifest = _commit(ctx, writer, tokenizer, splits, metrics)
    logger.info("prepare_data committed %s: %s", writer.uri, {k: v for k, v in metrics.items() if k.startswith("num_")})
    return manifest
