"""KTO and continued-pretraining data: the kto and text formats, plain-text files, and the
prepare_data splits they give (unpaired examples with their mismatched KL sequences; documents
packed into blocks), plus the config and registry wiring of the two opt-in stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.tiny import TINY_PREPARE
from trainer_core.config import DataSource, PipelineConfig, load_config
from trainer_core.data.batching import collate_kto
from trainer_core.data.formats import detect_format, to_kto_examples, to_text_example
from trainer_core.data.prepared import load_split, load_tokenizer_from
from trainer_core.data.sources import read_records
from trainer_core.errors import ConfigError, DataError
from trainer_core.fingerprint import stage_fingerprint
from trainer_core.registry import DEFAULT_STAGES, stage_inputs
from trainer_core.spec import build_spec
from trainer_core.stages.runner import run_spec
from trainer_core.storage import StageLayout, join_uri

TINY = {**TINY_PREPARE, "data.max_length_tokens": 64, "data.max_prompt_length_tokens": 32}
"""prepare_data's tiny data (``tests/tiny.py``), rows of at most 64 tokens (prompts 32)."""


def test_detect_kto_and_text():
    assert detect_format({"prompt": "p", "completion": "c", "label": True}) == "kto"
    assert detect_format({"prompt": "p", "completion": "c", "label": "math"}) == "prompt_completion"  # not a kto label
    assert detect_format({"text": "t"}) == "text"


