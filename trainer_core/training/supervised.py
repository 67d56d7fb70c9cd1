"""The supervised loop's objectives (SFT, reward model, DPO, KTO) and their batch sources.

Each objective implements :class:`~trainer_core.training.loop.Objective` from the pure losses of
:mod:`trainer_core.objectives` and the forwards of :mod:`trainer_core.modeling.forward`; the stages
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
)
from trainer_core.data.prepared import row_lengths
from trainer_core.errors import ConfigError
from trainer_core.modeling.forward import (
    implicit_reward_beta,
    masked_nll_sum,
    masked_token_logprobs,
    packed_sequence_scores,
    sequence_rewards,
)
from trainer_core.objectives.chunked import CHUNK_SIZE_TOKENS
from trainer_core.objectives.dpo import LENGTH_NORMALISED, REFERENCE_FREE, PairLogprobs, preference_loss
from trainer_core.objectives.kto import PER_LABEL_METRICS, kto_loss
from trainer_core.objectives.logprobs import sequence_logprobs, shift_mask
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

    The loss sum comes from :func:`~trainer_core.modeling.forward.masked_nll_sum` (the LM head on
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
            model, batch["input_ids"], batch.get("attention_mask"), batch["loss_mask"],
            chunk_size=self.chunk_size, position_ids=batch.get("position_ids"), counted_index=batch.get("counted_index"),
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


def num_pairs(batch: dict[str, Tensor]) -> int:
    """Preference pairs in a host or device batch, padded or packed (its shapes only: no sync)."""
    return batch["last_token_index"].shape[0] // 2 if is_packed(batch) else batch["chosen_input_ids"].shape[0]


def causal_source(
    rows: list[dict], pad_id: int, micro_batch_size: int, seed: int, device, shuffle=True, max_tokens: int | None = None
):
    """Batch source over prepared causal-LM rows (``input_ids``/``loss_mask``), packed when ``max_tokens`` is set."""
    lengths = row_lengths(rows, "input_ids")
    collate = partial(collate_causal if max_tokens is None else collate_causal_packed, pad_id=pad_id)
    return batch_source(rows, lengths, collate, micro_batch_size, seed, device, shuffle=shuffle, max_tokens=max_tokens)


def pair_source(
    rows: list[dict], pad_id: int, micro_batch_size: int, seed: int, device, shuffle=True, collate=None,
    max_tokens: int | None = None,
):
    """Batch source over prepared preference rows: bucketed by the longer of each pair, or (``max_tokens``
    set) packed by the tokens of both sides. ``collate`` replaces the default collation of the layout."""
    chosen, rejected = row_lengths(rows, "chosen_input_ids"), row_lengths(rows, "rejected_input_ids")
    lengths = np.maximum(chosen, rejected) if max_tokens is None else chosen + rejected
    collate = collate or partial(collate_pairs if max_tokens is None else collate_pairs_packed, pad_id=pad_id)
    return batch_source(rows, lengths, collate, micro_batch_size, seed, device, shuffle=shuffle, max_tokens=max_tokens)


def concat_pairs(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Stack chosen over rejected for one forward pass.

    Args:
        batch: ``chosen_*`` and ``rejected_*`` tensors, each [B, T] with a common T.

    Returns:
        (input_ids, attention_mask, loss_mask), each [2B, T]; rows [:B] are chosen.
    """
    return tuple(torch.cat([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]) for k in ("input_ids", "attention_mask", "loss_mask"))


