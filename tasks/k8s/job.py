"""Run a multi-node stage as a Kubernetes Job: submit it, watch it to its end, report, clean up.

:func:`run_trainer_job` is what the stage task calls instead of
:func:`~tasks.launch.process.launch_stage_process` when ``backend.nnodes > 1`` (``tasks/stages.py``). It
creates the objects :func:`~tasks.k8s.manifest.trainer_manifests` renders from
``infra/k8s/multinode-trainer.yaml`` (the Job first, then the headless Service and any
credentials Secret, both owned by the Job so that Kubernetes deletes them with it) through the
Kubernetes API (``kubernetes_asyncio``; in-cluster service account, else ``$KUBECONFIG`` or
``~/.kube/config``), then polls the Job and its pods every ``poll_interval_s`` until the Job ends:

- node 0's log (rank 0 prints the metrics) is followed into the stage's log and its ``on_line``
  (the progress artifact), as a local launch's output is;
- success returns a :class:`~tasks.launch.failures.LaunchResult`; the Job and Service are left for
  inspection until ``ttlSecondsAfterFinished`` (template: one day);
- a failed Job (``backoffLimit: 0``: one failed pod fails it, and Kubernetes stops the others)
  raises the error :func:`~tasks.launch.failures.raise_for_result` gives for the blamed pod's log tail,
  led by the pod and its node rank (= completion index): :class:`~tasks.launch.failures.StageFailed`
  naming the failing global rank where torchrun's error summary is in the log,
  :class:`~tasks.launch.failures.BadStageInput` for exit code 2 (never retried),
  :class:`~tasks.launch.failures.StageResourceError` for a container killed for memory. The failed Job
  stays (``kubectl logs``) until the retry replaces it;
- a timeout (``launch.timeout_s``, also the Job's ``activeDeadlineSeconds``), a pod that cannot
  start for ``stuck_after_s`` (image pull, missing secret), an abort of the flow run's launch
  group (:func:`~tasks.launch.aborts.abort_launches`) or any interruption deletes the Job and Service
  (foreground propagation: the pods go first) before the error propagates.

Retries: the stage task's retry calls this again with the same Job name; an existing Job of that
name (a failed attempt, or one left by a flow run that died) is deleted, and waited for, before
the new one is created, and the trainer resumes from the stage's latest checkpoint on S3.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tasks.k8s.api import KubeApi, KubeError, stamp_key
from tasks.k8s.manifest import JobSettings, TrainerJob, trainer_manifests
from tasks.k8s.status import (
    JobView,
    blamed_pod,
    container_state,
    describe_end,
    failed,
    job_finished,
    job_state,
    observe,
    pod_result,
    terminated,
)
from tasks.launch.aborts import abort_event
from tasks.launch.failures import BadStageInput, LaunchAborted, StageFailed, StageResourceError, raise_for_result
from tasks.launch.process import LaunchResult, LineLogger, Output
from trainer_core.errors import EXIT_BAD_INPUT, ConfigError

_TICK_S = 0.2
"""Longest wait between checks of the abort flag and the deadline."""

_DRAIN_S = 10.0
"""After success, how long node 0's log may take to end."""

_ENV_MEMORY = "POSTTRAIN_K8S_MEMORY_LIMIT (and _MEMORY_REQUEST)"


async def _follow_node0(api: KubeApi, view: JobView, out: Output, poll_s: float, log: LineLogger) -> None:
    """Stream node 0's log into ``out`` until its container has ended, reconnecting (and skipping
    the lines already seen, by timestamp) when the connection drops while it runs, and reading
    once more after it ended (what it wrote after a dropped stream)."""
    last: tuple[str, str] | None = None
    seen_at_last, said, final_read = 0, "", False
    while True:
        pod = view.pods.get(0)
        phase = (pod or {}).get("status", {}).get("phase", "Pending")
        if pod is None or (phase == "Pending" and not container_state(pod).get("running") and not terminated(pod)):
            await asyncio.sleep(_TICK_S)
            continue
        since = None if last is None else max(1, math.ceil(time.time() - _epoch(last[0]))) + 5
        skip = seen_at_last
        try:
            async for stamp, line in api.follow(pod["metadata"]["name"], since):
                key = stamp_key(stamp)
                if last is not None and key <= last:
                    if key < last or skip > 0:  # seen before the reconnection
                        skip -= 1 if key == last else 0
                        continue
                seen_at_last = seen_at_last + 1 if key == last else 1
                last = key
                out.add(line)
        except (KubeError, BadStageInput) as e:
            if str(e) != said:
                said = str(e)
                log.info("following the log of %s: %s (retrying)", pod["metadata"]["name"], e)
        latest = view.pods.get(0)
        if latest is None or latest["metadata"]["name"] != pod["metadata"]["name"] or final_read:
            return
        if terminated(latest):
            final_read = True
            continue
        await asyncio.sleep(poll_s)


