"""Whole-trainer parity with TRL 1.16 as the oracle: SFT, reward model, DPO (every loss type both
have) and KTO, trained for 20 steps by the project's loop and by TRL's trainer from the same
weights on the same rows in the same order (``tests/parity/trl_oracle.py`` says how, and why the
tolerance is what it is).

Each test compares, step by step, the training loss, the gradient norm before clipping and the
learning rate, then the objective's own per-step metrics where TRL logs the same quantity
(DPO's and KTO's rewards and log-probs, the reward model's accuracy and margin, KTO's KL
estimate), the held-out metrics after the last step (``evaluate()`` against the loop's final
evaluation) and the final weights. Where the project departs from TRL on purpose (SFT's held-out
loss, IPO's reward metrics, KTO's held-out per-label metrics), the test computes each side's
quantity from the other's numbers, so both definitions are still checked to the same tolerance,
asserts that the two definitions differ at these rows (so the pin is not vacuous), and its
docstring says why.

The rows of the table in bench/README.md ("Parity with TRL") are these comparisons; run
``pytest tests/parity`` (without ``-n``: the table is printed in the terminal
summary) to get them.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL (the dev extra's trl==1.16.0) is the oracle of these parity tests")
datasets = pytest.importorskip("datasets", reason="TRL's trainers read datasets.Dataset")

from tests.parity.trl_oracle import (  # noqa: E402
    CPU,
    LOGP_ATOL,
    MICRO_BATCH,
    PAD_ID,
    RTOL,
    SEED,
    STEPS,
    Rows,
    check_close,
    check_departure,
    check_same_optimizer,
    check_weights,
    copy_of,
    drawn_batches,
    drawn_order,
    lr_zero_steps,
    pretokenised,
    set_kl_completions,
    stage_config,
    tiny_model_config,
    train_project,
    train_trl,
    trl_settings,
    word_tokenizer,
)
from trainer_core.config.stages import (  # noqa: E402
    DPOConfig,
    KTOConfig,
    RewardModelConfig,
    SFTConfig,
)
from trainer_core.modeling.forwards.pairs import reference_logprobs  # noqa: E402
from trainer_core.modeling.models import load_causal_lm, load_reward_model  # noqa: E402
from trainer_core.training.supervised import (  # noqa: E402
    DPOObjective,
    KTOObjective,
    RewardObjective,
    SFTObjective,
    causal_source,
    collate_with_reference,
    eval_batches,
    kto_source,
    pair_source,
)

TRL_VERSION = "1.16.0"
STEPS_ALL = f"1-{STEPS}"
TASK_TOKENS, OTHER_TOKENS = range(2, 14), range(48, 96)
"""SFT: the training completions' tokens, and tokens no training completion has."""
WEIGHT_ATOL = RTOL * 0.01
"""Absolute floor of the final-weights comparison: a weight near 0 is held to the relative bar of a
typical weight (0.01, half the initialisation's standard deviation 0.02); the measured worst
element difference is in bench/README.md."""


def test_trl_is_the_version_these_tests_were_written_against():
    """The oracle is TRL 1.16 (pyproject's dev extra pins it): the trainers' internals read here
    (``_prepare_dataset``, the collators' columns, the metric names) are that version's."""
    assert trl.__version__ == TRL_VERSION


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One compute thread for the module (restored after): the tiny model's kernels gain nothing
    from more, and a second thread contending with other work on a 2-core machine slows every step
    several times over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


@pytest.fixture(scope="module")
def causal_lm(tokenizer):
    """The initial policy of every causal-LM run (both sides copy it): the project's
    ``load_causal_lm("init", ...)`` of the suite's tiny model, seeded."""
    return load_causal_lm("init", tiny_model_config(), tokenizer, SEED)


def dataset(records: list[dict]):
    return datasets.Dataset.from_list(records)


def flat(batches) -> list[int]:
    return [i for batch in batches for i in batch]


