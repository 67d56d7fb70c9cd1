"""The files of ``infra/`` and ``deployments/``, checked without Docker or a cluster.

- The compose files against the Compose Specification JSON schema (the copy that the
  ``check-jsonschema`` package ships), before and after ``${VAR}`` interpolation with
  ``.env.example``, plus what ``docker compose config`` would also refuse: unknown services in
  ``depends_on``, undeclared named volumes, missing bind-mount sources or build files.
- The Kubernetes work pool's base job template rendered as Prefect's Kubernetes worker renders it
  (defaults, then job variables, ``apply_values``, ``KubernetesWorkerJobConfiguration``,
  ``prepare_for_flow_run``).
- The multi-node trainer manifest rendered as ``envsubst`` renders it (``k8s_render.py``), and
  each pod's command run (``--dry-run``) against a stage spec.
- ``deployments/prefect.yaml`` through ``deployments.deploy`` (no API), and the stage task's GPU
  slot and MLflow link helpers.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import tomllib
import uuid
from contextlib import contextmanager
from importlib.resources import files
from pathlib import Path

import jsonschema
import pytest
import yaml

from deployments import deploy
from tests.unit.k8s_render import INFRA, MULTINODE_VALUES, render_multinode
from trainer_core.config import load_config
from trainer_core.errors import ConfigError

PROJECT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.gpu.yml")
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def env_example() -> dict[str, str]:
    lines = (INFRA / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def interpolate(node, env: dict[str, str]):
    """Compose's interpolation: ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``, ``$$``."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.groups()
        value = env.get(name)
        if value is None or (op and op.startswith(":") and value == ""):
            assert not (op or "").endswith("?"), f"${{{name}}} is required: {arg}"
            return arg or ""
        return value

    return _VAR.sub(one, node)


def compose_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text())
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_matches_the_compose_spec(name):
    raw = yaml.safe_load((INFRA / name).read_text())
    used = {m.group(1) for m in _VAR.finditer((INFRA / name).read_text()) if m.group(1)}
    assert used <= set(env_example()), f"not in .env.example: {used - set(env_example())}"
    for doc in (raw, interpolate(raw, env_example())):
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_validator().iter_errors(doc)]
        assert not errors, errors


