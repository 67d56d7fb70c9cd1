"""SFT stage: causal-LM loss on completion tokens of the prepared SFT split.

Shape legend: B batch, T tokens.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import Tensor, nn

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.data.batching import collate_causal
from trainer_core.loop import BatchSource, StepOutput
from trainer_core.models import load_causal_lm
from trainer_core.forward import masked_token_logprobs
from trainer_core.objectives.logprobs import shift_mask
from trainer_core.objectives.sft import sft_loss
from trainer_core.spec import StageSpec
from trainer_core.stages.common import batch_source, commit_final, eval_batches, load_rows, open_stage, train_stage


class SFTObjective:
    """Masked next-token NLL; the count unit is a completion token.

    Args:
        eval_source: unshuffled held-out batches (``sft/eval``).
        eval_max_batches: cap on evaluated micro-batches.
    """

    def __init__(self, eval_source: BatchSource, eval_max_batches: int) -> None:
        self.eval_source = eval_source
        self.eval_max_batches = eval_max_batches

    def count(self, batch: dict[str, Tensor]) -> int:
        return int(batch["loss_mask"][:, 1:].sum())

    def step(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        logprobs = masked_token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
        loss_sum, _ = sft_loss(logprobs, shift_mask(batch["loss_mask"]))
        return StepOutput(loss_sum=loss_sum, num_tokens=int(batch["attention_mask"].sum()))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out loss per completion token and its perplexity ``exp(loss)``."""
        total, count = 0.0, 0
        for batch in eval_batches(self.eval_source, self.eval_max_batches):
            out = self.step(model, batch)
            total += float(out.loss_sum)
            count += self.count(batch)
        loss = total / max(count, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def causal_source(rows: list[dict], pad_id: int, micro_batch_size: int, seed: int, device, shuffle=True):
    """Batch source over prepared causal-LM rows (``input_ids``/``loss_mask``)."""
    lengths = [len(r["input_ids"]) for r in rows]
    collate = partial(collate_causal, pad_id=pad_id)
    return batch_source(rows, lengths, collate, micro_batch_size, seed, device, shuffle=shuffle)


def run(spec: StageSpec) -> Manifest:
    """Train the SFT policy and commit it as an HF model directory."""
    ctx = open_stage(spec)
    cfg, seed = ctx.config.sft, ctx.config.seed
    pad_id, device = ctx.tokenizer.pad_token_id, ctx.backend.device
    train = causal_source(load_rows(ctx, "sft/train"), pad_id, cfg.micro_batch_size, seed, device)
    held_out = causal_source(load_rows(ctx, "sft/eval"), pad_id, cfg.micro_batch_size, seed, device, shuffle=False)
    model = ctx.backend.wrap(load_causal_lm(ctx.input("model"), ctx.config.model, ctx.tokenizer, seed))
    torch.manual_seed(seed)
    metrics = train_stage(ctx, model, SFTObjective(held_out, cfg.eval_max_batches), train, cfg)
    return commit_final(ctx, metrics, model=model)
