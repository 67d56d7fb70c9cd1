"""``posttrain`` command line: run, resume and inspect pipeline runs, validate a config, deploy.

It sits above every other package (``posttrain -> deployments -> flows -> tasks ->
trainer_core``): the flow does not know the CLI exists.

``posttrain run [CONFIG] [--set key.path=value ...] [--run-id ID]`` validates the config, runs
the flow and prints the output locations. Exit codes follow the error taxonomy
(``trainer_core/errors.py``):

- 0: every stage completed; the last stdout line is the URI of the run's ``summary.json``;
- 2: bad input. Before anything ran (a bad config or run id, a failed pre-flight check, the run
  held by another live ``run``/``resume``) nothing is written and no summary line is printed;
  a stage that failed on bad input (data, model source, a diverged run) ends with the summary line;
- 1: any other failure (a crash, an exhausted resource), after the summary line when the run
  had started;
- 4: every stage completed but the final policy failed a quality gate;
- 128 + N: stopped by signal N (130 for SIGINT, a terminal's Ctrl-C; 143 for SIGTERM; 129 for
  SIGHUP): every trainer is killed, the stages cut short are recorded ``interrupted`` in the
  summary, the run's lease is released; ``posttrain resume RUN_ID`` goes on from the last
  checkpoints.

The error is printed on stderr as plain text (no markup or emoji codes), without a traceback.
Without ``PREFECT_API_URL`` a run starts a temporary Prefect API server in its own session
(:mod:`posttrain.api_server`): a signal to the CLI's process group does not reach it, the CLI
stops it at exit, and it stops itself when the CLI is killed. ``posttrain validate CONFIG
[--set ...]`` prints the resolved config as YAML.
"""

from __future__ import annotations

import signal
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console

from deployments.deploy import deploy
from trainer_core.config import PipelineConfig, load_config, resolve_local_root
from trainer_core.errors import EXIT_BAD_INPUT, EXIT_FAILED, ConfigError, PosttrainError
from trainer_core.processes import gc_paused, skip_exit_collection

app = typer.Typer(help="LLM post-training pipeline (Prefect + MLflow).", no_args_is_help=True, add_completion=False)
_err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False, markup=False)

DEFAULT_CONFIG = "configs/demo.yaml"

ConfigArg = Annotated[str, typer.Argument(help="YAML config file (any fsspec URI).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override one field: key.path=value (YAML value). Repeatable."),
]
RootOpt = Annotated[str, typer.Option("--root", help="storage.root the run was written under.")]


def _fail(message: str, code: int) -> typer.Exit:
    """Print ``error: message`` to stderr; the ``typer.Exit`` to raise with ``code``."""
    _err.print(f"error: {message}", style="red")
    return typer.Exit(code)


def _load_or_exit(config: str, overrides: list[str] | None) -> PipelineConfig:
    """Load and validate; on a bad config print the message to stderr and exit 2."""
    try:
        return resolve_local_root(load_config(config, overrides=list(overrides or [])))
    except ConfigError as e:
        raise _fail(str(e), EXIT_BAD_INPUT) from None


def _checked_run_id(run_id: str) -> str:
    from tasks.runs import check_run_id

    try:
        return check_run_id(run_id)
    except ConfigError as e:
        raise _fail(str(e), EXIT_BAD_INPUT) from None


@app.command()
def validate(config: ConfigArg, overrides: SetOpt = None) -> None:
    """Validate CONFIG with overrides and print the resolved config as YAML (secrets masked)."""
    cfg = _load_or_exit(config, overrides)
    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())


@app.command()
def run(
    config: Annotated[str, typer.Argument(help="YAML config file (any fsspec URI).")] = DEFAULT_CONFIG,
    overrides: SetOpt = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Run id; reuse one to resume it.")] = None,
) -> None:
    """Run the pipeline; the last stdout line is the summary.json URI."""
    from tasks.runs import new_run_id

    cfg = _load_or_exit(config, overrides)
    _run_pipeline(cfg, _checked_run_id(run_id or new_run_id(cfg)))


