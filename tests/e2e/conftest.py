"""E2E fixtures, session-scoped and opt-in (each takes ~15 s to start on a small machine):

* ``prefect_api``: an in-process Prefect test server (``prefect_test_harness``), for tests that
  run flows in the test process;
* ``stack``: a real ``prefect server start`` (with its UIs) and ``mlflow server`` on loopback, in
  their own processes (``tests/e2e/stack.py``), for tests of deployments, workers and the UI;
* ``demo_run``: ``posttrain run configs/demo.yaml`` at tiny sizes, finished once and read by every
  test of a finished run (the CLI's exit and summary, the MLflow parent and nested runs, the
  registered version and its alias, the reuse of a finished run).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prefect.testing.utilities import prefect_test_harness

from tests.e2e.stack import run_cli, server_stack


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """A real Prefect API (temporary database) for the session; yields its URL."""
    from prefect.settings import PREFECT_API_URL

    with prefect_test_harness(server_startup_timeout=60):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Iterator[dict]:
    """One Prefect server and one MLflow server for the session (see ``server_stack``)."""
    with server_stack(tmp_path_factory.mktemp("stack")) as servers:
        yield servers


DEMO_RUN_SETS: dict[str, object] = {
    # score and evaluate generate through the static engine here (elsewhere: transformers' generate)
    "score.generation.engine": "static",
    "evaluate.generation.engine": "static",
    # a metric point every step: the training stages' MLflow curves have more than one point
    "sft.log_every": 1,
    "reward_model.log_every": 1,
    "dpo.log_every": 1,
    # one gate, judged twice: a threshold and the champion (none yet; later runs pass it within 1.0)
    "evaluate.gates": [
        {"metric": "grpo/exact_match", "op": ">=", "threshold": 0.0, "vs_champion": True, "tolerance": 1.0}
    ],
}
"""What the shared demo run sets over :data:`~tests.tiny.TINY_DEMO`."""


@dataclass(frozen=True)
class DemoRun:
    """The session's finished ``posttrain run configs/demo.yaml`` (every stage, single backend).

    Attributes:
        tmp: the directory it ran in (its working directory); ``root`` is ``tmp / "out"``.
        root: its storage root (the MLflow store is ``root / "mlflow.db"``).
        run_id: ``demo-run`` (the only flow runs of that name in the session's Prefect API are its own
            and its resumes').
        lines: its stdout lines.
        log: its stderr lines (the console log: the flow's and each task's).
        summary: the summary it wrote when it finished (``root/runs/<run_id>/summary.json`` then).
    """

    tmp: Path
    root: Path
    run_id: str
    lines: list[str]
    summary: dict
    log: list[str]


@pytest.fixture(scope="session")
def demo_run(prefect_api, tmp_path_factory) -> DemoRun:
    """``posttrain run configs/demo.yaml`` at tiny sizes, once a session (about 70 s).

    Tests read it; the one test that changes it (``test_model_lifecycle``: resumes with other
    settings) runs after its readers and works from what it finds."""
    tmp = tmp_path_factory.mktemp("demo-run")
    lines, summary, log = run_cli(prefect_api, tmp, "demo.yaml", DEMO_RUN_SETS, run_id="demo-run")
    return DemoRun(tmp=tmp, root=tmp / "out", run_id=summary["run_id"], lines=lines, summary=summary, log=log)
