"""The temporary Prefect API server of a ``posttrain run`` or ``resume`` started without
``PREFECT_API_URL``.

Prefect would start one itself (``SubprocessASGIServer``) as a child in the CLI's process group,
so a terminal's Ctrl-C, ``timeout`` or any signal to the group killed it together with the CLI,
and the interrupted flow then retried the dead API for minutes before exiting; a ``SIGKILL`` of
the CLI left it running for good. :func:`start_temporary_api_server` starts the same server
(Prefect's ``create_app`` under uvicorn, no UI, on 127.0.0.1) in its **own session**, so group
signals reach only the CLI, which stops it when it exits; and the server process watches the
CLI as the trainers do (:mod:`trainer_core.run`): when the CLI is gone it shuts down within
about a second. The CLI points Prefect at it through ``PREFECT_API_URL``.

``python -m posttrain.api_server --port PORT`` is that server process.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainer_core.errors import PosttrainError
from trainer_core.run import process_alive

WATCH_POLL_S = 0.5
"""How often the server checks that the CLI that started it is alive."""

STOP_WAIT_S = 5.0
"""How long a stop waits for the server to shut down gracefully before killing it."""

DEFAULT_STARTUP_TIMEOUT_S = 180.0
"""How long the CLI waits for the temporary server's health check when
``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` is not set (Prefect's own default, 20 s, is
what an idle machine needs; a user's setting, in the environment or the profile, still wins). The
first start of a Prefect home (its database created and migrated) on a 2-core machine whose cores
two other processes keep busy took 52 s, a later start 15 s (``bench/README.md``, "The temporary
Prefect API server"); this leaves room for a busier worker."""

PROGRESS_EVERY_S = 10.0
"""While the CLI waits for the server, it says so on stderr this often."""

EXIT_PORT_IN_USE = 3
"""The server process's exit code when it could not start (uvicorn's ``STARTUP_FAILURE``; mostly
its port taken between its choice and the bind: the CLI tries another)."""

_SERVER_ENV = {
    "PREFECT_UI_ENABLED": "0",
    "PREFECT__SERVER_EPHEMERAL": "1",
    "PREFECT__SERVER_FINAL": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}
"""What Prefect's own temporary server runs with (``SubprocessASGIServer``, Prefect 3.8), and no
telemetry (offline, it logged an error at every start)."""


class TemporaryServerError(PosttrainError):
    """The temporary Prefect API server did not start (exit code 1: not the user's input)."""


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TemporaryApiServer:
    """A running temporary server: its process and URL; :meth:`stop` ends it (idempotent).

    Attributes:
        process: The server process (leader of its own session).
        api_url: ``http://127.0.0.1:<port>/api``.
    """

    def __init__(self, process: subprocess.Popen, port: int) -> None:
        self.process, self.api_url = process, f"http://127.0.0.1:{port}/api"

    def stop(self) -> None:
        """SIGTERM the server, wait up to :data:`STOP_WAIT_S`, then SIGKILL it."""
        if self.process.poll() is not None:
            return
        _say(f"Stopping temporary Prefect API server on {self.api_url}")
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def startup_timeout_s(settings: Any) -> float:
    """The health check's wait in seconds: the user's ``server.ephemeral.startup_timeout_seconds``
    when set (environment or profile), else :data:`DEFAULT_STARTUP_TIMEOUT_S`.

    Args:
        settings: Prefect's current settings (``prefect.settings.get_current_settings()``).
    """
    ephemeral = settings.server.ephemeral
    if "startup_timeout_seconds" in ephemeral.model_fields_set:
        return float(ephemeral.startup_timeout_seconds)
    return DEFAULT_STARTUP_TIMEOUT_S


def _wait_healthy(process: subprocess.Popen, api_url: str, timeout_s: float) -> int | None:
    """Poll ``<api_url>/health`` until it answers 200: None; or the process's exit code if it
    exited. Says every :data:`PROGRESS_EVERY_S` that it is still waiting.

    Raises:
        TemporaryServerError: no answer within ``timeout_s`` (the process is killed).
    """
    import httpx

    start = time.monotonic()
    deadline, said = start + timeout_s, 0
    with httpx.Client(timeout=2.0) as client:
        while (now := time.monotonic()) < deadline:
            code = process.poll()
            if code is not None:
                return code
            try:
                if client.get(f"{api_url}/health").status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            if (waited := int((now - start) // PROGRESS_EVERY_S)) > said:
                said = waited
                _say(
                    f"waiting for the temporary Prefect API, {waited * PROGRESS_EVERY_S:g} s (up to {timeout_s:g} s) ..."
                )
            time.sleep(0.1)
    process.kill()
    process.wait()
    raise TemporaryServerError(
        f"the temporary Prefect API server did not answer on {api_url} within {timeout_s:g} s "
        "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS); set PREFECT_API_URL to a running Prefect server"
    )


def start_temporary_api_server(attempts: int = 3) -> TemporaryApiServer:
    """Start a temporary Prefect API server in its own session, watching this process; point
    Prefect at it (``PREFECT_API_URL`` in ``os.environ`` and Prefect's global settings); stop it
    at exit (``atexit``, registered before the flow's log and event workers so they drain first).

    Args:
        attempts: Ports to try (a free port can be taken between its choice and the bind).

    Returns:
        The running server.

    Raises:
        TemporaryServerError: it exited or did not answer its health check in time.
    """
    from prefect.context import refresh_global_settings_context
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    env = {**os.environ, **_SERVER_ENV, **settings.to_environment_variables(exclude_unset=True)}
    timeout_s = startup_timeout_s(settings)
    for _ in range(attempts):
        port = _free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "posttrain.api_server", "--port", str(port), "--watch-pid", str(os.getpid())],
            env=env,
            start_new_session=True,
        )
        server = TemporaryApiServer(process, port)
        _say(
            f"Starting temporary Prefect API server on {server.api_url} (stopped when this run ends; set "
            "PREFECT_API_URL to use a running server instead)"
        )
        code = _wait_healthy(process, server.api_url, timeout_s)
        if code is None:
            atexit.register(server.stop)
            os.environ["PREFECT_API_URL"] = server.api_url
            refresh_global_settings_context()
            return server
        if code != EXIT_PORT_IN_USE:
            raise TemporaryServerError(
                f"the temporary Prefect API server exited with code {code} before answering "
                f"on {server.api_url}; its error is above"
            )
    raise TemporaryServerError(
        f"the temporary Prefect API server did not start in {attempts} attempts (exit code "
        f"{EXIT_PORT_IN_USE}: its port was taken, or its startup failed; its error is above)"
    )


def needs_temporary_server() -> bool:
    """True when Prefect has no API URL (``PREFECT_API_URL`` or the active profile's)."""
    from prefect.settings import get_current_settings

    return not get_current_settings().api.url


def _sqlite_path(url: str) -> Path | None:
    """The file of a SQLite database URL (``sqlite+aiosqlite:////home/x/prefect.db``); None for
    any other database or an in-memory one."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if not parsed.drivername.startswith("sqlite") or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def prepare_database() -> None:
    """Create or migrate Prefect's database before the API starts, saying so when it is new.

    Prefect's app does the same in its lifespan, inside the CLI's silent wait for the health
    check. On a new SQLite file (the first start of a Prefect home) that is most of the start:
    Alembic runs every migration (8 s of a 16 s first start on an idle 2-core machine); a database
    already at head costs ~0.1 s, so later runs and the lifespan's own check are cheap. Nothing is
    done when ``PREFECT_API_DATABASE_MIGRATE_ON_START`` is off.
    """
    from prefect.server.database import provide_database_interface
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if not settings.server.database.migrate_on_start:
        return
    path = _sqlite_path(settings.server.database.connection_url.get_secret_value())
    new = path is not None and (not path.exists() or path.stat().st_size == 0)
    if new:
        _say(
            f"Creating Prefect's database {path} (the first start of PREFECT_HOME {settings.home}; "
            "later runs reuse it) ..."
        )
    start = time.monotonic()

    async def migrate() -> None:  # in a loop of its own: its engine is disposed with it
        db = provide_database_interface()
        await db.create_db()
        await (await db.engine()).dispose()

    asyncio.run(migrate())
    if new:
        _say(f"Prefect's database created in {time.monotonic() - start:.0f} s")


def serve(port: int, watch_pid: int, poll_s: float = WATCH_POLL_S) -> int:
    """Run Prefect's API (``prefect.server.api.server:create_app``) on 127.0.0.1:``port`` until
    SIGTERM/SIGINT, or until ``watch_pid`` (the CLI) is gone; returns the exit code
    (:data:`EXIT_PORT_IN_USE` when it could not bind). The database is prepared first
    (:func:`prepare_database`), while the watchdog already runs."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            "prefect.server.api.server:create_app",
            factory=True,
            host="127.0.0.1",
            port=port,
            log_level="error",
            lifespan="on",
        )
    )
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent or not process_alive(watch_pid):
                server.should_exit = True  # graceful: uvicorn ends its lifespan
                time.sleep(STOP_WAIT_S)
                os._exit(1)

    threading.Thread(target=watch, name="cli-watchdog", daemon=True).start()
    prepare_database()
    server.run()  # uvicorn exits 3 (STARTUP_FAILURE) itself when it cannot bind or start
    return 0 if server.started else EXIT_PORT_IN_USE


def main(argv: list[str] | None = None) -> int:
    """``python -m posttrain.api_server --port PORT --watch-pid PID``."""
    parser = argparse.ArgumentParser(prog="python -m posttrain.api_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--watch-pid", type=int, required=True, help="exit when this process is gone")
    args = parser.parse_args(argv)
    return serve(args.port, args.watch_pid)


if __name__ == "__main__":
    sys.exit(main())
