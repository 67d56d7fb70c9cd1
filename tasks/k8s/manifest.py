"""What a multi-node stage submits to Kubernetes: the objects rendered from the one template.

A stage whose backend has ``nnodes > 1`` runs as ``infra/k8s/multinode-trainer.yaml``: a headless
Service and an Indexed Job with one pod per node, pod ``i`` running
``python -m tasks.launch.process <spec-uri> --node-rank=i ...`` (``tasks/launch/process.py``, :func:`main`). The
template is the single source of truth: :func:`render_template` fills its ``${VAR}`` placeholders
as ``envsubst`` does (the operator's ``kubectl apply`` path), and :func:`trainer_manifests` then
sets only what the template leaves to the cluster (:class:`JobSettings`: image, service account,
secrets, GPUs per pod, node selection, deadline, labels).

This module is pure (no API calls); ``tasks/k8s/job.py`` creates, watches and deletes the objects.

Names: :func:`job_name` is a DNS-1035 label of at most 52 characters derived from the run id and
the stage (pod ``i`` is ``<name>-i``, its DNS name ``<name>-i.<name>``), the same for every attempt
of a stage: a retry deletes the previous Job before creating the new one, so a stage never has two
Jobs writing its checkpoints.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import fsspec
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.launch.commands import trainer_command
from tasks.launch.failures import BadStageInput
from trainer_core import storage
from trainer_core.config import BackendConfig, PipelineConfig
from trainer_core.errors import EXIT_BAD_INPUT, ConfigError

TEMPLATE = Path(__file__).resolve().parents[2] / "infra" / "k8s" / "multinode-trainer.yaml"
"""The trainer Job template (in the image at ``/opt/posttrain/infra/k8s/``)."""

MAX_NAME_CHARS = 52
"""Longest Job/Service name: pod host names ``<name>-<index>`` must stay DNS labels (63)."""

CONTAINER = "trainer"
"""The trainer container's name in the template."""

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
"""Where Kubernetes puts an Indexed Job pod's completion index (= node rank)."""

LABEL_STAGE = "posttrain.io/stage"
LABEL_JOB = "posttrain.io/trainer-job"
ANNOTATION_RUN = "posttrain.io/run-id"
ANNOTATION_SPEC = "posttrain.io/spec-uri"

ENV_PREFIX = "POSTTRAIN_K8S_"
"""Environment variables of the flow process that set :class:`JobSettings` fields (see there)."""

_LOCAL_PROTOCOLS = (None, "file", "local", "memory")
_LOCAL_TRACKING = ("", "file", "sqlite")
_VAR = re.compile(r"\$\{([A-Za-z_]\w*)\}")


