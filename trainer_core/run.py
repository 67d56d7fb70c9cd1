"""Process entry point of every stage: ``python -m trainer_core.run <stage-spec-uri>``.

Reads the :class:`~trainer_core.spec.StageSpec`, runs the stage and exits:
0 when the stage's final manifest is committed, :data:`~trainer_core.errors.EXIT_BAD_INPUT`
(2) for bad config or data, a corrupt input manifest or a stage held by another writer
(a :class:`~trainer_core.errors.PosttrainError`: never worth a retry), 1 for any other failure.
The stage runs under its writer lease (``checkpoint/lease.py``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import json
import logging
import sys
import traceback

from trainer_core.errors import EXIT_BAD_INPUT, ConfigError, PosttrainError

STAGE_MODULES = {
    "prepare_data": "trainer_core.stages.prepare_data",
    "sft": "trainer_core.stages.sft",
    "reward_model": "trainer_core.stages.reward_model",
    "score": "trainer_core.stages.score",
    "dpo": "trainer_core.stages.dpo",
    "ppo": "trainer_core.stages.ppo",
    "grpo": "trainer_core.stages.grpo",
    "evaluate": "trainer_core.stages.evaluate",
}


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
        from trainer_core.checkpoint.lease import StageLease
        from trainer_core.checkpoint.storage import configure

        spec = load_spec(argv[0])
        configure(spec.config.storage)
        if spec.stage not in STAGE_MODULES:
            raise ConfigError(f"unknown stage {spec.stage!r}; known: {sorted(STAGE_MODULES)}")
        module = importlib.import_module(STAGE_MODULES[spec.stage])
        # Rank 0 holds the stage's writer lease for the whole job; other ranks write only
        # between its barriers.
        if int(os.environ.get("RANK", "0")) == 0:
            lease = StageLease(spec.output_uri, owner=spec.writer_id, ttl_s=spec.config.launch.lease_ttl_s)
        else:
            lease = contextlib.nullcontext()
        with lease:
            manifest = module.run(spec)
        print(f"stage {spec.stage} committed: global_step={manifest.global_step}", flush=True)
        return 0
    except PosttrainError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    finally:
        _close_process_group()


def _close_process_group() -> None:
    """Leave the process group (if the stage joined one) so the launcher sees a clean exit."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        # FSDP2 modules sit in reference cycles: collect them now, while the group they hold
        # exists; freed at interpreter exit instead, they can abort the rank after its commit.
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
