"""GRPO parity with TRL 1.16's ``GRPOTrainer`` as the oracle, on one fixed rollout batch.

Both sides get the same rollout: 3 prompts (left-padded: 3, 5 and 8 tokens), 4 completions of
each (1 to 8 tokens, one cut at ``max_new_tokens`` without its EOS), the same rewards (one group
of equal rewards, whose advantages are 0), the same policy weights when the rollout is scored (the
"old" policy), and for the update the same current weights, far enough from the old ones that
the ratio clip bites on 9-11% of the tokens (:func:`~tests.parity.grpo_case.weights`). The
reference is the initial model. The rollout, the weights and the project's trainer are
``grpo_case.py``'s (shared with ``test_rloo_parity.py``). From the sampled tokens on, each side
runs its own code:

* TRL: ``GRPOTrainer._generate_and_score_completions``, with a ``rollout_func`` (TRL's hook for a
  custom generator) that returns the fixed completions and a reward function that returns the
  fixed rewards, builds the inputs dict its loss reads: ``prompt_ids`` / ``prompt_mask``
  (left-padded), ``completion_ids`` / ``completion_mask``, ``advantages`` (the group statistics
  under ``scale_rewards``), ``old_per_token_logps`` (the policy when the rollout is scored:
  ``num_iterations=2`` makes TRL score it, as it does when a generation is reused),
  ``ref_per_token_logps`` (its reference model), ``num_items_in_batch``. Then, the current weights
  loaded, ``GRPOTrainer.compute_loss`` (``_compute_loss``) and a backward give the loss and the
  gradients, and ``_metrics["train"]`` the per-token means of the KL, the clip ratio
  (``clip_ratio/region_mean``) and the entropy that loss logged.
* The project: :class:`~trainer_core.training.rl.trainer.RLTrainer` with
  :class:`~trainer_core.training.rl.algorithms.grpo.GRPOAlgorithm`, built as ``stages/rl_common.py`` builds it, its
  generation engine replaced by one that replays the fixed completions
  (:class:`~tests.parity.grpo_case.ReplayEngine`) and its reward function by the fixed rewards.
  ``RLTrainer.rollout`` collates the prompts, computes the old and reference log-probs
  (``completion_forward`` of the policy and of the reference) and the advantages
  (``GRPOAlgorithm.prepare``); then, the current weights loaded, ``RLTrainer.train_step``
  forwards, takes ``GRPOAlgorithm.loss`` under the loop's ``MiniBatchCounts``, backwards and steps
  an optimizer that records the gradients it is given
  (:class:`~tests.parity.grpo_case.GradientRecorder`; the norm is not clipped).

Estimators both have (all 32 combinations: :data:`LOSS_TYPES` x :data:`SUB_CASES`; each loss
type's 8 cases make one row per quantity in the table): TRL's ``loss_type="grpo"`` is the project's
``loss_aggregation: sequence_mean`` (each completion's token mean, then the mean over
completions), ``"bnpo"`` and ``"dapo"`` are ``token_mean`` (over the batch's completion tokens;
they part only under gradient accumulation, where the project's is DAPO's:
:func:`test_token_mean_is_dapo_not_bnpo_under_gradient_accumulation`), ``"dr_grpo"`` is
``constant`` (over completions x ``max_new_tokens``); ``scale_rewards`` ``"group"`` / ``"none"``
is ``True`` / ``False`` (the ``grpo`` estimator: centred, divided by the group's unbiased std +
1e-4 or not); ``beta`` is ``kl_coef`` with the k3 estimator (TRL's only one), on (0.04) and off;
``epsilon`` / ``epsilon_high`` are ``clip_eps`` / ``clip_eps_high``, symmetric (0.2) and DAPO's
clip-higher (0.28); the temperature (0.7: both divide the logits by it in every log-prob forward).

Departure pinned: TRL 1.16 multiplies the k3 KL term by the ratio by default
(``use_bias_correction_kl=True``, DeepSeek-V3.2); the project's KL term is DeepSeekMath's (eq. 3
with the k3 of eq. 4: ``trainer_core/objectives/grpo.py``, ``GRPOAlgorithm.loss``), so the cases
above run TRL with ``use_bias_correction_kl=False``, and
:func:`test_kl_term_is_deepseekmath_k3_not_trls_bias_corrected_default` measures the default's
difference.

Not covered, for want of an equivalent on the other side: TRL's ``scale_rewards="batch"``,
``importance_sampling_level="sequence"`` (GSPO), the two-sided clip ``delta``, the ``cispo`` /
``sapo`` / ``vespo`` / ``luspo`` losses, the entropy bonus and entropy mask,
``mask_truncated_completions``, ``off_policy_mask_threshold``, ``multi_objective_aggregation``
and vLLM's importance sampling; the project's ``kl_estimator: k1``, the ``reinforce_pp``
estimator (``rloo`` is ``test_rloo_parity.py``'s), DAPO's dynamic sampling and overlong shaping,
``importance_sampling_cap``, ``ptx_coef`` and the adaptive KL controller.

Tolerance: 1e-5 (the issue's bar). Both sides run the same fp32 arithmetic in another order: the
LM head on the completion positions only, in chunks, with ``cross_entropy``
(``trainer_core/modeling/forwards/completion.py``, ``kernels.py``) against TRL's fused, tiled
head on every position (``trl/trainer/utils.py``, ``add_fused_lm_head``); position ids that skip
the left padding here, counted from the first pad there (RoPE depends on position differences
only, so the two agree up to the rounding of the angles); the sums over other shapes. Each
log-prob differs by a few ulps (|log-prob| < 8 here, spacing at most 4.8e-7): the log-probs are
held to 1e-5 relative. The advantages, the loss and each gradient element are sums of terms of
both signs (group-centred advantages), so their rounding is relative to the terms, not to the
sum, which can be near 0: they are held to ``1e-5 x (|TRL| + scale)``, ``scale`` being the
largest advantage (a per-token loss term is ``|A|`` times a ratio in (0.5, 1.8) here, plus a KL
below 0.1) or the largest gradient element. The per-token KL mean is held to 1e-5 relative plus
:data:`LOGP_SPACING` (``k3(x)``'s error is ``|e^x - 1| <= 1`` times that of ``x``, a difference of
two log-probs). The measured worst (bench/README.md, "Parity with TRL") uses 5.3% of its
tolerance (a gradient element, 5e-7 of the largest): ~19 x inside the bar.

With sampling the two sides draw different completions, so only their learning curves can be
compared, statistically, over seeds: ``bench/parity_grpo.py`` (~2 min of CPU for the 40 seeds that
make its 2-standard-error criterion sharp; not in the test suite).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor

trl = pytest.importorskip("trl", reason="TRL (the dev extra's trl==1.16.0) is the oracle of these parity tests")
datasets = pytest.importorskip("datasets", reason="TRL's trainers read datasets.Dataset")

from tests.parity.grpo_case import (  # noqa: E402
    CLIP_EPS,
    COMPLETIONS,
    FIXED,
    GRAD_SCALED,
    GROUP_SIZE,
    LOGP_SPACING,
    MAX_NEW_TOKENS,
    PROMPTS,
    RTOL,
    SCALED,
    TEMPERATURE,
    Gathered,
    Side,
    Weights,
    flat,
    load,
    one_thread,  # noqa: F401  (the module's autouse fixture: one compute thread)
    project_side,
    project_trainer,
    prompt_text,
    trl_grads,
    trl_logged,
    trl_model,
    trl_reward,
    trl_rollout_settings,
    weights,  # noqa: F401  (the module-scoped fixture of the initial, old and current weights)
)
from tests.parity.trl_oracle import (  # noqa: E402
    check_close,
    check_departure,
    check_departure_vectors,
    word_tokenizer,
)
from trainer_core.config import GRPOConfig  # noqa: E402
from trainer_core.modeling.forwards.completion import completion_forward  # noqa: E402
from trainer_core.objectives.ppo import kl_k3  # noqa: E402
from trainer_core.training.rl.rollout import RolloutBatch  # noqa: E402
from trainer_core.training.rl.trainer import RLTrainer  # noqa: E402

LOSS_TYPES = {"grpo": "sequence_mean", "bnpo": "token_mean", "dapo": "token_mean", "dr_grpo": "constant"}
"""TRL's ``loss_type`` -> the project's ``loss_aggregation`` (module docstring)."""


@dataclass(frozen=True)
class Case:
    """One estimator both sides have: TRL's ``loss_type`` and the project's ``loss_aggregation``,
    ``scale_rewards``, ``beta`` = ``kl_coef`` (k3), the upper clip range (None: ``CLIP_EPS``)."""

    loss_type: str
    scale_rewards: bool
    beta: float
    clip_high: float | None = None

    @property
    def aggregation(self) -> str:
        return LOSS_TYPES[self.loss_type]

    @property
    def name(self) -> str:
        scale = "std-scaled" if self.scale_rewards else "unscaled"
        kl = f"KL {self.beta:g}" if self.beta else "no KL"
        clip = f"clip {CLIP_EPS:g}/{self.clip_high:g}" if self.clip_high else f"clip {CLIP_EPS:g}"
        return f"GRPO {self.loss_type} = {self.aggregation}, {scale}, {kl}, {clip}"


SUB_CASES = [(scale, beta, clip_high) for scale in (True, False) for beta in (0.04, 0.0) for clip_high in (None, 0.28)]
"""Every combination of the other shared options, for each loss type: advantages std-scaled or
not, the KL term on (0.04) or off, the symmetric clip range or clip-higher."""


# -- the two sides ----------------------------------------------------------------------------


def project_config(case: Case, **overrides) -> GRPOConfig:
    """The project's GRPO stage config of ``case``: one rollout of 3 prompts x 4 completions, one
    mini-batch, the gradient norm not clipped (the recorder sees the raw gradients)."""
    return GRPOConfig(
        group_size=GROUP_SIZE,
        prompts_per_rollout=len(PROMPTS),
        advantage_estimator="grpo",
        scale_rewards=case.scale_rewards,
        loss_aggregation=case.aggregation,
        kl_coef=case.beta,
        kl_estimator="k3",
        clip_eps=CLIP_EPS,
        clip_eps_high=case.clip_high,
        max_grad_norm=None,
        generation={"temperature": TEMPERATURE, "max_new_tokens": MAX_NEW_TOKENS},
        **overrides,
    )


def run_project(case: Case, weights: Weights, **overrides) -> tuple[Side, RolloutBatch, RLTrainer]:
    """``RLTrainer.rollout`` at the old weights, then ``RLTrainer.train_step`` on the whole rollout
    (one mini-batch) at the current ones."""
    trainer, engine = project_trainer(project_config(case, **overrides), weights)
    batch, _, _ = trainer.rollout()
    load(trainer.module.policy, weights.current)
    metrics = trainer.train_step(batch)
    advantages = batch.advantages  # [N, T]: each completion's advantage on each of its tokens
    assert torch.equal(advantages, advantages[:, :1] * batch.completion_mask)
    return project_side(trainer, engine, batch, metrics, kl=bool(case.beta)), batch, trainer


def trl_trainer(case: Case, weights: Weights, rows: list[tuple[int, int]], workdir: Path, **overrides):
    """TRL's GRPOTrainer for ``case``: a copy of the initial model whose config names
    ``weights.directory`` (TRL builds its reference from there), a ``rollout_func`` that returns the
    completions of ``rows`` and a reward function that returns their rewards; the 12 rows are one
    generation and one optimizer step (``overrides`` may cut it into micro-batches),
    ``num_iterations=2`` (``_generate_and_score_completions`` then scores the old policy), fp32 on
    the CPU, the KL term not multiplied by the ratio (the departure pinned below)."""

    def rollout_func(prompts, trainer):
        assert prompts == [prompt_text(p) for p, _ in rows], prompts
        return {
            "prompt_ids": [PROMPTS[p] for p, _ in rows],
            "completion_ids": [COMPLETIONS[p][j] for p, j in rows],
            "logprobs": [[0.0] * len(COMPLETIONS[p][j]) for p, j in rows],
        }

    settings = dict(
        **trl_rollout_settings(rows, workdir),
        num_iterations=2,
        beta=case.beta,
        loss_type=case.loss_type,
        scale_rewards="group" if case.scale_rewards else "none",
        epsilon_high=case.clip_high,
        use_bias_correction_kl=False,
    )
    trainer = trl.GRPOTrainer(
        model=trl_model(weights),
        reward_funcs=trl_reward(rows),
        args=trl.GRPOConfig(**{**settings, **overrides}),
        train_dataset=datasets.Dataset.from_list([{"prompt": prompt_text(p)} for p in range(len(PROMPTS))]),
        processing_class=word_tokenizer(),
        rollout_func=rollout_func,
    )
    assert (trainer.ref_model is not None) == (case.beta > 0)
    return trainer


def trl_inputs(trainer, weights: Weights, rows: list[tuple[int, int]]) -> dict:
    """``_generate_and_score_completions`` of ``rows`` at the old weights (training mode), then the
    current weights loaded: the inputs dict ``compute_loss`` reads."""
    trainer.model.train()
    load(trainer.model, weights.old)
    inputs = trainer._generate_and_score_completions([{"prompt": prompt_text(p)} for p, _ in rows])
    assert "old_per_token_logps" in inputs
    load(trainer.model, weights.current)
    trainer.model.zero_grad(set_to_none=True)
    return inputs


def trl_loss(trainer, inputs: dict, accumulation: int = 1) -> tuple[Tensor, dict[str, float]]:
    """``GRPOTrainer.compute_loss`` of ``inputs`` (as ``training_step`` calls it, in a step of
    ``accumulation`` micro-batches), backwarded, and the metrics it logged."""
    trainer.current_gradient_accumulation_steps = accumulation
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), trl_logged(trainer)


def run_trl(case: Case, weights: Weights, rows: list[tuple[int, int]], workdir: Path, **overrides) -> Side:
    """TRL's inputs dict at the old weights, then ``compute_loss`` and its backward at the current ones."""
    trainer = trl_trainer(case, weights, rows, workdir, **overrides)
    inputs = trl_inputs(trainer, weights, rows)
    loss, metrics = trl_loss(trainer, inputs)
    mask = inputs["completion_mask"].float()
    ref = inputs["ref_per_token_logps"] * mask if case.beta else None
    return Side(
        rows,
        mask,
        inputs["advantages"],
        inputs["old_per_token_logps"] * mask,
        ref,
        float(loss),
        trl_grads(trainer),
        metrics,
    )


