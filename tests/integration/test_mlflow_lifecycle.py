"""The MLflow lifecycle of a pipeline run against a real sqlite store: experiment and run tags,
stage models logged as MLflow transformers models (LoggedModels) and loaded back, headline
metrics on the parent run, and registered versions with a champion alias."""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import mlflow
import mlflow.transformers
import pytest
import torch
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus, Metric
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

from tasks.report import mlflow_models, tracking
from tests.tiny import LLAMA_1X16
from trainer_core import mlflow_model, storage
from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import load_config
from trainer_core.data.tokenizer import train_tokenizer
from trainer_core.errors import ConfigError

FLOW_URL = "http://prefect.local/flow-runs/flow-run/1234"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module (creating its schema takes seconds): (root, URI)."""
    root = tmp_path_factory.mktemp("mlflow-root")
    return str(root), f"sqlite:///{root}/mlflow.db"


@pytest.fixture
def config(store, monkeypatch, tmp_path):
    """The pipeline config on the module's store, with no process-global tracking URI: the
    functions under test must not need one (nor fall back to a default store in the cwd)."""
    root, uri = store
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    yield load_config(overrides={"storage.root": root, "tracking.tracking_uri": uri})
    assert not {"mlruns", "mlflow.db"} & set(os.listdir(tmp_path))


def _load(monkeypatch, uri: str, model_uri: str):
    """``mlflow.transformers.load_model``, which resolves ``models:/`` through the global URI."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return mlflow.transformers.load_model(model_uri)


def _tiny_llama(tokenizer, **extra) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        **LLAMA_1X16,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """Final directories as the stages write them: a tiny causal LM (policy) and a tiny
    one-label sequence classifier (reward model), each with a trained tokenizer."""
    root = tmp_path_factory.mktemp("finals")
    texts = ["<|user|>\nwhat is 2+3?<|end|>\n<|assistant|>\n5<|end|>\n"] * 4
    tokenizer = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    torch.manual_seed(0)
    dirs = {}
    for name, model in (
        ("policy", AutoModelForCausalLM.from_config(_tiny_llama(tokenizer))),
        ("reward_model", AutoModelForSequenceClassification.from_config(_tiny_llama(tokenizer, num_labels=1))),
    ):
        dirs[name] = str(root / name)
        model.save_pretrained(dirs[name])
        tokenizer.save_pretrained(dirs[name])
    return dirs


def _pipeline_with_stage(config, uri, run_id, stage, flow_run_url=None):
    parent = tracking.start_pipeline_run(config, run_id, tracking_uri=uri, flow_run_url=flow_run_url)
    return parent, tracking.start_stage_run(config, parent, stage, tracking_uri=uri, flow_run_url=flow_run_url)


def test_model_task_follows_the_stage_registry():
    assert [mlflow_model.model_task(s) for s in ("sft", "dpo", "ppo", "grpo")] == ["text-generation"] * 4
    assert mlflow_model.model_task("reward_model") == "text-classification"
    with pytest.raises(ValueError, match="produces no model"):
        mlflow_model.model_task("evaluate")
    with pytest.raises(ConfigError):
        mlflow_model.model_task("nope")


def test_experiment_kind_and_flow_run_url_tags(config, store):
    _, uri = store
    client = MlflowClient(uri)
    client.create_experiment("legacy", artifact_location=os.path.join(store[0], "legacy"))  # no kind
    legacy = config.model_copy(update={"tracking": config.tracking.model_copy(update={"experiment_name": "legacy"})})
    for cfg in (config, legacy):
        parent = tracking.start_pipeline_run(cfg, "tags-run", tracking_uri=uri)
        experiment = client.get_experiment(client.get_run(parent).info.experiment_id)
        assert experiment.tags[tracking.TAG_EXPERIMENT_KIND] == "custom_model_development"
    client.set_experiment_tag(experiment.experiment_id, tracking.TAG_EXPERIMENT_KIND, "genai_development")
    tracking.start_pipeline_run(legacy, "tags-run-2", tracking_uri=uri)
    assert client.get_experiment(experiment.experiment_id).tags[tracking.TAG_EXPERIMENT_KIND] == "genai_development"

    parent, stage = _pipeline_with_stage(config, uri, "url-run", "sft", flow_run_url=FLOW_URL)
    assert client.get_run(parent).data.tags[tracking.TAG_FLOW_RUN_URL] == FLOW_URL
    assert client.get_run(stage).data.tags[tracking.TAG_FLOW_RUN_URL] == FLOW_URL
    resumed_url = FLOW_URL.replace("1234", "5678")
    assert tracking.start_pipeline_run(config, "url-run", tracking_uri=uri, flow_run_url=resumed_url) == parent
    assert client.get_run(parent).data.tags[tracking.TAG_FLOW_RUN_URL] == resumed_url
    _, untagged = _pipeline_with_stage(config, uri, "no-url-run", "sft")
    assert tracking.TAG_FLOW_RUN_URL not in client.get_run(untagged).data.tags