@app.command()
def resume(run_id: str, overrides: SetOpt = None, root: RootOpt = "./outputs") -> None:
    """Re-run RUN_ID with its saved config (plus overrides): finished stages whose config and
    inputs are unchanged are skipped; the first unfinished one resumes from its checkpoint. The
    run is resumed under --root, where it was found, also when it was copied there from another
    root (the saved config's paths under that root are moved with it)."""
    from tasks.runs import resume_config

    run_id = _checked_run_id(run_id)
    try:
        cfg, moved = resume_config(_absolute(root), run_id, overrides)
    except ConfigError as e:
        raise _fail(str(e), EXIT_BAD_INPUT) from None
    for field, (saved, now) in moved.items():  # a run copied or moved from another root: resumed where it is
        _err.print(f"note: {field}: {saved} -> {now} (the run was started under another root)")
    _run_pipeline(cfg, run_id)


@app.command()
def status(run_id: str, root: RootOpt = "./outputs") -> None:
    """List RUN_ID's stages: state (completed, running, interrupted, not started), latest
    committed checkpoint step, output URI."""
    from rich.table import Table

    from tasks.runs import run_holder, run_status

    run_id = _checked_run_id(run_id)
    try:
        rows = run_status(_absolute(root), run_id)
    except ConfigError as e:
        raise _fail(str(e), EXIT_BAD_INPUT) from None
    holder = run_holder(_absolute(root), run_id)
    typer.echo(f"run {run_id}: " + (f"running (held by {holder})" if holder else "not running"))
    table = Table("stage", "state", "latest checkpoint step", "final step", "output")
    for r in rows:
        table.add_row(r["stage"], r["state"], _show(r["latest_step"]), _show(r["final_step"]), r["output_uri"])
    Console(width=200, emoji=False).print(table)


def _show(value: int | None) -> str:
    return "-" if value is None else str(value)


def _absolute(root: str) -> str:
    return resolve_local_root(PipelineConfig(storage={"root": root})).storage.root


INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that stop a run (the CLI exits ``128 + signum``)."""

_received: list[int] = []
"""The interrupt signals received during the current run, in order."""


def _interrupt(signum: int, frame: Any) -> None:
    """Stop the run as Ctrl-C does: the first signal raises ``KeyboardInterrupt`` (the flow unwinds,
    killing its trainers, and exit handlers run); later ones are noted, not raised, so that the
    clean-up they would cut short finishes (a SIGKILL still ends everything: the trainers and the
    temporary API server watch this process)."""
    _received.append(signum)
    if len(_received) == 1:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def exit_code_of(error: BaseException) -> int:
    """The CLI's exit code for a failed pipeline run: 2 for bad input (before any stage, or a
    stage's :class:`~tasks.launch.failures.BadStageInput`), 4 for a failed quality gate, else 1."""
    from tasks.launch.failures import BadStageInput
    from tasks.report.gates import QualityGateFailed

    if isinstance(error, QualityGateFailed):
        return error.exit_code
    bad_input = isinstance(error, PosttrainError) and error.exit_code == EXIT_BAD_INPUT
    return EXIT_BAD_INPUT if bad_input or isinstance(error, BadStageInput) else EXIT_FAILED


def _headline(error: BaseException) -> str:
    """The part of a failure's message a user reads first (a stage error's launch details and
    output tail follow a blank line; they are in summary.json and the task log)."""
    return f"{type(error).__name__}: {str(error).split(chr(10) + chr(10), 1)[0]}"


def _summary_bytes(uri: str, retry: bool = True) -> bytes | None:
    """The run's ``summary.json`` as it is now, or None when absent or unreadable; ``retry=False``
    reads once (after a failure: a storage outage would add the retries' ~30 s to the exit)."""
    from tenacity import stop_after_attempt

    from trainer_core import storage

    read = storage.read_bytes if retry else storage.read_bytes.retry_with(stop=stop_after_attempt(1))
    try:
        return read(uri)
    except Exception:  # noqa: BLE001 - absent or unreadable: not written by this run
        return None


def _refuse_if_held(cfg: PipelineConfig, layout: Any) -> None:
    """Exit 2 at once when a live ``run``/``resume`` holds the run's lease (before starting
    Prefect; the flow takes the lease itself, so two starting together are still told apart)."""
    from tasks.runs import run_lease
    from trainer_core.checkpoint.lease import LeaseHeldError

    try:
        run_lease(cfg, layout).check_free()
    except LeaseHeldError as e:
        raise _fail(str(e), EXIT_BAD_INPUT) from None
    except Exception:  # noqa: BLE001 - unreadable storage: the flow's pre-flight reports it
        return


