"""The flow runs a multi-node stage on Kubernetes itself: ``post_training_pipeline`` with
``prepare_data`` (a local process) and a 2-node ``sft`` (``backend.nnodes=2``), under a real
Prefect API and MLflow server (``stack``), storage on S3 (moto), the cluster a fake API server
(``tests/integration/k8s_fake.py``) whose scripted kubelet runs each pod's own command with
``--dry-run`` (so every node reads the spec the flow wrote from S3 and must accept it, exit 0)
and then stands in for the trainers: the first attempt's node 1 fails, the Prefect retry
replaces the Job, and the second attempt commits the stage's final manifest, which the flow
reads and reports as for a local stage. Settings come from ``POSTTRAIN_K8S_*`` variables."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
from mlflow import MlflowClient
from prefect.logging.handlers import APILogHandler
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.pipeline import post_training_pipeline
from tests.conftest import make_bucket
from tests.e2e.demo_overrides import tiny_demo
from tests.e2e.stack import PROJECT_DIR
from tests.integration.k8s_fake import FakeCluster, role_rules
from trainer_core import storage
from trainer_core.checkpoint.manifest import ArtifactWriter
from trainer_core.config import load_config
from trainer_core.spec import StageSpec
from trainer_core.storage import StageLayout

pytestmark = pytest.mark.slow

METRICS = {"train/loss": 0.75, "eval/loss": 0.875}
FAILURE = [
    "[default1]:RuntimeError: NCCL error: unhandled system error",
    "Failures:", "  <NO_OTHER_FAILURES>", "-" * 60, "Root Cause (first observed failure):", "[0]:",
    "  time      : 2026-11-21_08:00:00", "  host      : node-1", "  rank      : 3 (local_rank: 1)",
    "  exitcode  : 1 (pid: 77)", "  error_file: <N/A>", "  traceback : To enable traceback see: ...", "=" * 60,
]  # fmt: skip


def kubelet(s3_endpoint: str, attempts: list[str]):
    """What the pods of each Job do: run their command (``--dry-run``), then fail (attempt 1) or
    commit the stage's final output as the trainers would (attempt 2)."""

    def run_pods(cluster: FakeCluster, name: str) -> None:
        attempts.append(name)
        cluster.start_pods(name)
        # the pods' environment: the Job's own Secret (the config's S3 endpoint), created just after
        # the Job (a kubelet starts the containers once it exists), over ours
        deadline = time.monotonic() + 30
        while not (
            secret := next(
                (o for o in cluster.created if o["kind"] == "Secret" and o["metadata"]["name"] == name), None
            )
        ):
            assert time.monotonic() < deadline, f"no Secret {name}"
            time.sleep(0.05)
        assert secret["stringData"]["AWS_ENDPOINT_URL_S3"] == s3_endpoint
        env = {**os.environ, **secret["stringData"], "PYTHONUNBUFFERED": "1"}
        for index, pod in enumerate(cluster.pods(name)):
            command = [a.replace("$(NODE_RANK)", str(index)) for a in pod["spec"]["containers"][0]["command"]]
            done = subprocess.run(
                [sys.executable, *command[1:], "--dry-run"],
                cwd=PROJECT_DIR,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            cluster.log(name, index, *done.stdout.splitlines(), *done.stderr.splitlines())
            if done.returncode != 0:
                cluster.exit(name, index, done.returncode)
                return
        spec_uri = pod["metadata"]["annotations"]["posttrain.io/spec-uri"]
        spec = StageSpec.model_validate(storage.read_json(spec_uri))
        if len(attempts) == 1:
            cluster.log(name, 1, *FAILURE)
            cluster.exit(name, 1, 1)
            return
        cluster.log(name, 0, "[default0]:[sft] step 3: train/loss=0.75")
        writer = ArtifactWriter(StageLayout(spec.output_uri).final, overwrite=True)
        writer.write_json("trainer_state.json", {"global_step": 3})
        writer.commit(
            kind="final",
            stage=spec.stage,
            run_id=spec.run_id,
            global_step=3,
            world_size=4,
            backend="fsdp2",
            config_hash=spec.fingerprint,
            metrics=METRICS,
            extra={"mlflow_run_id": spec.mlflow_run_id},
        )
        cluster.exit(name, 1, 0)
        cluster.exit(name, 0, 0)

    return run_pods


def test_flow_runs_a_two_node_stage_on_kubernetes(stack, s3_server, tmp_path, monkeypatch):
    bucket = make_bucket(s3_server)
    attempts: list[str] = []
    cluster = FakeCluster(kubelet(s3_server, attempts)).start()
    cluster.rules = role_rules(PROJECT_DIR / "infra" / "k8s" / "worker.yaml")  # the flow-run pods' Role
    # storage.endpoint_url is the only place the endpoint is named: the local prepare_data trainer and
    # the pods read their specs from S3 with what the flow passes them (storage.process_env)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("POSTTRAIN_K8S_IMAGE", "registry.example.com/posttrain-worker:test")
    monkeypatch.setenv("POSTTRAIN_K8S_POLL_INTERVAL_S", "0.1")
    overrides = {
        **tiny_demo(tmp_path, stack["mlflow"]),
        "storage.root": f"s3://{bucket}/outputs", "storage.endpoint_url": s3_server,
        "tracking.log_models": False, "launch.retries": 1, "launch.retry_delay_s": 0,
        "sft.backend": {"name": "fsdp2", "device": "cpu", "nnodes": 2, "nproc_per_node": 2,
                        "rdzv_endpoint": "set-by-the-flow:29500"},
    }  # fmt: skip
    run_id = f"k8s-{uuid.uuid4().hex[:8]}"
    try:
        with temporary_settings(updates={PREFECT_API_URL: stack["api_url"]}):
            summary = post_training_pipeline(config=load_config(overrides=overrides), run_id=run_id)
            APILogHandler().flush()  # while this API is the one the log worker sends to
    finally:
        cluster.stop()
    assert not cluster.script_errors, cluster.script_errors
    sft = summary["stages"]["sft"]
    assert sft["status"] == "completed" and sft["metrics"] == METRICS
    assert sft["output_uri"] == f"s3://{bucket}/outputs/runs/{run_id}/stages/sft/final"
    jobs = [o for o in cluster.created if o["kind"] == "Job"]
    assert len(attempts) == 2 and attempts[0] == attempts[1] == jobs[0]["metadata"]["name"]
    assert jobs[0]["metadata"]["uid"] != jobs[1]["metadata"]["uid"]  # the retry's fresh Job
    assert ("jobs", attempts[0], "Foreground") in cluster.deleted  # the failed one, replaced
    pod = jobs[1]["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.example.com/posttrain-worker:test"
    assert "resources" not in pod["containers"][0]  # device=cpu: no GPUs requested
    run = MlflowClient(stack["mlflow"]).get_run(sft["mlflow_run_id"])
    assert run.info.status == "FINISHED"
