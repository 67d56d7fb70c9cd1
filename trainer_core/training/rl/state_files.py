"""The RL loop's checkpoint files beyond the supervised checkpoint (:class:`~trainer_core.training.rl.trainer.RLTrainer`):
``rl_state.json`` (the KL controller) and ``sampler_rng.pt`` (every rank's sampling generator), and
the layout a manifest must declare to be resumed from."""

from __future__ import annotations

import io
import json
import logging

import torch

from trainer_core.backends.base import Backend
from trainer_core.checkpoint.components import ReplicaMismatchError, state_checksum, torch_bytes
from trainer_core.checkpoint.manifest import Manifest
from trainer_core.objectives.ppo import AdaptiveKLController, FixedKLController
from trainer_core.storage import join_uri, read_bytes

log = logging.getLogger(__name__)

RL_CHECKPOINT_LAYOUT = 2
"""``extra.rl_checkpoint`` of the manifests the RL loop writes: 2 = one policy-and-value model in
the backend's format, ``sampler_rng.pt`` a list per rank. Checkpoints without it (layout 1: the
policy and ``value_head.safetensors`` apart) are not resumed from."""


def rl_state_files(
    backend: Backend,
    kl_ctl: AdaptiveKLController | FixedKLController,
    generator: torch.Generator,
    validate_replicas: bool,
) -> dict[str, bytes]:
    """Collective: the RL state beyond the supervised checkpoint, as GLOBAL files.

    ``rl_state.json`` (the KL controller, replicated: with ``validate_replicas`` its checksums are
    compared across ranks first) and ``sampler_rng.pt`` (every rank's sampling generator state, in
    rank order).

    Raises:
        ReplicaMismatchError: the KL controller differs between ranks.
    """
    state = kl_ctl.state_dict()
    if backend.world_size > 1 and validate_replicas:
        checksums = backend.all_gather_object(state_checksum(state))
        if len(set(checksums)) != 1:
            raise ReplicaMismatchError("rl_state.json", checksums)
    sampler_states = backend.all_gather_object(generator.get_state())
    return {
        "rl_state.json": json.dumps({"kl_controller": state}).encode(),
        "sampler_rng.pt": torch_bytes(sampler_states),
    }


def load_rl_state_files(
    uri: str, backend: Backend, kl_ctl: AdaptiveKLController | FixedKLController, generator: torch.Generator
) -> None:
    """Restore the KL controller and this rank's sampling generator from the checkpoint at ``uri``
    (:func:`rl_state_files`); a rank the checkpoint has no generator for (written by fewer ranks)
    keeps its own, with a warning."""
    state = json.loads(read_bytes(join_uri(uri, "rl_state.json")))
    kl_ctl.load_state_dict(state["kl_controller"])
    sampler_states = torch.load(io.BytesIO(read_bytes(join_uri(uri, "sampler_rng.pt"))), weights_only=True)
    if backend.rank < len(sampler_states):
        generator.set_state(sampler_states[backend.rank])
    else:
        log.warning(
            "checkpoint %s has no sampler state for rank %d (written by %d ranks)",
            uri,
            backend.rank,
            len(sampler_states),
        )


def layout_problem(manifest: Manifest) -> str | None:
    """Why the RL loop cannot resume from ``manifest`` (another layout), or None."""
    layout = (manifest.extra or {}).get("rl_checkpoint")
    return None if layout == RL_CHECKPOINT_LAYOUT else f"RL layout {layout}, not {RL_CHECKPOINT_LAYOUT}"
