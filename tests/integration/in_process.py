"""Training stages built in-process, for the micro-batch x accumulation checks
(``test_stage_outputs.py``, ``test_backends.py`` and its ``fixtures/backend_accum.py``): a stage's
model factory, objective, rows and collate from the tiny pipeline's prepared data, and a sampler
that cuts each micro-batch of the real one into consecutive pieces.
"""

from __future__ import annotations

from functools import partial

import torch

from tests.integration.helpers import TinyPipeline
from trainer_core.config import TrainStageConfig
from trainer_core.data.batching import BucketedBatchSampler, collate_causal, collate_pairs
from trainer_core.data.prepared import load_split, load_tokenizer_from
from trainer_core.modeling.forwards.pairs import reference_logprobs
from trainer_core.modeling.models import load_causal_lm, load_reward_model
from trainer_core.training.supervised import (
    DPOObjective,
    RewardObjective,
    SFTObjective,
    causal_source,
    collate_with_reference,
    pair_source,
)


class SplitSampler:
    """Each micro-batch of ``inner`` cut into ``parts`` consecutive equal pieces.

    With ``grad_accum_steps=parts`` an optimizer step then sees exactly the examples of one
    ``inner`` micro-batch, which the stock sampler does not guarantee across micro-batch sizes.
    Duck-types :class:`~trainer_core.data.batching.BucketedBatchSampler` (``len``, ``batches``).
    """

    def __init__(self, inner: BucketedBatchSampler, parts: int) -> None:
        assert inner.drop_last and inner.micro_batch_size % parts == 0
        self.inner, self.parts = inner, parts
        self.size = inner.micro_batch_size // parts

    def __len__(self) -> int:
        return len(self.inner) * self.parts

    def batches(self, epoch: int) -> list[list[int]]:
        return [b[i : i + self.size] for b in self.inner.batches(epoch) for i in range(0, len(b), self.size)]


def accumulation_run(
    lengths: list[int], examples_per_step: int, grad_accum_steps: int, steps: int
) -> tuple[BucketedBatchSampler | SplitSampler, TrainStageConfig]:
    """The sampler and stage config of ``steps`` optimizer steps of ``examples_per_step`` examples
    each (on one rank), cut into ``grad_accum_steps`` micro-batches (:class:`SplitSampler`), so that
    every cut makes the same steps: ``lengths`` the rows', lr 3e-3 after 2 warmup steps, no
    evaluation, no checkpoint within the run, saves synchronous."""
    inner = BucketedBatchSampler(lengths, examples_per_step, seed=0, drop_last=True)
    sampler = inner if grad_accum_steps == 1 else SplitSampler(inner, grad_accum_steps)
    cfg = TrainStageConfig(
        max_steps=steps,
        micro_batch_size=examples_per_step // grad_accum_steps,
        grad_accum_steps=grad_accum_steps,
        learning_rate=3e-3,
        warmup_steps=2,
        eval_every=1000,
        save_every=1000,
        async_save=False,
    )
    return sampler, cfg


def stage_parts(stage: str, pipeline: TinyPipeline):
    """(model factory, objective, train rows, row lengths, collate) of ``stage``, built in-process."""
    data, config, cpu = pipeline.data_uri, pipeline.config, torch.device("cpu")
    tokenizer = load_tokenizer_from(data)
    pad_id = tokenizer.pad_token_id
    if stage == "sft":
        rows = load_split(data, "sft/train")
        held_out = causal_source(load_split(data, "sft/eval"), pad_id, 4, 0, cpu, shuffle=False)
        make = partial(load_causal_lm, "init", config.model, tokenizer, config.seed)
        lengths = [len(r["input_ids"]) for r in rows]
        return make, SFTObjective(held_out, 1), rows, lengths, partial(collate_causal, pad_id=pad_id)
    rows = load_split(data, "preference/train")
    lengths = [max(len(r["chosen_input_ids"]), len(r["rejected_input_ids"])) for r in rows]
    eval_rows = load_split(data, "preference/eval")
    if stage == "reward_model":
        held_out = pair_source(eval_rows, pad_id, 4, 0, cpu, shuffle=False)
        make = partial(load_reward_model, "init", config.model, tokenizer, config.seed)
        return make, RewardObjective(held_out, 1), rows, lengths, partial(collate_pairs, pad_id=pad_id)
    make = partial(load_causal_lm, "init", config.model, tokenizer, config.seed)
    reference = make().eval()
    for split in (rows, eval_rows):  # policy = reference at the start: DPO loss log 2
        for row, (chosen, rejected) in zip(split, reference_logprobs(reference, split, pad_id, 16, cpu)):
            row["ref_chosen_logprobs"], row["ref_rejected_logprobs"] = chosen, rejected
    collate = partial(collate_with_reference, pad_id=pad_id)
    held_out = pair_source(eval_rows, pad_id, 4, 0, cpu, shuffle=False, collate=collate)
    return make, DPOObjective(0.1, held_out, 1), rows, lengths, collate