# -- the comparison ---------------------------------------------------------------------------


QUANTITIES = {
    "advantages": SCALED,
    "old and reference log-probs (completion tokens)": "rel 1e-05",
    "loss": SCALED,
    "gradient (every element)": GRAD_SCALED,
    "gradient norm": "rel 1e-05",
    "per-token means: KL (with it), clip ratio, entropy": "rel 1e-05 + abs 4.8e-07",
}
"""The rows of each loss type's comparison and their tolerances (module docstring)."""


def gather(rows: dict[str, Gathered], case: Case, ours: Side, theirs: Side) -> None:
    """Add one case's quantities to ``rows`` (keys of :data:`QUANTITIES`)."""
    assert ours.rows == theirs.rows and torch.equal(ours.mask, theirs.mask)
    tokens, label = ours.mask > 0, case.name
    scale = float(theirs.advantages.abs().max())
    assert scale > 0
    rows["advantages"].add(label, ours.advantages, theirs.advantages, RTOL * scale)
    logps = rows["old and reference log-probs (completion tokens)"]
    logps.add(label, ours.old_logprobs[tokens], theirs.old_logprobs[tokens], 0.0)
    if case.beta:
        logps.add(label, ours.ref_logprobs[tokens], theirs.ref_logprobs[tokens], 0.0)
    rows["loss"].add(label, [ours.loss], [theirs.loss], RTOL * scale)
    assert sorted(ours.grads) == sorted(theirs.grads)
    mine, other = flat(ours.grads), flat(theirs.grads)
    rows["gradient (every element)"].add(label, mine, other, RTOL * float(other.abs().max()))
    rows["gradient norm"].add(label, [float(mine.norm())], [float(other.norm())], 0.0)
    assert sorted(ours.metrics) == sorted(theirs.metrics)
    keys = sorted(theirs.metrics)
    means = rows["per-token means: KL (with it), clip ratio, entropy"]
    means.add(label, [ours.metrics[k] for k in keys], [theirs.metrics[k] for k in keys], LOGP_SPACING)