def _epoch(base: str) -> float:
    return datetime.fromisoformat(base).replace(tzinfo=UTC).timestamp()


@dataclass
class _Run:
    """One submission: its API, job, settings, log and node 0's output."""

    api: KubeApi
    job: TrainerJob
    settings: JobSettings
    log: LineLogger
    out: Output
    start: float
    tail_lines: int
    flow_pod: dict[str, Any] | None = None

    async def remove(self, kinds: tuple[str, ...] = ("job", "service", "secret")) -> list[str]:
        """Delete the Job and its objects (best effort: failures are logged); the kinds that existed."""
        found = []
        for kind in kinds:
            try:
                if await self.api.delete(kind, self.job.name):
                    found.append(kind)
            except (KubeError, BadStageInput) as e:
                getattr(self.log, "warning", self.log.info)("could not delete %s %s: %s", kind, self.job.name, e)
        return found

    async def replace_previous(self, abort: Any) -> None:
        """Delete a Job (and Service, Secret) of this name left by an earlier attempt, and wait
        until it is gone: its pods would otherwise race the new ones for the checkpoints.

        Raises:
            StageFailed: it is still there after ``delete_timeout_s``.
            LaunchAborted: the flow run was interrupted meanwhile.
        """
        previous = await self.api.get("job", self.job.name)
        if previous is None and await self.api.get("service", self.job.name) is None:
            return
        self.log.info(
            "deleting the earlier attempt's Job %s/%s (and its Service) before the new one",
            self.api.namespace,
            self.job.name,
        )
        await self.remove()
        deadline = time.monotonic() + self.settings.delete_timeout_s
        while await self.api.get("job", self.job.name) is not None or await self.api.get("service", self.job.name):
            if abort is not None and abort.is_set():
                raise LaunchAborted("the stage's flow run was interrupted; nothing submitted")
            if time.monotonic() > deadline:
                raise StageFailed(
                    f"stage {self.job.stage!r}: the earlier Job {self.job.name} is still being deleted "
                    f"after {self.settings.delete_timeout_s:.0f} s",
                    1,
                )
            await asyncio.sleep(min(self.settings.poll_interval_s, 1.0))

    async def submit(self, timeout_s: float | None) -> None:
        """Create the Job, then its Service and Secret owned by it. In a cluster the Job is owned
        by the flow-run pod: the pod's deletion (eviction, a killed flow run) has Kubernetes'
        garbage collector delete the Job and its pods, as a local launch's ranks exit when their
        launcher is gone."""
        manifests = trainer_manifests(self.job, self.settings, self.api.namespace, timeout_s)
        meta = (self.flow_pod or {}).get("metadata", {})
        if meta.get("uid") and meta.get("name"):
            manifests.job["metadata"]["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}
            ]
        created = await self.api.create("job", manifests.job)
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": self.job.name, "uid": created["metadata"]["uid"]}
        for kind, body in (("service", manifests.service), ("secret", manifests.secret)):
            if body is not None:
                body["metadata"]["ownerReferences"] = [owner]
                await self.api.create(kind, body)
        backend = self.job.backend
        self.log.info(
            "stage %s: Job %s/%s submitted: %d pod(s) x %d rank(s), rendezvous %s",
            self.job.stage,
            self.api.namespace,
            self.job.name,
            backend.nnodes,
            backend.nproc_per_node,
            self.job.rdzv_endpoint,
        )

    async def watch(self, deadline: float | None, abort: Any) -> tuple[str, str, JobView]:
        """Poll until the Job ends: ``(state, message, view)``, state one of succeeded, failed,
        deadline, timeout, stuck (message: the node rank and reason).

        Raises:
            LaunchAborted: the flow run's launch group was aborted.
            StageFailed: the Job vanished, or the API failed for longer than ``api_retry_s``.
        """
        view, next_read, api_down_since = JobView(), 0.0, None
        follower = asyncio.create_task(_follow_node0(self.api, view, self.out, self.settings.poll_interval_s, self.log))
        try:
            while True:
                if abort is not None and abort.is_set():
                    raise LaunchAborted("the stage's flow run was interrupted; its Job is deleted")
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return "timeout", "", view
                if now >= next_read:
                    next_read = now + self.settings.poll_interval_s
                    try:
                        await view.refresh(self.api, self.job.name)
                        api_down_since = None
                    except KubeError as e:
                        api_down_since = api_down_since or now
                        self.log.info("reading Job %s: %s (retrying)", self.job.name, e)
                        if now - api_down_since > self.settings.api_retry_s:
                            raise StageFailed(
                                f"stage {self.job.stage!r}: lost the Kubernetes API for "
                                f"{now - api_down_since:.0f} s while watching Job {self.job.name}: {e}",
                                1,
                            ) from e
                        continue
                    if view.job is None:
                        raise StageFailed(
                            f"stage {self.job.stage!r}: Job {self.api.namespace}/{self.job.name} was "
                            "deleted while it ran (not by this flow)",
                            1,
                        )
                    if (stuck := observe(view, self.settings, now, self.log)) is not None:
                        return "stuck", f"node rank {stuck[0]} cannot start: {stuck[1]}", view
                    if (ended := job_state(view)) is not None:
                        if ended[0] == "succeeded":
                            await asyncio.wait({follower}, timeout=_DRAIN_S)
                        return ended[0], ended[1], view
                await asyncio.sleep(_TICK_S)
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    def result(self, returncode: int, timed_out: bool = False) -> LaunchResult:
        """Node 0's streamed output as a launch result."""
        return LaunchResult(
            returncode=returncode,
            tail=list(self.out.tail),
            wall_s=time.monotonic() - self.start,
            timed_out=timed_out,
            rank_tails={r: list(t) for r, t in sorted(self.out.rank_tails.items())},
            launcher_lines=list(self.out.launcher_lines),
        )


