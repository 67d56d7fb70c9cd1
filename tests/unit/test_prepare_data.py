"""prepare_data end to end on tiny configs: manifest, Parquet columns and types, splits, drops, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import fsspec.config
import pytest

from tests.shared_data import GSM8K, HH
from tests.tiny import TINY_PREPARE
from trainer_core import storage
from trainer_core.checkpoint.manifest import read_manifest, verify
from trainer_core.config import load_config
from trainer_core.data.formats import final_answer
from trainer_core.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_tokenizer
from trainer_core.errors import EXIT_BAD_INPUT, DataError
from trainer_core.spec import StageSpec, build_spec
from trainer_core.storage import StageLayout, join_uri
from trainer_core.data.prepared import SPLIT_NAMES, load_split, load_tokenizer_from
from trainer_core.stages.prepare_data import split_train_eval
from trainer_core.stages.runner import run_spec as run


def _spec(root: str, **overrides) -> StageSpec:
    """A prepare_data spec writing under ``root`` (on S3: the endpoint the test configured)."""
    if root.startswith("s3://"):
        overrides.setdefault("storage.endpoint_url", fsspec.config.conf["s3"]["endpoint_url"])
    config = load_config(overrides={**TINY_PREPARE, **overrides})
    return build_spec(config, "prepare_data", "run-1", {}, output_uri=join_uri(root, "prepare_data"))


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_synthetic_run_writes_committed_splits(storage_root):
    spec = _spec(storage_root)
    manifest = run(spec)
    out = StageLayout(spec.output_uri).final
    assert read_manifest(out) == manifest and verify(out, hashes=True) == []
    assert (manifest.kind, manifest.stage, manifest.run_id) == ("final", "prepare_data", "run-1")
    paths = {f.path for f in manifest.files}
    assert {f"{n}/part-00000.parquet" for n in SPLIT_NAMES} | {
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
    } <= paths
    m = manifest.metrics
    # 40 problems, 25% held out but capped at 8; 20 pairs, 5 held out
    assert (m["num_sft_train"], m["num_sft_eval"], m["num_eval_problems"]) == (32, 8, 8)
    assert (m["num_preference_train"], m["num_preference_eval"]) == (15, 5)
    assert m["vocab_size"] == len(load_tokenizer_from(out)) and m["mean_sft_train_tokens"] > 10
    assert manifest.extra["sources"] == {"sft": "synthetic", "preference": "synthetic", "eval": "held-out sft rows"}


def test_parquet_columns_and_types(tmp_path):
    spec = _spec(str(tmp_path))
    run(spec)
    out = StageLayout(spec.output_uri).final
    schema = pq.read_schema(pa.BufferReader(storage.read_bytes(join_uri(out, "sft/train/part-00000.parquet"))))
    assert schema.names == [
        "prompt",
        "completion",
        "answer",
        "messages_json",
        "input_ids",
        "loss_mask",
        "num_tokens",
        "tools_json",
    ]
    assert schema.field("input_ids").type == pa.list_(pa.int32()) and schema.field("loss_mask").type == pa.list_(
        pa.int8()
    )
    assert schema.field("num_tokens").type == pa.int32()
    pref = pq.read_schema(pa.BufferReader(storage.read_bytes(join_uri(out, "preference/eval/part-00000.parquet"))))
    assert pref.names == [
        "messages_json",
        "chosen",
        "rejected",
        "chosen_input_ids",
        "chosen_loss_mask",
        "rejected_input_ids",
        "rejected_loss_mask",
    ]
    probs = pq.read_schema(pa.BufferReader(storage.read_bytes(join_uri(out, "eval_problems/part-00000.parquet"))))
    assert probs.names == ["messages_json", "answer", "prompt_input_ids"]


def test_rows_decode_to_chat_and_eval_problems_are_held_out_sft(tmp_path):
    spec = _spec(str(tmp_path))
    run(spec)
    out = StageLayout(spec.output_uri).final
    tok = load_tokenizer_from(out)
    sft_train, sft_eval = load_split(out, "sft/train"), load_split(out, "sft/eval")
    row = sft_train[0]
    assert row["num_tokens"] == len(row["input_ids"]) == len(row["loss_mask"])
    start = row["loss_mask"].index(1)
    assert tok.decode(row["input_ids"][start:]) == row["completion"] + SPECIAL_TOKENS["eos"] + "\n"
    assert json.loads(row["messages_json"]) == [{"role": "user", "content": row["prompt"]}]
    assert row["answer"] == final_answer(row["completion"])
    problems = load_split(out, "eval_problems")
    assert [(p["messages_json"], p["answer"]) for p in problems] == [
        (r["messages_json"], r["answer"]) for r in sft_eval
    ]
    assert tok.decode(problems[0]["prompt_input_ids"]).endswith("<|assistant|>\n")
    assert not {r["messages_json"] for r in sft_train} & {p["messages_json"] for p in problems}
    pair = load_split(out, "preference/train")[0]
    assert pair["chosen_input_ids"] != pair["rejected_input_ids"] and 1 in pair["chosen_loss_mask"]


def test_deterministic_for_a_seed(tmp_path):
    run(_spec(str(tmp_path / "a")))
    run(_spec(str(tmp_path / "b")))
    run(_spec(str(tmp_path / "c"), seed=6))
    read = {k: load_split(StageLayout(str(tmp_path / k / "prepare_data")).final, "sft/eval") for k in "abc"}
    assert read["a"] == read["b"] != read["c"]


def test_rerun_overwrites(tmp_path):
    spec = _spec(str(tmp_path))
    run(spec)
    second = run(spec)
    assert read_manifest(StageLayout(spec.output_uri).final) == second


def test_real_files_with_pretrained_tokenizer_and_eval_source(tmp_path):
    """GSM8K + HH-RLHF rows, a tokenizer loaded from a directory, a separate eval file."""
    tok_dir = tmp_path / "tok"
    train_tokenizer(["Human: hi\n\nAssistant: hello #### 12"] * 3, 300, 1).save_pretrained(tok_dir)
    eval_uri = _jsonl(tmp_path / "test.jsonl", [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}] * 3)
    if GSM8K.exists():
        sft, pref = str(GSM8K), str(HH)
    else:  # same formats, hand-made
        sft = _jsonl(tmp_path / "g.jsonl", [{"question": f"q{i}?", "answer": f"#### {i}"} for i in range(30)])
        pref = _jsonl(
            tmp_path / "h.jsonl",
            [
                {"chosen": f"\n\nHuman: h{i}\n\nAssistant: yes", "rejected": f"\n\nHuman: h{i}\n\nAssistant: no"}
                for i in range(30)
            ],
        )
    spec = _spec(
        str(tmp_path / "out"),
        **{
            "model.init": None,
            "model.name_or_path": str(tok_dir),
            "data.sft.uri": sft,
            "data.sft.max_rows": 30,
            "data.preference.uri": pref,
            "data.preference.max_rows": 30,
            "data.eval.uri": eval_uri,
            "data.max_eval_rows": 2,
            "data.max_length_tokens": 96,
            "data.max_prompt_length_tokens": 64,
        },
    )
    manifest = run(spec)
    out = StageLayout(spec.output_uri).final
    assert manifest.metrics["num_eval_problems"] == 2
    assert manifest.metrics["vocab_size"] == len(load_tokenizer(str(tok_dir))) == len(load_tokenizer_from(out))
    assert manifest.extra["tokenizer_trained"] is False
    assert all(len(r["input_ids"]) <= 96 for r in load_split(out, "sft/train"))
    assert load_split(out, "eval_problems")[0]["answer"] == "4"
    assert manifest.metrics["num_preference_train"] + manifest.metrics["num_preference_eval"] <= 30


def _call(i: int) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{i}+1"}}}


CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def test_conversations_count_every_assistant_turn(tmp_path):
    """``messages`` records with ``data.assistant_turns: all``: each SFT row's loss mask covers both
    assistant replies (their text, the first one's tool call and end of turn), never the tool's
    output, the declared tools (the ``tools`` column, a list or a JSON string of one) or the
    user's turns; ``last`` covers the final reply alone."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Tom has {i} apples."},
                {"role": "assistant", "content": f"{i}+1=", "tool_calls": [_call(i)]},
                {"role": "tool", "name": "calculator", "content": f"{i + 1}"},
                {"role": "user", "content": "And now?"},
                {"role": "assistant", "content": f"#### {i + 1}"},
            ],
            "tools": [CALCULATOR_SCHEMA] if i % 2 else json.dumps([CALCULATOR_SCHEMA]),
        }
        for i in range(20)
    ]
    sft = _jsonl(tmp_path / "chat.jsonl", rows)
    counted = {}
    for turns in ("all", "last"):
        spec = _spec(str(tmp_path / turns), **{"data.sft.uri": sft, "data.assistant_turns": turns})
        run(spec)
        out = StageLayout(spec.output_uri).final
        tok = load_tokenizer_from(out)
        row = load_split(out, "sft/train")[0]
        counted[turns] = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
        i = int(row["completion"].removeprefix("#### ")) - 1
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{i}+1"}}}}\n</tool_call>'
    assert counted["all"] == f"{i}+1=\n{call}<|end|>\n#### {i + 1}<|end|>\n"
    assert counted["last"] == f"#### {i + 1}<|end|>\n"
    assert json.loads(row["messages_json"])[1]["tool_calls"] == [_call(i)]
    assert json.loads(row["tools_json"]) == [CALCULATOR_SCHEMA]
    text = tok.decode(row["input_ids"])  # the prompt's first tokens may be cut (data.max_prompt_length_tokens)
    assert (
        '"description": "Evaluate arithmetic.", "parameters"' in text and "\n</tools><|end|>\n<|user|>\nTom has" in text
    )


