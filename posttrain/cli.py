"""``posttrain`` command line: run, resume and inspect pipeline runs, validate a config, deploy.

It sits above every other package (``posttrain -> deployments -> flows -> tasks ->
trainer_core``): the flow does not know the CLI exists.

``posttrain run [CONFIG] [--set key.path=value ...] [--run-id ID]`` validates the config
before anything runs (exit 2 on a bad one), runs the flow, and prints the output locations;
the last line on stdout is always the URI of the run's ``summary.json`` (exit 1 when the
pipeline failed). ``posttrain validate CONFIG [--set ...]`` prints the resolved config as YAML.
"""

from __future__ import annotations

from typing import Annotated

import typer
import yaml
from rich.console import Console

from deployments.deploy import deploy
from trainer_core.config import PipelineConfig, load_config, resolve_local_root
from trainer_core.errors import EXIT_BAD_INPUT, ConfigError

app = typer.Typer(help="LLM post-training pipeline (Prefect + MLflow).", no_args_is_help=True, add_completion=False)
_err = Console(stderr=True, highlight=False, soft_wrap=True)

DEFAULT_CONFIG = "configs/demo.yaml"

ConfigArg = Annotated[str, typer.Argument(help="YAML config file (any fsspec URI).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override one field: key.path=value (YAML value). Repeatable."),
]


def _load_or_exit(config: str, overrides: list[str] | None) -> PipelineConfig:
    """Load and validate; on a bad config print the message in red to stderr and exit 2."""
    try:
        return resolve_local_root(load_config(config, overrides=list(overrides or [])))
    except ConfigError as e:
        _err.print(str(e), style="red", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None


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
    from flows.pipeline import new_run_id

    cfg = _load_or_exit(config, overrides)
    _run_pipeline(cfg, run_id or new_run_id(cfg))


RootOpt = Annotated[str, typer.Option("--root", help="storage.root the run was written under.")]


@app.command()
def resume(run_id: str, overrides: SetOpt = None, root: RootOpt = "./outputs") -> None:
    """Re-run RUN_ID with its saved config (plus overrides): finished stages whose config and
    inputs are unchanged are skipped; the first unfinished one resumes from its checkpoint."""
    from tasks.runs import load_run_config

    try:
        saved = load_run_config(_absolute(root), run_id)
        cfg = resolve_local_root(load_config(base=saved, overrides=list(overrides or [])))
    except ConfigError as e:
        _err.print(str(e), style="red", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    _run_pipeline(cfg, run_id)


@app.command()
def status(run_id: str, root: RootOpt = "./outputs") -> None:
    """List RUN_ID's stages: state, latest committed checkpoint step, output URI."""
    from rich.table import Table

    from tasks.runs import run_status

    try:
        rows = run_status(_absolute(root), run_id)
    except ConfigError as e:
        _err.print(str(e), style="red", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    table = Table("stage", "state", "latest checkpoint step", "final step", "output")
    for r in rows:
        table.add_row(r["stage"], r["state"], _show(r["latest_step"]), _show(r["final_step"]), r["output_uri"])
    Console(width=200).print(table)


def _show(value: int | None) -> str:
    return "-" if value is None else str(value)


def _absolute(root: str) -> str:
    return resolve_local_root(PipelineConfig(storage={"root": root})).storage.root


def _run_pipeline(cfg: PipelineConfig, run_id: str) -> None:
    """Run the flow for ``cfg`` under ``run_id``; print locations; last line: the summary URI."""
    from flows.pipeline import check_run_id, post_training_pipeline
    from trainer_core.storage import RunLayout

    try:
        run_id = check_run_id(run_id)
    except ConfigError as e:
        _err.print(str(e), style="red", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    typer.echo(f"run id: {run_id}")
    layout = RunLayout(cfg.storage.root, run_id)
    typer.echo(f"outputs: {layout.uri}")
    try:
        summary = post_training_pipeline(config=cfg, run_id=run_id)
    except Exception as e:  # noqa: BLE001 - reported; the summary says which stage failed
        _err.print(f"pipeline failed: {type(e).__name__}: {e}", style="red", markup=False)
        typer.echo(layout.summary)
        raise typer.Exit(1) from None
    for name, entry in summary["stages"].items():
        reused = " (unchanged, not re-run)" if entry.get("reused") else ""
        typer.echo(f"{name}: {entry['status']}{reused} -> {entry['output_uri']}")
    mlflow = summary["mlflow"]
    typer.echo(f"mlflow: {mlflow['tracking_uri']} (run {mlflow['parent_run_id']})")
    typer.echo(summary["summary_uri"])


app.command("deploy")(deploy)


def main() -> None:
    """Entry point for ``python -m posttrain``."""
    app()


if __name__ == "__main__":
    main()