def check_rows(objective: str, rows: dict[str, Gathered], steps: str = FIXED) -> None:
    for quantity, tolerance in QUANTITIES.items():
        rows[quantity].check(objective, quantity, tolerance, steps)


def check_gradients(objective: str, ours: dict[str, Tensor], theirs: dict[str, Tensor]) -> None:
    """Every element against ``1e-5 x (|TRL| + the largest TRL element)``, and the norm to 1e-5."""
    rows = {q: Gathered() for q in QUANTITIES}
    assert sorted(ours) == sorted(theirs)
    mine, other = flat(ours), flat(theirs)
    rows["gradient (every element)"].add(objective, mine, other, RTOL * float(other.abs().max()))
    rows["gradient norm"].add(objective, [float(mine.norm())], [float(other.norm())], 0.0)
    check_rows(objective, rows)


def test_trl_grpo_defaults_are_the_ones_these_tests_read():
    """The TRL settings these tests rely on or turn off, at TRL 1.16's defaults: the KL term
    multiplied by the ratio (``use_bias_correction_kl``, turned off above and measured below),
    ``scale_rewards`` "group", ``loss_type`` "dapo", no two-sided clip (``delta``), token-level
    ratios, truncated completions kept in the loss."""
    defaults = trl.GRPOConfig(output_dir="unused", use_cpu=True, report_to="none")
    assert defaults.use_bias_correction_kl is True
    assert (defaults.scale_rewards, defaults.loss_type, defaults.delta) == ("group", "dapo", None)
    assert defaults.importance_sampling_level == "token" and defaults.mask_truncated_completions is False


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_and_gradients_match_grpotrainer(loss_type, weights, tmp_path):
    """The project's GRPO (``RLTrainer.rollout`` + ``RLTrainer.train_step`` with ``GRPOAlgorithm``)
    against ``GRPOTrainer._generate_and_score_completions`` + ``compute_loss`` on the fixed rollout
    (module docstring), for TRL's ``loss_type`` and its project equivalent under each of the 8
    :data:`SUB_CASES`: advantages, old and reference log-probs, loss, every gradient element,
    gradient norm, and the per-token means of the KL, clip ratio and entropy (one table row each,
    over the 8 cases). The ratio clip bites (on at least 3 of the 46 tokens) and the KL is not
    negligible where it is on."""
    rows = {q: Gathered() for q in QUANTITIES}
    for scale_rewards, beta, clip_high in SUB_CASES:
        case = Case(loss_type, scale_rewards, beta, clip_high)
        ours, _, _ = run_project(case, weights)
        theirs = run_trl(case, weights, ours.rows, tmp_path / f"{scale_rewards}-{beta}-{clip_high}")
        assert sorted(set(ours.rows)) == [(p, j) for p in range(len(PROMPTS)) for j in range(GROUP_SIZE)]
        assert theirs.metrics["clip_ratio"] > 0.05
        assert not beta or theirs.metrics["kl"] > 0.01
        gather(rows, case, ours, theirs)
    check_rows(f"GRPO {loss_type} = {LOSS_TYPES[loss_type]} (8 cases)", rows)