def check_steps(
    objective: str,
    ours,
    theirs,
    keys: dict[str, str],
    *,
    atol: dict[str, float] | None = None,
    first: dict[str, int] | None = None,
) -> None:
    """Per-step comparison of ``keys`` (the project's ``train/<key>`` -> TRL's log key) over the steps
    TRL logged the key in (KTO logs a label's rewards only in steps whose batch has that label),
    from step ``first[key]`` (default 1) on."""
    atol, first = atol or {}, first or {}
    for ours_key, trl_key in keys.items():
        start = first.get(ours_key, 1)
        steps = [s for s in range(start, STEPS + 1) if trl_key in theirs.steps[s]]
        assert len(steps) >= STEPS // 2, (objective, trl_key, steps)
        label = f"{steps[0]}-{steps[-1]}" if len(steps) == steps[-1] - steps[0] + 1 else f"{len(steps)} of {STEPS_ALL}"
        check_close(
            objective,
            f"train {trl_key}",
            [ours.logged[s][f"train/{ours_key}"] for s in steps],
            [theirs.steps[s][trl_key] for s in steps],
            steps=label,
            atol=atol.get(ours_key, 0.0),
        )


def check_eval(objective: str, ours, theirs, keys: dict[str, str], *, atol: dict[str, float] | None = None) -> None:
    """The held-out metrics after the last step: the project's ``eval/<key>`` -> TRL's ``eval_<key>``."""
    atol = atol or {}
    final = ours.final_eval()
    for ours_key, trl_key in keys.items():
        check_close(
            objective,
            f"eval {trl_key}",
            [final[ours_key]],
            [theirs.eval[trl_key]],
            steps="eval",
            atol=atol.get(ours_key, 0.0),
        )


def check_optimisation(objective: str, ours, theirs) -> None:
    """What every objective shares: the same optimizer, and per step the loss, the gradient norm
    before clipping (``clip_grad_norm_``'s return on both sides) and the learning rate."""
    check_same_optimizer(ours, theirs.trainer)
    check_steps(objective, ours, theirs, {"loss": "loss", "grad_norm": "grad_norm", "lr": "learning_rate"})


# -- SFT --------------------------------------------------------------------------------------


