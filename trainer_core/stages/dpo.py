"""DPO stage: a preference loss (``dpo.loss_type``; sigmoid DPO by default) against a frozen
reference whose log-probs are computed once; SimPO and ORPO use no reference at all.

The reference's log-probs are computed, committed and reused on resume by
:mod:`trainer_core.stages.reference` (with LoRA, the policy with its adapter disabled).

The objective is :class:`~trainer_core.training.supervised.DPOObjective`.
"""

from __future__ import annotations

import logging
from functools import partial

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.stages.commit import commit_final
from trainer_core.stages.context import StageContext, train_stage
from trainer_core.stages.reference import SPLITS, policy_and_reference
from trainer_core.training.supervised import DPOObjective, collate_with_reference, pair_source

log = logging.getLogger(__name__)


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
        splits["train"],
        pad_id,
        cfg.micro_batch_size,
        seed,
        device,
        collate=partial(collate, packed=packed),
        max_tokens=cfg.max_tokens_per_micro_batch,
    )
    held_out = pair_source(splits["eval"], pad_id, cfg.micro_batch_size, seed, device, shuffle=False, collate=collate)
    objective = DPOObjective(
        cfg.beta,
        held_out,
        cfg.eval_max_batches,
        loss_type=cfg.loss_type,
        label_smoothing=cfg.label_smoothing,
        gamma=cfg.simpo_gamma,
        rpo_alpha=cfg.rpo_alpha,
    )
    if objective.needs_reference:
        model = policy_and_reference(
            ctx, cfg, train, held_out, splits, ("ref_chosen_logprobs", "ref_rejected_logprobs")
        )
    else:
        log.info("loss_type %s is reference-free: no reference model or log-probs", cfg.loss_type)
        model = ctx.backend.wrap(ctx.models.causal_lm("model"))
    metrics = train_stage(ctx, model, objective, train, cfg)
    return commit_final(ctx, metrics, model=model)