def test_policy_logged_as_transformers_model_loads_and_generates(config, store, model_dirs, monkeypatch):
    _, uri = store
    client = MlflowClient(uri)
    parent, stage = _pipeline_with_stage(config, uri, "policy-run", "sft")
    client.log_batch(stage, metrics=[Metric("eval/loss", v, 0, s) for s, v in ((5, 2.0), (9, 1.5))])

    model_uri = mlflow_model.log_transformers_model(
        stage, model_dirs["policy"], task=mlflow_model.model_task("sft"), tracking_uri=uri, step=9
    )
    manifest = Manifest(
        kind="final", stage="sft", run_id="policy-run", global_step=9, files=[], metrics={"eval/loss": 1.5}
    )
    tracking.finish_stage_run(stage, manifest, model_dirs["policy"], "completed", tracking_uri=uri)

    assert model_uri.startswith("models:/m-")
    logged = client.get_logged_model(model_uri.removeprefix("models:/"))
    assert (logged.name, logged.source_run_id, logged.status) == ("model", stage, LoggedModelStatus.READY)
    experiment_id = client.get_run(parent).info.experiment_id
    assert logged.model_id in {m.model_id for m in client.search_logged_models([experiment_id])}  # its Models tab
    assert logged.tags[tracking.TAG_STAGE] == "sft" and logged.params["sft.learning_rate"]
    assert [(m.key, m.value, m.step) for m in logged.metrics] == [("eval/loss", 1.5, 9)]
    run = client.get_run(stage)
    assert [o.model_id for o in run.outputs.model_outputs] == [logged.model_id]
    assert not [k for k in run.data.metrics if k.startswith("final/")]
    assert {a.path for a in client.list_artifacts(stage)} == {"manifests"}

    pipe = _load(monkeypatch, uri, model_uri)
    assert pipe.task == "text-generation" and type(pipe.model).__name__ == "LlamaForCausalLM"
    assert pipe.tokenizer.eos_token == "<|end|>" and pipe.tokenizer.chat_template
    out = pipe("what is", max_new_tokens=3, do_sample=False)
    assert out[0]["generated_text"].startswith("what is")
    flavor = mlflow.models.get_model_info(model_uri).flavors["transformers"]
    assert flavor["task"] == "text-generation" and "tokenizer" in flavor["components"]
    runs_uri = _load(monkeypatch, uri, f"runs:/{stage}/model")
    assert type(runs_uri.model).__name__ == "LlamaForCausalLM"


def test_reward_model_from_a_remote_dir_logs_as_text_classification(config, store, model_dirs, monkeypatch):
    _, uri = store
    remote = "memory://mlflow-lifecycle/reward_model/final"
    for name in os.listdir(model_dirs["reward_model"]):
        storage.upload_file(os.path.join(model_dirs["reward_model"], name), f"{remote}/{name}")
    _, stage = _pipeline_with_stage(config, uri, "rm-run", "reward_model")

    model_uri = mlflow_model.log_transformers_model(
        stage, remote, task=mlflow_model.model_task("reward_model"), tracking_uri=uri
    )

    pipe = _load(monkeypatch, uri, model_uri)
    assert pipe.task == "text-classification" and pipe.model.config.num_labels == 1
    scores = pipe(["what is 2+3? 5", "what is 2+3? 7"])
    assert len(scores) == 2 and all(math.isfinite(s["score"]) for s in scores)
    logged = MlflowClient(uri).get_logged_model(model_uri.removeprefix("models:/"))
    assert logged.tags[tracking.TAG_OUTPUT_URI] == remote and not logged.metrics


