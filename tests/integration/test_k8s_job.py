"""A multi-node stage's Kubernetes Job against a fake API server (``k8s_fake.py``: a real HTTP
server on loopback, reached through a kubeconfig with a bearer token, as a cluster would be):
submitted objects, node 0's log streamed (across a dropped connection), success, failure
naming the pod, its node rank and the failing rank, bad input, out of memory, a pod that cannot
start, cancellation, timeout, a retry replacing the failed Job, RBAC refusal, and defaults taken
from the flow-run pod. No cluster: the two-node training itself is ``test_two_nodes.py``'s."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tasks.k8s.job import run_trainer_job
from tasks.k8s.manifest import JobSettings, TrainerJob, trainer_job
from tasks.launch.aborts import abort_launches, forget_launch_group
from tasks.launch.failures import BadStageInput, LaunchAborted, StageFailed, StageResourceError
from tests.integration.k8s_fake import FakeCluster, role_rules
from trainer_core.config import load_config

FIXTURES = Path(__file__).parent / "fixtures" / "torchrun_output"
WORKER_YAML = Path(__file__).resolve().parents[2] / "infra" / "k8s" / "worker.yaml"
SPEC_URI = "s3://bucket/outputs/runs/run42/specs/sft.json"
SETTINGS = JobSettings(
    image="registry.example.com/posttrain:1", poll_interval_s=0.05, stuck_after_s=0.5, delete_timeout_s=5
)


class Lines:
    """A line logger keeping what it is given."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: object) -> None:
        self.lines.append(msg % args if args else msg)

    warning = info


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """The fake API server, holding the flow to the Role the flow-run pods get (``infra/k8s/worker.yaml``)."""
    fake = FakeCluster().start()
    fake.rules = role_rules(WORKER_YAML)
    monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield fake
    fake.stop()
    assert not fake.script_errors, fake.script_errors


@pytest.fixture
def job() -> TrainerJob:
    config = load_config(
        overrides={
            "backend.name": "fsdp2",
            "backend.nnodes": 2,
            "backend.nproc_per_node": 2,
            "backend.rdzv_endpoint": "unused:1",
            "storage.root": "s3://bucket/outputs",
        }
    )
    return trainer_job(config, "sft", "run42", SPEC_URI, "http://mlflow:5000")


def finish(cluster: FakeCluster, name: str, node0: list[str], node1: list[str], codes=(0, 0)) -> None:
    """The pods start, print their lines, and exit (node 1 first)."""
    cluster.start_pods(name)
    for a, b in zip(node0, node1, strict=False):
        cluster.log(name, 0, a)
        cluster.log(name, 1, b)
        time.sleep(0.01)
    cluster.log(name, 0, *node0[len(node1) :])
    cluster.log(name, 1, *node1[len(node0) :])
    cluster.exit(name, 1, codes[1])
    if cluster.pod(name, 0)["status"]["phase"] == "Running":
        cluster.exit(name, 0, codes[0])


def deleted_kinds(cluster: FakeCluster) -> list[tuple[str, str | None]]:
    return [(plural, policy) for plural, _, policy in cluster.deleted]


def test_success_streams_node_0_and_leaves_the_job(cluster, job):
    node0 = [f"[default0]:[sft] step {i}: train/loss=1.{i}" for i in range(1, 6)] + ["[default0]:committed final"]
    cluster.on_job = lambda c, name: finish(c, name, node0, ["[default0]:node 1 says hello"])
    seen: list[str] = []
    log = Lines()
    result = run_trainer_job(job, log=log, timeout_s=60, on_line=seen.append, settings=SETTINGS)
    assert result.returncode == 0 and not result.timed_out
    assert result.tail == seen == node0  # node 0 only, each line once, in order
    assert result.rank_tails[0][-1] == "committed final"
    submitted_job, service = cluster.created
    assert submitted_job["kind"] == "Job" and service["kind"] == "Service"
    assert submitted_job["metadata"]["namespace"] == "posttrain"  # the kubeconfig context's
    assert service["metadata"]["ownerReferences"] == [
        {"apiVersion": "batch/v1", "kind": "Job", "name": job.name, "uid": submitted_job["metadata"]["uid"]}
    ]
    spec = submitted_job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["backoffLimit"], spec["activeDeadlineSeconds"]) == (
        "Indexed",
        2,
        0,
        60,
    )
    [container] = spec["template"]["spec"]["containers"]
    assert container["command"][3:5] == [SPEC_URI, "--node-rank=$(NODE_RANK)"]
    assert container["image"] == SETTINGS.image
    assert cluster.deleted == [] and cluster.job(job.name) is not None  # kept for inspection (TTL)
    assert any(f"Job posttrain/{job.name} completed" in line for line in log.lines)


