"""The demo deployment's Custom run form, driven in a real browser (Debian's chromium, headless,
through Playwright) against a real ``prefect server start`` and ``mlflow server`` on loopback (the
session's ``stack``).

``posttrain deploy --name demo`` registers the demo with ``$POSTTRAIN_PROJECT_DIR`` a temporary
project directory holding ``configs/demo.yaml`` at tiny sizes (``tests.tiny.write_tiny_demo``),
cut to its prepare_data and SFT stages (the field the form changes is SFT's; a run of every stage
is ``test_demo_cli.py``'s; the run's ``./outputs`` land there), tracking to the SQLite file the
stack's MLflow server serves, and ``$POSTTRAIN_MLFLOW_UI_URL`` that server (a local store's
links); a process worker serves the pool. In the default UI (the server's root redirects to the
V2 UI) the test goes Deployments -> demo -> Run -> Custom run, finds the form opened on that
file's values (SFT "Max steps" 4), changes that field, edits the ``overrides`` list (its
example item changed, one item added: a quality gate SFT's loss fails) and submits. The flow run
completes its stages, the resolved config it recorded has the typed values, and the gate fails
it: the deployment's Runs tab lists it Failed, tagged gate-failed, its Details give the gate's
message, its ``release`` artifact the gate's verdict, and the SFT row's link in its
``pipeline-summary`` opens SFT's run in the MLflow UI. A run started beside it through the API,
with a gate it passes, shows its version made champion in its ``release`` artifact. A second run from the form, with an
override of the field it changed, fails at once with a message naming both. The V1 UI's form of
the same deployment must render too; in both, descriptions are plain text (no reST markup).

Needs a chromium binary (``$POSTTRAIN_CHROMIUM``, else ``chromium`` on PATH): skipped, saying so,
without one; CI installs Debian's ``chromium`` (``.ci/run``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterDeploymentId,
)
from prefect.states import Cancelled

from tests.e2e.stack import client, posttrain, start_worker, stop
from tests.tiny import write_tiny_demo

CHROMIUM = os.environ.get("POSTTRAIN_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM, reason="no chromium binary: apt-get install chromium, or set POSTTRAIN_CHROMIUM"),
]
DEPLOYMENT = "post-training-pipeline/demo"
TYPED_MAX_STEPS = 6
RUN_TIMEOUT_S = 600
"""The tiny demo's prepare_data and SFT take seconds; at the demo's own sizes every stage took
325-568 s in CI."""
FAILED_GATE = '{"metric": "sft/train/loss", "op": "<=", "threshold": 0.0001}'
"""A gate the tiny SFT's final training loss (about 5) fails."""
TYPED_OVERRIDES = ["evaluate.generation.max_new_tokens=12", f"evaluate.gates=[{FAILED_GATE}]"]
PASSED_GATE = '{"metric": "sft/train/loss", "op": "<=", "threshold": 1000}'
"""A gate the same run passes: the run started beside the form's (through the API) to become the champion."""
SFT_GROUP = "xpath=//label[normalize-space()='SFT']/ancestor::div[contains(@class,'group')][1]"
"""The form's SFT section (a field group labelled "SFT")."""
OVERRIDES_GROUP = "xpath=//label[normalize-space()='overrides (Optional)']/ancestor::div[contains(@class,'group')][1]"
"""The form's ``overrides`` field: a list of text boxes, one per item, and an "Add item" button."""
UI_TIMEOUT_MS = 60_000
SUBMIT_ATTEMPTS = 3
MARKUP = ("``", ":func:", ":class:", ":meth:")


@pytest.fixture(scope="module")
def browser() -> Iterator:
    from playwright.sync_api import sync_playwright

    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def demo_project(stack, tmp_path_factory) -> Path:
    """A project directory with ``configs/demo.yaml`` at tiny sizes; the demo deployment registered
    to run there (its ./outputs and MLflow store land in it), its form opened on that file's values."""
    project = tmp_path_factory.mktemp("project")
    (project / "configs").mkdir()
    write_tiny_demo(
        project / "configs" / "demo.yaml",
        stages=["prepare_data", "sft"],
        **{"tracking.tracking_uri": f"sqlite:///{stack['tmp']}/mlflow.db"},
    )  # the MLflow server's store
    out = posttrain(
        stack,
        "deploy",
        "--name",
        "demo",
        env={"POSTTRAIN_PROJECT_DIR": str(project), "POSTTRAIN_MLFLOW_UI_URL": stack["mlflow"]},
    )
    assert f"deployment {DEPLOYMENT}:" in out
    return project


