"""KTO stage: Kahneman-Tversky optimisation on unpaired desirable / undesirable examples
(``kto/train``, made by prepare_data from ``data.kto``) against a frozen reference.

As DPO: the reference's log-probs of every example and of its mismatched KL sequence are
computed once, committed and reused on resume (:mod:`trainer_core.stages.reference`; with LoRA,
the policy with its adapter disabled), then the reference is freed.

The objective is :class:`~trainer_core.training.supervised.KTOObjective` (Ethayarajh et al. 2024).
"""

from __future__ import annotations

import logging

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.stages.commit import commit_final
from trainer_core.stages.context import StageContext, train_stage
from trainer_core.stages.reference import SPLITS, policy_and_reference
from trainer_core.training.supervised import KTOObjective, kto_source

log = logging.getLogger(__name__)


def run(ctx: StageContext) -> Manifest:
    """Train the KTO policy from the SFT model and commit it as an HF model directory."""
    cfg, seed = ctx.config.kto, ctx.config.seed
    pad_id, device = ctx.tokenizer.pad_token_id, ctx.backend.device
    splits = {s: ctx.load_rows(f"kto/{s}") for s in SPLITS}
    desirable = sum(splits["train"].values("label"))  # from the column: no row is built
    ratio = cfg.desirable_weight * desirable / max(cfg.undesirable_weight * (len(splits["train"]) - desirable), 1)
    if not 1.0 <= ratio <= 4 / 3:
        log.warning(
            "kto: desirable_weight x #desirable / (undesirable_weight x #undesirable) = %.3g, outside the "
            "paper's advised [1, 4/3] (%d desirable of %d train examples)",
            ratio,
            desirable,
            len(splits["train"]),
        )
    train = kto_source(splits["train"], pad_id, cfg.micro_batch_size, seed, device)
    held_out = kto_source(splits["eval"], pad_id, cfg.micro_batch_size, seed, device, shuffle=False)
    model = policy_and_reference(ctx, cfg, train, held_out, splits, ("ref_logprobs", "ref_kl_logprobs"), kind="kto")
    backend = ctx.backend
    mean_over_ranks = (lambda t: backend.all_reduce_sum(t) / backend.world_size) if backend.world_size > 1 else None
    objective = KTOObjective(
        cfg.beta,
        held_out,
        cfg.eval_max_batches,
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight,
        mean_over_ranks=mean_over_ranks,
    )
    metrics = train_stage(ctx, model, objective, train, cfg)
    return commit_final(ctx, metrics, model=model)