def test_log_stream_reconnects_without_losing_or_repeating_lines(cluster, job):
    cluster.cut_follow_after = 3  # the API server drops the stream every 3 lines
    node0 = [f"[default0]:line {i}" for i in range(10)]

    def script(c: FakeCluster, name: str) -> None:
        c.start_pods(name)
        for line in node0:
            c.log(name, 0, line)
            time.sleep(0.03)
        c.exit(name, 1, 0)
        c.exit(name, 0, 0)

    cluster.on_job = script
    result = run_trainer_job(job, log=Lines(), timeout_s=60, settings=SETTINGS)
    assert result.tail == node0
    follows = [q for method, path, q in cluster.calls if path.endswith("/log") and q.get("follow") == "true"]
    assert len(follows) >= 4 and all(q.get("sinceSeconds") for q in follows[1:])


def test_failure_names_the_pod_its_node_rank_and_the_failing_rank(cluster, job):
    """Node 1's torchrun reports rank 1 raising; Kubernetes then stops node 0 (exit 143). The
    error leads with node 1's pod and shows rank 1's own last lines; the Job stays."""
    node1 = (FIXTURES / "rank1_raise.log").read_text().splitlines()
    cluster.on_job = lambda c, name: finish(c, name, ["[default0]:[sft] step 1: train/loss=1.0"], node1, codes=(0, 1))
    with pytest.raises(StageFailed) as raised:
        run_trainer_job(job, log=Lines(), timeout_s=60, settings=SETTINGS)
    error = raised.value
    pod1 = cluster.pod(job.name, 1)["metadata"]["name"]
    first = str(error).splitlines()[0]
    assert first == (
        f"stage 'sft' failed on node rank 1 of 2: pod {pod1} (Job posttrain/{job.name}) exited with "
        "code 1; also: node rank 0 exited with code 143"
    )
    assert "rank 1 (local rank 1 on localhost) exited with code 1" in str(error)
    assert "ValueError: rank 1 cannot go on" in str(error) and error.rank == 1
    assert type(error) is StageFailed  # retried
    assert cluster.deleted == []  # the failed Job is kept for kubectl until the retry replaces it


def test_bad_input_on_a_node_is_not_retried(cluster, job):
    node1 = ["error: backend.nproc_per_node=2 but the job has nproc_per_node=4"]
    cluster.on_job = lambda c, name: finish(c, name, [], node1, codes=(0, 2))
    with pytest.raises(BadStageInput, match="node rank 1 of 2") as raised:
        run_trainer_job(job, log=Lines(), timeout_s=60, settings=SETTINGS)
    assert "stage 'sft': backend.nproc_per_node=2 but the job has" in str(raised.value)


def test_oom_killed_container_is_a_resource_error(cluster, job):
    def script(c: FakeCluster, name: str) -> None:
        c.start_pods(name)
        c.log(name, 0, "[default0]:loading shards")
        c.exit(name, 0, 137, reason="OOMKilled")

    cluster.on_job = script
    with pytest.raises(StageResourceError, match=r"node rank 0 of 2: .* exited with code 137 \(OOMKilled\)"):
        run_trainer_job(job, log=Lines(), timeout_s=60, settings=SETTINGS)


def run_in_thread(job: TrainerJob, **kw) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["result"] = run_trainer_job(job, log=Lines(), settings=SETTINGS, **kw)
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome


