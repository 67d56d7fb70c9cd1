"""A run copied to another root and resumed there tracks into the copy's own MLflow store and
artifacts (``tasks/report/tracking.py``: ``rehome_copied_store``), against real SQLite stores.

MLflow keeps the experiment's artifact location (``<root>/mlflow-artifacts``) and each run's,
absolute, inside ``mlflow.db``; a copied ``mlflow.db`` still named the original root, so the
resumed copy's reopened parent run and its new stage runs wrote artifacts into the original.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from mlflow import MlflowClient

from tasks.report import tracking
from tasks.runs import resume_config, save_run_config
from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import load_config, resolve_local_root
from trainer_core.storage import RunLayout


def _tree(root) -> dict[str, bytes]:
    """Every file under ``root`` (the lock file aside) -> its contents."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if not name.endswith(".lock"):
                path = os.path.join(folder, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = f.read()
    return out


def _finish_sft(config, parent_id: str, uri: str) -> str:
    """A stage run of ``sft`` under ``parent_id``, finished with a manifest artifact."""
    stage_id = tracking.start_stage_run(config, parent_id, "sft", tracking_uri=uri)
    manifest = Manifest(kind="final", stage="sft", run_id="r1", global_step=3, files=[], metrics={})
    tracking.finish_stage_run(stage_id, manifest, None, "completed", tracking_uri=uri)
    return stage_id


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A storage root whose run ``r1`` was tracked in ``<root>/mlflow.db``, then interrupted."""
    root = str(tmp_path_factory.mktemp("copied") / "outputs")
    uri = f"sqlite:///{root}/mlflow.db"
    config = resolve_local_root(
        load_config(overrides={"storage.root": root, "tracking.tracking_uri": uri, "stages": "prepare_data,sft"})
    )
    save_run_config(config, RunLayout(root, "r1"))
    parent_id = tracking.start_pipeline_run(config, "r1", tracking_uri=uri)
    _finish_sft(config, parent_id, uri)
    tracking.finish_pipeline_run(parent_id, "failed", tracking_uri=uri)
    return root, uri, parent_id


def test_a_resumed_copy_writes_its_mlflow_artifacts_under_its_own_root(original, tmp_path):
    """``cp -r outputs COPY; posttrain resume r1 --root COPY`` wrote the reopened parent run's
    ``config.json`` and the new stage run's manifest into ``outputs/mlflow-artifacts``."""
    root, uri, parent_id = original
    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy)
    before = _tree(root)

    config, _ = resume_config(copy, "r1")
    copy_uri = config.tracking.tracking_uri
    assert copy_uri == f"sqlite:///{copy}/mlflow.db"
    assert tracking.start_pipeline_run(config, "r1", tracking_uri=copy_uri) == parent_id  # reopened
    stage_id = _finish_sft(config, parent_id, copy_uri)
    tracking.finish_pipeline_run(parent_id, "completed", tracking_uri=copy_uri)

    assert _tree(root) == before  # the original root, its store and its artifacts, untouched
    client = MlflowClient(copy_uri)
    artifacts = os.path.join(copy, "mlflow-artifacts")
    experiment = client.get_experiment(client.get_run(parent_id).info.experiment_id)
    assert experiment.artifact_location == artifacts
    for run_id in (parent_id, stage_id):
        assert client.get_run(run_id).info.artifact_uri == os.path.join(artifacts, run_id, "artifacts")
    assert os.path.isfile(os.path.join(artifacts, stage_id, "artifacts", "manifests", "final.json"))
    with open(os.path.join(artifacts, parent_id, "artifacts", "config.json")) as f:
        assert json.load(f)["storage"]["root"] == copy  # the reopened parent's config, logged in the copy
    earlier = [r.info.run_id for r in client.search_runs([experiment.experiment_id]) if r.info.run_id != stage_id]
    assert all(client.list_artifacts(r) for r in earlier)  # the copied runs' artifacts are found in the copy
    assert MlflowClient(uri).get_experiment(experiment.experiment_id).artifact_location == os.path.join(
        root, "mlflow-artifacts"
    )


def test_a_store_outside_the_storage_root_keeps_its_artifact_locations(original, tmp_path):
    """A SQLite store shared by several roots (or a tracking server) is not the root's copy."""
    root, uri, _ = original
    other = str(tmp_path / "other")
    config = resolve_local_root(load_config(overrides={"storage.root": other, "tracking.tracking_uri": uri}))
    assert tracking.rehome_copied_store(uri, other) == {}
    parent_id = tracking.start_pipeline_run(config, "r2", tracking_uri=uri)
    assert MlflowClient(uri).get_run(parent_id).info.artifact_uri.startswith(os.path.join(root, "mlflow-artifacts"))
