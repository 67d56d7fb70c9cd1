"""The few Kubernetes API calls a trainer Job needs (``tasks/k8s/job.py``), on raw JSON.

Through ``kubernetes_asyncio``'s :class:`ApiClient` (authentication from the in-cluster service
account, else ``$KUBECONFIG`` or ``~/.kube/config``: tokens, client certificates, exec plugins),
with ``_preload_content=False``: objects come back as the API's JSON dicts, no model classes.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from typing import Any

from tasks.k8s.manifest import CONTAINER, LABEL_JOB, JobSettings
from tasks.launch.failures import BadStageInput
from trainer_core.errors import EXIT_BAD_INPUT, ConfigError

_REQUEST_TIMEOUT_S = 60.0
_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_API = {"job": ("/apis/batch/v1", "jobs"), "service": ("/api/v1", "services"), "secret": ("/api/v1", "secrets"),
        "pod": ("/api/v1", "pods")}  # fmt: skip


class KubeError(Exception):
    """A Kubernetes API call answered with an error status (``status`` 0: no answer)."""

    def __init__(self, what: str, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API: {what}: {status or 'no answer'} {message}".rstrip())
        self.status = status


class KubeApi:
    """The few calls a trainer Job needs, on raw JSON (``_preload_content=False``), in one namespace.

    Use as ``async with await KubeApi.connect(settings) as api``. A 401/403 raises
    :class:`~tasks.launch.failures.BadStageInput` (credentials, RBAC: ``infra/k8s/worker.yaml``), a
    400/422 on create one too (the manifest is invalid); other errors raise :class:`KubeError`.
    """

    def __init__(self, api_client: Any, namespace: str) -> None:
        self.client, self.namespace = api_client, namespace

    @classmethod
    async def connect(cls, settings: JobSettings) -> KubeApi:
        """The API of the cluster this process runs in, else of ``$KUBECONFIG`` (``~/.kube/config``).

        Raises:
            ConfigError: ``kubernetes_asyncio`` missing, or no usable cluster configuration.
        """
        try:
            from kubernetes_asyncio import client, config
            from kubernetes_asyncio.config.config_exception import ConfigException
        except ImportError:
            raise ConfigError("multi-node stages need kubernetes_asyncio: pip install prefect-kubernetes") from None
        configuration = client.Configuration()
        namespace = settings.namespace
        try:
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=configuration)
                if namespace is None and os.path.exists(_NAMESPACE_FILE):
                    with open(_NAMESPACE_FILE) as f:
                        namespace = f.read().strip()
            else:
                path = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
                loader = await config.load_kube_config(
                    config_file=path, client_configuration=configuration, persist_config=False
                )
                context = (loader.current_context or {}).get("context") or {}
                namespace = namespace or context.get("namespace")
        except (ConfigException, OSError) as e:
            raise ConfigError(f"no Kubernetes API to submit the trainer Job to: {e}") from None
        return cls(client.ApiClient(configuration), namespace or "posttrain")

    async def __aenter__(self) -> KubeApi:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()

    async def _request(
        self,
        method: str,
        path: str,
        what: str,
        *,
        query: dict[str, Any] | None = None,
        body: Any = None,
        stream: bool = False,
    ) -> Any:
        import aiohttp

        timeout = aiohttp.ClientTimeout(sock_connect=30, sock_read=None) if stream else _REQUEST_TIMEOUT_S
        try:
            resp = await self.client.call_api(
                path,
                method,
                query_params=[(k, v) for k, v in (query or {}).items() if v is not None],
                header_params={"Accept": "application/json", "Content-Type": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout,
            )
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise KubeError(what, 0, f"{type(e).__name__}: {e}") from None
        if resp.status < 400:
            return resp
        try:
            text = (await resp.read()).decode(errors="replace")
        finally:
            resp.release()
        try:
            message = json.loads(text).get("message", text)
        except (ValueError, AttributeError):
            message = text
        if resp.status in (401, 403) or (resp.status in (400, 422) and method == "POST"):
            raise BadStageInput(f"Kubernetes API refused to {what}: {resp.status} {message}", EXIT_BAD_INPUT)
        raise KubeError(what, resp.status, message)

    async def _json(self, method: str, path: str, what: str, **kw: Any) -> dict[str, Any]:
        resp = await self._request(method, path, what, **kw)
        try:
            return json.loads(await resp.read())
        finally:
            resp.release()

    def _path(self, kind: str, name: str | None = None) -> str:
        prefix, plural = _API[kind]
        return f"{prefix}/namespaces/{self.namespace}/{plural}" + (f"/{name}" if name else "")

    async def create(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create a ``kind`` (job, service, secret) object; the object as stored."""
        return await self._json("POST", self._path(kind), f"create {kind} {body['metadata']['name']}", body=body)

    async def get(self, kind: str, name: str) -> dict[str, Any] | None:
        """The ``kind`` object ``name``; None when there is none."""
        try:
            return await self._json("GET", self._path(kind, name), f"read {kind} {name}")
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def delete(self, kind: str, name: str) -> bool:
        """Delete with foreground propagation (dependents first); False when there was none."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Foreground"}
        try:
            await self._json(
                "DELETE",
                self._path(kind, name),
                f"delete {kind} {name}",
                body=body,
                query={"propagationPolicy": "Foreground"},
            )
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def pods(self, job: str) -> list[dict[str, Any]]:
        """The pods of Job ``job`` (by the label the template's pods carry)."""
        found = await self._json(
            "GET", self._path("pod"), f"list pods of {job}", query={"labelSelector": f"{LABEL_JOB}={job}"}
        )
        return found.get("items") or []

    async def log_tail(self, pod: str, lines: int) -> list[str]:
        """The last ``lines`` lines of ``pod``'s trainer container."""
        resp = await self._request(
            "GET",
            self._path("pod", pod) + "/log",
            f"read the log of {pod}",
            query={"container": CONTAINER, "tailLines": lines},
        )
        try:
            return (await resp.read()).decode(errors="replace").splitlines()
        finally:
            resp.release()

    async def follow(self, pod: str, since_s: int | None) -> AsyncIterator[tuple[str, str]]:
        """``pod``'s log as it is written, as (RFC 3339 timestamp, line) pairs, from ``since_s``
        seconds ago (None: the start); ends when the container does or the server closes the stream.

        Raises:
            KubeError: the connection broke (status 0) or the API answered an error.
        """
        resp = await self._request(
            "GET",
            self._path("pod", pod) + "/log",
            f"follow the log of {pod}",
            stream=True,
            query={"container": CONTAINER, "follow": "true", "timestamps": "true", "sinceSeconds": since_s},
        )
        import aiohttp

        buffer = b""
        try:
            async for chunk in resp.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    stamp, _, text = raw.decode(errors="replace").rstrip("\r").partition(" ")
                    yield stamp, text
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise KubeError(f"follow the log of {pod}", 0, f"{type(e).__name__}: {e}") from None
        finally:
            resp.release()


def stamp_key(stamp: str) -> tuple[str, str]:
    """An RFC 3339 UTC timestamp as a sortable key (fractions of a second padded to nanoseconds)."""
    base, _, fraction = stamp.rstrip("Z").partition(".")
    return base, fraction.ljust(9, "0")