def _refuse_unplannable(cfg: PipelineConfig, layout: Any) -> None:
    """Exit 2 at once when the run's stage graph cannot be planned (a stage input nothing provides:
    no prepare_data, a reward model no stage trains), before Prefect starts; the flow plans again."""
    from tasks.plan import plan_run

    try:
        plan_run(cfg, layout)
    except ConfigError as e:
        raise _fail(str(e), EXIT_BAD_INPUT) from None
    except Exception:  # noqa: BLE001 - unreadable storage: the flow's pre-flight reports it
        return


def _checked_layout(cfg: PipelineConfig, run_id: str) -> Any:
    """The run's layout once the checks that take seconds pass: the storage root is writable
    (first, before any read of the run), no live run holds it, its stages can be planned."""
    from tasks.preflight import check_storage_root
    from trainer_core import storage
    from trainer_core.storage import RunLayout

    storage.configure(cfg.storage)
    try:  # first: an unreachable root is refused in seconds, before any read of the run or Prefect
        check_storage_root(cfg.storage.root)
    except ConfigError as e:
        raise _fail(str(e), EXIT_BAD_INPUT) from None
    layout = RunLayout(cfg.storage.root, run_id)
    _refuse_if_held(cfg, layout)
    _refuse_unplannable(cfg, layout)
    return layout


def _run_pipeline(cfg: PipelineConfig, run_id: str) -> None:
    """Run the flow for ``cfg`` under ``run_id``; print locations; last line: the summary URI."""
    layout = _checked_layout(cfg, run_id)  # refused in seconds, before Prefect is imported or started
    with gc_paused():  # Prefect's and MLflow's imports
        from flows.pipeline import post_training_pipeline
        from posttrain.api_server import needs_temporary_server, start_temporary_api_server
        from tasks.console import use_plain_console

    typer.echo(f"run id: {run_id}")
    typer.echo(f"outputs: {layout.uri}")
    use_plain_console()
    before = _summary_bytes(layout.summary)
    _received.clear()
    previous = {sig: signal.signal(sig, _interrupt) for sig in INTERRUPT_SIGNALS}
    try:
        if needs_temporary_server():
            start_temporary_api_server()
        summary = post_training_pipeline(config=cfg, run_id=run_id)
    except BaseException as e:  # noqa: BLE001 - reported; the summary (when written) says which stage failed
        written = _summary_bytes(layout.summary, retry=False) not in (None, before)  # this run wrote it
        if isinstance(e, KeyboardInterrupt) or _received:
            signum = _received[0] if _received else signal.SIGINT
            _err.print(
                f"error: pipeline interrupted by {signal.Signals(signum).name}"
                + (f"; resume it with: posttrain resume {run_id} --root {cfg.storage.root}" if written else ""),
                style="red",
            )
            if written:
                typer.echo(layout.summary)
            raise typer.Exit(128 + signum) from None
        if isinstance(e, PosttrainError) and not written:  # refused before anything ran
            raise _fail(str(e), exit_code_of(e)) from None
        _err.print(f"error: pipeline failed: {_headline(e)}", style="red")
        if written:
            typer.echo(layout.summary)
        raise typer.Exit(exit_code_of(e)) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for name, entry in summary["stages"].items():
        reused = " (unchanged, not re-run)" if entry.get("reused") else ""
        typer.echo(f"{name}: {entry['status']}{reused} -> {entry['output_uri']}")
    release = summary.get("release") or {}
    for gate in release.get("gates", []):
        verdict = "not judged" if not gate.get("judged", True) else "passed" if gate["passed"] else "failed"
        typer.echo(f"gate {verdict}: {gate['result']}")
    registered = release.get("registered_model")
    if registered:
        typer.echo(f"registered: {registered['name']} version {registered['version']} ({registered['alias']})")
    mlflow = summary["mlflow"]
    typer.echo(f"mlflow: {mlflow['tracking_uri']} (run {mlflow['parent_run_id']})")
    typer.echo(summary["summary_uri"])