def test_reward_adapter_over_a_remote_causal_lm_logs_merged(config, store, model_dirs, monkeypatch, tmp_path):
    """A stage committed as a LoRA adapter (``lora.merge_on_commit: false``), on object storage,
    over a causal-LM base also on object storage: MLflow gets the merged reward model, whose
    scores are the adapted model's."""
    from trainer_core.config import LoraConfig, ModelConfig
    from trainer_core.modeling.lora import adapter_files, apply_lora
    from trainer_core.modeling.models import load_reward_model

    _, uri = store
    base, adapter = "memory://mlflow-lifecycle/sft/final", "memory://mlflow-lifecycle/rm-adapter/final"
    for name in os.listdir(model_dirs["policy"]):
        storage.upload_file(os.path.join(model_dirs["policy"], name), f"{base}/{name}")
    model = load_reward_model(model_dirs["policy"], ModelConfig(name_or_path=model_dirs["policy"]), None, seed=0)
    apply_lora(model, LoraConfig(enabled=True, rank=2, alpha=4), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)  # trained adapters and score head
    for name, data in adapter_files(model, model.state_dict(), base).items():
        storage.write_bytes(f"{adapter}/{name}", data)
    for name in os.listdir(model_dirs["policy"]):
        if name.startswith(("tokenizer", "special_tokens")):
            storage.upload_file(os.path.join(model_dirs["policy"], name), f"{adapter}/{name}")
    _, stage = _pipeline_with_stage(config, uri, "rm-adapter-run", "reward_model")

    model_uri = mlflow_model.log_transformers_model(stage, adapter, task="text-classification", tracking_uri=uri)

    pipe = _load(monkeypatch, uri, model_uri)
    assert pipe.task == "text-classification" and type(pipe.model).__name__ == "LlamaForSequenceClassification"
    assert not [n for n, _ in pipe.model.named_parameters() if "lora_" in n]
    ids = pipe.tokenizer(["what is 2+3? 5"], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(pipe.model(ids).logits, model(ids).logits, atol=1e-5)


def test_models_log_from_threads_side_by_side(config, store, model_dirs, monkeypatch):
    """Stage tasks run in threads of the flow process: two models log at once, each into its run,
    and leave transformers' loader as they found it (its ``no_tie_weights`` swaps
    ``PreTrainedModel.tie_weights`` during a load: two unserialised loads can leave it swapped, and
    every later load of a tied model in the process then misses ``lm_head.weight``)."""
    from transformers import PreTrainedModel

    tie_weights = PreTrainedModel.tie_weights
    _, uri = store
    stages = [_pipeline_with_stage(config, uri, f"thread-run-{i}", "sft")[1] for i in range(2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [
            pool.submit(
                mlflow_model.log_transformers_model, s, model_dirs["policy"], task="text-generation", tracking_uri=uri
            )
            for s in stages
        ]
        model_uris = [job.result() for job in jobs]
    client = MlflowClient(uri)
    assert [client.get_logged_model(u.removeprefix("models:/")).source_run_id for u in model_uris] == stages
    assert type(_load(monkeypatch, uri, model_uris[1]).model).__name__ == "LlamaForCausalLM"
    assert PreTrainedModel.tie_weights is tie_weights


def test_log_transformers_model_rejects_bad_input(config, store, tmp_path, model_dirs):
    _, uri = store
    _, stage = _pipeline_with_stage(config, uri, "bad-run", "sft")
    with pytest.raises(FileNotFoundError):
        mlflow_model.log_transformers_model(stage, str(tmp_path / "missing"), task="text-generation", tracking_uri=uri)
    with pytest.raises(ValueError, match="unsupported model task"):
        mlflow_model.log_transformers_model(stage, model_dirs["policy"], task="fill-mask", tracking_uri=uri)
    assert MlflowClient(uri).get_run(stage).outputs.model_outputs == []


def test_pipeline_metrics_and_champion_of_the_registry(config, store, model_dirs, monkeypatch):
    _, uri = store
    client = MlflowClient(uri)
    name = "posttrain-policy"
    assert mlflow_models.model_version_by_alias(name, "champion", tracking_uri=uri) is None
    assert mlflow_models.read_champion(name, tracking_uri=uri) is None

    versions = []
    for i, run_id in enumerate(("reg-run-1", "reg-run-2")):
        parent, stage = _pipeline_with_stage(config, uri, run_id, "dpo")
        model_uri = mlflow_model.log_transformers_model(
            stage, model_dirs["policy"], task="text-generation", tracking_uri=uri
        )
        headline = {"eval/dpo/win_rate": 0.5 + i / 10, "acc@1": 0.25, "bad": math.nan, "worse": -math.inf}
        tracking.log_pipeline_metrics(parent, headline, tracking_uri=uri)
        tags = {"posttrain.run_id": run_id, "posttrain.stage": "dpo"}
        source = model_uri if i == 0 else mlflow_models.run_model_uri(stage)  # the run's LoggedModel either way
        versions.append(mlflow_models.register_model_version(name, source, run_id=stage, tags=tags, tracking_uri=uri))
    assert versions == ["1", "2"]
    assert client.get_run(parent).data.metrics == {"eval/dpo/win_rate": 0.6, "acc_1": 0.25}
    v2 = client.get_model_version(name, "2")
    assert v2.tags == {"posttrain.run_id": "reg-run-2", "posttrain.stage": "dpo"} and v2.run_id == stage
    logged = client.get_logged_model(model_uri.removeprefix("models:/"))
    assert json.loads(logged.tags["mlflow.modelVersions"]) == [{"name": name, "version": 2}]
    assert v2.source == logged.artifact_location  # a sqlite registry: see register_model_version
    assert mlflow_models.model_version_by_alias(name, "champion", tracking_uri=uri) is None  # model, no alias

    mlflow_models.set_model_alias(name, "champion", versions[0], tracking_uri=uri)
    mlflow_models.set_model_alias(name, "candidate", versions[1], tracking_uri=uri)
    assert str(mlflow_models.model_version_by_alias(name, "candidate", tracking_uri=uri).version) == "2"
    found = mlflow_models.read_champion(name, tracking_uri=uri)
    assert (found.version, found.metrics) == ("1", {"eval/dpo/win_rate": 0.5, "acc_1": 0.25})
    assert found.tags == {"posttrain.run_id": "reg-run-1", "posttrain.stage": "dpo"}
    champion = _load(monkeypatch, uri, f"models:/{name}@champion")
    assert type(champion.model).__name__ == "LlamaForCausalLM"


def test_register_races_to_create_the_registered_model(config, store, model_dirs):
    _, uri = store
    _, stage = _pipeline_with_stage(config, uri, "race-run", "sft")
    model_uri = mlflow_models.run_model_uri(stage)  # plain run artifacts, no LoggedModel: passed on as the source
    MlflowClient(uri).log_artifact(stage, os.path.join(model_dirs["policy"], "config.json"), "model")
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [
            pool.submit(
                mlflow_models.register_model_version, "raced", model_uri, run_id=stage, tags={}, tracking_uri=uri
            )
            for _ in range(2)
        ]
        assert sorted(job.result() for job in jobs) == ["1", "2"]
    assert MlflowClient(uri).get_model_version("raced", "1").source == model_uri


def test_a_stage_model_the_trainer_did_not_log_is_logged_once_by_the_task_side_process(
    config, store, model_dirs, tmp_path
):
    """A committed stage whose trainer died before logging its model (or one committed before
    models were logged): ``stage_model_uri`` runs ``python -m trainer_core.mlflow_model
    <spec-uri>`` as the stage task does, and a second call finds the model without logging again."""
    import subprocess
    import sys

    from trainer_core.checkpoint.manifest import ArtifactWriter
    from trainer_core.spec import build_spec

    _, uri = store
    _, stage_run = _pipeline_with_stage(config, uri, "crashed-before-logging", "sft")
    spec = build_spec(
        config,
        "sft",
        "crashed-before-logging",
        {"data": "unused"},
        tracking_uri=uri,
        mlflow_run_id=stage_run,
        output_uri=str(tmp_path / "stages" / "sft"),
    )
    writer = ArtifactWriter(str(tmp_path / "stages" / "sft" / "final"))
    for name in os.listdir(model_dirs["policy"]):
        with open(os.path.join(model_dirs["policy"], name), "rb") as f:
            writer.write_bytes(name, f.read())
    writer.commit(kind="final", stage="sft", run_id="crashed-before-logging", global_step=3, metrics={})
    spec_uri = str(tmp_path / "sft.json")
    storage.write_json(spec_uri, spec.model_dump(mode="json"))
    calls = []

    def log_missing() -> None:
        calls.append(1)
        done = subprocess.run(
            [sys.executable, "-m", "trainer_core.mlflow_model", spec_uri],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "MLFLOW_TRACKING_URI": ""},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().splitlines()[-1].startswith("models:/")

    model_uri = mlflow_models.stage_model_uri("sft", config, stage_run, tracking_uri=uri, log_missing=log_missing)
    again = mlflow_models.stage_model_uri("sft", config, stage_run, tracking_uri=uri, log_missing=log_missing)
    assert model_uri == again and model_uri.startswith("models:/") and calls == [1]
    assert (
        mlflow_models.stage_model_uri("evaluate", config, stage_run, tracking_uri=uri, log_missing=log_missing) is None
    )
    with pytest.raises(RuntimeError, match="no MLflow model"):
        _, other = _pipeline_with_stage(config, uri, "never-logged", "dpo")
        mlflow_models.stage_model_uri("dpo", config, other, tracking_uri=uri, log_missing=lambda: None)