class JobSettings(BaseModel):
    """Where and how the trainer Job runs: the cluster side, not the experiment.

    Read by :meth:`from_env` from the flow process's environment (``POSTTRAIN_K8S_<FIELD>``, e.g.
    ``POSTTRAIN_K8S_IMAGE``; JSON for mappings and lists, commas for ``secrets``), which the work
    pool's ``env`` job variable sets per deployment. Fields left unset take the flow-run pod's
    own values when the flow runs in a pod (image, service account, secrets), else the template's.
    """

    model_config = ConfigDict(extra="forbid")

    namespace: str | None = Field(
        None, description="Namespace; default: the flow-run pod's, else the kubeconfig context's, else 'posttrain'."
    )
    image: str | None = Field(None, description="Trainer image; default: the flow-run pod's image (the same code).")
    image_pull_policy: str | None = Field(None, description="Image pull policy; default: the flow-run pod's.")
    image_pull_secrets: list[str] | None = Field(None, description="Image pull secrets; default: the flow-run pod's.")
    service_account: str | None = Field(
        None, description="Service account; default: the flow-run pod's, else the template's (posttrain-worker)."
    )
    secrets: list[str] | None = Field(
        None,
        description="Secrets whose keys become the trainers' environment "
        "(S3, MLflow, HF credentials); default: the flow-run pod's envFrom, else the "
        "template's (posttrain-s3, optional posttrain-env).",
    )
    env_from: list[dict[str, Any]] | None = Field(
        None, description="envFrom entries, used when `secrets` is unset; default: the flow-run pod's (see inherit)."
    )
    node_selector: dict[str, str] | None = Field(
        None, description="Node selector; default: the template's (GPU nodes)."
    )
    tolerations: list[dict[str, Any]] | None = Field(None, description="Tolerations; default: the template's.")
    gpu_resource: str = Field("nvidia.com/gpu", description="Extended resource requested per rank (none on cpu).")
    cpu_request: str | None = Field(None, description="CPU request per pod (e.g. '32'); default: none.")
    memory_request: str | None = Field(None, description="Memory request per pod (e.g. '256Gi'); default: none.")
    memory_limit: str | None = Field(None, description="Memory limit per pod; default: none.")
    shm_size: str | None = Field(None, description="/dev/shm size limit; default: the template's.")
    ttl_after_finished_s: int | None = Field(
        None,
        ge=0,
        description="Seconds a finished Job (and its Service) stays for inspection; default: the template's.",
    )
    poll_interval_s: float = Field(5.0, gt=0, description="Seconds between status reads of the Job and its pods.")
    stuck_after_s: float = Field(
        300.0,
        gt=0,
        description="Seconds a pod may fail to start (image pull, missing "
        "secret) before the stage fails; an unschedulable pod waits for the timeout.",
    )
    api_retry_s: float = Field(300.0, gt=0, description="Seconds of consecutive API errors tolerated while watching.")
    delete_timeout_s: float = Field(300.0, gt=0, description="Seconds to wait for a previous attempt's Job to go.")
    log_tail_lines: int = Field(200, ge=1, description="Lines of a failed pod's log read for the failure report.")
    flow_pod: str | None = Field(
        None,
        description="The flow-run pod whose image, service account and secrets are "
        "the defaults; default: $HOSTNAME when running in a cluster.",
    )
    template: str | None = Field(None, description="Template path; default: infra/k8s/multinode-trainer.yaml.")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> JobSettings:
        """The settings given by ``POSTTRAIN_K8S_*`` variables (defaults for the others).

        Args:
            environ: The environment (default ``os.environ``).

        Raises:
            ConfigError: a variable that does not parse (named).
        """
        environ = os.environ if environ is None else environ
        in_cluster = bool(environ.get("KUBERNETES_SERVICE_HOST"))
        raw: dict[str, Any] = {"flow_pod": environ.get("HOSTNAME") if in_cluster else None}
        for name in cls.model_fields:
            value = environ.get(ENV_PREFIX + name.upper())
            if value is None or value == "":
                continue
            try:
                if name == "secrets":
                    raw[name] = [s.strip() for s in value.split(",") if s.strip()]
                elif name in ("node_selector", "tolerations", "image_pull_secrets", "env_from"):
                    raw[name] = json.loads(value)
                else:
                    raw[name] = value
            except json.JSONDecodeError as e:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()}: not JSON ({e})") from None
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            fields = "; ".join(f"{ENV_PREFIX}{str(err['loc'][0]).upper()}: {err['msg']}" for err in e.errors())
            raise ConfigError(f"Kubernetes job settings: {fields}") from None

    def inherit(self, flow_pod: dict[str, Any] | None) -> JobSettings:
        """These settings with the unset image, pull policy, pull secrets, service account and
        envFrom (its secrets and config maps, ``optional`` flags kept) taken from ``flow_pod`` (a
        Pod object as the API returns it; None: unchanged)."""
        if not flow_pod:
            return self
        spec = flow_pod.get("spec", {})
        container = (spec.get("containers") or [{}])[0]
        found = {
            "image": container.get("image"),
            "image_pull_policy": container.get("imagePullPolicy"),
            "image_pull_secrets": [s["name"] for s in spec.get("imagePullSecrets") or []] or None,
            "service_account": spec.get("serviceAccountName"),
            "env_from": container.get("envFrom") or None,
        }
        return self.model_copy(update={k: v for k, v in found.items() if getattr(self, k) is None and v is not None})