def parse_grid(items: list[str] | None) -> dict[str, list[Any]]:
    """``--grid`` items as a grid: ``key=v1,v2,...`` (each value read as YAML) or
    ``key=[v1, v2]`` (a YAML list).

    Raises:
        ConfigError: an item without ``=`` or without a value, naming it.
    """
    grid: dict[str, list[Any]] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or not raw.strip():
            raise ConfigError(f"--grid {item!r}: expected key.path=value1,value2,...")
        try:
            values = (
                yaml.safe_load(raw) if raw.lstrip().startswith("[") else [yaml.safe_load(v) for v in raw.split(",")]
            )
        except yaml.YAMLError as e:
            raise ConfigError(f"--grid {item!r}: not YAML: {e}") from None
        grid[key.strip()] = values if isinstance(values, list) else [values]
    return grid


@app.command()
def sweep(
    config: ConfigArg = DEFAULT_CONFIG,
    grid: Annotated[
        list[str] | None,
        typer.Option(
            "--grid",
            "-g",
            help="A swept key and its values: key.path=v1,v2 (YAML values). Repeatable: one point "
            "per combination. Added to the config's sweep.grid.",
        ),
    ] = None,
    overrides: SetOpt = None,
    sweep_id: Annotated[
        str | None, typer.Option("--sweep-id", help="Sweep id; reuse one to resume it or to add points.")
    ] = None,
) -> None:
    """Run one pipeline per grid point (the stages they share once), compare the points and
    release the best; the last stdout line is the sweep's summary.json URI."""
    from tasks.runs import new_run_id
    from tasks.sweep import sweep_grid

    cfg = _load_or_exit(config, overrides)
    try:
        swept = parse_grid(grid)
        sweep_grid(cfg, swept)  # the rule of sweep.grid, before Prefect or anything else starts
    except ConfigError as e:
        raise _fail(str(e), EXIT_BAD_INPUT) from None
    _run_sweep(cfg, _checked_run_id(sweep_id or f"sweep-{new_run_id(cfg)}"), swept)


def _run_sweep(cfg: PipelineConfig, sweep_id: str, grid: dict[str, list[Any]]) -> None:
    """Run the sweep flow; print each point, the best and the release; last line: the summary URI."""
    with gc_paused():  # Prefect's and MLflow's imports
        from flows.sweep import post_training_sweep
        from posttrain.api_server import needs_temporary_server, start_temporary_api_server
        from tasks.console import use_plain_console
        from trainer_core import storage

    storage.configure(cfg.storage)
    typer.echo(f"sweep id: {sweep_id}")
    use_plain_console()
    _received.clear()
    previous = {sig: signal.signal(sig, _interrupt) for sig in INTERRUPT_SIGNALS}
    try:
        if needs_temporary_server():
            start_temporary_api_server()
        summary = post_training_sweep(config=cfg, grid=grid, sweep_id=sweep_id)
    except BaseException as e:  # noqa: BLE001 - reported with the exit code of the taxonomy
        if isinstance(e, KeyboardInterrupt) or _received:
            signum = _received[0] if _received else signal.SIGINT
            _err.print(
                f"error: sweep interrupted by {signal.Signals(signum).name}; resume it with: posttrain sweep "
                f"CONFIG --sweep-id {sweep_id} (and the same --grid)",
                style="red",
            )
            raise typer.Exit(128 + signum) from None
        raise _fail(f"sweep failed: {_headline(e)}", exit_code_of(e)) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    comparison = summary["comparison"]
    for row in comparison["rows"]:
        value = "-" if row["value"] is None else f"{row['value']:.4g}"
        best = " (best)" if row["run_id"] == comparison["best"] else ""
        typer.echo(f"{row['run_id']}: {row['status']} {row['values']} {comparison['metric']}={value}{best}")
    registered = ((summary.get("release") or {}).get(comparison["best"]) or {}).get("registered_model")
    if registered:
        typer.echo(f"registered: {registered['name']} version {registered['version']} ({registered['alias']})")
    typer.echo(summary["summary_uri"])


app.command("deploy")(deploy)


def main() -> None:
    """Entry point for ``python -m posttrain``."""
    skip_exit_collection()
    app()


if __name__ == "__main__":
    main()