def test_kl_term_is_deepseekmath_k3_not_trls_bias_corrected_default(weights, tmp_path):
    """Departure pinned: the KL term. The project adds ``beta x k3`` per token (DeepSeekMath eq. 3
    with the k3 of eq. 4: ``trainer_core/objectives/grpo.py``; ``GRPOAlgorithm.loss``: "+ beta *
    KL(pi || pi_ref) per token (k3, eq. 4)"); TRL 1.16 by default multiplies it by the token's
    ratio ``pi / pi_old`` (``use_bias_correction_kl=True``, DeepSeek-V3.2's unbiased reverse-KL
    gradient; ``GRPOTrainer._compute_loss``), which changes the loss off-policy and the gradient
    always (the ratio is differentiable even where it is 1).

    With ``use_bias_correction_kl=False`` TRL agrees with the project (the cases above). With the
    default, TRL's loss is the project's plus ``beta`` times the aggregated ``k3 x (ratio - 1)``, and
    its gradient the project's plus that term's: the term is computed here from the project's
    numbers (its rollout's old and reference log-probs, ``completion_forward`` at the current weights,
    the ``sequence_mean`` of this case) and both sums are held to TRL's default like the cases
    above. The two definitions' losses and gradients (L2) differ by more than 10 x the bar."""
    case = Case("grpo", True, 0.04)
    assert case.aggregation == "sequence_mean" and case.beta > 0
    name = "GRPO grpo, KL 0.04 vs TRL's default use_bias_correction_kl"
    ours, batch, trainer = run_project(case, weights)
    theirs = run_trl(case, weights, ours.rows, tmp_path, use_bias_correction_kl=True)
    current = completion_forward(trainer.module, batch, temperature=TEMPERATURE, with_values=False).logprobs
    mask = batch.completion_mask
    per_token = kl_k3(current, batch.ref_logprobs) * (torch.exp(current - batch.logprobs) - 1.0) * mask
    term = case.beta * (per_token.sum(1) / mask.sum(1)).mean()
    term.backward()
    term_grads = {n.removeprefix("policy."): p.grad for n, p in trainer.module.named_parameters()}
    scale = float(theirs.advantages.abs().max())
    check_close(
        name,
        "TRL's loss = the project's + beta x k3 x (ratio - 1), aggregated",
        [ours.loss + float(term)],
        [theirs.loss],
        steps=FIXED,
        rtol=RTOL,
        atol=RTOL * scale,
        tolerance=SCALED,
    )
    check_gradients(
        f"{name}: TRL's = the project's + that term's",
        {n: g + term_grads[n] for n, g in ours.grads.items()},
        theirs.grads,
    )
    check_departure(name, "loss, the project's vs TRL's default (departure)", ours.loss, theirs.loss, steps=FIXED)
    check_departure_vectors(
        name,
        "gradient, the project's vs TRL's default (departure, L2)",
        flat(ours.grads),
        flat(theirs.grads),
        steps=FIXED,
    )


