"""Process entry point of every stage: ``python -m trainer_core.run <stage-spec-uri>``.

Reads the :class:`~trainer_core.spec.StageSpec`, runs it with
:func:`~trainer_core.stages.runner.run_spec` (which owns the backend, the lease and the
logger) and exits: 0 when the stage's final manifest is committed,
:data:`~trainer_core.errors.EXIT_BAD_INPUT` (2) for bad config or data, a corrupt input
manifest or a stage held by another writer (a :class:`~trainer_core.errors.PosttrainError`:
never worth a retry), 1 for any other failure.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback

from trainer_core.errors import EXIT_BAD_INPUT, ConfigError, PosttrainError


def load_spec(uri: str):
    """Read and validate a stage spec (any fsspec URI).

    Raises:
        ConfigError: the spec is missing, not JSON, or fails validation.
    """
    import fsspec
    from pydantic import ValidationError

    from trainer_core.spec import StageSpec

    try:
        with fsspec.open(uri, "r") as f:
            return StageSpec.model_validate(json.load(f))
    except FileNotFoundError as e:
        raise ConfigError(f"stage spec not found: {uri}") from e
    except (json.JSONDecodeError, ValidationError) as e:
        raise ConfigError(f"invalid stage spec {uri}: {e}") from e


def main(argv: list[str] | None = None) -> int:
    """Run the stage named in the spec; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    if len(argv) != 1:
        print("usage: python -m trainer_core.run <stage-spec-uri>", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        from trainer_core.stages.runner import run_spec

        spec = load_spec(argv[0])
        manifest = run_spec(spec)
        print(f"stage {spec.stage} committed: global_step={manifest.global_step}", flush=True)
        return 0
    except PosttrainError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        return 1


if __name__ == "__main__":
    sys.exit(main())