def test_compose_stack_is_consistent():
    stack = interpolate(yaml.safe_load((INFRA / "docker-compose.yml").read_text()), env_example())
    services, volumes = stack["services"], set(stack["volumes"])
    assert {"postgres", "minio", "minio-init", "prefect-server", "mlflow", "worker"} <= set(services)
    for name, service in services.items():
        assert set(service.get("depends_on", {})) <= set(services), name
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("."):
                assert (INFRA / source).is_file(), f"{name}: bind mount {source} is missing"
            else:
                assert source in volumes, f"{name}: volume {source} is not declared"
        if "build" in service:
            context = (INFRA / service["build"]["context"]).resolve()
            assert context == PROJECT and (context / service["build"]["dockerfile"]).is_file()
    prefect_db = services["prefect-server"]["environment"]["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    assert prefect_db.startswith("postgresql+asyncpg://") and prefect_db.endswith("@postgres:5432/prefect")
    mlflow_args = " ".join(services["mlflow"]["command"])
    assert "--backend-store-uri=postgresql://" in mlflow_args and "--artifacts-destination=s3://mlflow/" in mlflow_args
    assert services["mlflow"]["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    worker = services["worker"]
    assert worker["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert worker["environment"]["AWS_ENDPOINT_URL"] == "http://minio:9000"
    deployed = re.findall(r"--name (\S+)", worker["command"][-1])
    declared = [d["name"] for d in deploy.load_prefect_file()["deployments"]]
    assert deployed and set(deployed) <= set(declared)
    assert "prefect worker start --pool posttrain-local" in worker["command"][-1]


def test_dockerfile_installs_every_package_and_config():
    dockerfile = (INFRA / "Dockerfile").read_text()
    find = tomllib.loads((PROJECT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    copied = set(re.findall(r"^COPY .* (\S+)$", dockerfile, flags=re.M))
    assert {p.rstrip("*") for p in find["include"]} | {"configs"} <= copied
    assert re.search(r"^WORKDIR /opt/posttrain$", dockerfile, flags=re.M)
    template = json.loads((INFRA / "k8s" / "base-job-template.json").read_text())
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["workingDir"] == "/opt/posttrain"


def k8s_deployment_job_variables() -> dict:
    [entry] = deploy.select_deployments(deploy.load_prefect_file(), ["qwen2.5-0.5b-k8s"])
    return entry["work_pool"]["job_variables"]


def render_work_pool_job(job_variables: dict):
    """The Job manifest the Kubernetes worker submits for a flow run with these job variables."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.utilities.templating import apply_values
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = json.loads((INFRA / "k8s" / "base-job-template.json").read_text())
    properties = template["variables"]["properties"]
    values = {k: v["default"] for k, v in properties.items() if "default" in v} | job_variables
    config = KubernetesWorkerJobConfiguration(**apply_values(template["job_configuration"], values))
    config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="brave-otter"))
    return config


def test_work_pool_template_declares_its_variables():
    from prefect.utilities.templating import find_placeholders

    template = json.loads((INFRA / "k8s" / "base-job-template.json").read_text())
    variables = template["variables"]
    used = {p.name for p in find_placeholders(json.dumps(template["job_configuration"]))}
    assert used <= set(variables["properties"])
    jsonschema.Draft202012Validator.check_schema(variables)
    defaults = {k: v["default"] for k, v in variables["properties"].items() if "default" in v}
    jsonschema.validate(defaults | k8s_deployment_job_variables(), variables)


def test_work_pool_job_renders_gpu_image_and_secrets():
    config = render_work_pool_job(k8s_deployment_job_variables())
    pod = config.job_manifest["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert config.namespace == "posttrain" and pod["restartPolicy"] == "Never"
    assert container["image"] == "posttrain-worker:latest"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["envFrom"] == [
        {"secretRef": {"name": "posttrain-s3", "optional": False}},
        {"secretRef": {"name": "posttrain-env", "optional": True}},
    ]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["POSTTRAIN_GPU_CONCURRENCY_LIMIT"] == "posttrain-gpu-k8s"
    assert container["args"] == ["prefect", "flow-run", "execute"]
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]

    custom = render_work_pool_job(
        {"gpu_count": 4, "image": "registry.example.com/posttrain-worker:1.2", "s3_secret": "team-s3"}
    )
    [container] = custom.job_manifest["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/posttrain-worker:1.2"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["envFrom"][0]["secretRef"]["name"] == "team-s3"


def test_multinode_trainer_manifest_renders():
    values = MULTINODE_VALUES
    service, job = render_multinode(values)
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": "sft-run42"}
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    assert spec["backoffLimit"] == 0
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"]
    [container] = pod["containers"]
    assert container["command"] == [
        "python", "-m", "tasks.launch.process", values["SPEC_URI"], "--node-rank=$(NODE_RANK)",
        "--nnodes=2", "--nproc-per-node=8", "--rdzv-endpoint=sft-run42-0.sft-run42:29500",
    ]  # fmt: skip
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    [port] = service["spec"]["ports"]
    assert port["port"] == container["ports"][0]["containerPort"] == 29500
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["envFrom"][0] == {"secretRef": {"name": "posttrain-s3"}}


def write_stage_spec(path: Path, overrides: list[str]) -> str:
    from trainer_core.spec import build_spec

    config = load_config(
        overrides=["stages=[prepare_data,sft]", *overrides]
    )  # 16 ranks: the RL stages' shares would not divide
    spec = build_spec(config, "sft", "run42", {}, output_uri=str(path.parent / "sft"))
    path.write_text(json.dumps(spec.model_dump(mode="json")))
    return str(path)


def test_multinode_pods_run_the_stage_command_built_from_the_spec(tmp_path, capsys):
    """Each pod's command, with Kubernetes' ``$(NODE_RANK)`` expanded to its index, runs
    ``tasks.launch.process``, which prints (``--dry-run``) the torchrun command ``trainer_command``
    (``tasks/launch/commands.py``) builds for that node from the spec's backend; a spec that disagrees
    with the job is refused."""
    from tasks.launch import commands
    from tasks.launch import process as launch

    spec_uri = write_stage_spec(tmp_path / "sft.json", [
        "backend.name=fsdp2", "backend.nnodes=2", "backend.nproc_per_node=8",
        "backend.rdzv_endpoint=sft-run42-0.sft-run42:29500",
    ])  # fmt: skip
    [container] = render_multinode(MULTINODE_VALUES | {"SPEC_URI": spec_uri})[1]["spec"]["template"]["spec"][
        "containers"
    ]
    assert container["command"][:3] == ["python", "-m", "tasks.launch.process"]
    config = load_config(
        overrides={
            "stages": "prepare_data,sft",
            "backend.name": "fsdp2",
            "backend.nnodes": 2,
            "backend.nproc_per_node": 8,
            "backend.rdzv_endpoint": "sft-run42-0.sft-run42:29500",
        }
    )
    for index in (0, 1):
        argv = [a.replace("$(NODE_RANK)", str(index)) for a in container["command"][3:]]
        assert launch.main([*argv, "--dry-run"]) == 0
        printed = shlex.split(capsys.readouterr().out)
        backend = config.backend.model_copy(update={"node_rank": index})
        assert printed == commands.trainer_command(spec_uri, backend, "run42-sft")
        assert printed[printed.index("--rdzv-conf") + 1] == f"is_host={'true' if index == 0 else 'false'}"

    mismatched = write_stage_spec(tmp_path / "bad.json", [
        "backend.name=fsdp2", "backend.nnodes=2", "backend.nproc_per_node=4", "backend.rdzv_endpoint=x-0.x:29500",
    ])  # fmt: skip
    argv = [mismatched if a == spec_uri else a.replace("$(NODE_RANK)", "0") for a in container["command"][3:]]
    assert launch.main([*argv, "--dry-run"]) == 2
    assert "nproc_per_node=8 but the stage spec has backend.nproc_per_node=4" in capsys.readouterr().err
    assert launch.main([spec_uri, "--node-rank", "2", "--dry-run"]) == 2
    assert "node_rank" in capsys.readouterr().err
    assert launch.main([str(tmp_path / "missing.json"), "--node-rank", "0", "--dry-run"]) == 2


def test_prefect_file_deployments_resolve():
    from prefect.flows import load_flow_from_entrypoint

    spec = deploy.load_prefect_file()
    entries = deploy.select_deployments(spec, None)
    assert [e["name"] for e in entries] == ["demo", "demo-sweep", "qwen2.5-0.5b-1gpu", "qwen2.5-0.5b-k8s"]
    demo = entries[0]
    assert demo["work_pool"] == {
        "name": "posttrain-local",
        "job_variables": {
            "working_dir": str(PROJECT),
            "env": {"POSTTRAIN_MLFLOW_UI_URL": deploy.DEFAULT_MLFLOW_UI_URL},
        },
    }
    pools, limits = deploy.used_resources(spec, entries)
    assert {n: p["type"] for n, p in pools.items()} == {"posttrain-local": "process", "posttrain-gpu": "kubernetes"}
    assert deploy.base_job_template(pools["posttrain-gpu"])["job_configuration"]["job_manifest"]["kind"] == "Job"
    assert deploy.base_job_template(pools["posttrain-local"])["job_configuration"]["working_dir"] == "{{ working_dir }}"
    assert limits == {"posttrain-gpu-local": 1, "posttrain-gpu-k8s": 8}
    for entry in entries:
        flow = load_flow_from_entrypoint(entry["entrypoint"])
        sweep = entry["name"] == "demo-sweep"
        assert flow.name == ("post-training-sweep" if sweep else "post-training-pipeline")
        params = deploy.deployment_parameters(flow, entry)
        deployment = deploy.build_deployment(flow, entry, enable_schedule=False, parameters=params)
        assert deployment.entrypoint == entry["entrypoint"]
        assert all(s.active is False for s in deployment.schedules or [])
        schema = deployment._parameter_openapi_schema
        assert set(schema.properties) == (
            {"config_uri", "grid", "settings", "overrides", "sweep_id"}
            if sweep
            else {"config_uri", "settings", "overrides", "run_id"}
        )
        assert "PipelineConfig" not in schema.definitions and "SFTSettings" in schema.definitions
        assert "SweepPoint" not in schema.definitions  # the pipeline's sweep parameter is the sweep flow's to set
        assert deployment.parameters == params
    assert entries[1]["parameters"]["grid"] == {"dpo.beta": [0.05, 0.1, 0.2]}
    [nightly] = deploy.build_deployment(flow, entries[2], enable_schedule=True).schedules
    assert nightly.active is True and nightly.schedule.cron == "0 2 * * *" and nightly.slug == "nightly"


def test_prefect_file_errors_name_the_problem(tmp_path, monkeypatch):
    from prefect.flows import load_flow_from_entrypoint

    monkeypatch.delenv("POSTTRAIN_TEST_UNSET", raising=False)
    bad = tmp_path / "prefect.yaml"
    bad.write_text("deployments:\n  - name: x\n    work_pool: {name: '{{ $POSTTRAIN_TEST_UNSET }}'}\n")
    with pytest.raises(ConfigError, match=r"\$POSTTRAIN_TEST_UNSET"):
        deploy.load_prefect_file(bad)
    spec = deploy.load_prefect_file()
    with pytest.raises(ConfigError, match="nightly-typo"):
        deploy.select_deployments(spec, ["nightly-typo"])
    flow = load_flow_from_entrypoint("flows.pipeline.post_training_pipeline")
    entry = {
        "name": "x",
        "work_pool": {"name": "posttrain-local"},
        "parameters": {"config_uri": "configs/demo.yaml", "overrides": {"sft.learning_rate": -1}},
    }
    with pytest.raises(ConfigError, match=r"sft\.learning_rate"):
        deploy.deployment_parameters(flow, entry)
    with pytest.raises(ConfigError, match="confg"):
        deploy.deployment_parameters(flow, {**entry, "parameters": {"confg": {}}})
    with pytest.raises(ConfigError, match="Python callers"):
        deploy.deployment_parameters(flow, {**entry, "parameters": {"config": {}}})
    with pytest.raises(ConfigError, match="posttrain-nowhere"):
        deploy.used_resources(spec, [{"name": "x", "work_pool": {"name": "posttrain-nowhere"}}])


def test_deploy_needs_an_api_url():
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from typer.testing import CliRunner

    from posttrain.cli import app

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        result = CliRunner().invoke(app, ["deploy"])
    assert result.exit_code == 2 and "PREFECT_API_URL" in result.output


@pytest.mark.parametrize(
    ("env", "stage", "device", "taken"),
    [
        (None, "sft", "cuda", False),
        ("posttrain-gpu-a", "prepare_data", "cuda", False),
        ("posttrain-gpu-a", "sft", "cpu", False),
        ("posttrain-gpu-a", "sft", "cuda", True),
        ("posttrain-gpu-a", "evaluate", "auto", True),
    ],
)
def test_gpu_slots_only_for_gpu_stages(monkeypatch, env, stage, device, taken):
    from tasks import stages

    calls: list = []

    @contextmanager
    def recording_concurrency(name, **kwargs):
        calls.append((name, kwargs))
        yield

    monkeypatch.setattr(stages, "concurrency", recording_concurrency)
    if env is None:
        monkeypatch.delenv(stages.GPU_CONCURRENCY_ENV, raising=False)
    else:
        monkeypatch.setenv(stages.GPU_CONCURRENCY_ENV, env)
    config = load_config(overrides={"backend.device": device})
    with stages.gpu_slots(stage, config, logging.getLogger("test")):
        pass
    expected = [(env, {"occupy": 1, "strict": True, "raise_on_lease_renewal_failure": False})]
    assert calls == (expected if taken else [])


def test_gpu_slots_limit_from_config_wins_over_env(monkeypatch):
    from tasks import stages

    calls: list = []

    @contextmanager
    def recording_concurrency(name, **kwargs):
        calls.append(name)
        yield

    monkeypatch.setattr(stages, "concurrency", recording_concurrency)
    monkeypatch.setenv(stages.GPU_CONCURRENCY_ENV, "from-env")
    config = load_config(overrides={"backend.device": "cuda", "launch.gpu_concurrency_limit": "from-config"})
    with stages.gpu_slots("sft", config, logging.getLogger("test")):
        pass
    assert calls == ["from-config"]


def test_mlflow_link_only_when_a_ui_url_is_known():
    """A sqlite store without ``tracking.ui_url`` has no UI to link (and no store is read);
    links themselves: tests/unit/test_reports.py."""
    from tasks.stages import mlflow_run_markdown

    assert mlflow_run_markdown(load_config(), "sqlite:////tmp/mlflow.db", "abc123") == "`abc123`"