async def _failure(run: _Run, view: JobView, state: str, message: str) -> StageFailed:
    """The error for a Job that ended in ``state`` (not succeeded): for a failed one, read the
    failed pods' log tails and name the blamed pod (see :func:`~tasks.k8s.status.blamed_pod`)."""
    stage, where = run.job.stage, f"Job {run.api.namespace}/{run.job.name}"
    if state == "stuck":
        return BadStageInput(
            f"stage {stage!r}: {where}: {message} for {run.settings.stuck_after_s:.0f} s", EXIT_BAD_INPUT
        )
    if state in ("timeout", "deadline"):
        try:
            raise_for_result(run.result(-9, timed_out=True), stage)
        except StageFailed as e:
            return StageFailed(f"{e}\n({where})", e.returncode, e.tail)
    try:
        await view.refresh(run.api, run.job.name)  # the other pods' ends, when they came after the first
    except KubeError:
        pass
    results: dict[int, LaunchResult] = {}
    for rank, pod in view.pods.items():
        if failed(pod):
            try:
                lines = await run.api.log_tail(pod["metadata"]["name"], run.settings.log_tail_lines)
            except (KubeError, BadStageInput) as e:
                lines = [f"(log unavailable: {e})"]
            results[rank] = pod_result(lines, (terminated(pod) or {}).get("exitCode", 1), run.tail_lines)
    rank = blamed_pod(view.pods, results)
    if rank is None:
        return StageFailed(
            f"stage {stage!r}: {where} failed ({message}) with no failed pod; node 0's last output:\n"
            + "\n".join(run.out.tail),
            1,
            list(run.out.tail),
        )
    pod, result = view.pods[rank], results[rank]
    others = [f"node rank {r} {describe_end(p)}" for r, p in sorted(view.pods.items()) if r != rank and failed(p)]
    head = (
        f"stage {stage!r} failed on node rank {rank} of {run.job.backend.nnodes}: pod {pod['metadata']['name']} "
        f"({where}) {describe_end(pod)}" + (f"; also: {'; '.join(others)}" if others else "")
    )
    if (terminated(pod) or {}).get("reason") == "OOMKilled":
        return StageResourceError(
            f"{head}: out of host memory; raise {_ENV_MEMORY}\n\n" + "\n".join(result.tail[-20:]),
            result.returncode,
            result.tail,
        )
    try:
        raise_for_result(result, stage)
    except StageFailed as e:
        return type(e)(f"{head}\n\n{e}", e.returncode, e.tail, rank=e.rank)
    return StageFailed(f"{head}\n\n" + "\n".join(result.tail[-20:]), result.returncode or 1, result.tail)


