"""A real Prefect server and MLflow server on loopback, shared by the e2e tests that need them
(``tests/e2e/conftest.py`` starts one pair per session: fixture ``stack``), and the helpers to
start and stop processes in their own process groups and talk to the stack."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.settings import PREFECT_API_URL, temporary_settings

from tests.tiny import REPO as PROJECT_DIR
from tests.tiny import as_sets, tiny_demo

BIN_DIR = Path(sys.executable).parent
STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict, log_path: Path, cwd: Path) -> subprocess.Popen:
    """Start ``cmd`` in its own process group, output to ``log_path``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (a Prefect worker shuts down gracefully), SIGKILL it after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args[:3]} exited:\n{log_path.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not healthy after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


@contextmanager
def server_stack(tmp: Path) -> Iterator[dict]:
    """A Prefect server (its UI at ``ui``) and an MLflow server on free loopback ports, started
    in parallel, with their own state under ``tmp``; yields the environment that points at them."""
    prefect_port, mlflow_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "POSTTRAIN_"))}
    env.update(
        PREFECT_HOME=str(tmp / "prefect-home"),
        PREFECT_API_URL=f"http://127.0.0.1:{prefect_port}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_API_LOG_RETRYABLE_ERRORS="true",  # a 503's cause (SQLite busy) in prefect-server.log
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
    )
    procs = {
        "prefect": start(
            [str(BIN_DIR / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
            env,
            tmp / "prefect-server.log",
            tmp,
        ),
        "mlflow": start(
            [
                str(BIN_DIR / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(mlflow_port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{tmp}/mlflow.db",
            ],
            env,
            tmp / "mlflow-server.log",
            tmp,
        ),
    }
    try:
        wait_healthy(f"http://127.0.0.1:{prefect_port}/api/health", procs["prefect"], tmp / "prefect-server.log")
        wait_healthy(f"http://127.0.0.1:{mlflow_port}/health", procs["mlflow"], tmp / "mlflow-server.log")
        yield {
            "env": env,
            "tmp": tmp,
            "api_url": env["PREFECT_API_URL"],
            "ui": f"http://127.0.0.1:{prefect_port}",
            "mlflow": f"http://127.0.0.1:{mlflow_port}",
        }
    finally:
        for proc in procs.values():
            stop(proc)


def posttrain(stack: dict, *args: str, env: dict | None = None) -> str:
    """``python -m posttrain *args`` against the stack (``env`` added to its environment); its stdout."""
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", *args],
        env={**stack["env"], **(env or {})},
        check=False,
        cwd=stack["tmp"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def start_worker(stack: dict, log_path: Path, pool: str = "posttrain-local") -> subprocess.Popen:
    """A process worker of ``pool`` polling every second, in its own process group (``stop`` it)."""
    return start(
        [str(BIN_DIR / "prefect"), "worker", "start", "--pool", pool],
        {**stack["env"], "PREFECT_WORKER_QUERY_SECONDS": "1"},
        log_path,
        stack["tmp"],
    )


@contextmanager
def client(stack: dict) -> Iterator[SyncPrefectClient]:
    """A client of the stack's Prefect API (whatever API the rest of the session uses)."""
    with temporary_settings(updates={PREFECT_API_URL: stack["api_url"]}), get_client(sync_client=True) as api:
        yield api


def run_cli(
    prefect_api: str,
    tmp: Path,
    config: str,
    sets: dict[str, object],
    run_id: str = "demo-cli",
) -> tuple[list[str], dict, list[str]]:
    """``posttrain run configs/<config>`` as a user runs it (a child process, against the Prefect API
    ``prefect_api``, its MLflow store the default SQLite file under the storage root) with
    :data:`~tests.tiny.TINY_DEMO` and ``sets`` as ``--set`` overrides, writing under ``tmp/out``.

    Returns its stdout lines, the summary it names and its stderr lines (the console log), after
    checking that the run and every stage of it completed and that its last stdout line names the
    summary."""
    root = tmp / "out"
    args = [
        str(PROJECT_DIR / "configs" / config),
        "--run-id",
        run_id,
        "--set",
        f"storage.root={root}",
        *as_sets(tiny_demo(**sets)),
    ]
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "run", *args],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == f"run id: {run_id}"
    uri = lines[-1]
    assert uri == str(root / "runs" / run_id / "summary.json")
    summary = json.loads(Path(uri).read_text())
    assert summary["run_id"] == run_id and summary["status"] == "completed"
    for name, entry in summary["stages"].items():
        assert entry["status"] == "completed", (name, entry)
        assert (Path(entry["output_uri"]) / "manifest.json").is_file()
        assert f"{name}: completed -> {entry['output_uri']}" in lines
    return lines, summary, result.stderr.splitlines()
