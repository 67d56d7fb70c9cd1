"""Reading a trainer Job's state from its API objects: ended or not, pods that cannot start, and
which pod (node rank) a failed Job is blamed on.

Pods are the API's JSON dicts; a pod's node rank is its completion index (annotation
``batch.kubernetes.io/job-completion-index``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tasks.k8s.api import KubeApi
from tasks.k8s.manifest import CONTAINER, INDEX_ANNOTATION, JobSettings
from tasks.launch.failures import RankFailure, blamed_failure, parse_torchrun_failures
from tasks.launch.process import LaunchResult, LineLogger, Output
from trainer_core.errors import EXIT_BAD_INPUT

_CANNOT_START = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                 "CreateContainerConfigError", "CreateContainerError"}  # fmt: skip
"""Container waiting reasons of a pod that will not start by itself soon."""

_SIGTERM_EXIT = 143
"""A container stopped with SIGTERM (the Job controller stopping the other pods of a failed Job)."""


def pod_index(pod: dict[str, Any]) -> int:
    """The pod's completion index (its node rank); -1 without one."""
    meta = pod.get("metadata", {})
    return int(
        (meta.get("annotations") or {}).get(INDEX_ANNOTATION) or (meta.get("labels") or {}).get(INDEX_ANNOTATION, -1)
    )


def container_state(pod: dict[str, Any]) -> dict[str, Any]:
    """The trainer container's state (``{"waiting" | "running" | "terminated": {...}}``); {} before it has one."""
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return next((s.get("state") or {} for s in statuses if s.get("name") == CONTAINER), {})


def terminated(pod: dict[str, Any] | None) -> dict[str, Any] | None:
    """The trainer container's ``terminated`` state (``exitCode``, ``reason``, ``finishedAt``), or None."""
    return container_state(pod)["terminated"] if pod and "terminated" in container_state(pod) else None


def failed(pod: dict[str, Any]) -> bool:
    """Whether the pod failed: phase Failed (evicted, deleted mid-run) or a non-zero exit."""
    ended = terminated(pod)
    return pod.get("status", {}).get("phase") == "Failed" or (ended is not None and ended.get("exitCode") != 0)


def describe_end(pod: dict[str, Any]) -> str:
    """How the pod ended, in words: ``exited with code 1``, ``exited with code 137 (OOMKilled)``, ``evicted: ...``."""
    ended, status = terminated(pod), pod.get("status", {})
    if ended is None:
        reason = status.get("reason") or "failed"
        return f"{reason.lower()}: {status.get('message', '')}".rstrip(": ")
    words = f"exited with code {ended.get('exitCode')}"
    return f"{words} ({ended['reason']})" if ended.get("reason") not in (None, "Error", "Completed") else words


@dataclass
class JobView:
    """The latest read of the Job and its pods (node rank -> newest pod)."""

    job: dict[str, Any] | None = None
    pods: dict[int, dict[str, Any]] = field(default_factory=dict)
    phases: dict[str, str] = field(default_factory=dict)
    blocked_since: dict[str, float] = field(default_factory=dict)
    said: set[str] = field(default_factory=set)

    async def refresh(self, api: KubeApi, name: str) -> None:
        """Read the Job ``name`` (None once it is gone) and its pods.

        Raises:
            KubeError: the API failed.
        """
        self.job = await api.get("job", name)
        pods: dict[int, dict[str, Any]] = {}
        for pod in sorted(await api.pods(name), key=lambda p: p["metadata"].get("creationTimestamp", "")):
            pods[pod_index(pod)] = pod
        self.pods = pods


def job_finished(job: dict[str, Any] | None) -> bool:
    """Whether Kubernetes considers the Job ended (condition Complete or Failed): its pods are stopped."""
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in (job or {}).get("status", {}).get("conditions") or []
    )


def job_state(view: JobView) -> tuple[str, str] | None:
    """``("succeeded" | "failed" | "deadline", message)`` once the Job has ended, else None."""
    conditions = {
        c.get("type"): c
        for c in (view.job or {}).get("status", {}).get("conditions") or []
        if c.get("status") == "True"
    }
    for kind, state in (
        ("Complete", "succeeded"),
        ("SuccessCriteriaMet", "succeeded"),
        ("Failed", "failed"),
        ("FailureTarget", "failed"),
    ):
        if kind in conditions:
            reason = conditions[kind].get("reason") or ""
            state = "deadline" if reason == "DeadlineExceeded" else state
            return state, f"{reason}: {conditions[kind].get('message', '')}".strip(": ")
    completions = (view.job or {}).get("spec", {}).get("completions")
    if completions and (view.job or {}).get("status", {}).get("succeeded", 0) >= completions:
        return "succeeded", ""
    if any(failed(p) for p in view.pods.values()):
        return "failed", "a pod failed (backoffLimit 0)"
    return None