def demo_settings(project: Path) -> dict:
    """The form's values for ``project``'s demo.yaml (what ``posttrain deploy`` fills in)."""
    from flows.settings import resolve_config, settings_of

    return settings_of(resolve_config(None, str(project / "configs" / "demo.yaml"), None)).model_dump(mode="json")


@contextmanager
def evidence(page, where: Path, worker_log: Path, server_log: Path) -> Iterator[None]:
    """On a failure: a screenshot and the HTML of ``page`` under ``where``, named (with the worker
    log's and the Prefect server log's tails) in the re-raised assertion."""
    try:
        yield
    except Exception as e:
        shot, html = where / "failure.png", where / "failure.html"
        try:
            page.screenshot(path=str(shot), full_page=True)
            html.write_text(page.content())
        except Exception as capture_error:  # noqa: BLE001
            shot = html = f"(not captured: {capture_error})"
        tail = worker_log.read_text()[-4000:] if worker_log.exists() else "(no worker log)"
        server = server_log.read_text()[-4000:] if server_log.exists() else "(no server log)"
        raise AssertionError(
            f"{type(e).__name__}: {e}\npage {page.url}\nscreenshot {shot}\nhtml {html}\n"
            f"worker log tail ({worker_log}):\n{tail}\n"
            f"Prefect server log tail ({server_log}):\n{server}"
        ) from e


SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "images"
"""Where :func:`screenshot` keeps the docs site's pictures of the UIs, with
``POSTTRAIN_DOCS_SCREENSHOTS=1`` (``make screenshots``); otherwise under the test's tmp dir."""


def screenshot(page, where: Path, name: str) -> Path:
    """A picture of ``page`` as ``name``: into ``docs/images`` with ``POSTTRAIN_DOCS_SCREENSHOTS=1``
    (the docs show the UI as this test drives it, so they stay current), else under ``where``."""
    folder = SCREENSHOTS if os.environ.get("POSTTRAIN_DOCS_SCREENSHOTS") == "1" else where
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / name))
    assert (folder / name).stat().st_size > 10_000  # a rendered page, not a blank one
    return folder / name


def form_text(page) -> str:
    return page.locator("main").inner_text() if page.locator("main").count() else page.inner_text("body")


def assert_plain_text(text: str, ui: str) -> None:
    found = [m for m in MARKUP if m in text]
    assert not found, f"the {ui} form shows raw markup {found}:\n{text}"