def test_kto_record_and_pairs_unpaired():
    (one,) = to_kto_examples({"prompt": "p", "completion": "c", "label": False, "_source": "k.jsonl:3"})
    assert one == {
        "messages": [{"role": "user", "content": "p"}],
        "completion": "c",
        "label": False,
        "_source": "k.jsonl:3",
    }
    chosen, rejected = to_kto_examples({"prompt": "p", "chosen": "good", "rejected": "bad"})
    assert (chosen["completion"], chosen["label"], rejected["completion"], rejected["label"]) == (
        "good",
        True,
        "bad",
        False,
    )
    hh = {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!", "rejected": "\n\nHuman: Hi\n\nAssistant: Go away."}
    assert [ex["label"] for ex in to_kto_examples(hh, "hh_rlhf")] == [True, False]


def test_kto_errors_name_source_and_field():
    with pytest.raises(DataError, match=r"k.jsonl:4: field 'label' must be bool, got int"):
        to_kto_examples({"prompt": "p", "completion": "c", "label": 1, "_source": "k.jsonl:4"}, "kto")
    with pytest.raises(DataError, match=r"g.jsonl:1: format 'gsm8k' has no desirable/undesirable labels"):
        to_kto_examples({"question": "q", "answer": "a", "_source": "g.jsonl:1"})


def test_text_examples():
    assert to_text_example({"body": "raw", "_source": "t:1"}, "text", field="body") == {"text": "raw", "_source": "t:1"}
    assert to_text_example({"question": "q?", "answer": "a\n#### 1"}, "gsm8k") == {"text": "q?\na\n#### 1"}
    assert to_text_example({"prompt": "p", "completion": "c"}, "prompt_completion") == {"text": "p\nc"}
    with pytest.raises(DataError, match=r"x:2: missing field 'text'"):
        to_text_example({"body": "raw", "_source": "x:2"}, "text")
    with pytest.raises(DataError, match=r"x:2: cannot detect the record format"):
        to_text_example({"body": "raw", "_source": "x:2"})
    assert to_text_example({"question": "q?", "answer": "a"}) == {"text": "q?\na"}  # auto: detected, rendered
    with pytest.raises(DataError, match=r"has no raw-text rendering"):
        to_text_example({"prompt": "p", "chosen": "a", "rejected": "b"}, "prompt_completion")


def test_plain_text_file_gives_a_record_per_line(tmp_path: Path):
    path = tmp_path / "corpus.txt"
    path.write_text("first line\n\n  \nsecond line\r\n", encoding="utf-8")
    records = read_records(DataSource(uri=str(path), text_field="body"))
    assert records == [{"body": "first line", "_source": f"{path}:1"}, {"body": "second line", "_source": f"{path}:4"}]
    (tmp_path / "bad.txt").write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(DataError, match=r"bad.txt:2: invalid text: not UTF-8"):
        read_records(DataSource(uri=str(tmp_path / "bad.txt")))


def test_collate_kto_pads_both_sequences_and_carries_labels():
    rows = [
        {
            "input_ids": [1, 2, 3],
            "loss_mask": [0, 1, 1],
            "kl_input_ids": [1, 2, 4, 5],
            "kl_loss_mask": [0, 1, 1, 1],
            "label": True,
            "ref_logprobs": -1.5,
            "ref_kl_logprobs": -2.5,
        },
        {
            "input_ids": [6, 7],
            "loss_mask": [0, 1],
            "kl_input_ids": [6, 3],
            "kl_loss_mask": [0, 1],
            "label": False,
            "ref_logprobs": -0.5,
            "ref_kl_logprobs": -0.25,
        },
    ]
    batch = collate_kto(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [6, 7, 0]]
    assert batch["kl_input_ids"].tolist() == [[1, 2, 4, 5], [6, 3, 0, 0]]
    assert batch["kl_attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["label"].tolist() == [True, False] and batch["label"].dtype == torch.bool
    assert batch["ref_kl_logprobs"].tolist() == [-2.5, -0.25]
    with pytest.raises(ValueError, match="batch row 0 has no 'label'"):
        collate_kto([{k: v for k, v in rows[0].items() if k != "label"}], pad_id=0)


def test_opt_in_stages_need_their_data():
    assert "kto" not in DEFAULT_STAGES and "pretrain" not in DEFAULT_STAGES
    assert PipelineConfig().stages == list(DEFAULT_STAGES)
    for stage in ("kto", "pretrain"):
        with pytest.raises(ConfigError, match=rf"stage '{stage}' reads data.{stage}, which is not set"):
            load_config(overrides={"stages": ["prepare_data", stage]})


def test_sft_starts_from_pretrain_and_kto_from_sft():
    config = load_config(
        overrides={"stages": ["prepare_data", "pretrain", "sft", "kto"], "data.kto": {}, "data.pretrain": {}}
    )
    outputs = {"prepare_data": "d", "pretrain": "p"}
    assert stage_inputs(config, "pretrain", {"prepare_data": "d"})["model"] == "init"
    assert stage_inputs(config, "sft", outputs)["model"] == "p"
    assert stage_inputs(config, "kto", {**outputs, "sft": "s"}) == {"data": "d", "model": "s", "reference": "s"}


def test_unset_kto_and_pretrain_keep_the_prepare_data_fingerprint():
    config = load_config(overrides=TINY)
    extended = load_config(overrides={**TINY, "data.kto": {}})
    assert stage_fingerprint(config, "prepare_data", {}) != stage_fingerprint(extended, "prepare_data", {})
    plain = config.model_dump(mode="json")
    plain["data"].pop("kto"), plain["data"].pop("pretrain")
    for source in ("sft", "preference", "eval"):
        plain["data"][source].pop("text_field")
    # the payload without the new fields hashes as before them: they are left out at their neutral values
    assert stage_fingerprint(load_config(base=plain), "prepare_data", {}) == stage_fingerprint(
        config, "prepare_data", {}
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[str, object]:
    root = str(tmp_path_factory.mktemp("prepared"))
    config = load_config(overrides={**TINY, "data.kto": {"uri": None}, "data.pretrain": {"uri": None}})
    spec = build_spec(config, "prepare_data", "run-1", {}, output_uri=join_uri(root, "prepare_data"))
    return StageLayout(spec.output_uri).final, run_spec(spec)


def test_kto_splits_unpair_the_preference_pairs(prepared):
    out, manifest = prepared
    train, held_out = load_split(out, "kto/train"), load_split(out, "kto/eval")
    assert manifest.metrics["num_kto_train"] == len(train) and manifest.metrics["num_kto_eval"] == len(held_out)
    for rows in (train, held_out):
        labels = [r["label"] for r in rows]
        assert labels.count(True) == labels.count(False)  # both sides of every pair, no pair across splits
    assert {r["messages_json"] for r in train}.isdisjoint({r["messages_json"] for r in held_out})
    for i, row in enumerate(train):
        prompt = row["input_ids"][: row["loss_mask"].index(1)]
        assert row["kl_input_ids"][: len(prompt)] == prompt  # the example's own prompt ...
        previous = train[i - 1]  # ... with the previous example's completion (each cut to its row's length)
        kl_completion, completion = (
            row["kl_input_ids"][len(prompt) :],
            previous["input_ids"][previous["loss_mask"].index(1) :],
        )
        n = min(len(kl_completion), len(completion))
        assert n > 0 and kl_completion[:n] == completion[:n]
        assert len(row["kl_loss_mask"]) == len(row["kl_input_ids"])


def test_pretrain_splits_pack_every_document_token(prepared):
    out, manifest = prepared
    tokenizer = load_tokenizer_from(out)
    train = load_split(out, "pretrain/train")
    assert all(r["num_tokens"] == 64 for r in train[:-1]) and 2 <= train[-1]["num_tokens"] <= 64
    stream = [t for r in train for t in r["input_ids"]]
    assert stream.count(tokenizer.eos_token_id) == manifest.metrics["num_pretrain_train_documents"]
    assert len(stream) == manifest.metrics["num_pretrain_train_tokens"]
    first = tokenizer.decode(stream[: stream.index(tokenizer.eos_token_id)])
    assert "####" in first and "\n" in first  # a problem and its worked solution, as plain text


def test_pretrain_documents_holding_an_eval_question_are_dropped(tmp_path):
    question = "What is 2 + 2?"
    docs = [{"text": f"doc {i}: some words"} for i in range(12)] + [{"text": f"leaked: {question} 4"}] * 3
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text(json.dumps({"question": question, "answer": "#### 4"}) + "\n", encoding="utf-8")
    config = load_config(
        overrides={
            **TINY,
            "data.pretrain": {"uri": str(path)},
            "data.eval": {"uri": str(eval_path)},
            "data.eval_fraction": 0.1,
            "data.max_eval_rows": 1,
        }
    )
    spec = build_spec(config, "prepare_data", "run-1", {}, output_uri=str(tmp_path / "out"))
    manifest = run_spec(spec)
    kept = manifest.metrics["num_pretrain_train_documents"]
    assert manifest.metrics["num_pretrain_train_dropped_overlap"] >= 2 and kept + 1 + manifest.metrics[
        "num_pretrain_train_dropped_overlap"
    ] == len(docs)
    tokenizer = load_tokenizer_from(StageLayout(spec.output_uri).final)
    text = tokenizer.decode(
        [t for r in load_split(StageLayout(spec.output_uri).final, "pretrain/train") for t in r["input_ids"]]
    )
    assert "What is 2" not in text


def test_a_missing_optional_split_says_why(tmp_path):
    config = load_config(overrides=TINY)
    spec = build_spec(config, "prepare_data", "run-1", {}, output_uri=str(tmp_path / "out"))
    run_spec(spec)
    with pytest.raises(DataError, match=r"kto/train.parquet .* made without data.kto"):
        load_split(StageLayout(spec.output_uri).final, "kto/train")


def test_kto_needs_two_examples_a_micro_batch():
    with pytest.raises(ConfigError, match="kto.micro_batch_size must be at least 2"):
        load_config(overrides={"kto.micro_batch_size": 1})