def test_sft_matches_sfttrainer(tokenizer, causal_lm, tmp_path):
    """SFT (``SFTObjective``: NLL of the completion tokens, summed over the step and divided by its
    completion tokens) against ``trl.SFTTrainer`` with ``completion_only_loss`` on pre-tokenised
    ``input_ids`` + ``completion_mask`` rows (``SFTTrainer.compute_loss``: the summed NLL divided by
    ``num_items_in_batch``, the step's counted tokens).

    Departure pinned: the held-out loss. The project's is per completion token over every evaluated
    batch (``SFTObjective.evaluate``: sum / count, like its training loss, so it does not depend on
    how the held-out rows are cut into batches). TRL's ``evaluate()`` averages each batch's token
    mean, weighted by the batch's rows (transformers' ``evaluation_loop`` repeats a batch's loss
    once per row). Both are checked: the per-batch token means of the two sides against each
    other, the project's loss against the token-weighted mean of TRL's per-batch losses, TRL's
    ``eval_loss`` against the row-weighted mean of the project's per-batch losses; and the two
    definitions differ at these rows (two held-out batches of unequal token counts), so the check
    is not vacuous.
    """
    builder = Rows(1)
    rows = builder.sft(40, ids=TASK_TOKENS)
    # held out: 4 short rows of the trained tokens, then 4 long rows of others; the unshuffled
    # source's batches are length-sorted, so these are its two batches, of unequal token counts and
    # unequal losses (the trained tokens have become likelier, the others less likely)
    eval_rows = builder.sft(4, ids=TASK_TOKENS, low=2, high=3) + builder.sft(4, ids=OTHER_TOKENS, low=10, high=12)
    cfg = stage_config(SFTConfig, learning_rate=3e-3)
    train = causal_source(rows, PAD_ID, cfg.micro_batch_size, SEED, CPU)
    held_out = causal_source(eval_rows, PAD_ID, cfg.micro_batch_size, SEED, CPU, shuffle=False)
    objective = SFTObjective(held_out, cfg.eval_max_batches)
    ours = train_project(copy_of(causal_lm), objective, train, cfg, tmp_path)

    def records(source_rows, order):
        return dataset(
            [{"input_ids": source_rows[i]["input_ids"], "completion_mask": source_rows[i]["loss_mask"]} for i in order]
        )

    held_out_batches = list(held_out.sampler.batches(0))
    assert sorted(map(sorted, held_out_batches)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    args = trl.SFTConfig(**trl_settings(cfg, tmp_path), completion_only_loss=True)
    trainer = trl.SFTTrainer(
        model=copy_of(causal_lm),
        args=args,
        train_dataset=records(rows, drawn_order(train, STEPS)),
        eval_dataset=records(eval_rows, flat(held_out_batches)),
        processing_class=tokenizer,
    )
    theirs = train_trl(trainer)

    check_optimisation("SFT", ours, theirs)
    check_weights("SFT", ours.model, trainer.model, WEIGHT_ATOL)

    # the held-out loss, batch by batch: TRL's evaluate() of each batch alone is that batch's token mean
    trl_batch_losses = [
        trainer.evaluate(eval_dataset=records(eval_rows, batch))["eval_loss"] for batch in held_out_batches
    ]
    ours.model.eval()
    with torch.no_grad():
        sums_counts = [
            (float(objective.step(ours.model, batch).loss_sum), objective.count(batch))
            for batch in eval_batches(held_out, cfg.eval_max_batches)
        ]
    ours_batch_losses = [s / c for s, c in sums_counts]
    check_close(
        "SFT", "eval loss of each held-out batch (token mean)", ours_batch_losses, trl_batch_losses, steps="eval"
    )
    tokens = [c for _, c in sums_counts]
    sizes = [len(batch) for batch in held_out_batches]
    per_token = sum(t * loss for t, loss in zip(tokens, trl_batch_losses)) / sum(tokens)
    per_row = sum(n * loss for n, loss in zip(sizes, ours_batch_losses)) / sum(sizes)
    check_close(
        "SFT",
        "eval loss, the project's: per token (from TRL's batches)",
        [ours.final_eval()["loss"]],
        [per_token],
        steps="eval",
    )
    check_close(
        "SFT",
        "eval_loss, TRL's: batch means by rows (from the project's batches)",
        [per_row],
        [theirs.eval["loss"]],
        steps="eval",
    )
    check_departure(
        "SFT", "eval loss per token vs TRL's batch means by rows (departure)", per_token, per_row, steps="eval"
    )


# -- reward model -----------------------------------------------------------------------------


def test_reward_model_matches_rewardtrainer(tokenizer, tmp_path):
    """The reward model (``RewardObjective``: Bradley-Terry ``-log sigmoid(r_c - r_r)`` per pair, a
    reward being the sequence-classification head's score of the last real token) against
    ``trl.RewardTrainer`` on pre-tokenised ``chosen_ids`` / ``rejected_ids`` (``compute_loss``:
    the same loss, its mean over the batch's pairs; no margin, no centring). Per step: loss,
    gradient norm, learning rate, accuracy (r_c > r_r) and margin; held out: loss, accuracy and
    margin (TRL averages each batch's mean; the project pools the pairs: equal here, every
    held-out batch has the same number of pairs)."""
    model = load_reward_model("init", tiny_model_config(), tokenizer, SEED)
    rows, eval_rows = Rows(3).pairs(40), Rows(4).pairs(8)
    cfg = stage_config(RewardModelConfig, learning_rate=3e-3)
    train = pair_source(rows, PAD_ID, cfg.micro_batch_size, SEED, CPU)
    held_out = pair_source(eval_rows, PAD_ID, cfg.micro_batch_size, SEED, CPU, shuffle=False)
    ours = train_project(copy_of(model), RewardObjective(held_out, cfg.eval_max_batches), train, cfg, tmp_path)

    def records(source_rows, order):
        return dataset(
            [
                {"chosen_ids": source_rows[i]["chosen_input_ids"], "rejected_ids": source_rows[i]["rejected_input_ids"]}
                for i in order
            ]
        )

    trainer = trl.RewardTrainer(
        model=copy_of(model),
        args=trl.RewardConfig(**trl_settings(cfg, tmp_path)),
        train_dataset=records(rows, drawn_order(train, STEPS)),
        eval_dataset=records(eval_rows, flat(held_out.sampler.batches(0))),
        processing_class=tokenizer,
    )
    theirs = train_trl(trainer)

    check_optimisation("reward model", ours, theirs)
    check_steps("reward model", ours, theirs, {"accuracy": "accuracy", "margin": "margin"})
    check_eval("reward model", ours, theirs, {"loss": "loss", "accuracy": "accuracy", "margin": "margin"})
    check_weights("reward model", ours.model, trainer.model, WEIGHT_ATOL)


# -- DPO --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def preference_rows(causal_lm):
    """Train and held-out pairs with the reference's log-probs precomputed by the project's
    ``reference_logprobs`` (as ``stages/reference.py`` does: batches of ``micro_batch_size``
    pairs in length order), the reference being the initial policy."""
    rows, eval_rows = Rows(5).pairs(40), Rows(6).pairs(8)
    reference = copy_of(causal_lm).eval()
    for split in (rows, eval_rows):
        for row, (chosen, rejected) in zip(split, reference_logprobs(reference, split, PAD_ID, MICRO_BATCH, CPU)):
            row["ref_chosen_logprobs"], row["ref_rejected_logprobs"] = chosen, rejected
    return rows, eval_rows


DPO_LOSSES = [
    pytest.param("sigmoid", {}, id="sigmoid"),
    pytest.param("ipo", {}, id="ipo"),
    pytest.param("hinge", {}, id="hinge"),
    pytest.param("robust", {"label_smoothing": 0.1}, id="robust"),
]
"""The loss types of ``dpo.loss_type`` that TRL's DPOTrainer has too (``trl/trainer/dpo_trainer.py``,
``_compute_loss``). The project's other two, SimPO and ORPO, are CPOTrainer's and ORPOTrainer's
in TRL (``trl.experimental``); their losses are checked against those in
``tests/unit/test_preference_losses.py``. cDPO (sigmoid with label smoothing) has no DPOTrainer
counterpart (TRL 1.x's sigmoid loss ignores ``label_smoothing``)."""


REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


@pytest.mark.parametrize("loss_type, settings", DPO_LOSSES)
def test_dpo_matches_dpotrainer(tokenizer, causal_lm, preference_rows, tmp_path, monkeypatch, loss_type, settings):
    """DPO (``DPOObjective`` with ``loss_type``) against ``trl.DPOTrainer`` with the same loss type,
    beta and label smoothing, its reference a copy of the initial policy computed live in every
    step (the project's reference log-probs are computed once before training: the reference is
    frozen, so the values are the same up to rounding).

    Per step: loss, gradient norm, learning rate, ``rewards/chosen`` and ``rewards/rejected``
    (``beta`` times the policy-reference log-ratio of the completion), ``rewards/margins``,
    ``rewards/accuracies`` and the summed log-probs ``logps/chosen`` / ``logps/rejected``; held out:
    the same after the last step (per-pair means of equal-sized batches, so TRL's mean of batch
    means is the project's pooled mean). The accuracies are compared from the first step whose
    policy differs from the reference: before it every margin is 0 up to rounding, and which side
    rounds above decides ``r_c > r_r``.

    Departure pinned (IPO): the reward metrics. The project reports IPO's rewards on the
    length-averaged log-ratios its loss is a function of (``trainer_core/objectives/dpo.py``,
    ``ipo_loss``: "rewards ``beta`` times the averaged log-ratios", so the margin is the one the
    loss drives to ``1/2``); TRL logs ``beta`` times the summed log-ratios for every loss type
    (``DPOTrainer._compute_loss``: ``chosen_rewards = self.beta * chosen_logratios``). The loss,
    gradients and log-probs agree as for the other losses; the four reward metrics are checked
    through the per-pair log-probs the project's loss received (recorded by wrapping
    ``preference_loss``): TRL's values against their summed-ratio means, the project's against
    their averaged-ratio means.
    """
    calls = record_preference_loss(monkeypatch)
    rows, eval_rows = preference_rows
    cfg = stage_config(DPOConfig, learning_rate=3e-3, beta=0.1, loss_type=loss_type, **settings)
    collate = partial(collate_with_reference, pad_id=PAD_ID)
    train = pair_source(rows, PAD_ID, cfg.micro_batch_size, SEED, CPU, collate=collate)
    held_out = pair_source(eval_rows, PAD_ID, cfg.micro_batch_size, SEED, CPU, shuffle=False, collate=collate)
    objective = DPOObjective(
        cfg.beta,
        held_out,
        cfg.eval_max_batches,
        loss_type=cfg.loss_type,
        label_smoothing=cfg.label_smoothing,
        gamma=cfg.simpo_gamma,
    )
    ours = train_project(copy_of(causal_lm), objective, train, cfg, tmp_path)

    def records(source_rows, order):
        return dataset(
            [
                {
                    "prompt_ids": source_rows[i]["prompt"],
                    "chosen_ids": source_rows[i]["chosen"],
                    "rejected_ids": source_rows[i]["rejected"],
                }
                for i in order
            ]
        )

    args = trl.DPOConfig(
        **trl_settings(cfg, tmp_path), beta=cfg.beta, loss_type=[loss_type], label_smoothing=cfg.label_smoothing
    )
    trainer = pretokenised(trl.DPOTrainer)(
        model=copy_of(causal_lm),
        ref_model=copy_of(causal_lm),
        args=args,
        train_dataset=records(rows, drawn_order(train, STEPS)),
        eval_dataset=records(eval_rows, flat(held_out.sampler.batches(0))),
        processing_class=tokenizer,
    )
    theirs = train_trl(trainer)

    name = f"DPO {loss_type}"
    atol = {k: cfg.beta * LOGP_ATOL for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")}
    first = {"rewards/accuracies": lr_zero_steps(ours) + 1}
    logps = {"logps/chosen": "logps/chosen", "logps/rejected": "logps/rejected"}
    rewards = {k: k for k in REWARD_METRICS}
    check_optimisation(name, ours, theirs)
    check_steps(name, ours, theirs, logps if loss_type == "ipo" else {**rewards, **logps}, atol=atol, first=first)
    check_eval(name, ours, theirs, {"loss": "loss", **logps, **({} if loss_type == "ipo" else rewards)}, atol=atol)
    check_weights(name, ours.model, trainer.model, WEIGHT_ATOL)
    if loss_type != "ipo":
        return

    train_calls = [tensors for grad, tensors in calls if grad]
    eval_calls = [tensors for grad, tensors in calls if not grad][-len(held_out.sampler.batches(0)) :]
    assert len(train_calls) == STEPS
    summed = [reward_metrics(*tensors, beta=cfg.beta, averaged=False) for tensors in train_calls]
    averaged = [reward_metrics(*tensors, beta=cfg.beta, averaged=True) for tensors in train_calls]
    eval_summed = reward_metrics(*map(torch.cat, zip(*eval_calls)), beta=cfg.beta, averaged=False)
    eval_averaged = reward_metrics(*map(torch.cat, zip(*eval_calls)), beta=cfg.beta, averaged=True)
    for key in REWARD_METRICS:
        steps = range(first.get(key, 1), STEPS + 1)
        span = f"{steps[0]}-{steps[-1]}"
        check_close(
            name,
            f"train {key}, TRL's: summed log-ratios (from the project's log-probs)",
            [summed[s - 1][key] for s in steps],
            theirs.series(key)[steps[0] - 1 :],
            steps=span,
            atol=atol.get(key, 0.0),
        )
        check_close(
            name,
            f"train {key}, the project's: averaged log-ratios",
            ours.series(key)[steps[0] - 1 :],
            [averaged[s - 1][key] for s in steps],
            steps=span,
            atol=atol.get(key, 0.0),
        )
        check_close(
            name,
            f"eval {key}, TRL's: summed log-ratios (from the project's log-probs)",
            [eval_summed[key]],
            [theirs.eval[key]],
            steps="eval",
            atol=atol.get(key, 0.0),
        )
        check_close(
            name,
            f"eval {key}, the project's: averaged log-ratios",
            [ours.final_eval()[key]],
            [eval_averaged[key]],
            steps="eval",
            atol=atol.get(key, 0.0),
        )
    check_departure(
        name,
        "eval rewards/margins, averaged vs summed log-ratios (departure)",
        eval_averaged["rewards/margins"],
        eval_summed["rewards/margins"],
        steps="eval",
    )


def record_preference_loss(monkeypatch) -> list[tuple[bool, list[torch.Tensor | None]]]:
    """Wrap the ``preference_loss`` that ``DPOObjective.step`` calls so that each call's tensors
    (policy chosen / rejected log-probs, reference chosen / rejected, and the lengths where the loss
    takes them) are recorded, with whether gradients were on (training) or off (evaluation)."""
    from trainer_core.training import supervised

    calls: list[tuple[bool, list[torch.Tensor | None]]] = []
    real = supervised.preference_loss

    def recording(loss_type, pairs, **settings):
        tensors = [getattr(pairs, f.name) for f in dataclasses.fields(pairs)]
        calls.append((torch.is_grad_enabled(), [None if t is None else t.detach().clone() for t in tensors]))
        return real(loss_type, pairs, **settings)

    monkeypatch.setattr(supervised, "preference_loss", recording)
    return calls


def reward_metrics(
    chosen, rejected, ref_chosen, ref_rejected, chosen_lengths, rejected_lengths, *, beta: float, averaged: bool
) -> dict[str, float]:
    """The batch means of DPO's reward metrics from per-pair log-probs: ``beta`` times the summed
    log-ratios (TRL's, every loss type) or the log-ratios averaged over each completion's tokens
    (the project's for IPO)."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if averaged:
        chosen_ratio, rejected_ratio = chosen_ratio / chosen_lengths, rejected_ratio / rejected_lengths
    c, r = beta * chosen_ratio, beta * rejected_ratio
    return {
        "rewards/chosen": float(c.mean()),
        "rewards/rejected": float(r.mean()),
        "rewards/margins": float((c - r).mean()),
        "rewards/accuracies": float((c > r).float().mean()),
    }


# -- KTO --------------------------------------------------------------------------------------


def test_kto_matches_ktotrainer(tokenizer, causal_lm, tmp_path):
    """KTO (``KTOObjective``: ``lambda_D (1 - sigmoid(beta (r - z0)))`` for a desirable example,
    ``lambda_U (1 - sigmoid(beta (z0 - r)))`` for an undesirable one, ``z0`` the micro-batch's KL
    estimate from mismatched pairs, clamped at 0) against ``trl.KTOTrainer`` (``loss_type="kto"``,
    the same beta and weights, ``desirable_weight`` 1.2), its reference a copy of the initial
    policy run live.

    The KL sequences are TRL's: the completions rotated by one within each micro-batch
    (:func:`~tests.parity.trl_oracle.set_kl_completions`), built from the batches the project's
    sampler draws; the 80 rows are one epoch of 20 micro-batches, so each row is in one batch.
    Per step: loss, gradient norm, learning rate, ``kl``, ``rewards/chosen`` and
    ``rewards/rejected`` (means over the batch's desirable / undesirable examples; TRL logs them
    only in steps whose batch has such an example), ``logps/chosen`` / ``logps/rejected``; held
    out: loss and ``kl`` (means over examples of two equal batches: the same on both sides).

    Departure pinned: the held-out per-label metrics (``rewards/*``, ``logps/*``). The project
    pools them, the sum over every evaluated example of a label divided by their number
    (``KTOObjective.metric_denominators``, ``evaluate_pairs``), as it does within a step; TRL's
    ``evaluate()`` averages each batch's per-label mean (``KTOTrainer.log``: the mean of the
    values ``_compute_loss`` appended, one a batch with that label). The held-out batches here hold
    3 and 1 desirable examples, so the two differ; each side's quantity is computed from the
    other's per-batch values (TRL's ``evaluate()`` of each batch alone; the project's objective on
    each of its batches), and the per-batch values are compared too.
    """
    builder = Rows(7)
    rows, eval_rows = builder.unpaired(STEPS * MICRO_BATCH, 5), builder.unpaired(2 * MICRO_BATCH, 5)
    for split in (rows, eval_rows):  # provisional KL sequences (each row its own): the lengths only
        set_kl_completions(split, [[i] for i in range(len(split))])
    cfg = stage_config(KTOConfig, learning_rate=3e-3, beta=0.1, desirable_weight=1.2)
    train = kto_source(rows, PAD_ID, cfg.micro_batch_size, SEED, CPU)
    batches = drawn_batches(train, STEPS)
    assert sorted(flat(batches)) == list(range(len(rows)))  # one epoch: every row once
    set_kl_completions(rows, batches)
    held_out = kto_source(eval_rows, PAD_ID, cfg.micro_batch_size, SEED, CPU, shuffle=False)
    eval_split = list(held_out.sampler.batches(0))
    for batch, desirable in zip(eval_split, (3, 1)):  # unequal label counts: the per-label means differ
        for k, i in enumerate(batch):
            eval_rows[i]["label"] = k < desirable
    set_kl_completions(eval_rows, eval_split)
    reference = copy_of(causal_lm).eval()
    for split in (rows, eval_rows):
        for row, (logps, kl_logps) in zip(
            split, reference_logprobs(reference, split, PAD_ID, MICRO_BATCH, CPU, kind="kto")
        ):
            row["ref_logprobs"], row["ref_kl_logprobs"] = logps, kl_logps
    objective = KTOObjective(
        cfg.beta,
        held_out,
        cfg.eval_max_batches,
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight,
    )
    ours = train_project(copy_of(causal_lm), objective, train, cfg, tmp_path)

    def records(source_rows, order):
        return dataset(
            [
                {
                    "prompt_ids": source_rows[i]["prompt"],
                    "completion_ids": source_rows[i]["completion"],
                    "KL_completion_ids": source_rows[i]["kl_completion"],
                    "label": source_rows[i]["label"],
                }
                for i in order
            ]
        )

    args = trl.KTOConfig(
        **trl_settings(cfg, tmp_path),
        beta=cfg.beta,
        loss_type="kto",
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight,
    )
    trainer = pretokenised(trl.KTOTrainer)(
        model=copy_of(causal_lm),
        ref_model=copy_of(causal_lm),
        args=args,
        train_dataset=records(rows, flat(batches)),
        eval_dataset=records(eval_rows, flat(eval_split)),
        processing_class=tokenizer,
    )
    assert trainer.calculate_KL
    theirs = train_trl(trainer)

    per_label = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
    metrics = {"kl": "kl", **{k: k for k in per_label}}
    atol = {"kl": LOGP_ATOL, "rewards/chosen": cfg.beta * LOGP_ATOL, "rewards/rejected": cfg.beta * LOGP_ATOL}
    check_optimisation("KTO", ours, theirs)
    check_steps("KTO", ours, theirs, metrics, atol=atol)
    check_eval("KTO", ours, theirs, {"loss": "loss", "kl": "kl"}, atol=atol)
    check_weights("KTO", ours.model, trainer.model, WEIGHT_ATOL)

    # the held-out per-label metrics, batch by batch: TRL's evaluate() of each batch alone
    trl_batches = [trainer.evaluate(eval_dataset=records(eval_rows, batch)) for batch in eval_split]
    ours.model.eval()
    with torch.no_grad():
        ours_sums = [
            {k: float(v.sum()) for k, v in objective.step(ours.model, batch).metric_sums.items()}
            for batch in eval_batches(held_out, cfg.eval_max_batches)
        ]
    counts = {"chosen": [s["count/chosen"] for s in ours_sums], "rejected": [s["count/rejected"] for s in ours_sums]}
    assert counts == {"chosen": [3.0, 1.0], "rejected": [1.0, 3.0]}
    final = ours.final_eval()
    for key in per_label:
        n = counts[key.split("/")[1]]
        ours_means = [s[key] / c for s, c in zip(ours_sums, n)]
        trl_means = [m[f"eval_{key}"] for m in trl_batches]
        check_close(
            "KTO", f"eval {key} of each held-out batch", ours_means, trl_means, steps="eval", atol=atol.get(key, 0.0)
        )
        pooled = sum(m * c for m, c in zip(trl_means, n)) / sum(n)
        check_close(
            "KTO",
            f"eval {key}, the project's: pooled (from TRL's batches)",
            [final[key]],
            [pooled],
            steps="eval",
            atol=atol.get(key, 0.0),
        )
        check_close(
            "KTO",
            f"eval {key}, TRL's: mean of batch means (from the project's batches)",
            [sum(ours_means) / len(ours_means)],
            [theirs.eval[key]],
            steps="eval",
            atol=atol.get(key, 0.0),
        )
        if key == "logps/chosen":
            check_departure(
                "KTO",
                f"eval {key} pooled vs mean of batch means (departure)",
                pooled,
                sum(trl_means) / len(trl_means),
                steps="eval",
            )