def test_custom_run_form_in_the_browser(stack, demo_project, browser, tmp_path):
    from playwright.sync_api import expect

    ui, worker_log = stack["ui"], tmp_path / "worker.log"
    with client(stack) as api:
        deployment = api.read_deployment_by_name(DEPLOYMENT)
        earlier_runs = {r.id for r in runs_of(api, deployment.id)}
    assert deployment.parameters["settings"] == demo_settings(demo_project), (
        "the form does not open on the demo's values"
    )
    worker = start_worker(stack, worker_log)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(UI_TIMEOUT_MS)
    flow_run_id = passing_id = None
    try:
        with evidence(page, tmp_path, worker_log, stack["tmp"] / "prefect-server.log"):
            # The V1 UI (still served, one click away) renders the same form, in plain text.
            page.goto(f"{ui}/deployments/deployment/{deployment.id}/run")
            expect(page.get_by_text("Max steps", exact=True).first).to_be_visible()
            assert_plain_text(form_text(page), "V1")

            # The default UI, as a person gets there: root -> Deployments -> demo -> Run -> Custom run.
            page.goto(f"{ui}/")
            expect(page).to_have_url(re.compile(r"/v2/"))
            page.get_by_role("link", name="Deployments", exact=True).click()
            page.get_by_role("link", name="demo", exact=True).click()
            expect(page).to_have_url(re.compile(rf"/deployments/deployment/{deployment.id}"))
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Custom run").click()
            expect(page).to_have_url(re.compile(rf"/deployments/deployment/{deployment.id}/run"))

            # settings -> SFT -> Max steps: the field group whose own label is "SFT", then the input
            # labelled "Max steps" inside it (every training section has a "Max steps": SFT_GROUP).
            max_steps = page.locator(SFT_GROUP).get_by_label("Max steps", exact=True)
            expect(max_steps).to_have_value(str(deployment.parameters["settings"]["sft"]["max_steps"]))
            assert_plain_text(form_text(page), "V2")
            max_steps.fill(str(TYPED_MAX_STEPS))
            expect(max_steps).to_have_value(str(TYPED_MAX_STEPS))
            # overrides: key.path=value items, one text box each; change the example, add an item
            items = overrides_items(page)
            expect(items).to_have_count(1)
            items.first.fill(TYPED_OVERRIDES[0])
            overrides_group(page).get_by_role("button", name="Add item", exact=True).click()
            expect(items).to_have_count(2)
            items.nth(1).fill(TYPED_OVERRIDES[1])
            screenshot(page, tmp_path, "prefect-run-form.png")

            response = submit(page, deployment.id)
            assert response.ok, f"create_flow_run answered {response.status}: {response.text()}"
            flow_run_id = response.json()["id"]
            assert response.json()["parameters"]["settings"]["sft"]["max_steps"] == TYPED_MAX_STEPS
            assert response.json()["parameters"]["overrides"] == TYPED_OVERRIDES
            with client(stack) as api:  # beside it (the worker runs both): a run whose gate passes
                passing_id = api.create_flow_run_from_deployment(
                    deployment.id, parameters={"overrides": [f"evaluate.gates=[{PASSED_GATE}]"]}
                ).id

            with client(stack) as api:
                run = wait_final(api, flow_run_id)
                passing = wait_final(api, passing_id)
                new_runs = [r.id for r in runs_of(api, deployment.id) if r.id not in {*earlier_runs, passing_id}]
            assert run.state.is_failed(), f"flow run {run.name}: {run.state.type}: {run.state.message}"
            assert run.state.name == "Failed" and run.state.message.startswith("gate: sft/train/loss ")
            assert new_runs == [run.id], "the form did not create exactly one flow run"
            # the flow renames its run to the pipeline run id; the run recorded its resolved config there
            config = json.loads((demo_project / "outputs" / "runs" / run.name / "config.json").read_text())
            assert config["sft"]["max_steps"] == TYPED_MAX_STEPS
            assert config["sft"]["learning_rate"] == deployment.parameters["settings"]["sft"]["learning_rate"]
            assert config["evaluate"]["generation"]["max_new_tokens"] == 12 and len(config["evaluate"]["gates"]) == 1
            summary = json.loads((demo_project / "outputs" / "runs" / run.name / "summary.json").read_text())
            assert summary["status"] == "gate_failed", summary
            assert all(s["status"] == "completed" for s in summary["stages"].values()), summary

            # The failed gate, as an operator finds it: Runs tab -> the run (Failed, gate-failed)
            # -> Details (the gate's message) -> Artifacts -> release; pipeline-summary -> MLflow.
            page.goto(f"{ui}/v2/deployments/deployment/{deployment.id}")
            # the run's card: the nearest block around its link that holds a state badge
            card = page.get_by_role("link", name=run.name, exact=True).locator(
                "xpath=ancestor::div[.//*[normalize-space()='Failed' or normalize-space()='Completed']][1]"
            )
            expect(card.get_by_text("Failed", exact=True)).to_be_visible()
            expect(card.get_by_text("gate-failed", exact=True)).to_have_count(1)  # tags may be cut to "+N"
            card.get_by_role("link", name=run.name, exact=True).click()
            expect(page).to_have_url(re.compile(rf"/runs/flow-run/{run.id}"))
            page.get_by_role("tab", name="Details").click()
            expect(page.get_by_text(run.state.message, exact=True)).to_be_visible()
            page.get_by_role("tab", name="Artifacts").click()
            open_artifact(page, stack, run.id, "release")
            expect(page.get_by_text("Gate failed", exact=True).first).to_be_visible()
            expect(page.get_by_role("cell", name="sft/train/loss", exact=True)).to_be_visible()
            page.goto(f"{ui}/v2/runs/flow-run/{run.id}")
            page.get_by_role("tab", name="Artifacts").click()
            expect(page.get_by_text("pipeline-summary", exact=True).first).to_be_visible()
            screenshot(page, tmp_path, "prefect-flow-run-artifacts.png")
            open_artifact(page, stack, run.id, "pipeline-summary")
            sft_run = summary["stages"]["sft"]["mlflow_run_id"]
            link = page.get_by_role("link", name=sft_run, exact=True)
            href = link.get_attribute("href")
            assert href.startswith(f"{stack['mlflow']}/#/experiments/") and href.endswith(f"/runs/{sft_run}"), href
            page.goto(href)
            expect(page.get_by_text(sft_run, exact=True).first).to_be_visible()
            expect(page.get_by_text("sft", exact=True).first).to_be_visible()

            # The passing run's release: its version became the champion, its gate passed.
            assert passing.state.is_completed(), (
                f"flow run {passing.name}: {passing.state.type}: {passing.state.message}"
            )
            page.goto(f"{ui}/v2/runs/flow-run/{passing.id}")
            page.get_by_role("tab", name="Artifacts").click()
            open_artifact(page, stack, passing.id, "release")
            expect(page.get_by_text("Champion", exact=True).first).to_be_visible()
            expect(page.get_by_text(re.compile(r"is now")).first).to_be_visible()
            expect(page.get_by_role("cell", name="passed", exact=True)).to_be_visible()
            # ... and its version's page in the MLflow UI (the picture of the registry in the docs)
            passed = json.loads((demo_project / "outputs" / "runs" / passing.name / "summary.json").read_text())
            registered = passed["release"]["registered_model"]
            page.goto(f"{stack['mlflow']}/#/models/{registered['name']}/versions/{registered['version']}")
            expect(page.get_by_text(f"Version {registered['version']}").first).to_be_visible()
            screenshot(page, tmp_path, "mlflow-model-version.png")

            # An override of the field the form changed: refused at the run's start, naming both.
            page.goto(f"{ui}/v2/deployments/deployment/{deployment.id}/run")
            max_steps = page.locator(SFT_GROUP).get_by_label("Max steps", exact=True)
            max_steps.fill(str(TYPED_MAX_STEPS))
            overrides_items(page).first.fill("sft.max_steps=5")
            response = submit(page, deployment.id)
            assert response.ok, f"create_flow_run answered {response.status}: {response.text()}"
            flow_run_id = response.json()["id"]
            with client(stack) as api:
                clash = wait_final(api, flow_run_id)
            assert clash.state.is_failed(), f"flow run {clash.name}: {clash.state.type}: {clash.state.message}"
            assert f"overrides sets sft.max_steps=5 but settings set it to {TYPED_MAX_STEPS}" in clash.state.message
    finally:
        page.close()
        with client(stack) as api:  # never leave a run for the next worker of this pool
            for left in (flow_run_id, passing_id):
                if left is not None and not api.read_flow_run(left).state.is_final():
                    api.set_flow_run_state(left, Cancelled(), force=True)
        stop(worker)


