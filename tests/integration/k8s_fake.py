"""A fake Kubernetes API server on 127.0.0.1 for the trainer Job tests: a real HTTP server
(aiohttp, in a thread) answering the calls ``tasks/k8s/api.py`` makes, with a bearer token
and a kubeconfig pointing at it, and a scripted kubelet and Job controller.

What it keeps: Jobs, Services, Secrets and Pods of any namespace, in memory. Creating an
Indexed Job creates its pods (Pending, one per completion index, annotated with the index and
carrying the template's labels), then runs ``on_job(cluster, job_name)`` in a thread: the test's
script of what the pods do (:meth:`FakeCluster.start_pods`, :meth:`FakeCluster.log`,
:meth:`FakeCluster.exit`, :meth:`FakeCluster.wait_pod`). The Job controller part: a failed pod
fails the Job (``backoffLimit: 0``: condition Failed, BackoffLimitExceeded) and stops the
others (exit 143); all pods succeeded completes it. Deletion with ``propagationPolicy:
Foreground`` removes the pods first, then the Job, then the objects it owns
(``ownerReferences``), after ``delete_delay_s``. Pod logs: ``tailLines``, ``timestamps``,
``sinceSeconds`` and ``follow`` (streamed until the container ends; with ``cut_follow_after``
N, the stream is dropped once after every N-th line, to test reconnection).
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

TOKEN = "fake-token"
INDEX = "batch.kubernetes.io/job-completion-index"
_PATHS = {("api", "v1"): {"services", "secrets", "pods"}, ("apis", "batch/v1"): {"jobs"}}


def now_stamp(offset_s: float = 0.0) -> str:
    """RFC 3339 UTC with microseconds, as the API writes times."""
    return (datetime.now(UTC) + timedelta(seconds=offset_s)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def role_rules(manifest: Path) -> list[dict[str, Any]]:
    """The rules of the (first) Role in a Kubernetes manifest file."""
    return next(d for d in yaml.safe_load_all(manifest.read_text()) if d and d.get("kind") == "Role")["rules"]


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response(
        {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason, "code": code},
        status=code,
    )


class FakeCluster:
    """The fake API server and its scripted cluster (see the module docstring).

    Attributes:
        objects: (plural, namespace, name) -> object.
        logs: pod name -> [(timestamp, line)].
        calls: (method, path, query) of every request, in order.
        created: every object created, in order (deep copies, as submitted plus metadata).
        deleted: (plural, name, propagationPolicy) of every delete.
        forbidden: (method, plural) pairs answered 403.
        rules: RBAC Role rules the caller is held to (None: all allowed); see :func:`role_rules`.
        on_job: the pods' script, run in a thread per created Job.
    """

    def __init__(self, on_job: Callable[[FakeCluster, str], None] | None = None) -> None:
        self.lock = threading.RLock()
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.logs: dict[str, list[tuple[str, str]]] = {}
        self.calls: list[tuple[str, str, dict[str, str]]] = []
        self.created: list[dict[str, Any]] = []
        self.deleted: list[tuple[str, str, str | None]] = []
        self.forbidden: set[tuple[str, str]] = set()
        self.rules: list[dict[str, Any]] | None = None
        self.on_job = on_job
        self.delete_delay_s = 0.0
        self.cut_follow_after: int | None = None
        self._cuts: set[tuple[str, int]] = set()
        self.script_errors: list[BaseException] = []
        self._closed = False
        self.port = 0

    # ------------------------------------------------------------------ server

    def start(self) -> FakeCluster:
        """Serve on a free loopback port (returns at once when it listens)."""
        ready = threading.Event()
        self.loop = asyncio.new_event_loop()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)
            self.loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self._runner.cleanup())

        self._thread = threading.Thread(target=serve, name="fake-k8s", daemon=True)
        self._thread.start()
        assert ready.wait(10), "fake API server did not start"
        return self

    def stop(self) -> None:
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path, namespace: str = "posttrain") -> Path:
        """Write a kubeconfig whose current context is this server (bearer token, ``namespace``)."""
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "fake", "user": {"token": TOKEN}}],
                    "contexts": [
                        {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}
                    ],
                }
            )
        )
        return path

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        with self.lock:
            self.calls.append((request.method, request.path, query))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return _status(401, "Unauthorized", "no or wrong bearer token")
        parts = request.path.strip("/").split("/")
        group = ("api", "v1") if parts[:2] == ["api", "v1"] else ("apis", "/".join(parts[1:3]))
        rest = parts[2:] if group[0] == "api" else parts[3:]
        if group not in _PATHS or len(rest) < 3 or rest[0] != "namespaces" or rest[2] not in _PATHS[group]:
            return _status(404, "NotFound", f"no route {request.path}")
        namespace, plural, name = rest[1], rest[2], (rest[3] if len(rest) > 3 else None)
        verb = {"POST": "create", "DELETE": "delete"}.get(request.method, "get" if name else "list")
        resource = f"{plural}/log" if len(rest) == 5 else plural
        if (request.method, plural) in self.forbidden or not self._allowed(group[1], resource, verb):
            return _status(403, "Forbidden", f'{resource} is forbidden: cannot {verb} in "{namespace}"')
        if request.method == "POST" and name is None:
            return self._create(plural, namespace, await request.json())
        if request.method == "GET" and name is None:
            return self._list(plural, namespace, query.get("labelSelector", ""))
        if request.method == "GET" and len(rest) == 5 and rest[4] == "log":
            return await self._log(request, namespace, name, query)
        if request.method == "GET":
            with self.lock:
                found = copy.deepcopy(self.objects.get((plural, namespace, name)))
            return web.json_response(found) if found else _status(404, "NotFound", f'{plural} "{name}" not found')
        if request.method == "DELETE":
            body = await request.json() if request.can_read_body else {}
            return self._delete(
                plural, namespace, name, query.get("propagationPolicy") or body.get("propagationPolicy")
            )
        return _status(405, "MethodNotAllowed", request.method)

    def _allowed(self, group_version: str, resource: str, verb: str) -> bool:
        if self.rules is None:
            return True
        group = "" if group_version == "v1" else group_version.split("/")[0]
        return any(
            group in r.get("apiGroups", []) and resource in r.get("resources", []) and verb in r.get("verbs", [])
            for r in self.rules
        )

    def _create(self, plural: str, namespace: str, body: dict[str, Any]) -> web.Response:
        name = body["metadata"]["name"]
        with self.lock:
            if (plural, namespace, name) in self.objects:
                return _status(409, "AlreadyExists", f'{plural} "{name}" already exists')
            meta = body["metadata"]
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_stamp(), namespace=namespace)
            body.setdefault("status", {})
            self.objects[(plural, namespace, name)] = body
            self.created.append(copy.deepcopy(body))
            if plural == "jobs":
                self._make_pods(namespace, body)
        if plural == "jobs" and self.on_job is not None:
            threading.Thread(target=self._script, args=(name,), daemon=True).start()
        return web.json_response(copy.deepcopy(body), status=201)

    def _script(self, job: str) -> None:
        try:
            self.on_job(self, job)
        except BaseException as e:  # noqa: BLE001 - reported by the fixture
            self.script_errors.append(e)

    def _list(self, plural: str, namespace: str, selector: str) -> web.Response:
        wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        with self.lock:
            items = [
                copy.deepcopy(o)
                for (p, ns, _), o in self.objects.items()
                if p == plural
                and ns == namespace
                and all((o["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())
            ]
        return web.json_response({"kind": "List", "apiVersion": "v1", "items": items})

    def _delete(self, plural: str, namespace: str, name: str, propagation: str | None) -> web.Response:
        with self.lock:
            found = self.objects.get((plural, namespace, name))
            if found is None:
                return _status(404, "NotFound", f'{plural} "{name}" not found')
            self.deleted.append((plural, name, propagation))
            found["metadata"]["deletionTimestamp"] = now_stamp()
        threading.Timer(self.delete_delay_s, self._remove, args=(plural, namespace, name)).start()
        return web.json_response(copy.deepcopy(found))

    def _remove(self, plural: str, namespace: str, name: str) -> None:
        with self.lock:
            gone = self.objects.pop((plural, namespace, name), None)
            if gone is None:
                return
            uid = gone["metadata"]["uid"]
            if plural == "jobs":
                for pod in self.pods(name):
                    self.objects.pop(("pods", namespace, pod["metadata"]["name"]), None)
            owned = [
                k
                for k, o in self.objects.items()
                if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])
            ]
            for key in owned:
                self.objects.pop(key)

    async def _log(self, request: web.Request, namespace: str, pod: str, query: dict[str, str]) -> web.StreamResponse:
        with self.lock:
            if ("pods", namespace, pod) not in self.objects:
                return _status(404, "NotFound", f'pods "{pod}" not found')
        stamps = query.get("timestamps") == "true"
        since = now_stamp(-float(query["sinceSeconds"])) if "sinceSeconds" in query else ""

        def entries_from(start: int) -> list[tuple[str, str]]:
            with self.lock:
                return list(self.logs.get(pod, [])[start:])

        def text(entry: tuple[str, str]) -> str:
            return f"{entry[0]} {entry[1]}\n" if stamps else f"{entry[1]}\n"

        if query.get("follow") != "true":
            lines = [text(e) for e in entries_from(0) if e[0] >= since]
            tail = int(query.get("tailLines") or len(lines))
            return web.Response(text="".join(lines[len(lines) - tail :] if tail else []))
        response = web.StreamResponse()
        await response.prepare(request)
        sent = 0
        while not self._closed:
            with self.lock:
                ended = self._container_ended(namespace, pod)
                entries = entries_from(sent)
            for entry in entries:
                sent += 1
                if entry[0] < since:
                    continue
                await response.write(text(entry).encode())
                if self.cut_follow_after and sent % self.cut_follow_after == 0 and (pod, sent) not in self._cuts:
                    self._cuts.add((pod, sent))
                    return response  # the stream ends mid-log, as when the API server drops it
            if ended:
                break
            await asyncio.sleep(0.02)
        await response.write_eof()
        return response

    def _container_ended(self, namespace: str, pod: str) -> bool:
        found = self.objects.get(("pods", namespace, pod))
        return found is None or "terminated" in found["status"]["containerStatuses"][0]["state"]

    # ------------------------------------------------------------------ the scripted cluster

    def _make_pods(self, namespace: str, job: dict[str, Any]) -> None:
        template = job["spec"]["template"]
        for index in range(job["spec"]["completions"]):
            name = f"{job['metadata']['name']}-{index}-{uuid.uuid4().hex[:5]}"
            meta = copy.deepcopy(template.get("metadata") or {})
            meta.update(name=name, namespace=namespace, creationTimestamp=now_stamp(), uid=str(uuid.uuid4()))
            meta.setdefault("labels", {}).update({"job-name": job["metadata"]["name"], INDEX: str(index)})
            meta.setdefault("annotations", {})[INDEX] = str(index)
            spec = copy.deepcopy(template["spec"])
            spec["hostname"] = f"{job['metadata']['name']}-{index}"
            container = spec["containers"][0]["name"]
            self.objects[("pods", namespace, name)] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": meta,
                "spec": spec,
                "status": {
                    "phase": "Pending",
                    "containerStatuses": [
                        {
                            "name": container,
                            "ready": False,
                            "restartCount": 0,
                            "image": spec["containers"][0]["image"],
                            "imageID": "",
                            "state": {"waiting": {"reason": "ContainerCreating"}},
                        }
                    ],
                },
            }
            self.logs[name] = []

    def pods(self, job: str) -> list[dict[str, Any]]:
        """The pods of ``job`` in completion-index order."""
        with self.lock:
            found = [
                o
                for (p, _, _), o in self.objects.items()
                if p == "pods" and (o["metadata"].get("labels") or {}).get("job-name") == job
            ]
        return sorted(found, key=lambda o: int(o["metadata"]["annotations"][INDEX]))

    def pod(self, job: str, index: int) -> dict[str, Any]:
        return self.pods(job)[index]

    def job(self, name: str, namespace: str = "posttrain") -> dict[str, Any] | None:
        with self.lock:
            return copy.deepcopy(self.objects.get(("jobs", namespace, name)))

    def start_pods(self, job: str) -> None:
        """Every pod of ``job`` Running."""
        with self.lock:
            for pod in self.pods(job):
                pod["status"]["phase"] = "Running"
                pod["status"]["containerStatuses"][0]["state"] = {"running": {"startedAt": now_stamp()}}
            self._update_job(job)

    def waiting(self, job: str, index: int, reason: str, message: str = "") -> None:
        """Pod ``index`` of ``job`` stays Pending with its container waiting for ``reason``."""
        with self.lock:
            self.pod(job, index)["status"]["containerStatuses"][0]["state"] = {
                "waiting": {"reason": reason, "message": message}
            }

    def log(self, job: str, index: int, *lines: str) -> None:
        """Pod ``index`` of ``job`` prints ``lines`` (stamped a microsecond apart at least)."""
        with self.lock:
            entries = self.logs[self.pod(job, index)["metadata"]["name"]]
            for line in lines:
                stamp = now_stamp()
                if entries and stamp <= entries[-1][0]:
                    time.sleep(2e-6)
                    stamp = now_stamp()
                entries.append((stamp, line))

    def exit(self, job: str, index: int, code: int, reason: str | None = None) -> None:
        """Pod ``index``'s container ends with ``code``; the Job controller reacts (module docstring)."""
        with self.lock:
            self._terminate(self.pod(job, index), code, reason or ("Completed" if code == 0 else "Error"))
            self._update_job(job)

    def _terminate(self, pod: dict[str, Any], code: int, reason: str) -> None:
        pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
        pod["status"]["containerStatuses"][0]["state"] = {
            "terminated": {"exitCode": code, "reason": reason, "finishedAt": now_stamp()}
        }

    def _update_job(self, name: str) -> None:
        job = next((o for (p, _, n), o in self.objects.items() if p == "jobs" and n == name), None)
        if job is None:
            return
        pods = self.pods(name)
        phases = [p["status"]["phase"] for p in pods]
        status = job["status"]
        status.update(
            active=phases.count("Running") + phases.count("Pending"),
            succeeded=phases.count("Succeeded"),
            failed=phases.count("Failed"),
        )
        if status["failed"] and not status.get("conditions"):
            for pod in pods:
                if pod["status"]["phase"] in ("Running", "Pending"):
                    self._terminate(pod, 143, "Error")  # the controller stops the others
            status.update(
                active=0,
                conditions=[
                    {
                        "type": "Failed",
                        "status": "True",
                        "reason": "BackoffLimitExceeded",
                        "message": "Job has reached the specified backoff limit",
                    }
                ],
            )
        elif status["succeeded"] == job["spec"]["completions"]:
            status["conditions"] = [{"type": "Complete", "status": "True"}]

    def wait_pod(self, job: str, phase: str = "Running", timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if self.pods(job) and all(p["status"]["phase"] == phase for p in self.pods(job)):
                    return
            time.sleep(0.01)
        raise AssertionError(f"pods of {job} not {phase}")
