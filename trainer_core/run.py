"""Process entry point of every stage: ``python -m trainer_core.run <stage-spec-uri>``.

Reads the :class:`~trainer_core.spec.StageSpec`, runs it with
:func:`~trainer_core.stages.runner.run_spec` (which owns the backend, the lease and the
logger) and exits with the taxonomy's code (``trainer_core/errors.py``): 0 when the stage's
final manifest is committed; 2 for bad input (config, data, model source, credentials,
permissions, a stage held by another writer, a diverged run: never worth a retry); 3 for an
exhausted resource (disk full, out of memory); 1 for anything else (storage that stayed down
through its retries among them: :class:`~trainer_core.errors.StorageUnavailable`, naming the S3
endpoint and the URI). A taxonomy error is printed
as one ``error: <message>`` line on stderr (the task shows it as the stage's error); anything
else prints its traceback.

The process watches its parent (the stage task, or the torchrun agent of a rank): when the
parent dies (``SIGKILL`` of the CLI, a killed agent) the trainer exits within a second, without
committing anything it had not committed yet, instead of training on as an orphan.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import traceback

from trainer_core.errors import EXIT_BAD_INPUT, EXIT_FAILED, ResourceError, classify
from trainer_core.processes import gc_paused, process_alive, process_start, skip_exit_collection

PARENT_POLL_S = 0.5
"""How often the trainer checks that its parent is alive."""

EXIT_PARENT_GONE = 1
"""Exit code of a trainer whose parent died (a crash from the task's view: a retry resumes it)."""


WATCH_PID_ENV = "POSTTRAIN_WATCH_PID"
"""Environment variable naming the process that launched the stage (set by ``tasks/launch/process.py``);
under torchrun a rank's own parent is the agent, so it watches this one too."""


def watch_parent(poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Exit this process (code :data:`EXIT_PARENT_GONE`) as soon as its parent, or the process
    named by ``POSTTRAIN_WATCH_PID`` (the stage task that launched it), is gone.

    A daemon thread compares ``os.getppid()`` with its value at start (an orphan is re-parented
    to init or a subreaper) and checks the watched pid with
    :func:`~trainer_core.processes.process_alive`: a zombie counts as gone (a SIGKILLed CLI stays
    one until its own parent reaps it, and under torchrun the rank's parent, the agent, lives on:
    only this check notices), and so does another process given the pid later (its start time
    differs from the one read here). ``os._exit`` stops at once: no cleanup runs, so nothing
    half-done is committed (a checkpoint or final directory is committed only by its manifest,
    written last); the writer lease it held lapses. The torchrun agent watches nothing itself: it
    exits once its ranks have (``--max-restarts 0``).

    Args:
        poll_s: Seconds between checks.

    Returns:
        The (started) watchdog thread.
    """
    parent = os.getppid()
    launcher = int(os.environ[WATCH_PID_ENV]) if os.environ.get(WATCH_PID_ENV, "").isdigit() else None
    started = process_start(launcher) if launcher else None

    def launcher_gone() -> bool:
        return launcher is not None and not process_alive(launcher, started)

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(poll_s):
            gone = parent if os.getppid() != parent else launcher if launcher_gone() else None
            if gone is not None:
                sys.stderr.write(f"error: the trainer's launching process {gone} is gone; exiting without committing\n")
                sys.stderr.flush()
                os._exit(EXIT_PARENT_GONE)

    thread = threading.Thread(target=watch, name="parent-watchdog", daemon=True)
    thread.start()
    return thread


def _where(spec, exc: BaseException) -> str:
    """``stage <name>``, with the micro-batch size it ran at for an out-of-memory error (what its
    message needs; other errors do not depend on it)."""
    if spec is None:
        return ""
    bare = classify(exc)
    if not (isinstance(bare, ResourceError) and "out of memory" in str(bare)):
        return f"stage {spec.stage}"
    try:
        micro = getattr(spec.config.section(spec.stage), "micro_batch_size", None)
    except Exception:  # noqa: BLE001 - an unknown stage: the error being reported says so
        micro = None
    return f"stage {spec.stage}" + (f" at {spec.stage}.micro_batch_size={micro}" if micro is not None else "")


def main(argv: list[str] | None = None) -> int:
    """Run the stage named in the spec; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    if len(argv) != 1:
        print("usage: python -m trainer_core.run <stage-spec-uri>", file=sys.stderr)
        return EXIT_BAD_INPUT
    watch_parent()
    skip_exit_collection()
    spec = None
    try:
        with gc_paused():  # the imports of torch, transformers and the stage's module
            from trainer_core.registry import get_stage
            from trainer_core.spec import read_spec
            from trainer_core.stages.runner import run_spec

            spec = read_spec(argv[0])
            importlib.import_module(get_stage(spec.stage).module)
        manifest = run_spec(spec)
        print(f"stage {spec.stage} committed: global_step={manifest.global_step}", flush=True)
        return 0
    except Exception as e:  # noqa: BLE001 - every failure becomes an exit code
        error = classify(e, where=_where(spec, e))
        if error is None:
            traceback.print_exc()
            sys.stdout.flush()
            return EXIT_FAILED
        sys.stdout.flush()
        print(f"error: {error}", file=sys.stderr, flush=True)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