def keep_running(c: FakeCluster, name: str) -> None:
    """The pods run (and print) until their Job is deleted."""
    c.start_pods(name)
    i = 0
    while c.job(name) is not None and i < 2000:
        c.log(name, 0, f"[default0]:[sft] step {i}: train/loss=1.0")
        i += 1
        time.sleep(0.01)


def test_cancelled_flow_run_deletes_the_job_and_service(cluster, job):
    cluster.on_job = keep_running
    cluster.delete_delay_s = 0.2
    thread, outcome = run_in_thread(job, timeout_s=60, group="flow-run-1")
    try:
        cluster.wait_pod(job.name, "Running")
        time.sleep(0.2)
        abort_launches("flow-run-1")  # what the flow does when its run is cancelled
        thread.join(10)
    finally:
        forget_launch_group("flow-run-1")
    assert isinstance(outcome.get("error"), LaunchAborted)
    assert deleted_kinds(cluster) == [("jobs", "Foreground"), ("services", "Foreground")]
    time.sleep(0.4)
    assert cluster.objects == {}  # pods, Job and Service gone


def test_abort_before_submission_submits_nothing(cluster, job):
    abort_launches("flow-run-2")
    try:
        with pytest.raises(LaunchAborted, match="nothing submitted"):
            run_trainer_job(job, log=Lines(), timeout_s=60, group="flow-run-2", settings=SETTINGS)
    finally:
        forget_launch_group("flow-run-2")
    assert cluster.calls == []


def test_timeout_deletes_the_job(cluster, job):
    cluster.on_job = keep_running
    with pytest.raises(StageFailed, match=r"timed out after \d+ s and was killed") as raised:
        run_trainer_job(job, log=Lines(), timeout_s=0.8, settings=SETTINGS)
    assert f"(Job posttrain/{job.name})" in str(raised.value)
    assert deleted_kinds(cluster)[0] == ("jobs", "Foreground")
    assert cluster.objects == {}  # the Service (owned by the Job) went with it
    assert cluster.created[0]["spec"]["activeDeadlineSeconds"] == 1  # Kubernetes enforces it too


def test_a_retry_replaces_the_failed_job(cluster, job):
    """Attempt 1 fails and its Job stays; attempt 2 (the Prefect retry) deletes it, waits until it
    is gone, and creates a fresh Job of the same name that succeeds."""
    attempts: list[str] = []

    def script(c: FakeCluster, name: str) -> None:
        attempts.append(c.job(name)["metadata"]["uid"])
        finish(c, name, ["[default0]:resumed"], ["[default0]:boom"], codes=(0, 1) if len(attempts) == 1 else (0, 0))

    cluster.on_job = script
    cluster.delete_delay_s = 0.3  # foreground deletion takes a while: creating at once would conflict
    with pytest.raises(StageFailed):
        run_trainer_job(job, log=Lines(), timeout_s=60, settings=SETTINGS)
    log = Lines()
    result = run_trainer_job(job, log=log, timeout_s=60, settings=SETTINGS)
    assert result.returncode == 0 and len(attempts) == 2 and attempts[0] != attempts[1]
    assert deleted_kinds(cluster) == [("jobs", "Foreground"), ("services", "Foreground")]
    assert [o["kind"] for o in cluster.created] == ["Job", "Service", "Job", "Service"]
    assert any("deleting the earlier attempt's Job" in line for line in log.lines)


def test_a_pod_that_cannot_start_fails_the_stage(cluster, job):
    def script(c: FakeCluster, name: str) -> None:
        c.waiting(name, 1, "ImagePullBackOff", 'Back-off pulling image "registry.example.com/posttrain:1"')

    cluster.on_job = script
    log = Lines()
    with pytest.raises(BadStageInput, match=r"node rank 1 cannot start: ImagePullBackOff: Back-off pulling image"):
        run_trainer_job(job, log=log, timeout_s=60, settings=SETTINGS)
    assert deleted_kinds(cluster)[:1] == [("jobs", "Foreground")]
    assert any("cannot start: ImagePullBackOff" in line for line in log.lines)