def test_train_rows_with_an_eval_problem_prompt_are_dropped(tmp_path):
    rows = [{"question": f"How many is {i}?", "answer": f"It is {i}.\n#### {i}"} for i in range(20)]
    sft = _jsonl(tmp_path / "sft.jsonl", rows)
    eval_uri = _jsonl(tmp_path / "eval.jsonl", rows[:6])
    spec = _spec(str(tmp_path / "out"), **{"data.sft.uri": sft, "data.eval.uri": eval_uri, "data.max_eval_rows": 10})
    m = run(spec).metrics
    out = StageLayout(spec.output_uri).final
    held_out_sft = {r["prompt"] for r in load_split(out, "sft/eval")}
    expected = len({r["question"] for r in rows[:6]} - held_out_sft)
    assert expected > 0 and m["num_sft_train_dropped_overlap"] == expected
    assert m["num_sft_train"] == 20 - len(held_out_sft) - expected and m["num_eval_problems"] == 6
    assert not {r["prompt"] for r in load_split(out, "sft/train")} & {r["question"] for r in rows[:6]}


def test_identical_and_unparsable_pairs_are_dropped_and_counted(tmp_path):
    good = [{"prompt": f"p{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(8)]
    same = [{"prompt": "p", "chosen": "same", "rejected": "same"}]
    pref = _jsonl(tmp_path / "p.jsonl", good + same)
    spec = _spec(str(tmp_path / "out"), **{"data.preference.uri": pref, "data.eval_fraction": 0.1})
    m = run(spec).metrics
    assert m["num_preference_train_dropped_identical"] + m["num_preference_eval_dropped_identical"] == 1
    assert m["num_preference_train"] + m["num_preference_eval"] == 8

    pairs = [
        {"chosen": f"\n\nHuman: h{i}\n\nAssistant: yes", "rejected": f"\n\nHuman: h{i}\n\nAssistant: no"}
        for i in range(40)
    ]
    broken = [{"chosen": "\n\nHuman: a\n\nAssistant: x", "rejected": "\n\nHuman: b\n\nAssistant: y"}]
    spec = _spec(str(tmp_path / "out2"), **{"data.preference.uri": _jsonl(tmp_path / "h.jsonl", pairs + broken)})
    assert run(spec).metrics["num_preference_invalid"] == 1
    spec = _spec(str(tmp_path / "out3"), **{"data.preference.uri": _jsonl(tmp_path / "h2.jsonl", pairs[:5] + broken)})
    with pytest.raises(DataError, match=r"1 of 6 records do not parse .*h2.jsonl:6"):
        run(spec)


def test_bad_data_raises_and_commits_nothing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q2"}\n', encoding="utf-8")
    spec = _spec(str(tmp_path / "out"), **{"data.sft.uri": str(bad)})
    with pytest.raises(DataError, match=rf"{bad}:2: missing field 'answer'"):
        run(spec)
    assert not storage.exists(join_uri(StageLayout(spec.output_uri).final, "manifest.json"))
    with pytest.raises(DataError, match="not a committed prepare_data output"):
        load_split(StageLayout(spec.output_uri).final, "sft/train")


def test_lone_surrogate_is_bad_input_naming_file_and_line(tmp_path):
    """A JSON ``"\\ud800"`` escape (half a surrogate pair) crashed the staging in pyarrow (a
    UnicodeEncodeError naming nothing, retried): it is a DataError (exit 2, never retried) naming
    the file, the line and the field, and nothing is written."""
    sft = tmp_path / "sft.jsonl"
    rows = [json.dumps({"question": f"q{i}?", "answer": f"#### {i}"}) for i in range(5)]
    sft.write_text("\n".join(rows[:3] + ['{"question": "bad \\ud800 q", "answer": "#### 1"}'] + rows[3:]) + "\n")
    spec = _spec(str(tmp_path / "out"), **{"data.sft.uri": str(sft)})
    with pytest.raises(DataError, match=rf"data.sft.uri: {sft}:4: field 'question' holds a lone UTF-16 surrogate") as e:
        run(spec)
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert not os.path.exists(StageLayout(spec.output_uri).final)


def _every_train_row_dropped(tmp_path: Path) -> tuple[dict, str]:
    rows = [{"question": f"How many is {i}?", "answer": f"It is {i}.\n#### {i}"} for i in range(20)]
    return (
        {
            "data.sft.uri": _jsonl(tmp_path / "sft.jsonl", rows),
            "data.eval.uri": _jsonl(tmp_path / "eval.jsonl", rows),
            "data.max_eval_rows": 100,
        },
        rf"sft/train: no rows left: 20 records read from {tmp_path}/sft.jsonl gave 20 examples, 5 held out for "
        r"sft/eval and 15 for sft/train; dropped from sft/train: 15 that overlap an eval problem",
    )


def _every_pair_identical(tmp_path: Path) -> tuple[dict, str]:
    pairs = [{"prompt": f"p{i}", "chosen": "same", "rejected": "same"} for i in range(10)]
    return (
        {"data.preference.uri": _jsonl(tmp_path / "p.jsonl", pairs)},
        rf"preference/train: no rows left: 10 records read from {tmp_path}/p.jsonl gave 10 examples, 2 held out "
        r"for preference/eval and 8 for preference/train; dropped from preference/train: 0 that overlap an eval "
        r"problem \(decontamination\), 8 whose chosen and rejected token ids are identical",
    )


@pytest.mark.parametrize("case", [_every_train_row_dropped, _every_pair_identical], ids=lambda f: f.__name__)
def test_split_left_empty_states_the_counts_and_leaves_no_final_dir(tmp_path, case):
    """Issue: "no rows left ... (see the dropped counts)" showed no count, and left ``final/``
    without a manifest. The message gives the records read, the split and the rows dropped by
    reason; a split emptied by decontamination fails before ``final/`` is opened, one emptied
    while tokenising removes the uncommitted directory."""
    overrides, message = case(tmp_path)
    spec = _spec(str(tmp_path / "out"), **overrides)
    with pytest.raises(DataError, match=message):
        run(spec)
    assert not os.path.exists(StageLayout(spec.output_uri).final)


def test_held_out_rows_with_a_non_number_answer_are_not_eval_problems(tmp_path):
    """Evaluation compares numbers: a held-out SFT row ending ``#### seventy-two`` could never
    match, so it is not an eval problem (an eval file's such row is refused, test_data_formats)."""
    rows = [
        {"question": f"How many is {i}?", "answer": f"It is {i}.\n#### {'seventy-two' if i % 2 else i}"}
        for i in range(20)
    ]
    spec = _spec(str(tmp_path / "out"), **{"data.sft.uri": _jsonl(tmp_path / "sft.jsonl", rows)})
    run(spec)
    out = StageLayout(spec.output_uri).final
    held_out = [r["answer"] for r in load_split(out, "sft/eval")]
    assert "seventy-two" in held_out and [p["answer"] for p in load_split(out, "eval_problems")] == [
        a for a in held_out if a != "seventy-two"
    ]


def test_load_split_unknown_name(tmp_path):
    spec = _spec(str(tmp_path))
    run(spec)
    with pytest.raises(DataError, match="prepared split not found"):
        load_split(StageLayout(spec.output_uri).final, "sft/test")


def test_split_train_eval():
    rows = [{"i": i} for i in range(10)]
    train, held_out = split_train_eval(rows, seed=0, eval_fraction=0.3, max_eval_rows=2)
    assert len(held_out) == 2 and len(train) == 8
    assert sorted(r["i"] for r in train + held_out) == list(range(10))
    assert split_train_eval(rows, 0, 0.3, 2) == (train, held_out)
    assert len(split_train_eval(rows[:2], 0, 0.01, 5)[1]) == 1
    with pytest.raises(DataError, match="need at least 2"):
        split_train_eval(rows[:1], 0, 0.5, 5, name="sft")


def test_cut_prompts_and_completions_are_counted_and_warned(tmp_path, caplog):
    """Issue 35, item 13: a prompt over data.max_prompt_length_tokens keeps its last tokens and a
    completion is cut to fit data.max_length_tokens, as before, but no longer silently: each
    split counts them (``num_<split>_truncated_prompts`` / ``_completions``) and warns once."""
    with caplog.at_level("WARNING", logger="trainer_core.stages.prepare_data"):
        m = run(
            _spec(str(tmp_path / "tight"), **{"data.max_prompt_length_tokens": 8, "data.max_length_tokens": 24})
        ).metrics
    assert m["num_sft_train_truncated_prompts"] == m["num_sft_train"] == 32  # every prompt is longer than 8
    assert 0 < m["num_sft_train_truncated_completions"] <= 32
    warned = [r.getMessage() for r in caplog.records if "sft/train" in r.getMessage()]
    assert len(warned) == 1 and "of 32 encoded sequences, cut 32 prompts to data.max_prompt_length_tokens" in warned[0]