async def _run_job(
    job: TrainerJob,
    settings: JobSettings,
    log: LineLogger,
    timeout_s: float | None,
    abort: Any,
    on_line: Callable[[str], None] | None,
    tail_lines: int,
) -> LaunchResult:
    """:func:`run_trainer_job`'s work, in its event loop: replace, submit, watch, report, clean up."""
    start = time.monotonic()
    async with await KubeApi.connect(settings) as api:
        flow_pod = None
        if settings.flow_pod:
            try:
                flow_pod = await api.get("pod", settings.flow_pod)
                settings = settings.inherit(flow_pod)
            except (KubeError, BadStageInput) as e:
                log.info(
                    "flow-run pod %s not read (%s); trainer pods take the template's defaults", settings.flow_pod, e
                )
        run = _Run(api, job, settings, log, Output(log, tail_lines, on_line), start, tail_lines, flow_pod)
        await run.replace_previous(abort)
        kept = False
        try:
            await run.submit(timeout_s)
            state, message, view = await run.watch(None if timeout_s is None else start + timeout_s, abort)
            if state == "succeeded":
                kept = True
                log.info("stage %s: Job %s/%s completed", job.stage, api.namespace, job.name)
                return run.result(0)
            error = await _failure(run, view, state, message)
            kept = state == "failed" and job_finished(view.job)  # its pods are stopped; kept for kubectl until its TTL
        finally:
            if not kept:
                deleted = await run.remove()
                log.info(
                    "stage %s: deleted %s %s/%s",
                    job.stage,
                    " + ".join(deleted) or "nothing of",
                    api.namespace,
                    job.name,
                )
        raise error


def run_trainer_job(
    job: TrainerJob,
    *,
    log: LineLogger,
    timeout_s: float | None,
    group: str | None = None,
    on_line: Callable[[str], None] | None = None,
    settings: JobSettings | None = None,
    tail_lines: int = 50,
) -> LaunchResult:
    """Run ``job`` on Kubernetes until it ends (see the module docstring); blocks the calling thread.

    Args:
        job: From :func:`~tasks.k8s.manifest.trainer_job` (its spec already written).
        log: Receives node 0's output lines and the Job's progress.
        timeout_s: Wall-clock limit in seconds from submission (also the Job's
            ``activeDeadlineSeconds``); None: none.
        group: Abort group (the flow run id): :func:`~tasks.launch.aborts.abort_launches` deletes the Job.
        on_line: Called with each of node 0's lines (e.g. the progress tracker).
        settings: Cluster settings (default :meth:`~tasks.k8s.manifest.JobSettings.from_env`).
        tail_lines: Lines kept for the result and for error messages.

    Returns:
        The successful launch: return code 0, node 0's last lines, wall seconds.

    Raises:
        StageFailed: the Job failed (message: the pod, its node rank, and the failing global rank
            with its last lines when the log names it), timed out, vanished, or the API was lost.
        BadStageInput: a pod exited 2, a pod could not start for ``stuck_after_s``, the API
            refused the request (credentials, RBAC, an invalid manifest), or there is no cluster
            configuration, ``kubernetes_asyncio``, image or template, or a bad ``POSTTRAIN_K8S_*``.
        StageResourceError: the blamed rank exited ``EXIT_RESOURCE`` or its container was OOMKilled.
        LaunchAborted: the group was aborted (the Job and Service are deleted first).
    """
    abort = abort_event(group) if group is not None else None
    if abort is not None and abort.is_set():
        raise LaunchAborted("the stage's flow run was interrupted before its Job was submitted; nothing submitted")
    try:
        in_loop = asyncio.get_running_loop() is not None
    except RuntimeError:
        in_loop = False
    try:
        coro = _run_job(job, settings or JobSettings.from_env(), log, timeout_s, abort, on_line, tail_lines)
        if not in_loop:
            return asyncio.run(coro)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from a thread that runs an event loop
            return pool.submit(asyncio.run, coro).result()
    except KubeError as e:  # the API failed outside the watch's retries (submitting, deleting): retry the stage
        raise StageFailed(f"stage {job.stage!r}: {e}", 1) from e
    except ConfigError as e:  # no cluster, client, image or template: a retry cannot help
        raise BadStageInput(f"stage {job.stage!r} (a Kubernetes Job): {e}", EXIT_BAD_INPUT) from e
