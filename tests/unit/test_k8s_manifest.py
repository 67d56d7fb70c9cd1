"""The trainer Job of a multi-node stage, without a cluster: its name, the objects rendered from
``infra/k8s/multinode-trainer.yaml`` (the same as ``envsubst`` renders them for ``kubectl``),
the spec the flow writes for it (its pods' ``tasks.launch.process --dry-run`` accepts it), what is
refused before anything is submitted, the settings, and which pod a failed Job is blamed on."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from tasks.k8s.manifest import (
    MAX_NAME_CHARS,
    JobSettings,
    job_name,
    pin_rendezvous,
    render_template,
    trainer_job,
    trainer_manifests,
)
from tasks.k8s.status import JobView, blamed_pod, job_state, pod_result
from tasks.launch import commands
from tasks.launch import process as launch
from tasks.launch.failures import BadStageInput
from tests.unit.k8s_render import MULTINODE_VALUES, render_multinode
from trainer_core.config import load_config
from trainer_core.errors import ConfigError
from trainer_core.spec import build_spec

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MULTINODE = {
    "backend.name": "fsdp2",
    "backend.nnodes": 2,
    "backend.nproc_per_node": 4,
    "backend.rdzv_endpoint": "placeholder:1",
    "storage.root": "s3://bucket/outputs",
}
SPEC_URI = "s3://bucket/outputs/runs/run42/specs/sft.json"
TRACKING = "http://mlflow.posttrain:5000"


def multinode_config(**overrides):
    return load_config(overrides={**MULTINODE, **overrides})


def test_job_name_is_a_dns_label_per_run_and_stage():
    name = job_name("demo-20261121-082652-a1b2c3", "reward_model")
    assert DNS_1035.match(name) and len(name) <= MAX_NAME_CHARS
    assert name.startswith("reward-model-demo-20261121-082652-a1b2c3-")
    assert job_name("demo-20261121-082652-a1b2c3", "reward_model") == name  # every attempt: the same Job
    long_a, long_b = "x" * 100 + "a", "x" * 100 + "b"
    assert job_name(long_a, "sft") != job_name(long_b, "sft")  # cut alike, told apart by the hash
    assert all(
        DNS_1035.match(job_name(r, "dpo")) and len(job_name(r, "dpo")) <= MAX_NAME_CHARS
        for r in (long_a, "Run_ID.With.Dots", "r--", "9")
    )
    assert len(f"{job_name(long_a, 'grpo')}-9999") <= 63  # pod host names stay DNS labels


def test_template_renders_as_envsubst_does():
    """One source of truth: the Python rendering equals ``envsubst < multinode-trainer.yaml``."""
    values = dict(MULTINODE_VALUES)
    expected = render_multinode(values)
    assert render_template({**values, "NNODES": 2, "NPROC_PER_NODE": 8}) == expected
    with pytest.raises(ConfigError, match=r"uses \$\{IMAGE\}, which has no value"):
        render_template({k: v for k, v in values.items() if k != "IMAGE"})


def test_trainer_job_pins_the_rendezvous_to_pod_0():
    job = trainer_job(multinode_config(), "sft", "run42", SPEC_URI, TRACKING)
    assert job.name == job_name("run42", "sft")
    assert job.rdzv_endpoint == f"{job.name}-0.{job.name}:29500"
    assert job.backend.nnodes == 2 and job.backend.nproc_per_node == 4 and job.secret_env == {}


@pytest.mark.parametrize(("overrides", "tracking", "match"), [
    ({"storage.root": "./outputs"}, TRACKING, r"storage.root './outputs' is local to the flow process"),
    ({"storage.root": "file:///data/out"}, TRACKING, "is local to the flow process"),
    ({"storage.root": "memory://out"}, TRACKING, "is local to the flow process"),
    ({}, "sqlite:///outputs/mlflow.db", "local store the pods cannot reach"),
    ({}, "/tmp/mlruns", "local store the pods cannot reach"),
    ({"backend.name": "deepspeed", "backend.launcher": "deepspeed"}, TRACKING, "use backend.launcher=torchrun"),
])  # fmt: skip
def test_what_pods_cannot_run_is_refused_before_submitting(overrides, tracking, match):
    with pytest.raises(BadStageInput, match=match) as raised:
        trainer_job(multinode_config(**overrides), "sft", "run42", SPEC_URI, tracking)
    assert "stage 'sft' (backend.nnodes > 1, a Kubernetes Job)" in str(raised.value)


def test_manifests_apply_the_settings_to_the_template():
    config = multinode_config(
        **{
            "storage.access_key_id": "AKIA-SECRET",
            "storage.secret_access_key": "s3cr3t",
            "storage.endpoint_url": "http://minio.storage:9000",
            "storage.region": "eu-west-1",
        }
    )
    job = trainer_job(config, "sft", "run42", SPEC_URI, TRACKING)
    assert "s3cr3t" not in repr(job)
    settings = JobSettings(
        image="registry.example.com/posttrain:1.2",
        service_account="trainer",
        secrets=["team-s3", "team-env"],
        cpu_request="32",
        memory_limit="512Gi",
        shm_size="128Gi",
        ttl_after_finished_s=600,
        image_pull_secrets=["regcred"],
    )
    m = trainer_manifests(job, settings, "ml", timeout_s=3600.5)
    assert m.service["metadata"]["name"] == m.job["metadata"]["name"] == job.name
    assert m.service["metadata"]["namespace"] == m.job["metadata"]["namespace"] == "ml"
    assert m.service["spec"]["clusterIP"] == "None" and m.service["spec"]["selector"] == {"job-name": job.name}
    spec = m.job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed",
        2,
        2,
        0,
    )
    assert spec["activeDeadlineSeconds"] == 3601 and spec["ttlSecondsAfterFinished"] == 600
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == job.name and pod["serviceAccountName"] == "trainer"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    [container] = pod["containers"]
    assert container["image"] == "registry.example.com/posttrain:1.2"
    assert container["command"] == [
        "python", "-m", "tasks.launch.process", SPEC_URI, "--node-rank=$(NODE_RANK)", "--nnodes=2", "--nproc-per-node=4",
        f"--rdzv-endpoint={job.rdzv_endpoint}",
    ]  # fmt: skip
    assert container["resources"] == {
        "requests": {"nvidia.com/gpu": 4, "cpu": "32"},
        "limits": {"nvidia.com/gpu": 4, "memory": "512Gi"},
    }
    assert container["envFrom"] == [
        {"secretRef": {"name": "team-s3"}},
        {"secretRef": {"name": "team-env"}},
        {"secretRef": {"name": job.name}},
    ]
    assert m.secret["metadata"]["name"] == job.name
    assert m.secret["stringData"] == {
        "AWS_ACCESS_KEY_ID": "AKIA-SECRET",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t",
        "AWS_ENDPOINT_URL_S3": "http://minio.storage:9000",
        "AWS_DEFAULT_REGION": "eu-west-1",
    }  # the pods read their spec from it
    assert all("s3cr3t" not in json.dumps(o) for o in (m.service, m.job))
    assert {v["name"]: v["emptyDir"]["sizeLimit"] for v in pod["volumes"]} == {"dshm": "128Gi"}
    for meta in (m.service["metadata"], m.job["metadata"], spec["template"]["metadata"]):
        assert meta["labels"]["posttrain.io/trainer-job"] == job.name and meta["labels"]["posttrain.io/stage"] == "sft"
        assert meta["annotations"]["posttrain.io/run-id"] == "run42"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}  # the template's, kept


def test_cpu_stage_requests_no_gpus():
    job = trainer_job(multinode_config(**{"backend.device": "cpu"}), "sft", "run42", SPEC_URI, TRACKING)
    m = trainer_manifests(job, JobSettings(image="img"), "posttrain")
    pod = m.job["spec"]["template"]["spec"]
    assert "resources" not in pod["containers"][0] and "nodeSelector" not in pod and "tolerations" not in pod
    assert m.secret is None and "activeDeadlineSeconds" not in m.job["spec"]
    assert pod["containers"][0]["envFrom"][0] == {"secretRef": {"name": "posttrain-s3"}}  # the template's
    with pytest.raises(ConfigError, match="POSTTRAIN_K8S_IMAGE"):
        trainer_manifests(job, JobSettings(), "posttrain")


def test_pods_accept_the_spec_the_flow_writes(tmp_path, capsys):
    """The spec written with the pinned rendezvous, read by each pod's own command
    (``$(NODE_RANK)`` expanded, ``--dry-run``), gives the torchrun command for that node."""
    config = multinode_config()
    job = trainer_job(config, "sft", "run42", str(tmp_path / "sft.json"), TRACKING)
    spec = build_spec(
        pin_rendezvous(config, "sft", job.rdzv_endpoint), "sft", "run42", {}, output_uri=str(tmp_path / "out")
    )
    (tmp_path / "sft.json").write_text(json.dumps(spec.model_dump(mode="json")))
    [container] = trainer_manifests(job, JobSettings(image="img"), "posttrain").job["spec"]["template"]["spec"][
        "containers"
    ]
    for index in (0, 1):
        argv = [a.replace("$(NODE_RANK)", str(index)) for a in container["command"][3:]]
        assert launch.main([*argv, "--dry-run"]) == 0, capsys.readouterr().err
        printed = shlex.split(capsys.readouterr().out)
        assert printed == commands.trainer_command(
            job.spec_uri, job.backend.model_copy(update={"node_rank": index}), "run42-sft"
        )
    unpinned = build_spec(config, "sft", "run42", {}, output_uri=str(tmp_path / "out"))
    (tmp_path / "sft.json").write_text(json.dumps(unpinned.model_dump(mode="json")))
    assert launch.main([*[a.replace("$(NODE_RANK)", "0") for a in container["command"][3:]], "--dry-run"]) == 2


def test_pin_rendezvous_overrides_a_stage_backend_too():
    config = multinode_config(**{"sft.backend": {"rdzv_endpoint": "elsewhere:1"}})
    pinned = pin_rendezvous(config, "sft", "j-0.j:29500")
    assert pinned.backend_for("sft").rdzv_endpoint == "j-0.j:29500"
    assert config.backend_for("sft").rdzv_endpoint == "elsewhere:1"  # a copy


def test_settings_from_the_environment_and_the_flow_pod():
    env = {
        "POSTTRAIN_K8S_IMAGE": "img:2",
        "POSTTRAIN_K8S_SECRETS": "a, b",
        "POSTTRAIN_K8S_POLL_INTERVAL_S": "0.5",
        "POSTTRAIN_K8S_NODE_SELECTOR": '{"pool": "h100"}',
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "HOSTNAME": "flow-pod-x",
    }
    settings = JobSettings.from_env(env)
    assert (settings.image, settings.secrets, settings.poll_interval_s) == ("img:2", ["a", "b"], 0.5)
    assert settings.node_selector == {"pool": "h100"} and settings.flow_pod == "flow-pod-x"
    assert JobSettings.from_env({"HOSTNAME": "laptop"}).flow_pod is None  # outside a cluster
    with pytest.raises(ConfigError, match="POSTTRAIN_K8S_POLL_INTERVAL_S"):
        JobSettings.from_env({"POSTTRAIN_K8S_POLL_INTERVAL_S": "-1"})
    with pytest.raises(ConfigError, match="POSTTRAIN_K8S_TOLERATIONS: not JSON"):
        JobSettings.from_env({"POSTTRAIN_K8S_TOLERATIONS": "[oops"})
    flow_pod = {
        "spec": {
            "serviceAccountName": "flow-sa",
            "imagePullSecrets": [{"name": "regcred"}],
            "containers": [
                {
                    "name": "prefect-job",
                    "image": "posttrain:9",
                    "imagePullPolicy": "Always",
                    "envFrom": [
                        {"secretRef": {"name": "s3", "optional": False}},
                        {"secretRef": {"name": "env", "optional": True}},
                    ],
                }
            ],
        }
    }
    inherited = JobSettings(image="mine").inherit(flow_pod)
    assert inherited.image == "mine"  # set explicitly: kept
    assert (inherited.service_account, inherited.image_pull_policy, inherited.image_pull_secrets) == (
        "flow-sa",
        "Always",
        ["regcred"],
    )
    assert inherited.env_from == flow_pod["spec"]["containers"][0]["envFrom"]  # optional flags kept
    assert JobSettings().inherit(None) == JobSettings()


# ---------------------------------------------------------------- which pod a failed Job is blamed on


def pod(index: int, phase: str, exit_code: int | None = None, finished: str = "2026-11-21T08:00:00Z") -> dict:
    state = {"running": {}} if exit_code is None else {"terminated": {"exitCode": exit_code, "finishedAt": finished}}
    return {
        "metadata": {
            "name": f"j-{index}-abcde",
            "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
        },
        "status": {"phase": phase, "containerStatuses": [{"name": "trainer", "state": state}]},
    }


def torchrun_log(failures: list[tuple[int, int, int, bool]], tails: dict[int, list[str]]) -> list[str]:
    """A node's log: each local rank's last lines (``[default<i>]:`` prefix), then torchrun's
    error summary with ``(global rank, local rank, exitcode, root cause)`` failures."""
    lines = [f"[default{local}]:{line}" for local, rank_lines in tails.items() for line in rank_lines]
    lines += ["Failures:"]
    for i, (rank, local, code, root) in enumerate(failures):
        if root:
            lines += ["-" * 60, "Root Cause (first observed failure):"]
        lines += [
            f"[{i}]:",
            "  time      : 2026-11-21_08:00:00",
            "  host      : node",
            f"  rank      : {rank} (local_rank: {local})",
            f"  exitcode  : {code} (pid: 1)",
            "  error_file: <N/A>",
            "  traceback : To enable traceback see: ...",
        ]
    return [*lines, "=" * 60]


def test_blamed_pod_is_the_cause_not_the_first_to_end():
    """Node 0 ended first, its rank 0 failing on a broken collective (a consequence); node 1's
    rank 3 raised: node 1 is blamed, by global rank."""
    pods = {0: pod(0, "Failed", 1, "2026-11-21T08:00:00Z"), 1: pod(1, "Failed", 1, "2026-11-21T08:00:05Z")}
    results = {
        0: pod_result(torchrun_log([(0, 0, 1, True)], {0: ["RuntimeError: Connection closed by peer"]}), 1, 50),
        1: pod_result(torchrun_log([(3, 1, 1, True)], {1: ["ValueError: rank 3 cannot go on"]}), 1, 50),
    }
    assert blamed_pod(pods, results) == 1


def test_blamed_pod_without_summaries():
    # exit 2 (bad input) first, whenever it ended
    assert (
        blamed_pod({0: pod(0, "Failed", 1, "2026-11-21T08:00:00Z"), 1: pod(1, "Failed", 2, "2026-11-21T08:00:09Z")}, {})
        == 1
    )
    # the Job controller's SIGTERM (143) of the survivors is not a cause
    assert (
        blamed_pod(
            {0: pod(0, "Failed", 143, "2026-11-21T08:00:00Z"), 1: pod(1, "Failed", 1, "2026-11-21T08:00:01Z")}, {}
        )
        == 1
    )
    # else the first to end; none failed: None
    assert (
        blamed_pod({0: pod(0, "Failed", 1, "2026-11-21T08:00:03Z"), 1: pod(1, "Failed", 1, "2026-11-21T08:00:01Z")}, {})
        == 1
    )
    assert blamed_pod({0: pod(0, "Running"), 1: pod(1, "Succeeded", 0)}, {}) is None


def test_job_state_reads_conditions_and_pods():
    view = JobView(job={"spec": {"completions": 2}, "status": {}}, pods={0: pod(0, "Running"), 1: pod(1, "Running")})
    assert job_state(view) is None
    view.pods[1] = pod(1, "Failed", 1)
    assert job_state(view) == ("failed", "a pod failed (backoffLimit 0)")
    view.job["status"] = {
        "conditions": [
            {
                "type": "Failed",
                "status": "True",
                "reason": "DeadlineExceeded",
                "message": "Job was active longer than specified deadline",
            }
        ]
    }
    assert job_state(view) == ("deadline", "DeadlineExceeded: Job was active longer than specified deadline")
    view = JobView(job={"spec": {"completions": 2}, "status": {"succeeded": 2}}, pods={})
    assert job_state(view) == ("succeeded", "")
