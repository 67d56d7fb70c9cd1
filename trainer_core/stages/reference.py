"""The frozen reference's log-probs of an offline preference stage (DPO, KTO), computed once.

The reference's summed completion log-probs of every train and eval row the stage will read
are computed at its start, committed under ``<output_uri>/reference/`` (manifest last, with the
stage's fingerprint) and reused on resume; the reference model is then freed, so training holds
only the policy. With LoRA (``lora.reference_model: disabled_adapter``) no reference model is
loaded at all: the reference log-probs are the policy's with its (still untrained) adapter
disabled.
"""

from __future__ import annotations

import contextlib
import json
import logging

from torch import nn

from trainer_core.checkpoint.manifest import ArtifactWriter, load_verified
from trainer_core.config import TrainStageConfig
from trainer_core.modeling.forwards.pairs import reference_logprobs
from trainer_core.modeling.lora import adapter_disabled
from trainer_core.stages.context import StageContext
from trainer_core.storage import join_uri, read_bytes
from trainer_core.training.loop import BatchSource
from trainer_core.training.supervised import rows_used

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")


def load_or_compute_reference(
    ctx: StageContext,
    needed: dict[str, list[int]],
    splits: dict[str, list[dict]],
    batch_size: int,
    *,
    kind: str = "pairs",
    policy: nn.Module | None = None,
) -> dict[str, dict[int, list[float]]]:
    """Reference log-probs (split -> row index -> two values) of the rows each split will use.

    Args:
        ctx: the stage's context (its ``reference`` input, fingerprint and layout).
        needed: split -> indices of the rows the run reads (``rows_used``).
        splits: split -> prepared rows.
        batch_size: rows per reference forward.
        kind: ``pairs`` ([chosen, rejected]) or ``kto`` ([completion, KL completion]); see
            :func:`~trainer_core.modeling.forwards.pairs.reference_logprobs`.
        policy: the wrapped LoRA policy whose disabled adapter is the reference
            (``ctx.models.reference_is_disabled_adapter``), or None to load the reference input as its
            own model.

    Returns:
        Every rank gets the same values; rank 0 has committed them.
    """
    uri = ctx.layout.artifact("reference")
    committed = _committed_reference(ctx, uri)
    if committed is not None:
        return committed
    if policy is None:
        reference, disabled = ctx.backend.prepare_frozen(ctx.models.causal_lm("reference")), contextlib.nullcontext()
    else:  # LoRA: the policy with its adapter off is the model it starts from; eval mode (no adapter dropout)
        reference, disabled = policy, adapter_disabled(ctx.backend.unwrap(policy))
        policy.eval()
        log.info("reference: the policy with its LoRA adapter disabled (no reference model loaded)")
    pad_id, device = ctx.tokenizer.pad_token_id, ctx.backend.device
    values: dict[str, dict[int, list[float]]] = {}
    with disabled:
        for s, indices in needed.items():
            with ctx.backend.autocast():  # the policy's compute precision: an unchanged policy's margin is 0
                computed = reference_logprobs(
                    reference, [splits[s][i] for i in indices], pad_id, batch_size, device, kind=kind
                )
            values[s] = dict(zip(indices, computed))
            log.info("reference log-probs: %d of %d %s rows (the ones this run reads)", len(indices), len(splits[s]), s)
    if policy is not None:
        policy.train()
    del reference
    ctx.check_fence(f"the reference log-probs {uri}")  # collective: every rank stops alike
    if ctx.is_main:  # every rank computed the same values; rank 0 commits them
        _commit_reference(ctx, uri, values)
    return values


def _committed_reference(ctx: StageContext, uri: str) -> dict[str, dict[int, list[float]]] | None:
    """The reference log-probs committed at ``uri`` under this stage's fingerprint, on every rank;
    None (on every rank) when there are none or they are another config's. Rank 0 decides for all:
    a sharded reference needs every rank's forward."""
    reuse = False
    if ctx.is_main:
        try:
            reuse = load_verified(uri).config_hash == ctx.fingerprint
        except (FileNotFoundError, ValueError) as e:
            log.info("computing reference log-probs (%s)", e.__class__.__name__)
    if not ctx.backend.broadcast_object(reuse):
        return None
    log.info("reusing reference log-probs from %s", uri)
    loaded = {s: json.loads(read_bytes(join_uri(uri, f"{s}.json"))) for s in SPLITS}
    return {s: {int(i): v for i, v in values.items()} for s, values in loaded.items()}


def _commit_reference(ctx: StageContext, uri: str, values: dict[str, dict[int, list[float]]]) -> None:
    """Commit ``values`` at ``uri`` (one JSON file a split) under this stage's fingerprint."""
    writer = ArtifactWriter(uri, overwrite=True)
    for s, v in values.items():
        writer.write_bytes(f"{s}.json", json.dumps({str(i): lp for i, lp in v.items()}).encode())
    writer.commit(
        kind="final",
        stage=ctx.spec.stage,
        run_id=ctx.spec.run_id,
        config_hash=ctx.fingerprint,
        extra={"role": "reference_logprobs", "reference": ctx.input("reference")},
    )


def attach_reference(
    splits: dict[str, list[dict]], values: dict[str, dict[int, list[float]]], keys: tuple[str, str]
) -> None:
    """Store each row's two reference log-probs in the row under ``keys`` (in place)."""
    for s, rows in splits.items():
        for i, pair in values[s].items():
            rows[i][keys[0]], rows[i][keys[1]] = pair


def policy_and_reference(
    ctx: StageContext,
    cfg: TrainStageConfig,
    train: BatchSource,
    held_out: BatchSource,
    splits: dict[str, list[dict]],
    keys: tuple[str, str],
    *,
    kind: str = "pairs",
) -> nn.Module:
    """The wrapped policy, after the reference log-probs of the rows the run will read are in
    ``splits`` under ``keys`` (:func:`load_or_compute_reference`, :func:`attach_reference`).

    The rows read are the first ``max_steps`` optimizer steps' of ``train`` and the evaluated
    batches of ``held_out``. With LoRA's disabled-adapter reference the policy is loaded first
    (it is the reference); otherwise the reference model is loaded, used and freed before the
    policy, so the two are never in memory together.
    """
    world_size = ctx.backend.world_size
    needed = {
        "train": rows_used(train, cfg.max_steps * cfg.accum_steps(world_size) * world_size),
        "eval": rows_used(held_out, min(cfg.eval_max_batches, len(held_out.sampler))),
    }
    batch_size = cfg.micro_batch_size * cfg.accum_steps(world_size)
    if ctx.models.reference_is_disabled_adapter:
        model = ctx.backend.wrap(ctx.models.causal_lm("model"))
        values = load_or_compute_reference(ctx, needed, splits, batch_size, kind=kind, policy=model)
    else:
        values = load_or_compute_reference(ctx, needed, splits, batch_size, kind=kind)
        model = ctx.backend.wrap(ctx.models.causal_lm("model"))
    attach_reference(splits, values, keys)
    return model
