"""DPO stage: a preference loss (``dpo.loss_type``; sigmoid DPO by default) against a frozen
reference whose log-probs are computed once; SimPO and ORPO use no reference at all.

The reference's summed completion log-probs for every train and eval pair are computed at
the start of the stage, committed under ``<output_uri>/reference/`` (manifest last) and
reused on resume; the reference model is then freed, so training holds only the policy. With
LoRA (``lora.reference_model: disabled_adapter``) no reference model is loaded at all: the
reference log-probs are the policy's with its (still untrained) adapter disabled.

The objective is :class:`~trainer_core.training.supervised.DPOObjective`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from functools import partial

from torch import nn

from trainer_core.checkpoint.manifest import ArtifactWriter, Manifest, load_verified
from trainer_core.lora import adapter_disabled
from trainer_core.stages.context import StageContext, commit_final, train_stage
from trainer_core.storage import join_uri, read_bytes
from trainer_core.training.supervised import (
    DPOObjective,
    collate_with_reference,
    pair_source,
    reference_logprobs,
    rows_used,
)

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")


def _load_or_compute_reference(
    ctx: StageContext, needed: dict[str, list[int]], splits: dict[str, list[dict]], policy: nn.Module | None = None
) -> dict[str, dict[int, list[float]]]:
    """Reference log-probs (row index -> [chosen, rejected]) of the rows each split will use.

    ``policy``: the wrapped LoRA policy whose disabled adapter is the reference
    (``ctx.reference_is_disabled_adapter``), or None to load the reference input as its own model.
    """
    uri = ctx.layout.artifact("reference")
    expected = ctx.fingerprint
    reuse = False
    if ctx.is_main:  # one decision for all ranks: a sharded reference needs every rank's forward
        try:
            reuse = load_verified(uri).config_hash == expected
        except (FileNotFoundError, ValueError) as e:
            log.info("computing reference log-probs (%s)", e.__class__.__name__)
    if ctx.backend.broadcast_object(reuse):
        log.info("reusing reference log-probs from %s", uri)
        loaded = {s: json.loads(read_bytes(join_uri(uri, f"{s}.json"))) for s in SPLITS}
        return {s: {int(i): v for i, v in values.items()} for s, values in loaded.items()}
    cfg = ctx.config.dpo
    if policy is None:
        reference, disabled = ctx.backend.prepare_frozen(ctx.causal_lm("reference")), contextlib.nullcontext()
    else:  # LoRA: the policy with its adapter off is the model it starts from; eval mode (no adapter dropout)
        reference, disabled = policy, adapter_disabled(ctx.backend.unwrap(policy))
        policy.eval()
        log.info("reference: the policy with its LoRA adapter disabled (no reference model loaded)")
    pad_id, device = ctx.tokenizer.pad_token_id, ctx.backend.device
    batch_size = cfg.micro_batch_size * cfg.accum_steps(ctx.backend.world_size)
    values: dict[str, dict[int, list[float]]] = {}
    with disabled:
        for s, indices in needed.items():
            with ctx.backend.autocast():  # the policy's compute precision: an unchanged policy's margin is 0
                computed = reference_logprobs(reference, [splits[s][i] for i in indices], pad_id, batch_size, device)
            values[s] = dict(zip(indices, computed))
            log.info("reference log-probs: %d of %d %s pairs (the ones this run reads)", len(indices), len(splits[s]), s)
    if policy is not None:
        policy.train()
    del reference
    if not ctx.is_main:  # every rank computed the same values; rank 0 commits them
        return values
    writer = ArtifactWriter(uri, overwrite=True)
    for s, v in values.items():
        writer.write_bytes(f"{s}.json", json.dumps({str(i): lp for i, lp in v.items()}).encode())
    writer.commit(
        kind="final", stage="dpo", run_id=ctx.spec.run_id, config_hash=expected,
        extra={"role": "reference_logprobs", "reference": ctx.input("reference")},
    )
    return values


def run(ctx: StageContext) -> Manifest:
    """Train the DPO policy from the SFT model and commit it as an HF model directory.

    Reference log-probs are computed once, before training, for the pairs the run will read.
    """
    cfg, seed = ctx.config.dpo, ctx.config.seed
    pad_id, device = ctx.tokenizer.pad_token_id, ctx.backend.device
    splits = {s: ctx.load_rows(f"preference/{s}") for s in SPLITS}
    collate = partial(collate_with_reference, pad_id=pad_id)
    packed = cfg.max_tokens_per_micro_batch is not None
    train = pair_source(
        splits["train"], pad_id, cfg.micro_batch_size, seed, device,
        collate=partial(collate, packed=packed), max_tokens=cfg.max_tokens_per_micro_batch,
    )
    held_out = pair_source(splits["eval"], pad_id, cfg.micro_batch_size, seed, device, shuffle=False, collate=collate)
    needed = {
        "train": rows_used(train, cfg.max_steps * cfg.accum_steps(ctx.backend.world_size) * ctx.backend.world_size),
        "eval": rows_used(held_out, min(cfg.eval_max_batches, len(held_out.sampler))),
    }
    objective = DPOObjective(cfg.beta, held_out, cfg.eval_max_batches, loss_type=cfg.loss_type,
                             label_smoothing=cfg.label_smoothing, gamma=cfg.simpo_gamma)
    if not objective.needs_reference:
        log.info("loss_type %s is reference-free: no reference model or log-probs", cfg.loss_type)
        model = ctx.backend.wrap(ctx.causal_lm("model"))
    elif ctx.reference_is_disabled_adapter:
        model = ctx.backend.wrap(ctx.causal_lm("model"))
        reference = _load_or_compute_reference(ctx, needed, splits, policy=model)
    else:
        reference = _load_or_compute_reference(ctx, needed, splits)
        model = ctx.backend.wrap(ctx.causal_lm("model"))
    if objective.needs_reference:
        for s, rows in splits.items():
            for i, (c, r) in reference[s].items():
                rows[i]["ref_chosen_logprobs"], rows[i]["ref_rejected_logprobs"] = c, r
    metrics = train_stage(ctx, model, objective, train, cfg)
    return commit_final(ctx, metrics, model=model)
