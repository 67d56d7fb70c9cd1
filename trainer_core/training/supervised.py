"""The supervised loop's objectives (SFT, reward model, DPO, KTO) and their batch sources.

Each objective implements :class:`~trainer_core.training.loop.Objective` from the pure losses of
:mod:`trainer_core.objectives` and the forwards of :mod:`trainer_core.modeling.forwards`; the stages
(``stages/sft.py``, ``pretrain.py``, ``reward_model.py``, ``dpo.py``, ``kto.py``) train with them and ``stages/evaluate.py``
scores held-out data with them.

Shape legend: B batch (sequences, or pairs for the pairwise objectives), T tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from itertools import islice

import numpy as np
import torch
from torch import Tensor, nn

from trainer_core.data.batching import (
    BucketedBatchSampler,
    DataPosition,
    PackedBatchSampler,
    collate_causal,
    collate_causal_packed,
    collate_kto,
    collate_pairs,
    collate_pairs_packed,
    is_packed,
    iterate_batches,
    num_pairs,
)
from trainer_core.data.prepared import row_lengths
from trainer_core.errors import ConfigError
from trainer_core.modeling.forwards.kernels import CHUNK_SIZE_TOKENS
from trainer_core.modeling.forwards.pairs import kto_inputs, pair_logprobs, pair_rewards
from trainer_core.modeling.forwards.token import masked_nll_sum, padded_sequence_logprobs
from trainer_core.objectives.dpo import LENGTH_NORMALISED, REFERENCE_FREE, PairLogprobs, preference_loss
from trainer_core.objectives.kto import PER_LABEL_METRICS, kto_loss
from trainer_core.objectives.reward import bradley_terry_loss
from trainer_core.training.loop import BatchSource, Objective, StepOutput


def batch_source(
    rows: Sequence[dict],
    lengths: Sequence[int] | np.ndarray,
    collate: Callable[[list[dict]], dict[str, Tensor]],
    micro_batch_size: int,
    seed: int,
    device: torch.device,
    shuffle: bool = True,
    max_tokens: int | None = None,
) -> BatchSource:
    """A deterministic :class:`BatchSource` over ``rows``: length-bucketed micro-batches of
    ``micro_batch_size`` rows, or (``max_tokens`` set) rows packed under that token budget.

    Raises:
        ConfigError: ``rows`` is empty, or a row is longer than ``max_tokens``.
    """
    if not len(rows):
        raise ConfigError("a training or eval split is empty: check the data config and max lengths")
    if max_tokens is None:
        sampler = BucketedBatchSampler(lengths, micro_batch_size, seed=seed, shuffle=shuffle)
    else:
        try:
            sampler = PackedBatchSampler(lengths, max_tokens, seed=seed, shuffle=shuffle)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return BatchSource(rows=rows, sampler=sampler, collate=collate, device=device)


def eval_batches(source: BatchSource, max_batches: int):
    """The first ``max_batches`` micro-batches of epoch 0 of an unshuffled source."""
    stream = source.stream(DataPosition(0, 0))
    count = min(max_batches, len(source.sampler))
    for _ in range(count):
        batch, _, _ = next(stream)
        yield batch


class SFTObjective(Objective):
    """Masked next-token NLL; the count unit is a completion token.

    The loss sum comes from :func:`~trainer_core.modeling.forwards.token.masked_nll_sum` (the LM head on
    completion positions only, in chunks or Liger's fused kernel), equal to
    ``sft_loss(masked_token_logprobs(...), mask)``.

    Args:
        eval_source: unshuffled held-out batches (``sft/eval``).
        eval_max_batches: cap on evaluated micro-batches.
        chunk_size: tokens per chunk of the LM head.
    """

    def __init__(self, eval_source: BatchSource, eval_max_batches: int, chunk_size: int = CHUNK_SIZE_TOKENS) -> None:
        self.eval_source = eval_source
        self.eval_max_batches = eval_max_batches
        self.chunk_size = chunk_size

    def count(self, batch: dict[str, Tensor]) -> int:
        return int(batch["loss_mask"][:, 1:].sum())

    def num_tokens(self, batch: dict[str, Tensor]) -> int:
        """Non-padding tokens of a host micro-batch (the loop calls it before the copy to the device)."""
        return num_tokens(batch, "")

    def step(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        loss_sum = masked_nll_sum(
            model,
            batch["input_ids"],
            batch.get("attention_mask"),
            batch["loss_mask"],
            chunk_size=self.chunk_size,
            position_ids=batch.get("position_ids"),
            counted_index=batch.get("counted_index"),
        )
        return StepOutput(loss_sum=loss_sum)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out loss per completion token and its perplexity ``exp(loss)``."""
        total, count = 0.0, 0
        for batch in eval_batches(self.eval_source, self.eval_max_batches):
            out = self.step(model, batch)
            total += float(out.loss_sum)
            count += self.count(batch)
        loss = total / max(count, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def num_tokens(batch: dict[str, Tensor], prefix: str) -> int:
    """Real (non-padding) tokens of a host batch: all of a packed one, else those of the attention masks.

    ``prefix`` is ``""`` for causal-LM batches and ``"pair"`` for preference pairs (both sides).
    """
    if is_packed(batch):
        return batch["input_ids"].numel()
    if prefix == "pair":
        return int(batch["chosen_attention_mask"].sum() + batch["rejected_attention_mask"].sum())
    return int(batch["attention_mask"].sum())


def causal_source(
    rows: list[dict], pad_id: int, micro_batch_size: int, seed: int, device, shuffle=True, max_tokens: int | None = None
):
    """Batch source over prepared causal-LM rows (``input_ids``/``loss_mask``), packed when ``max_tokens`` is set."""
    lengths = row_lengths(rows, "input_ids")
    collate = partial(collate_causal if max_tokens is None else collate_causal_packed, pad_id=pad_id)
    return batch_source(rows, lengths, collate, micro_batch_size, seed, device, shuffle=shuffle, max_tokens=max_tokens)


def pair_source(
    rows: list[dict],
    pad_id: int,
    micro_batch_size: int,
    seed: int,
    device,
    shuffle=True,
    collate=None,
    max_tokens: int | None = None,
):
    """Batch source over prepared preference rows: bucketed by the longer of each pair, or (``max_tokens``
    set) packed by the tokens of both sides. ``collate`` replaces the default collation of the layout."""
    chosen, rejected = row_lengths(rows, "chosen_input_ids"), row_lengths(rows, "rejected_input_ids")
    lengths = np.maximum(chosen, rejected) if max_tokens is None else chosen + rejected
    collate = collate or partial(collate_pairs if max_tokens is None else collate_pairs_packed, pad_id=pad_id)
    return batch_source(rows, lengths, collate, micro_batch_size, seed, device, shuffle=shuffle, max_tokens=max_tokens)


class RewardObjective(Objective):
    """Bradley-Terry loss; the count unit is a pair."""

    def __init__(self, eval_source: BatchSource, eval_max_batches: int) -> None:
        self.eval_source = eval_source
        self.eval_max_batches = eval_max_batches

    def count(self, batch: dict[str, Tensor]) -> int:
        return num_pairs(batch)

    def num_tokens(self, batch: dict[str, Tensor]) -> int:
        """Non-padding tokens of both sides of a host micro-batch (counted before the copy to the device)."""
        return num_tokens(batch, "pair")

    def step(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        chosen, rejected = pair_rewards(model, batch)
        losses, m = bradley_terry_loss(chosen, rejected)
        sums = {"accuracy": m["accuracies"].sum(), "margin": m["margins"].sum()}
        return StepOutput(loss_sum=losses.sum(), metric_sums=sums)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out mean loss, pairwise accuracy (r_chosen > r_rejected) and mean margin."""
        return evaluate_pairs(self, model, self.eval_source, self.eval_max_batches)


def evaluate_pairs(objective, model: nn.Module, source: BatchSource, max_batches: int) -> dict[str, float]:
    """Mean loss and per-unit metrics (pairs, or KTO's examples) of ``objective`` over the first
    ``max_batches`` batches; a metric the objective lists in ``metric_denominators`` is averaged
    over that count metric instead."""
    totals: dict[str, float] = {"loss": 0.0}
    count = 0
    for batch in eval_batches(source, max_batches):
        out = objective.step(model, batch)
        totals["loss"] += float(out.loss_sum)
        for k, v in out.metric_sums.items():
            totals[k] = totals.get(k, 0.0) + float(v)
        count += objective.count(batch)
    per = objective.metric_denominators
    return {k: v / max(totals[per[k]] if k in per else count, 1) for k, v in totals.items()}


def collate_with_reference(rows: list[dict], pad_id: int, packed: bool = False) -> dict[str, Tensor]:
    """:func:`collate_pairs` (``packed``: :func:`collate_pairs_packed`) plus ``chosen_lengths`` /
    ``rejected_lengths`` [B] float32 (completion tokens whose log-probs are summed) and, when the
    rows carry them, ``ref_chosen_logprobs`` / ``ref_rejected_logprobs`` [B] float32."""
    batch = (collate_pairs_packed if packed else collate_pairs)(rows, pad_id)
    for side in ("chosen", "rejected"):
        batch[f"{side}_lengths"] = torch.tensor([sum(r[f"{side}_loss_mask"][1:]) for r in rows], dtype=torch.float32)
    for key in ("ref_chosen_logprobs", "ref_rejected_logprobs"):
        if rows and key in rows[0]:
            batch[key] = torch.tensor([r[key] for r in rows], dtype=torch.float32)
    return batch


class _OfflinePreferenceObjective(Objective):
    """What DPO's and KTO's objectives share: beta, the held-out source and the LM head's chunk
    size; their evaluation is :func:`evaluate_pairs` over the held-out source."""

    def __init__(self, beta: float, eval_source: BatchSource, eval_max_batches: int, chunk_size: int) -> None:
        self.beta = beta
        self.eval_source = eval_source
        self.eval_max_batches = eval_max_batches
        self.chunk_size = chunk_size

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out mean loss and the objective's per-unit metrics."""
        return evaluate_pairs(self, model, self.eval_source, self.eval_max_batches)


class DPOObjective(_OfflinePreferenceObjective):
    """A preference loss of the DPO family (:func:`~trainer_core.objectives.dpo.preference_loss`);
    the count unit is a pair. Metrics use TRL's names.

    Args:
        beta: DPO's beta (each loss's scale; ORPO's lambda).
        eval_source: unshuffled held-out pairs, with their reference log-probs unless the loss
            is reference-free.
        eval_max_batches: cap on evaluated micro-batches.
        chunk_size: tokens per chunk of the LM head (:func:`~trainer_core.modeling.forwards.pairs.pair_logprobs`).
        loss_type: ``dpo.loss_type`` (``sigmoid``: DPO).
        label_smoothing: cDPO / rDPO / SimPO label smoothing.
        gamma: SimPO's target margin.
        rpo_alpha: weight of each pair's chosen NLL per token, ``-pi_c / |c|``, added to its loss
            (RPO, Pang et al. 2024, "Iterative Reasoning Preference Optimization", eq. 1; logged
            as ``nll_loss``). TRL 1.16 (``loss_type="sft"``) averages it over the batch's chosen
            tokens; here over each pair's, then over pairs like the loss (equal for equal lengths).
    """

    def __init__(
        self,
        beta: float,
        eval_source: BatchSource,
        eval_max_batches: int,
        chunk_size: int = CHUNK_SIZE_TOKENS,
        *,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        gamma: float = 0.5,
        rpo_alpha: float = 0.0,
    ) -> None:
        super().__init__(beta, eval_source, eval_max_batches, chunk_size)
        self.loss_type, self.label_smoothing, self.gamma, self.rpo_alpha = loss_type, label_smoothing, gamma, rpo_alpha

    @property
    def needs_reference(self) -> bool:
        """False for the reference-free losses (SimPO, ORPO)."""
        return self.loss_type not in REFERENCE_FREE

    def count(self, batch: dict[str, Tensor]) -> int:
        return num_pairs(batch)

    def num_tokens(self, batch: dict[str, Tensor]) -> int:
        """Non-padding tokens of both sides of a host micro-batch (counted before the copy to the device)."""
        return num_tokens(batch, "pair")

    def step(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        chosen, rejected = pair_logprobs(model, batch, self.chunk_size)
        reference = (
            (batch["ref_chosen_logprobs"], batch["ref_rejected_logprobs"]) if self.needs_reference else (None, None)
        )
        lengths = (
            (batch["chosen_lengths"], batch["rejected_lengths"])
            if self.loss_type in LENGTH_NORMALISED
            else (None, None)
        )
        pairs = PairLogprobs(chosen, rejected, *reference, *lengths)
        losses, m = preference_loss(
            self.loss_type, pairs, beta=self.beta, label_smoothing=self.label_smoothing, gamma=self.gamma
        )
        sums = {k: v.sum() for k, v in m.items()}
        if self.rpo_alpha:
            nll = -chosen / batch["chosen_lengths"].float()
            losses = losses + self.rpo_alpha * nll
            sums["nll_loss"] = nll.detach().sum()
        sums["logps/chosen"] = chosen.detach().sum()
        sums["logps/rejected"] = rejected.detach().sum()
        return StepOutput(loss_sum=losses.sum(), metric_sums=sums)


class KTOObjective(_OfflinePreferenceObjective):
    """The KTO loss (:func:`~trainer_core.objectives.kto.kto_loss`); the count unit is an example.

    The policy's log-probs of the mismatched KL sequences are computed without gradient (TRL's
    ``_compute_kl_logps``); the reference's come precomputed in the batch (``ref_logprobs``,
    ``ref_kl_logprobs``). Metrics use TRL's names; ``rewards/*`` and ``logps/*`` are means over
    the desirable (``chosen``) or undesirable (``rejected``) examples of the step.

    Args:
        beta: KTO's beta.
        eval_source: unshuffled held-out examples with their reference log-probs.
        eval_max_batches: cap on evaluated micro-batches.
        chunk_size: tokens per chunk of the LM head.
        desirable_weight: lambda_D.
        undesirable_weight: lambda_U.
        mean_over_ranks: ``scalar -> its mean over the data-parallel ranks`` (a collective every
            rank runs in every step and evaluation), for the KL estimate, as TRL gathers it;
            None: this process's micro-batch alone (one device).
    """

    metric_denominators = PER_LABEL_METRICS

    def __init__(
        self,
        beta: float,
        eval_source: BatchSource,
        eval_max_batches: int,
        chunk_size: int = CHUNK_SIZE_TOKENS,
        *,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        mean_over_ranks: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        super().__init__(beta, eval_source, eval_max_batches, chunk_size)
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight
        self.mean_over_ranks = mean_over_ranks

    def count(self, batch: dict[str, Tensor]) -> int:
        return batch["label"].shape[0]

    def num_tokens(self, batch: dict[str, Tensor]) -> int:
        """Non-padding tokens of the completions and the KL sequences of a host micro-batch."""
        return int(batch["attention_mask"].sum() + batch["kl_attention_mask"].sum())

    def step(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        with torch.no_grad():
            kl_logps = padded_sequence_logprobs(model, *kto_inputs(batch, "kl_"), self.chunk_size)
        logps = padded_sequence_logprobs(model, *kto_inputs(batch, ""), self.chunk_size)
        kl = (kl_logps - batch["ref_kl_logprobs"]).mean()
        if self.mean_over_ranks is not None:
            kl = self.mean_over_ranks(kl)
        losses, m = kto_loss(
            logps,
            batch["ref_logprobs"],
            kl_logps,
            batch["ref_kl_logprobs"],
            batch["label"],
            self.beta,
            self.desirable_weight,
            self.undesirable_weight,
            kl=kl,
        )
        return StepOutput(loss_sum=losses.sum(), metric_sums={k: v.sum() for k, v in m.items()})


def kto_source(rows: list[dict], pad_id: int, micro_batch_size: int, seed: int, device, shuffle=True) -> BatchSource:
    """Batch source over prepared KTO rows, bucketed by the longer of completion and KL sequence."""
    lengths = np.maximum(row_lengths(rows, "input_ids"), row_lengths(rows, "kl_input_ids"))
    return batch_source(
        rows, lengths, partial(collate_kto, pad_id=pad_id), micro_batch_size, seed, device, shuffle=shuffle
    )


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
