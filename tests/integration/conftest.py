"""Integration fixtures: prepared data and one uninterrupted run of every training stage,
shared by the whole session (each stage process takes ~10 s, mostly imports)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from trainer_core.spec import build_spec
from trainer_core.storage import StageLayout

from .helpers import RUN_ID, TinyPipeline, run_stage, tiny_config, write_spec


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyPipeline]:
    """prepare_data, then SFT, then reward model and DPO side by side, each run once to the end."""
    root = str(tmp_path_factory.mktemp("pipeline"))
    config = tiny_config(root)
    data_out = os.path.join(root, "data")
    spec = build_spec(config, "prepare_data", RUN_ID, {}, output_uri=data_out)
    run = run_stage(write_spec(spec, os.path.join(root, "specs", "prepare_data.json")))
    assert run.returncode == 0, run.tail()
    pipeline = TinyPipeline(root=root, config=config, data_uri=StageLayout(data_out).final)
    pipeline.run_baseline("sft")
    with ThreadPoolExecutor(max_workers=2) as pool:
        for job in [pool.submit(pipeline.run_baseline, s) for s in ("reward_model", "dpo")]:
            job.result()
    yield pipeline