def open_artifact(page, stack: dict, flow_run_id, key: str) -> None:
    """From a flow run's Artifacts tab: the artifact ``key``, then the page of the version this
    flow run created (the key's page lists every run's versions, each by its id's first 8
    characters), where the V2 UI renders its content."""
    with client(stack) as api:
        [artifact] = api.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
            )
        )
    page.get_by_text(key, exact=True).click()
    page.get_by_role("link", name=str(artifact.id)[:8], exact=True).click()


def overrides_group(page):
    return page.locator(OVERRIDES_GROUP)


def overrides_items(page):
    """The text boxes of the ``overrides`` items (V2 form)."""
    return overrides_group(page).locator("textarea")


def submit(page, deployment_id, attempts: int = SUBMIT_ATTEMPTS):
    """Click the form's Submit and return the ``create_flow_run`` response; on a 503, click again
    (up to ``attempts`` clicks), as a person does when the UI reports the error and keeps the form.

    Prefect's server answers 503 for the errors it calls retryable (SQLite busy: its own services
    and the worker write to the same file; ``prefect.server.api.server.is_client_retryable_exception``)
    and its Python client retries them; the UI does not. A 503's transaction is rolled back, so
    no run is created (the caller checks that exactly one run came of the form)."""

    def click():
        with page.expect_response(
            lambda r: r.url.endswith(f"/deployments/{deployment_id}/create_flow_run") and r.request.method == "POST"
        ) as created:
            page.get_by_role("button", name="Submit", exact=True).click()
        return created.value

    response = click()
    for _ in range(attempts - 1):
        if response.status != 503:
            break
        time.sleep(2)
        response = click()
    return response


def runs_of(api, deployment_id) -> list:
    return api.read_flow_runs(
        flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]))
    )


def wait_final(api, flow_run_id):
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        run = api.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        assert time.monotonic() < deadline, f"flow run {run.name} is {run.state_type} after {RUN_TIMEOUT_S} s"
        time.sleep(2)