def test_token_mean_is_dapo_not_bnpo_under_gradient_accumulation(weights, tmp_path):
    """Departure pinned: the token mean under gradient accumulation. The project's ``token_mean``
    divides the summed token losses by the tokens of the whole mini-batch, however it is cut into
    micro-batches (``MiniBatchCounts``: "the step one device takes on the union of the ranks'
    rows"; ``grpo_family.token_mean``: DAPO's token-level mean, TRL's ``"dapo"``); TRL's ``"bnpo"``
    divides each micro-batch's sum by that micro-batch's tokens, then by the number of
    micro-batches (``_compute_loss``: "normalized by the local batch"). Without accumulation the
    two are one (the cases above).

    Here the 12 rows go through in 2 micro-batches of 6 (the project's ``forward_micro_batch_size:
    6``; TRL's ``per_device_train_batch_size=6``, ``gradient_accumulation_steps=2``, its inputs
    dict cut as ``_prepare_inputs`` cuts it, without the shuffle), of unequal token counts. The
    project's loss and gradients agree with TRL's ``"dapo"`` to the same tolerance as above; TRL's
    ``"bnpo"`` equals the mean of the micro-batches' token means (computed from the ``"dapo"``
    micro-batch losses) and differs from the project's (loss, and gradient in L2) by more than 10 x
    the bar."""
    from trl.trainer.utils import split_tensor_dict

    name = "GRPO token_mean, 2 micro-batches"
    case = Case("dapo", True, 0.04)
    ours, _, _ = run_project(case, weights, forward_micro_batch_size=6)
    accumulation = dict(per_device_train_batch_size=6, gradient_accumulation_steps=2, steps_per_generation=2)
    results = {}
    for loss_type in ("dapo", "bnpo"):
        trainer = trl_trainer(Case(loss_type, True, 0.04), weights, ours.rows, tmp_path, **accumulation)
        inputs = trl_inputs(trainer, weights, ours.rows)
        parts = split_tensor_dict(inputs, 2)
        losses = [float(trl_loss(trainer, part, accumulation=2)[0]) for part in parts]
        results[loss_type] = (losses, [float(part["completion_mask"].sum()) for part in parts], trl_grads(trainer))
    (dapo_parts, tokens, dapo_grads), (bnpo_parts, _, bnpo_grads) = results["dapo"], results["bnpo"]
    assert tokens[0] != tokens[1], tokens
    scale = float(ours.advantages.abs().max())
    check_close(
        name,
        "loss, the project's vs TRL dapo (accumulated)",
        [ours.loss],
        [sum(dapo_parts)],
        steps=FIXED,
        rtol=RTOL,
        atol=RTOL * scale,
        tolerance=SCALED,
    )
    check_gradients(f"{name}: the project's vs TRL dapo (accumulated)", ours.grads, dapo_grads)
    # dapo's part losses are (sum of the part's token losses) / (all tokens): bnpo is their token means' mean
    per_part_means = [loss * sum(tokens) / n for loss, n in zip(dapo_parts, tokens)]
    check_close(
        name,
        "TRL bnpo = mean of the micro-batches' token means",
        [sum(bnpo_parts)],
        [sum(per_part_means) / len(per_part_means)],
        steps=FIXED,
        rtol=RTOL,
        atol=RTOL * scale,
        tolerance=SCALED,
    )
    check_departure(name, "loss, the project's vs TRL bnpo (departure)", ours.loss, sum(bnpo_parts), steps=FIXED)
    check_departure_vectors(
        name, "gradient, the project's vs TRL bnpo (departure, L2)", flat(ours.grads), flat(bnpo_grads), steps=FIXED
    )