@dataclass(frozen=True)
class TrainerJob:
    """One attempt of a multi-node stage, as submitted.

    Attributes:
        name: Job and Service name (:func:`job_name`).
        stage: Stage name.
        run_id: Pipeline run id.
        spec_uri: The stage spec every pod reads.
        backend: The stage's backend, rendezvous pinned to pod 0 (:attr:`rdzv_endpoint`).
        secret_env: The config's S3 settings the pods need to read their spec (endpoint, region,
            keys: ``storage.process_env``); sent as a Secret owned by the Job, never in its
            spec. Not in ``repr``.
    """

    name: str
    stage: str
    run_id: str
    spec_uri: str
    backend: BackendConfig
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def rdzv_endpoint(self) -> str:
        """``<name>-0.<name>:<port>``: pod 0 through the headless Service."""
        return str(self.backend.rdzv_endpoint)


def job_name(run_id: str, stage: str) -> str:
    """The Job and Service name of ``stage`` in ``run_id``: ``<stage>-<run id>`` lower-cased, runs of
    other characters as ``-``, cut to fit :data:`MAX_NAME_CHARS` with 8 hex digits of a hash of both
    (so two runs whose names cut alike never share a Job). Starts with a letter (stage names do).
    """
    digest = hashlib.sha256(f"{run_id}\0{stage}".encode()).hexdigest()[:8]
    readable = re.sub(r"[^a-z0-9]+", "-", f"{stage}-{run_id}".lower()).strip("-")
    return f"{readable[: MAX_NAME_CHARS - 9].rstrip('-')}-{digest}"


def _template_text(settings: JobSettings) -> str:
    path = Path(settings.template) if settings.template else TEMPLATE
    try:
        return path.read_text()
    except OSError as e:
        raise ConfigError(f"trainer Job template {path}: {e} (set {ENV_PREFIX}TEMPLATE)") from None


