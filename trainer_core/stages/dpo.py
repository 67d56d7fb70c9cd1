"""DPO stage: sigmoid DPO against a frozen reference whose log-probs are computed once.

The reference's summed completion log-probs for every train and eval pair are computed at
the start of the stage, committed under ``<output_uri>/reference/`` (manifest last) and
reused on resume; the reference model is then freed, so training holds only the policy.

Shape legend: B batch (pairs), T tokens.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from itertools import islice

import torch
from torch import Tensor, nn

from trainer_core.checkpoint.manifest import ArtifactWriter, Manifest, load_verified
from trainer_core.checkpoint.storage import read_bytes
from trainer_core.data.batching import DataPosition, collate_pairs, iterate_batches
from trainer_core.loop import BatchSource, StepOutput
from trainer_core.models import load_causal_lm
from trainer_core.objectives.dpo import dpo_loss
from trainer_core.forward import masked_token_logprobs
from trainer_core.objectives.logprobs import sequence_logprobs, shift_mask
from trainer_core.spec import StageSpec, join_uri
from trainer_core.stages.common import StageContext, commit_final, load_rows, open_stage, train_stage
from trainer_core.stages.reward_model import concat_pairs, evaluate_pairs, pair_source

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")


def pair_logprobs(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Summed completion log-probs of chosen and rejected, each [B], from one [2B, T] forward."""
    input_ids, attention_mask, loss_mask = concat_pairs(batch)
    token_logprobs = masked_token_logprobs(model, input_ids, attention_mask, loss_mask)
    logprobs = sequence_logprobs(token_logprobs, shift_mask(loss_mask))
    num_pairs = batch["chosen_input_ids"].shape[0]
    return logprobs[:num_pairs], logprobs[num_pairs:]


def collate_with_reference(rows: list[dict], pad_id: int) -> dict[str, Tensor]:
    """:func:`collate_pairs` plus ``ref_chosen_logprobs`` / ``ref_rejected_logprobs`` [B] float32."""
    batch = collate_pairs(rows, pad_id)
    for key in ("ref_chosen_logprobs", "ref_rejected_logprobs"):
        batch[key] = torch.tensor([r[key] for r in rows], dtype=torch.float32)
    return batch


class DPOObjective:
    """Sigmoid DPO loss; the count unit is a pair. Metrics use TRL's names."""

    def __init__(self, beta: float, eval_source: BatchSource, eval_max_batches: int) -> None:
        self.beta = beta
        self.eval_source = eval_source
        self.eval_max_batches = eval_max_batches

    def count(self, batch: dict[str, Tensor]) -> int:
        return batch["chosen_input_ids"].shape[0]

    def step(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        chosen, rejected = pair_logprobs(model, batch)
        losses, m = dpo_loss(
            chosen, rejected, batch["ref_chosen_logprobs"], batch["ref_rejected_logprobs"], beta=self.beta
        )
        num_tokens = int(batch["chosen_attention_mask"].sum() + batch["rejected_attention_mask"].sum())
        sums = {k: v.sum() for k, v in m.items()}
        sums["logps/chosen"] = chosen.detach().sum()
        sums["logps/rejected"] = rejected.detach().sum()
        return StepOutput(loss_sum=losses.sum(), num_tokens=num_tokens, metric_sums=sums)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out mean DPO loss and TRL's reward metrics."""
        return evaluate_pairs(self, model, self.eval_source, self.eval_max_batches)


@torch.no_grad()
def reference_logprobs(model: nn.Module, rows: list[dict], pad_id: int, batch_size: int, device) -> list[list[float]]:
    """[chosen, rejected] summed log-probs under ``model`` for each row, in row order.

    Rows are batched in length order to limit padding; results are put back in row order.
    """
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["chosen_input_ids"]) + len(rows[i]["rejected_input_ids"]))
    out: list[list[float]] = [[0.0, 0.0] for _ in rows]
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = {k: v.to(device) for k, v in collate_pairs([rows[i] for i in idx], pad_id).items()}
        chosen, rejected = pair_logprobs(model, batch)
        for i, c, r in zip(idx, chosen.tolist(), rejected.tolist()):
            out[i] = [c, r]
    return out


def rows_used(source: BatchSource, num_micro_batches: int) -> list[int]:
    """Indices of the rows that the first ``num_micro_batches`` micro-batches of ``source`` read.

    The batch order is fully determined by (seed, epoch), so this is exactly what training
    (or evaluation) will consume, resumed or not; early stopping only reads fewer.
    """
    used: set[int] = set()
    for indices, _ in islice(iterate_batches(source.sampler, DataPosition(0, 0)), num_micro_batches):
        used.update(indices)
        if len(used) == len(source.rows):
            break
    return sorted(used)


def _load_or_compute_reference(ctx: StageContext, needed: dict[str, list[int]], splits: dict[str, list[dict]]) -> dict[str, dict[int, list[float]]]:
    """Reference log-probs (row index -> [chosen, rejected]) of the rows each split will use."""
    uri = join_uri(ctx.spec.output_uri, "reference")
    expected = ctx.stage_hash()
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
    reference = load_causal_lm(ctx.input("reference"), ctx.config.model, ctx.tokenizer, ctx.config.seed)
    reference = ctx.backend.prepare_frozen(reference)
    pad_id, device = ctx.tokenizer.pad_token_id, ctx.backend.device
    batch_size = cfg.micro_batch_size * cfg.accum_steps(ctx.backend.world_size)
    values: dict[str, dict[int, list[float]]] = {}
    for s, indices in needed.items():
        computed = reference_logprobs(reference, [splits[s][i] for i in indices], pad_id, batch_size, device)
        values[s] = dict(zip(indices, computed))
        log.info("reference log-probs: %d of %d %s pairs (the ones this run reads)", len(indices), len(splits[s]), s)
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


def run(spec: StageSpec) -> Manifest:
    """Train the DPO policy from the SFT model and commit it as an HF model directory.

    Reference log-probs are computed once, before training, for the pairs the run will read.
    """
    ctx = open_stage(spec)
    cfg, seed = ctx.config.dpo, ctx.config.seed
    pad_id, device = ctx.tokenizer.pad_token_id, ctx.backend.device
    splits = {s: load_rows(ctx, f"preference/{s}") for s in SPLITS}
    collate = partial(collate_with_reference, pad_id=pad_id)
    train = pair_source(splits["train"], pad_id, cfg.micro_batch_size, seed, device, collate=collate)
    held_out = pair_source(splits["eval"], pad_id, cfg.micro_batch_size, seed, device, shuffle=False, collate=collate)
    needed = {
        "train": rows_used(train, cfg.max_steps * cfg.accum_steps(ctx.backend.world_size) * ctx.backend.world_size),
        "eval": rows_used(held_out, min(cfg.eval_max_batches, len(held_out.sampler))),
    }
    reference = _load_or_compute_reference(ctx, needed, splits)
    for s, rows in splits.items():
        for i, (c, r) in reference[s].items():
            rows[i]["ref_chosen_logprobs"], rows[i]["ref_rejected_logprobs"] = c, r
    model = ctx.backend.wrap(load_causal_lm(ctx.input("model"), ctx.config.model, ctx.tokenizer, seed))
    metrics = train_stage(ctx, model, DPOObjective(cfg.beta, held_out, cfg.eval_max_batches), train, cfg)
    return commit_final(ctx, metrics, model=model)
