"""Bad SFT data fails the ``prepare_data`` stage process with exit code 2 (bad input: never
retried) and one ``error:`` line naming the file, the line or the config field, and it commits
nothing: a missing field, a corrupt gzip stream, an empty file.

The shipped ``configs/gsm8k-hh.yaml`` with its SFT source replaced (read first), as
``tests/e2e/test_bad_input.py`` runs it through the CLI for a malformed JSON line (the CLI's exit
code, its ``pipeline failed:`` message, the summary, one task run, the failed MLflow run): the
stage process is where the three cases here differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer_core.config import load_config
from trainer_core.spec import build_spec

from .helpers import REPO_ROOT, run_stage, write_spec

CONFIG = REPO_ROOT / "configs" / "gsm8k-hh.yaml"
GOOD = {"question": "Ann has 2 apples and buys 3. How many now?", "answer": "2+3=<<2+3=5>>5\n#### 5"}


def missing_field(tmp: Path) -> tuple[Path, tuple[str, ...]]:
    sft = tmp / "sft.jsonl"
    sft.write_text(f"{json.dumps(GOOD)}\n{json.dumps({'answer': GOOD['answer']})}\n")
    return sft, (f"{sft}:2", "missing field 'question'")


def corrupt_gzip(tmp: Path) -> tuple[Path, tuple[str, ...]]:
    sft = tmp / "sft.jsonl.gz"
    sft.write_bytes(b"\x1f\x8b\x08 a truncated gzip stream")
    return sft, (f"data.sft.uri: {sft}:1", "corrupt or truncated")


def empty_file(tmp: Path) -> tuple[Path, tuple[str, ...]]:
    sft = tmp / "empty.jsonl"
    sft.write_text("")
    return sft, (str(sft), "no records")


@pytest.mark.parametrize("bad", [missing_field, corrupt_gzip, empty_file], ids=lambda f: f.__name__)
def test_bad_sft_file_fails_prepare_data_with_exit_2_naming_it(tmp_path, bad):
    sft, needles = bad(tmp_path)
    root = tmp_path / "out"
    config = load_config(str(CONFIG), overrides={"storage.root": str(root), "data.sft.uri": str(sft)})
    output = str(root / "prepare_data")
    spec = write_spec(build_spec(config, "prepare_data", "bad-data", {}, output_uri=output), tmp_path / "spec.json")
    run = run_stage(spec)
    assert run.returncode == 2, run.tail()
    errors = [line for line in run.lines if line.startswith("error: ")]
    assert len(errors) == 1, run.tail()
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    assert not list(root.rglob("manifest.json"))
