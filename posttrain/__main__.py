"""``python -m posttrain``: the command line."""

from trainer_core.processes import gc_paused

with gc_paused():  # typer's, Prefect's (deployments) and pydantic's imports
    from posttrain.cli import main

main()