def render_template(values: dict[str, str | int], text: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The template's Service and Job with its ``${VAR}`` placeholders filled, as ``envsubst``
    then ``yaml.safe_load_all`` would give them for plain values (a value is put in as a string,
    never parsed as YAML; a placeholder alone standing for an int stays an int).

    Args:
        values: ``NAME``, ``NAMESPACE``, ``NNODES``, ``NPROC_PER_NODE``, ``IMAGE``, ``SPEC_URI``.
        text: The template (default :data:`TEMPLATE`'s).

    Raises:
        ConfigError: a placeholder without a value, or a template that is not a Service then a Job.
    """
    docs = list(yaml.safe_load_all(TEMPLATE.read_text() if text is None else text))
    if [d.get("kind") for d in docs if d] != ["Service", "Job"]:
        raise ConfigError("the trainer Job template must hold a Service, then a Job")

    def fill(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v) for v in node]
        if not isinstance(node, str):
            return node
        missing = [m[1] for m in _VAR.finditer(node) if m[1] not in values]
        if missing:
            raise ConfigError(f"the trainer Job template uses ${{{missing[0]}}}, which has no value")
        whole = _VAR.fullmatch(node)
        if whole and isinstance(values[whole[1]], int):
            return values[whole[1]]
        return _VAR.sub(lambda m: str(values[m[1]]), node)

    service, job = (fill(d) for d in docs if d)
    return service, job


def rendezvous_port(settings: JobSettings | None = None) -> int:
    """The rendezvous port: the template Service's first port."""
    service, _ = render_template(_PLACEHOLDERS, _template_text(settings or JobSettings()))
    return int(service["spec"]["ports"][0]["port"])


_PLACEHOLDERS: dict[str, str | int] = {
    "NAME": "x", "NAMESPACE": "x", "NNODES": 2, "NPROC_PER_NODE": 1, "IMAGE": "x", "SPEC_URI": "x",
}  # fmt: skip


def pin_rendezvous(config: PipelineConfig, stage: str, endpoint: str) -> PipelineConfig:
    """A copy of ``config`` whose backend for ``stage`` has ``rdzv_endpoint = endpoint`` (pipeline
    backend and the stage's override alike), so the spec agrees with the Job's pods."""
    pinned = config.model_copy(deep=True)
    pinned.backend = pinned.backend.model_copy(update={"rdzv_endpoint": endpoint})
    override = getattr(pinned.section(stage), "backend", None)  # a training stage's BackendOverride
    if override is not None and "rdzv_endpoint" in override.model_fields_set:
        override.rdzv_endpoint = endpoint
    return pinned


def _refuse(stage: str, why: str) -> BadStageInput:
    return BadStageInput(f"stage {stage!r} (backend.nnodes > 1, a Kubernetes Job): {why}", EXIT_BAD_INPUT)


def trainer_job(
    config: PipelineConfig,
    stage: str,
    run_id: str,
    spec_uri: str,
    tracking_uri: str | None,
    settings: JobSettings | None = None,
) -> TrainerJob:
    """Plan the Job of a multi-node stage, refusing what its pods could not run.

    Args:
        config: The pipeline config (with secrets: config credentials go to a Secret).
        stage: The stage; ``config.backend_for(stage).nnodes > 1``.
        run_id: Pipeline run id.
        spec_uri: Where the stage spec will be written.
        tracking_uri: The resolved MLflow tracking URI the trainers log to.
        settings: Cluster settings (for the template; default :meth:`JobSettings.from_env`).

    Returns:
        The job, its backend's rendezvous pinned to pod 0 (write the spec with
        :func:`pin_rendezvous` and :attr:`TrainerJob.rdzv_endpoint`).

    Raises:
        BadStageInput: a storage root or tracking URI the pods cannot reach (a local path,
            ``memory://``, ``sqlite``), a launcher that cannot span nodes (``deepspeed``), an
            unreadable template or bad ``POSTTRAIN_K8S_*`` variables.
    """
    protocol, _ = fsspec.core.split_protocol(config.storage.root)
    if protocol in _LOCAL_PROTOCOLS:
        raise _refuse(
            stage,
            f"storage.root {config.storage.root!r} is local to the flow process; the pods read the "
            "spec and write checkpoints there: use shared object storage (storage.root=s3://...)",
        )
    if urlsplit(tracking_uri or "").scheme in _LOCAL_TRACKING:
        raise _refuse(
            stage,
            f"MLflow tracking URI {tracking_uri!r} is a local store the pods cannot reach: use a "
            "tracking server (tracking.tracking_uri or MLFLOW_TRACKING_URI=http://...)",
        )
    try:
        port = rendezvous_port(settings or JobSettings.from_env())
    except ConfigError as e:
        raise _refuse(stage, str(e)) from None
    name = job_name(run_id, stage)
    endpoint = f"{name}-0.{name}:{port}"
    backend = config.backend_for(stage).model_copy(update={"rdzv_endpoint": endpoint})
    try:
        trainer_command(spec_uri, backend, f"{run_id}-{stage}")
    except ValueError as e:
        raise _refuse(stage, str(e)) from None
    return TrainerJob(name, stage, run_id, spec_uri, backend, storage.process_env(config.storage))


@dataclass(frozen=True)
class Manifests:
    """The objects of one trainer Job, ready to create (Secret None when the config has no credentials)."""

    service: dict[str, Any]
    job: dict[str, Any]
    secret: dict[str, Any] | None


def trainer_manifests(
    job: TrainerJob, settings: JobSettings, namespace: str, timeout_s: float | None = None
) -> Manifests:
    """The template rendered for ``job`` with ``settings`` applied (resolve them first with
    :meth:`JobSettings.inherit`).

    Each pod requests ``backend.nproc_per_node`` of ``settings.gpu_resource`` (none with
    ``backend.device=cpu``, which also drops the template's GPU node selector and tolerations
    unless the settings give their own); the Job's ``activeDeadlineSeconds`` is ``timeout_s``.

    Raises:
        ConfigError: no image (set ``POSTTRAIN_K8S_IMAGE`` outside a cluster), or a bad template.
    """
    if not settings.image:
        raise ConfigError(f"no image for the trainer Job: set {ENV_PREFIX}IMAGE (the flow's own image when in a pod)")
    values = {
        "NAME": job.name,
        "NAMESPACE": namespace,
        "NNODES": job.backend.nnodes,
        "NPROC_PER_NODE": job.backend.nproc_per_node,
        "IMAGE": settings.image,
        "SPEC_URI": job.spec_uri,
    }
    service, manifest = render_template(values, _template_text(settings))
    labels = {LABEL_STAGE: re.sub(r"[^a-z0-9]+", "-", job.stage.lower()), LABEL_JOB: job.name}
    annotations = {ANNOTATION_RUN: job.run_id, ANNOTATION_SPEC: job.spec_uri}
    for meta in (service["metadata"], manifest["metadata"], manifest["spec"]["template"].setdefault("metadata", {})):
        meta.setdefault("labels", {}).update(labels)
        meta.setdefault("annotations", {}).update(annotations)
    spec = manifest["spec"]
    if timeout_s is not None:
        spec["activeDeadlineSeconds"] = math.ceil(timeout_s)
    if settings.ttl_after_finished_s is not None:
        spec["ttlSecondsAfterFinished"] = settings.ttl_after_finished_s
    pod = spec["template"]["spec"]
    _apply_pod_settings(pod, settings, job.backend)
    secret = None
    if job.secret_env:
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": job.name, "namespace": namespace, "labels": dict(labels)},
            "stringData": dict(job.secret_env),
        }
        _container(pod).setdefault("envFrom", []).append({"secretRef": {"name": job.name}})
    return Manifests(service, manifest, secret)


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["containers"] if c["name"] == CONTAINER)