def pair_rewards(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Rewards of chosen and rejected completions, each [B] float32, from one forward of the
    concatenated [2B, T] pairs or of a packed [1, S] batch, in the model's parameterisation
    (:func:`~trainer_core.modeling.forward.sequence_rewards`: a scalar head, or the implicit
    reward ``beta / |y| * log pi(y | x)``)."""
    pairs = num_pairs(batch)
    beta = implicit_reward_beta(model)
    if not is_packed(batch):
        input_ids, attention_mask, loss_mask = concat_pairs(batch)
        rewards = sequence_rewards(model, input_ids, attention_mask, loss_mask, batch.get("counted_index"))
    elif beta is None:
        rewards = packed_sequence_scores(model, batch["input_ids"], batch["position_ids"], batch["last_token_index"])
    else:
        chosen, rejected = pair_logprobs(model, batch)
        counted = batch["loss_mask"][0, 1:].float()  # as pair_logprobs sums: each sequence's tokens after its first
        lengths = torch.zeros(2 * pairs, device=counted.device).index_add(0, batch["sequence_ids"][0, 1:], counted)
        rewards = beta * torch.cat([chosen, rejected]) / lengths.clamp(min=1)
    return rewards[:pairs], rewards[pairs:]


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


def pair_logprobs(
    model: nn.Module, batch: dict[str, Tensor], chunk_size: int = CHUNK_SIZE_TOKENS
) -> tuple[Tensor, Tensor]:
    """Summed completion log-probs of chosen and rejected, each [B] float32, from one forward of the
    concatenated [2B, T] pairs or of a packed [1, S] batch (summed per sequence by ``sequence_ids``).

    ``model`` is an HF causal LM, plain or wrapped by a backend; its LM head runs on completion
    positions only, ``chunk_size`` tokens at a time (:func:`~trainer_core.modeling.forward.masked_token_logprobs`).
    """
    pairs = num_pairs(batch)
    if is_packed(batch):
        loss_mask = batch["loss_mask"]
        token_logprobs = masked_token_logprobs(
            model, batch["input_ids"], None, loss_mask, chunk_size=chunk_size, position_ids=batch["position_ids"],
            counted_index=batch.get("counted_index"),
        )  # [1, S - 1], 0 where not counted (each sequence's first token included)
        logprobs = torch.zeros(2 * pairs, dtype=token_logprobs.dtype, device=token_logprobs.device)
        logprobs = logprobs.index_add(0, batch["sequence_ids"][0, 1:], token_logprobs[0])
    else:
        logprobs = padded_sequence_logprobs(model, *concat_pairs(batch), batch.get("counted_index"), chunk_size)
    return logprobs[:pairs], logprobs[pairs:]


def padded_sequence_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor, counted_index: Tensor | None,
    chunk_size: int = CHUNK_SIZE_TOKENS,
) -> Tensor:
    """Summed log-probs [B] float32 of the counted tokens of each padded [B, T] row, the LM head
    on counted positions only (:func:`~trainer_core.modeling.forward.masked_token_logprobs`;
    ``counted_index`` the collated batch's, or None)."""
    token_logprobs = masked_token_logprobs(
        model, input_ids, attention_mask, loss_mask, chunk_size=chunk_size, counted_index=counted_index
    )
    return sequence_logprobs(token_logprobs, shift_mask(loss_mask))


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
        chunk_size: tokens per chunk of the LM head (:func:`pair_logprobs`).
        loss_type: ``dpo.loss_type`` (``sigmoid``: DPO).
        label_smoothing: cDPO / rDPO / SimPO label smoothing.
        gamma: SimPO's target margin.
        rpo_alpha: weight of each pair's chosen NLL per token, ``-pi_c / |c|``, added to its loss
            (RPO, Pang et al. 2024, "Iterative Reasoning Preference Optimization", eq. 1; logged
            as ``nll_loss``). TRL 1.16 (``loss_type="sft"``) averages it over the batch's chosen
            tokens; here over each pair's, then over pairs like the loss (equal for equal lengths).
    """

    def __init__(
        self, beta: float, eval_source: BatchSource, eval_max_batches: int, chunk_size: int = CHUNK_SIZE_TOKENS,
        *, loss_type: str = "sigmoid", label_smoothing: float = 0.0, gamma: float = 0.5, rpo_alpha: float = 0.0,
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
        reference = (batch["ref_chosen_logprobs"], batch["ref_rejected_logprobs"]) if self.needs_reference else (None, None)
        lengths = (batch["chosen_lengths"], batch["rejected_lengths"]) if self.loss_type in LENGTH_NORMALISED else (None, None)
        pairs = PairLogprobs(chosen, rejected, *reference, *lengths)
        losses, m = preference_loss(
            self.loss_type, pairs, beta=self.beta, label_smoothing=self.label_smoothing, gamma=self.gamma)
        sums = {k: v.sum() for k, v in m.items()}
        if self.rpo_alpha:
            nll = -chosen / batch["chosen_lengths"].float()
            losses = losses + self.rpo_alpha * nll
            sums["nll_loss"] = nll.detach().sum()
        sums["logps/chosen"] = chosen.detach().sum()
        sums["logps/rejected"] = rejected.detach().sum()
        return StepOutput(loss_sum=losses.sum(), metric_sums=sums)


def completion_logprobs(model: nn.Module, batch: dict[str, Tensor], prefix: str = "",
                        chunk_size: int = CHUNK_SIZE_TOKENS) -> Tensor:
    """:func:`padded_sequence_logprobs` of ``batch``'s ``<prefix>input_ids``, ``<prefix>attention_mask``,
    ``<prefix>loss_mask`` and ``<prefix>counted_index``: [B] float32."""
    keys = ("input_ids", "attention_mask", "loss_mask")
    return padded_sequence_logprobs(
        model, *(batch[f"{prefix}{k}"] for k in keys), batch.get(f"{prefix}counted_index"), chunk_size
    )


def kto_logprobs(model: nn.Module, batch: dict[str, Tensor], chunk_size: int = CHUNK_SIZE_TOKENS) -> tuple[Tensor, Tensor]:
    """Summed log-probs of a :func:`~trainer_core.data.batching.collate_kto` batch's completions
    and of its KL sequences' completions, each [B] float32 (two forwards)."""
    return completion_logprobs(model, batch, "", chunk_size), completion_logprobs(model, batch, "kl_", chunk_size)


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
        self, beta: float, eval_source: BatchSource, eval_max_batches: int, chunk_size: int = CHUNK_SIZE_TOKENS,
        *, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
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
            kl_logps = completion_logprobs(model, batch, "kl_", self.chunk_size)
        logps = completion_logprobs(model, batch, "", self.chunk_size)
        kl = (kl_logps - batch["ref_kl_logprobs"]).mean()
        if self.mean_over_ranks is not None:
            kl = self.mean_over_ranks(kl)
        losses, m = kto_loss(
            logps, batch["ref_logprobs"], kl_logps, batch["ref_kl_logprobs"], batch["label"], self.beta,
            self.desirable_weight, self.undesirable_weight, kl=kl,
        )
        return StepOutput(loss_sum=losses.sum(), metric_sums={k: v.sum() for k, v in m.items()})


def kto_source(rows: list[dict], pad_id: int, micro_batch_size: int, seed: int, device, shuffle=True) -> BatchSource:
    """Batch source over prepared KTO rows, bucketed by the longer of completion and KL sequence."""
    lengths = np.maximum(row_lengths(rows, "input_ids"), row_lengths(rows, "kl_input_ids"))
    return batch_source(rows, lengths, partial(collate_kto, pad_id=pad_id), micro_batch_size, seed, device,
                        shuffle=shuffle)


def _pair_length(row: dict) -> int:
    return len(row["chosen_input_ids"]) + len(row["rejected_input_ids"])


def _kto_length(row: dict) -> int:
    return len(row["input_ids"]) + len(row["kl_input_ids"])


@torch.no_grad()
def reference_logprobs(
    model: nn.Module, rows: list[dict], pad_id: int, batch_size: int, device, chunk_size: int = CHUNK_SIZE_TOKENS,
    *, kind: str = "pairs",
) -> list[list[float]]:
    """Summed completion log-probs under ``model`` for each row, in row order: [chosen, rejected]
    of preference pairs (``kind="pairs"``, :func:`pair_logprobs`) or [completion, KL completion]
    of KTO examples (``kind="kto"``, :func:`kto_logprobs`).

    ``model`` is the frozen reference, plain or as ``Backend.prepare_frozen`` placed it (an
    FSDP2 module, a ZeRO-3 engine); its LM head runs on completion positions only, in chunks
    of ``chunk_size`` tokens. Rows are batched in length order to limit padding; results are
    put back in row order.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in ("pairs", "kto"):
        raise ValueError(f"unknown reference log-prob kind {kind!r} (pairs or kto)")
    collate, forward, length = (
        (collate_pairs, pair_logprobs, _pair_length) if kind == "pairs" else (collate_kto, kto_logprobs, _kto_length)
    )
    order = sorted(range(len(rows)), key=lambda i: length(rows[i]))
    out: list[list[float]] = [[0.0, 0.0] for _ in rows]
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = {k: v.to(device) for k, v in collate([rows[i] for i in idx], pad_id).items()}
        first, second = forward(model, batch, chunk_size)
        for i, a, b in zip(idx, first.tolist(), second.tolist()):
            out[i] = [a, b]
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