def test_rbac_refusal_is_bad_input(cluster, job):
    cluster.forbidden.add(("POST", "jobs"))
    with pytest.raises(BadStageInput, match=r"Kubernetes API refused to create job .*: 403 jobs is forbidden"):
        run_trainer_job(job, log=Lines(), timeout_s=60, settings=SETTINGS)
    assert cluster.created == []


def test_a_job_deleted_by_someone_else_fails_the_stage(cluster, job):
    def script(c: FakeCluster, name: str) -> None:
        c.start_pods(name)
        time.sleep(0.2)
        c._remove("jobs", "posttrain", name)

    cluster.on_job = script
    with pytest.raises(StageFailed, match="was deleted while it ran"):
        run_trainer_job(job, log=Lines(), timeout_s=60, settings=SETTINGS)


def test_trainer_pods_take_the_flow_run_pods_image_and_secrets(cluster, job):
    flow_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "flow-run-abc", "namespace": "posttrain", "uid": "uid-of-the-flow-run-pod"},
        "spec": {
            "serviceAccountName": "posttrain-worker",
            "imagePullSecrets": [{"name": "regcred"}],
            "containers": [
                {
                    "name": "prefect-job",
                    "image": "registry.example.com/posttrain:7",
                    "envFrom": [
                        {"secretRef": {"name": "team-s3", "optional": False}},
                        {"secretRef": {"name": "posttrain-env", "optional": True}},
                    ],
                }
            ],
        },
        "status": {"phase": "Running"},
    }
    cluster.objects[("pods", "posttrain", "flow-run-abc")] = flow_pod
    cluster.on_job = lambda c, name: finish(c, name, ["[default0]:ok"], ["[default0]:ok"])
    run_trainer_job(
        job, log=Lines(), timeout_s=60, settings=SETTINGS.model_copy(update={"image": None, "flow_pod": "flow-run-abc"})
    )
    pod = cluster.created[0]["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.example.com/posttrain:7"
    assert pod["containers"][0]["envFrom"] == flow_pod["spec"]["containers"][0]["envFrom"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["serviceAccountName"] == "posttrain-worker"
    # the Job is the flow-run pod's: if that pod goes (evicted, killed), Kubernetes deletes the Job
    assert cluster.created[0]["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "flow-run-abc", "uid": "uid-of-the-flow-run-pod"}
    ]


def test_config_credentials_travel_in_a_secret_owned_by_the_job(cluster):
    config = load_config(
        overrides={
            "backend.name": "ddp",
            "backend.nnodes": 2,
            "backend.rdzv_endpoint": "unused:1",
            "storage.root": "s3://bucket/outputs",
            "storage.access_key_id": "AKIA-CONFIG",
            "storage.secret_access_key": "from-the-config",
        }
    )
    job = trainer_job(config, "sft", "run43", SPEC_URI, "http://mlflow:5000")
    cluster.on_job = lambda c, name: finish(c, name, ["[default0]:ok"], ["[default0]:ok"])
    run_trainer_job(job, log=Lines(), timeout_s=60, settings=SETTINGS)
    submitted, service, secret = cluster.created
    assert secret["kind"] == "Secret" and secret["stringData"]["AWS_SECRET_ACCESS_KEY"] == "from-the-config"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == submitted["metadata"]["uid"]
    container = submitted["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"][-1] == {"secretRef": {"name": job.name}}
    assert "from-the-config" not in str(submitted) + str(service)


def test_no_cluster_or_no_image_is_bad_input(cluster, job, tmp_path, monkeypatch):
    with pytest.raises(BadStageInput, match="no image for the trainer Job: set POSTTRAIN_K8S_IMAGE"):
        run_trainer_job(job, log=Lines(), timeout_s=60, settings=SETTINGS.model_copy(update={"image": None}))
    assert not [o for o in cluster.created if o["kind"] == "Job"]
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(BadStageInput, match="no Kubernetes API to submit the trainer Job to"):
        run_trainer_job(job, log=Lines(), timeout_s=60, settings=SETTINGS)