def _apply_pod_settings(pod: dict[str, Any], settings: JobSettings, backend: BackendConfig) -> None:
    container = _container(pod)
    if settings.service_account:
        pod["serviceAccountName"] = settings.service_account
    if settings.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in settings.image_pull_secrets]
    if settings.image_pull_policy:
        container["imagePullPolicy"] = settings.image_pull_policy
    if settings.secrets is not None:
        container["envFrom"] = [{"secretRef": {"name": s}} for s in settings.secrets]
    elif settings.env_from is not None:
        container["envFrom"] = copy.deepcopy(settings.env_from)
    gpus = 0 if backend.device == "cpu" else backend.nproc_per_node
    resources = copy.deepcopy(container.get("resources") or {})
    for kind in ("requests", "limits"):
        section = {k: v for k, v in resources.get(kind, {}).items() if "gpu" not in k}
        if gpus:
            section[settings.gpu_resource] = gpus
        resources[kind] = section
    for kind, key, value in (
        ("requests", "cpu", settings.cpu_request),
        ("requests", "memory", settings.memory_request),
        ("limits", "memory", settings.memory_limit),
    ):
        if value:
            resources[kind][key] = value
    container.pop("resources", None)
    if resources := {k: v for k, v in resources.items() if v}:
        container["resources"] = resources
    if settings.node_selector is not None:
        pod["nodeSelector"] = settings.node_selector
    elif not gpus:
        pod.pop("nodeSelector", None)
    if settings.tolerations is not None:
        pod["tolerations"] = settings.tolerations
    elif not gpus:
        pod.pop("tolerations", None)
    if settings.shm_size:
        for volume in pod.get("volumes", []):
            if volume["name"] == "dshm":
                volume["emptyDir"]["sizeLimit"] = settings.shm_size