def observe(view: JobView, settings: JobSettings, now: float, log: LineLogger) -> tuple[int, str] | None:
    """Log pod phase changes and scheduling waits; the first pod that cannot start (node rank,
    reason) after ``stuck_after_s``, else None."""
    warn = getattr(log, "warning", log.info)
    for rank, pod in sorted(view.pods.items()):
        name, status = pod["metadata"]["name"], pod.get("status", {})
        phase = status.get("phase", "Pending")
        if view.phases.get(name) != phase:
            log.info("pod %s (node rank %d): %s", name, rank, phase)
            view.phases[name] = phase
        for condition in status.get("conditions") or []:
            if (
                condition.get("reason") == "Unschedulable"
                and (text := f"{name}: {condition.get('message')}") not in view.said
            ):
                view.said.add(text)
                warn("pod %s (node rank %d) waits for a node: %s", name, rank, condition.get("message"))
        waiting = container_state(pod).get("waiting") or {}
        if waiting.get("reason") in _CANNOT_START:
            since = view.blocked_since.setdefault(name, now)
            if (text := f"{name}: {waiting['reason']}") not in view.said:
                view.said.add(text)
                warn(
                    "pod %s (node rank %d) cannot start: %s: %s",
                    name,
                    rank,
                    waiting["reason"],
                    waiting.get("message", ""),
                )
            if now - since >= settings.stuck_after_s:
                return rank, f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
        else:
            view.blocked_since.pop(name, None)
    return None


class Quiet:
    """A line logger that drops every line."""

    def info(self, msg: str, *args: Any) -> None:
        pass


def pod_result(lines: list[str], returncode: int, tail_lines: int) -> LaunchResult:
    """A pod's log lines read as a local launch's output would be (merged tail, each rank's tail,
    torchrun's own lines), so :func:`~tasks.launch.failures.raise_for_result` reads it the same way."""
    out = Output(Quiet(), tail_lines)
    for line in lines:
        out.add(line)
    return LaunchResult(
        returncode=returncode,
        tail=list(out.tail),
        wall_s=0.0,
        timed_out=False,
        rank_tails={r: list(t) for r, t in out.rank_tails.items()},
        launcher_lines=list(out.launcher_lines),
    )


def blamed_pod(pods: dict[int, dict[str, Any]], results: dict[int, LaunchResult]) -> int | None:
    """The node rank whose pod the stage is failed for.

    In order: a pod that exited ``EXIT_BAD_INPUT``; the pod of the rank
    :func:`~tasks.launch.failures.blamed_failure` picks among every pod's torchrun error summary (global
    ranks; pods in the order they ended, so the first one's root cause leads); the first pod to
    end that Kubernetes did not stop itself (exit 143, SIGTERM: the Job controller stopping the
    others); the first failed pod.

    Args:
        pods: Node rank -> pod object.
        results: Node rank -> that pod's log tail read as a launch result (failed pods only).

    Returns:
        The node rank, or None when no pod failed.
    """
    ended = sorted(
        (r for r, p in pods.items() if failed(p)),
        key=lambda r: ((terminated(pods[r]) or {}).get("finishedAt") or "~", r),
    )
    if not ended:
        return None
    bad = [r for r in ended if (terminated(pods[r]) or {}).get("exitCode") == EXIT_BAD_INPUT]
    if bad:
        return bad[0]
    owner: dict[int, int] = {}
    summary: list[RankFailure] = []
    tails: dict[int, list[str]] = {}
    for r in ended:
        result = results.get(r)
        for f in parse_torchrun_failures(result.launcher_lines) if result else []:
            owner.setdefault(f.rank, r)
            tails[f.rank] = result.rank_tails.get(f.local_rank, [])
            summary.append(RankFailure(f.rank, f.rank, f.exitcode, f.host, f.root_cause, f.traceback, f.error_file))
    if (blamed := blamed_failure(summary, tails)) is not None:
        return owner[blamed.rank]
    causes = [r for r in ended if (terminated(pods[r]) or {}).get("exitCode") != _SIGTERM_EXIT]
    return (causes or ended)[0]
