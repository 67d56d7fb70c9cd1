"""RLOO parity with TRL 1.16's ``RLOOTrainer`` as the oracle, on the fixed rollout batch of
``test_grpo_parity.py`` (``grpo_case.py``).

Both sides get that rollout (:data:`~tests.parity.grpo_case.PROMPTS`, ``COMPLETIONS``,
``REWARDS``: 3 left-padded prompts x 4 completions of 1 to 8 tokens, one cut at
``max_new_tokens`` without its EOS, one group of equal rewards), its weights (the ``weights``
fixture: the initial model is the reference, "old" and "current" perturbations of it) and its
temperature (0.7). From the sampled tokens on, each side runs its own code:

* TRL: ``RLOOTrainer._generate_and_score_completions``, its ``_generate_single_turn`` (the one
  generation call, which has no ``rollout_func`` hook in ``RLOOTrainer``) replaced by one that
  checks the tokenised prompts and returns the fixed completions, a reward function that returns
  the fixed rewards. It builds the inputs dict its loss reads: ``prompt_ids`` / ``prompt_mask``,
  ``completion_ids`` / ``completion_mask``, ``old_logps`` (each completion's summed log-probs
  under the policy at scoring time: RLOO computes them always) and ``advantages`` (leave-one-out,
  after the KL penalty and before the optional normalisation). Then ``RLOOTrainer.compute_loss``
  (``_compute_loss``) and a backward give the loss and the gradients, and ``_metrics["train"]``
  the means it logged (``entropy``, ``clip_ratio/region_mean``, ``kl``).
* The project: :class:`~trainer_core.training.rl.trainer.RLTrainer` with
  :class:`~trainer_core.training.rl.algorithms.grpo.GRPOAlgorithm` and ``advantage_estimator: rloo``
  (``trainer_core/objectives/grpo_family.py``, ``rloo_advantages``: ``r_i`` minus the mean of the
  group's other ``G - 1`` scores), built by ``grpo_case.project_trainer`` (its replaying
  engine and gradient-recording optimizer): ``RLTrainer.rollout``, then ``RLTrainer.train_step``.

What the two share, and where they part (``trl/trainer/rloo_trainer.py``,
``RLOOTrainer._generate_and_score_completions`` and ``_compute_loss``, against
``GRPOAlgorithm.prepare`` / ``GRPOAlgorithm.loss``):

* The advantage: both are ``r_i - mean_{j != i} r_j`` over a group of ``num_generations`` =
  ``group_size`` completions (TRL: ``(grouped_sum - grouped_rewards) / (scorable_counts - 1)``).
  Compared exactly where nothing else enters (``beta=0``, ``normalize_advantages=False``).
* The ratio: TRL's is per completion, ``exp(sum_t log pi - sum_t log pi_old)``, clipped and
  multiplied by ``A_i`` once per completion, ``-min(...)`` averaged over completions
  (``per_sequence_loss.mean()``); the project's is per token (``clipped_policy_loss_asymmetric``),
  aggregated by ``loss_aggregation``. At the rollout's own weights (on-policy, TRL's default
  ``num_iterations=1``: every ratio is 1) both gradients are ``A_i`` times the gradient of the
  completion's summed log-probs; TRL divides their sum by the completions N, the project's
  ``constant`` by ``N x max_new_tokens``: TRL's gradient is the project's ``constant`` gradient
  times ``max_new_tokens`` (8 here, a power of 2: the scaling is exact). That is the parity test
  (:func:`test_rloo_gradients_match_rlootrainer_on_policy`); off-policy the two ratios part
  (:func:`test_ratio_is_per_token_not_per_completion`).
* The KL: TRL's RLOO subtracts ``beta x sum_t (log pi_old - log pi_ref)`` (k1, summed over the
  completion, at scoring time) from the reward before the leave-one-out baseline; the project's
  RLOO adds ``kl_coef x k3`` per token to the loss (``GRPOAlgorithm.kl_in_loss``: only
  ``reinforce_pp`` puts the KL in the reward). Pinned:
  :func:`test_kl_is_a_reward_penalty_in_trl_a_loss_term_here`.
* The normalisation: TRL's ``normalize_advantages=True`` divides the centred advantages by their
  std over the whole generation batch (+ 1e-4); the project's ``rloo`` has no normalisation
  (``scale_rewards`` applies to the ``grpo`` estimator only). Pinned:
  :func:`test_normalize_advantages_has_no_project_equivalent`.
* The aggregation: beyond ``constant`` x ``max_new_tokens``, the project's ``token_mean`` (its
  default) is TRL's times ``N / tokens`` (a step size that changes with the batch's length) and
  ``sequence_mean`` weights each completion by ``1 / its length`` (another direction). Pinned:
  :func:`test_token_and_sequence_means_are_not_trls_sequence_sum`.

Not covered, for want of an equivalent: TRL's ``reward_clip_range``, ``mask_truncated_completions``,
unscorable (``None``) rewards, several reward functions with ``reward_weights``, vLLM; the
project's clip-higher off-policy (its clip is per token, TRL's per completion), ``kl_estimator:
k1`` in the loss, the adaptive KL controller, DAPO's dynamic sampling and overlong shaping,
``importance_sampling_cap``, ``ptx_coef`` and gradient accumulation.

Tolerance: 1e-5, as ``test_grpo_parity.py`` and for the same reasons (the same fp32 arithmetic in
another order: chunked LM head on completion positions here, TRL's fused head there; position
ids; sums over other shapes). The advantages and the loss are held to ``1e-5 x (|TRL| + scale)``,
``scale`` the largest advantage (on-policy a completion's loss term is ``|A_i|``; off-policy the
largest ``|A_i| x max(ratio_i, 1)``, the size of the largest term of TRL's mean, since a ratio's
relative error is the absolute error of its summed log-ratio); each gradient element to ``1e-5 x
(|TRL| + the largest TRL element)``; summed old log-probs (negative terms, no cancellation) to 1e-5
relative; the per-token means to 1e-5 relative plus one log-prob spacing (4.8e-7). The comparisons
use at most 7.7% of their tolerance (TRL's logged k1 mean: 5.2e-8 against 6.8e-7), 7.4% for a
gradient element (TRL's off-policy gradient recomputed from the project's log-probs), 3.3% for the
on-policy gradients: ~13 x inside the bar (bench/README.md, "Parity with TRL", the RLOO rows).
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
    fixed_rewards,
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
from trainer_core.training.rl.algorithms import GRPOAlgorithm  # noqa: E402
from trainer_core.training.rl.rollout import RolloutBatch  # noqa: E402
from trainer_core.training.rl.trainer import RLTrainer  # noqa: E402

BETA = 0.04
"""The KL coefficient of the KL cases (TRL's ``beta``, the project's ``kl_coef``)."""
NORM_EPS = 1e-4
"""Added to the batch std by TRL's ``normalize_advantages`` (``_generate_and_score_completions``)."""
MEAN = "per-token mean: entropy"
MEAN_TOLERANCE = "rel 1e-05 + abs 4.8e-07"


# -- the project's side -----------------------------------------------------------------------


def rloo_config(aggregation: str, beta: float = 0.0, **overrides) -> GRPOConfig:
    """The project's RLOO stage config: one rollout of 3 prompts x 4 completions, one mini-batch,
    ``loss_aggregation`` ``aggregation``, the k3 KL term in the loss when ``beta`` > 0, the
    symmetric clip, the gradient norm not clipped."""
    return GRPOConfig(
        group_size=GROUP_SIZE,
        prompts_per_rollout=len(PROMPTS),
        advantage_estimator="rloo",
        loss_aggregation=aggregation,
        kl_coef=beta,
        kl_estimator="k3",
        clip_eps=CLIP_EPS,
        max_grad_norm=None,
        generation={"temperature": TEMPERATURE, "max_new_tokens": MAX_NEW_TOKENS},
        **overrides,
    )


def run_project(
    cfg: GRPOConfig,
    weights: Weights,
    scored: dict[str, Tensor],
    updated: dict[str, Tensor],
    penalty: dict[tuple[int, int], float] | None = None,
) -> tuple[Side, RolloutBatch, RLTrainer]:
    """``RLTrainer.rollout`` with the policy at ``scored``, then ``RLTrainer.train_step`` on the whole
    rollout (one mini-batch) at ``updated``; ``penalty`` (by (prompt, completion)), when given, is
    subtracted from each fixed reward (its reward function's)."""
    trainer, engine = project_trainer(cfg, weights)
    if penalty is not None:

        def penalised(prompts, texts):
            rows = engine.rows[-len(texts) :]
            return fixed_rewards(rows, texts) - torch.tensor([penalty[row] for row in rows])

        trainer.reward_fn = penalised
    load(trainer.module.policy, scored)
    batch, _, _ = trainer.rollout()
    assert torch.equal(batch.advantages, batch.advantages[:, :1] * batch.completion_mask)
    load(trainer.module.policy, updated)
    metrics = trainer.train_step(batch)
    return project_side(trainer, engine, batch, metrics, kl=bool(cfg.kl_coef)), batch, trainer


# -- TRL's side -------------------------------------------------------------------------------


@dataclass
class TRLSide:
    """What ``RLOOTrainer`` computed on the fixed batch: the completion mask [N, T], the advantages
    [N], the summed old log-probs [N] (``old_logps``), the loss, the gradients by parameter name and
    the logged ``entropy``, ``clip_ratio`` (per completion) and, with ``beta``, ``kl``."""

    mask: Tensor
    advantages: Tensor
    old_logps: Tensor
    loss: float
    grads: dict[str, Tensor]
    metrics: dict[str, float]


def rloo_trainer(weights: Weights, rows: list[tuple[int, int]], workdir: Path, beta: float, normalize_advantages: bool):
    """TRL's RLOOTrainer on a copy of the initial model (whose config names ``weights.directory``, where
    TRL builds its reference from when ``beta`` > 0), the 12 rows one generation and one step, fp32
    on the CPU; its ``_generate_single_turn`` returns the completions of ``rows`` (after checking
    that the prompts tokenised to theirs) and its reward function their rewards."""
    args = trl.RLOOConfig(
        **trl_rollout_settings(rows, workdir),
        num_iterations=1,
        beta=beta,
        normalize_advantages=normalize_advantages,
    )
    trainer = trl.RLOOTrainer(
        model=trl_model(weights),
        reward_funcs=trl_reward(rows),
        args=args,
        processing_class=word_tokenizer(),
        train_dataset=datasets.Dataset.from_list([{"prompt": prompt_text(p)} for p in range(len(PROMPTS))]),
    )
    assert (trainer.ref_model is not None) == (beta > 0)

    def replay(prompt_ids, images, multimodal_fields):
        assert [list(ids) for ids in prompt_ids] == [PROMPTS[p] for p, _ in rows], prompt_ids
        return [list(COMPLETIONS[p][j]) for p, j in rows]

    trainer._generate_single_turn = replay
    return trainer


def run_trl(
    weights: Weights,
    rows: list[tuple[int, int]],
    workdir: Path,
    scored: dict[str, Tensor],
    updated: dict[str, Tensor],
    *,
    beta: float = 0.0,
    normalize_advantages: bool = False,
) -> TRLSide:
    """``_generate_and_score_completions`` of ``rows`` with the policy at ``scored`` (training mode),
    then ``compute_loss`` and its backward at ``updated``."""
    trainer = rloo_trainer(weights, rows, workdir, beta, normalize_advantages)
    trainer.model.train()
    load(trainer.model, scored)
    inputs = trainer._generate_and_score_completions([{"prompt": prompt_text(p)} for p, _ in rows])
    load(trainer.model, updated)
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return TRLSide(
        inputs["completion_mask"].float(),
        inputs["advantages"],
        inputs["old_logps"],
        float(loss.detach()),
        trl_grads(trainer),
        trl_logged(trainer),
    )


# -- comparisons ------------------------------------------------------------------------------


def scaled(grads: dict[str, Tensor], factor: float) -> dict[str, Tensor]:
    return {n: g * factor for n, g in grads.items()}


def check_gradient_departs(name: str, ours: Side, theirs: TRLSide) -> None:
    """Departure pinned: the project's ``constant`` gradient x ``max_new_tokens`` (the form that
    matches TRL's on-policy without KL) differs from TRL's by more than 1e-3 relative (L2)."""
    check_departure_vectors(
        name,
        f"gradient, the project's constant x {MAX_NEW_TOKENS} vs TRL's (departure, L2)",
        flat(ours.grads) * MAX_NEW_TOKENS,
        flat(theirs.grads),
        steps=FIXED,
    )


def check_advantages_and_gradient_depart(name: str, ours: Side, theirs: TRLSide) -> None:
    """Departure pinned: the project's advantages, then its gradient (:func:`check_gradient_departs`),
    differ from TRL's by more than 1e-3 relative (L2)."""
    check_departure_vectors(
        name, "advantages, the project's vs TRL's (departure, L2)", ours.advantages, theirs.advantages, steps=FIXED
    )
    check_gradient_departs(name, ours, theirs)


GRADIENT, NORM, LOGPS = "gradient (every element)", "gradient norm", "old log-probs (summed per completion)"


def add_gradients(
    rows: dict[str, Gathered], label: str, ours: dict[str, Tensor], theirs: dict[str, Tensor], suffix: str = ""
) -> None:
    """Every element (``1e-5 x (|TRL| + the largest TRL element)``) into ``rows[GRADIENT + suffix]`` and
    the norm (1e-5 relative) into ``rows[NORM + suffix]``."""
    assert sorted(ours) == sorted(theirs)
    mine, other = flat(ours), flat(theirs)
    rows.setdefault(GRADIENT + suffix, Gathered()).add(label, mine, other, RTOL * float(other.abs().max()))
    rows.setdefault(NORM + suffix, Gathered()).add(label, [float(mine.norm())], [float(other.norm())], 0.0)


def check_gradients(objective: str, ours: dict[str, Tensor], theirs: dict[str, Tensor]) -> None:
    rows: dict[str, Gathered] = {}
    add_gradients(rows, objective, ours, theirs)
    check_rows(objective, rows)


def tolerance_of(quantity: str) -> str:
    """The tolerance of a table row, as the table states it (module docstring)."""
    for prefix, tolerance in (
        (GRADIENT, GRAD_SCALED),
        (NORM, "rel 1e-05"),
        (LOGPS, "rel 1e-05"),
        (MEAN, MEAN_TOLERANCE),
    ):
        if quantity.startswith(prefix):
            return tolerance
    return SCALED


def check_rows(objective: str, rows: dict[str, Gathered]) -> None:
    """One table row per non-empty entry of ``rows`` (elements gathered with their own floors)."""
    for quantity, r in rows.items():
        r.check(objective, quantity, tolerance_of(quantity))


def check_scalar(objective: str, quantity: str, ours: float, theirs: float, scale: float) -> None:
    """``|ours - TRL| <= 1e-5 x (|TRL| + scale)`` (:data:`SCALED`)."""
    check_close(objective, quantity, [ours], [theirs], steps=FIXED, rtol=RTOL, atol=RTOL * scale, tolerance=SCALED)


def check_vector(objective: str, quantity: str, ours: Tensor, theirs: Tensor) -> None:
    """Elementwise ``|ours - TRL| <= 1e-5 x (|TRL| + max |TRL|)`` (:data:`SCALED`, advantages)."""
    check_close(
        objective,
        quantity,
        ours.tolist(),
        theirs.tolist(),
        steps=FIXED,
        rtol=RTOL,
        atol=RTOL * float(theirs.abs().max()),
        tolerance=SCALED,
    )


def all_rows(side: Side) -> list[tuple[int, int]]:
    assert sorted(set(side.rows)) == [(p, j) for p in range(len(PROMPTS)) for j in range(GROUP_SIZE)]
    return side.rows


# -- the tests --------------------------------------------------------------------------------


def test_trl_rloo_defaults_are_the_ones_these_tests_read():
    """TRL 1.16's RLOO defaults that these tests rely on or set: the KL penalty on (``beta`` 0.05, in
    the reward), advantages not normalised, one iteration per generation (on-policy), the
    symmetric clip 0.2 (per completion), truncated completions kept, rewards not clipped."""
    defaults = trl.RLOOConfig(output_dir="unused", use_cpu=True, report_to="none")
    assert (defaults.beta, defaults.normalize_advantages, defaults.num_iterations) == (0.05, False, 1)
    assert (defaults.epsilon, defaults.epsilon_high) == (0.2, None)
    assert defaults.mask_truncated_completions is False and defaults.reward_clip_range is None


def test_rloo_gradients_match_rlootrainer_on_policy(weights, tmp_path):
    """The project's RLOO (``RLTrainer.rollout`` + ``train_step``, ``advantage_estimator: rloo``)
    against ``RLOOTrainer._generate_and_score_completions`` + ``compute_loss``, on-policy (the
    update at the weights that scored the rollout, TRL's default ``num_iterations=1``), without KL
    and without normalisation, in 2 cases: the rollout scored and the step taken at the "old"
    weights, and at the "current" ones.

    Compared (one table row each, over both cases): the leave-one-out advantages; the old
    log-probs (TRL keeps only each completion's sum, ``old_logps``); every gradient element and the
    norm, TRL's against the project's ``constant`` aggregation times ``max_new_tokens`` (module
    docstring: on-policy both are ``sum_i A_i grad(sum_t log pi)`` over N, the project's over ``N x
    max_new_tokens``); the per-token mean entropy both log; and the loss, TRL's against the
    project's ``sequence_mean`` (each ratio 1: both are ``-mean_i A_i``, which the leave-one-out
    baseline makes 0 in every group, so this row only says both are 0 up to rounding; the
    off-policy loss is compared in :func:`test_ratio_is_per_token_not_per_completion`). The group
    of equal rewards has advantages 0 on both sides."""
    objective = "RLOO on-policy, no KL, unnormalised (2 cases)"
    times = f", the project's constant x {MAX_NEW_TOKENS}"
    quantities = ["advantages", LOGPS, "loss, the project's sequence_mean", GRADIENT + times, NORM + times, MEAN]
    rows = {q: Gathered() for q in quantities}
    for name in ("old", "current"):
        params = getattr(weights, name)
        ours, _, _ = run_project(rloo_config("constant"), weights, params, params)
        theirs = run_trl(weights, all_rows(ours), tmp_path / name, params, params)
        assert torch.equal(ours.mask, theirs.mask)
        means, _, _ = run_project(rloo_config("sequence_mean"), weights, params, params)
        assert means.rows == ours.rows
        label = f"RLOO on-policy at the {name} weights"
        scale = float(theirs.advantages.abs().max())
        assert scale > 0 and float(theirs.advantages[[p == 2 for p, _ in ours.rows]].abs().max()) == 0.0
        rows["advantages"].add(label, ours.advantages, theirs.advantages, RTOL * scale)
        rows[LOGPS].add(label, ours.old_logprobs.sum(1), theirs.old_logps, 0.0)
        rows["loss, the project's sequence_mean"].add(label, [means.loss], [theirs.loss], RTOL * scale)
        add_gradients(rows, label, scaled(ours.grads, MAX_NEW_TOKENS), theirs.grads, times)
        rows[MEAN].add(label, [ours.metrics["entropy"]], [theirs.metrics["entropy"]], LOGP_SPACING)
        assert ours.metrics["clip_ratio"] == 0.0 and theirs.metrics["clip_ratio"] == 0.0
    check_rows(objective, rows)


def test_ratio_is_per_token_not_per_completion(weights, tmp_path):
    """Departure pinned: the importance ratio. TRL's RLOO takes one ratio per completion,
    ``exp(sum_t log pi - sum_t old_logps)``, clips it to ``[1 - epsilon, 1 + epsilon_high]`` and
    averages ``-min(ratio_i A_i, clip(ratio_i) A_i)`` over the completions (``RLOOTrainer._compute_loss``:
    ``log_ratio = logps - old_logps`` on the summed log-probs, ``per_sequence_loss.mean()``); the
    project's GRPO family, RLOO included, takes PPO's per-token ratio
    (``GRPOAlgorithm.loss`` -> ``grpo_loss`` -> ``clipped_policy_loss``). On-policy the gradients agree
    (:func:`test_rloo_gradients_match_rlootrainer_on_policy`) but not the loss values: a
    completion's term is ``A_i`` there, ``|o_i| x A_i`` summed over its tokens here. Off-policy the
    ratios themselves part: a completion's ratio is the product of its tokens' (here 0.25 to 1.99,
    9 of the 12 outside [0.8, 1.2]; 3 completions clipped in TRL's loss, TRL's clip ratio 0.25,
    against 11% of the tokens on the project's side).

    Rollout scored at the "old" weights, loss at the "current" ones, no KL, clip 0.2. TRL's loss,
    every gradient element and its logged (per-completion) clip ratio are recomputed from the
    project's numbers under TRL's definition (the project's rollout log-probs and advantages,
    ``completion_forward`` at the current weights) and held to the module's tolerances (the loss's
    scale: the largest ``|A_i| x max(ratio_i, 1)``). The project's own loss and gradient
    (``constant`` x ``max_new_tokens``, the form that matches on-policy) differ from TRL's by more
    than 1e-3 relative (``check_departure``'s minimum, 100 x the bar; the gradient in L2),
    off-policy and (the loss) on-policy."""
    name = "RLOO per-completion ratio (TRL) vs per-token (project)"
    ours, batch, trainer = run_project(rloo_config("constant"), weights, weights.old, weights.current)
    theirs = run_trl(weights, all_rows(ours), tmp_path / "off", weights.old, weights.current)
    module = trainer.module
    module.zero_grad(set_to_none=True)
    mask, advantages = batch.completion_mask, batch.advantages[:, 0]
    current = completion_forward(module, batch, temperature=TEMPERATURE, with_values=False).logprobs
    ratio = torch.exp(((current - batch.logprobs) * mask).sum(1))
    clipped = ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS)
    loss = -torch.min(ratio * advantages, clipped * advantages).mean()
    loss.backward()
    grads = {n.removeprefix("policy."): p.grad for n, p in module.named_parameters()}
    ratio, advantages = ratio.detach(), advantages.detach()
    assert int(((ratio - 1).abs() > CLIP_EPS).sum()) >= len(ratio) // 2, ratio
    outside = ((ratio < 1 - CLIP_EPS) & (advantages < 0)) | ((ratio > 1 + CLIP_EPS) & (advantages > 0))
    assert int(outside.sum()) >= 2, (ratio, advantages)
    scale = float((advantages.abs() * ratio.clamp(min=1.0)).max())
    check_scalar(
        name,
        "TRL's loss = its per-completion clipped ratio on the project's log-probs",
        float(loss.detach()),
        theirs.loss,
        scale,
    )
    check_gradients(f"{name}: TRL's = its per-completion clipped ratio on the project's log-probs", grads, theirs.grads)
    check_close(
        name,
        "TRL's clip ratio (per completion) from the project's log-probs",
        [float(outside.float().mean())],
        [theirs.metrics["clip_ratio"]],
        steps=FIXED,
        rtol=RTOL,
    )
    check_departure(
        name,
        f"loss, the project's constant x {MAX_NEW_TOKENS} vs TRL's (departure)",
        ours.loss * MAX_NEW_TOKENS,
        theirs.loss,
        steps=FIXED,
    )
    check_gradient_departs(name, ours, theirs)
    on_policy, _, _ = run_project(rloo_config("constant"), weights, weights.old, weights.old)
    lengths = on_policy.mask.sum(1)
    assert abs(on_policy.loss * MAX_NEW_TOKENS + float((on_policy.advantages * lengths).mean())) < RTOL * scale
    on_trl = run_trl(weights, on_policy.rows, tmp_path / "on", weights.old, weights.old)
    check_departure(
        name,
        f"loss on-policy, the project's constant x {MAX_NEW_TOKENS} (-mean A_i x length) vs TRL's "
        "(-mean A_i = 0) (departure)",
        on_policy.loss * MAX_NEW_TOKENS,
        on_trl.loss,
        steps=FIXED,
    )


def test_kl_is_a_reward_penalty_in_trl_a_loss_term_here(weights, tmp_path):
    """Departure pinned: where the KL goes. TRL's RLOO subtracts ``beta x sum_t (old_logps_t -
    ref_logps_t)`` (k1 at the policy that scored the rollout, summed over the completion; "RLOO
    applies KL as a reward penalty", ``RLOOTrainer._generate_and_score_completions``) from each
    reward before the leave-one-out baseline, and its loss has no KL term; the project's RLOO keeps
    the rewards and adds ``kl_coef x k3`` per token to the loss (``GRPOAlgorithm.__init__``:
    ``kl_in_loss`` unless ``reinforce_pp``; ``GRPOAlgorithm.loss``, DeepSeekMath eq. 3-4).

    On-policy at the "old" weights, beta = ``kl_coef`` = 0.04, the reference the initial model.
    TRL's definition is checked from the project's numbers: its logged ``kl`` is the per-token mean
    of the k1 of the project's rollout (its old and reference log-probs); its advantages and
    gradient are those of the project's RLOO without KL (``kl_coef`` 0, ``constant`` x
    ``max_new_tokens``) whose reward function returns the fixed rewards minus ``beta x`` each
    completion's summed k1 (from that rollout). The project's own advantages and gradient (KL in the
    loss) differ from TRL's (L2) by more than 1e-3 relative (100 x the bar)."""
    name = f"RLOO KL {BETA:g}: k1 in TRL's reward vs k3 in the project's loss"
    ours, batch, _ = run_project(rloo_config("constant", BETA), weights, weights.old, weights.old)
    rows = all_rows(ours)
    theirs = run_trl(weights, rows, tmp_path / "kl", weights.old, weights.old, beta=BETA)
    mask = batch.completion_mask
    k1 = (batch.logprobs - batch.ref_logprobs) * mask
    check_close(
        name,
        "TRL's kl = the per-token mean of the rollout's k1",
        [float(k1.sum() / mask.sum())],
        [theirs.metrics["kl"]],
        steps=FIXED,
        rtol=RTOL,
        atol=LOGP_SPACING,
        tolerance=MEAN_TOLERANCE,
    )
    penalty = dict(zip(rows, (BETA * k1.sum(1)).tolist()))
    fed, _, _ = run_project(rloo_config("constant"), weights, weights.old, weights.old, penalty=penalty)
    assert fed.rows == rows and "kl" not in fed.metrics
    fed_name = f"{name}: TRL's = the project's without KL, rewards minus beta x summed k1"
    check_vector(
        name,
        "TRL's advantages = the project's without KL, rewards minus beta x summed k1",
        fed.advantages,
        theirs.advantages,
    )
    check_gradients(f"{fed_name} (constant x {MAX_NEW_TOKENS})", scaled(fed.grads, MAX_NEW_TOKENS), theirs.grads)
    check_advantages_and_gradient_depart(name, ours, theirs)


def test_normalize_advantages_has_no_project_equivalent(weights, tmp_path):
    """Departure pinned: TRL's ``normalize_advantages=True`` (``RLOOTrainer._generate_and_score_completions``:
    ``(advantages - nanmean) / (nanstd + 1e-4)`` over the whole generation batch, unbiased std) has
    no counterpart in the project's ``rloo``: ``rloo_advantages`` (``trainer_core/objectives/grpo_family.py``)
    never divides, and ``scale_rewards`` switches the ``grpo`` estimator only (``GRPOAlgorithm.__init__``).

    On-policy at the "old" weights, no KL. TRL's advantages are the project's centred over the 12
    completions and divided by their std + 1e-4 (checked), its gradient the project's ``constant``
    gradient x ``max_new_tokens / (std + 1e-4)`` (the centring moves no gradient: the leave-one-out
    advantages already sum to 0 in each group); the advantages and gradients differ (L2) by more
    than 1e-3 relative (100 x the bar)."""
    name = "RLOO normalize_advantages (TRL) vs none (project)"
    for scale_rewards in (True, False):
        assert GRPOAlgorithm(rloo_config("constant", scale_rewards=scale_rewards)).estimator == "rloo"
    ours, _, _ = run_project(rloo_config("constant"), weights, weights.old, weights.old)
    theirs = run_trl(weights, all_rows(ours), tmp_path, weights.old, weights.old, normalize_advantages=True)
    std = float(ours.advantages.std()) + NORM_EPS
    check_vector(
        name,
        "TRL's advantages = the project's, centred, / (batch std + 1e-4)",
        (ours.advantages - ours.advantages.mean()) / std,
        theirs.advantages,
    )
    check_gradients(
        f"{name}: TRL's = the project's constant x {MAX_NEW_TOKENS} / (batch std + 1e-4)",
        scaled(ours.grads, MAX_NEW_TOKENS / std),
        theirs.grads,
    )
    check_advantages_and_gradient_depart(name, ours, theirs)


def test_token_and_sequence_means_are_not_trls_sequence_sum(weights, tmp_path):
    """Departure pinned: the aggregation. TRL's RLOO loss sums each completion's term over its
    tokens (one ratio of summed log-probs) and averages over the completions
    (``RLOOTrainer._compute_loss``: ``per_sequence_loss.mean()``), i.e. ``sum_t / N``; the project's
    aggregations (``trainer_core/objectives/grpo_family.py``) are ``constant`` (``sum_t / (N x
    max_new_tokens)``: on-policy TRL's gradient / ``max_new_tokens``, the parity test),
    ``token_mean`` (the default: ``sum_t / tokens``) and ``sequence_mean`` (``sum_t / (N x |o_i|)``).

    On-policy at the "old" weights, no KL. ``token_mean``'s gradient is TRL's x ``N / tokens``
    (checked: the same direction on one batch, a step size that depends on the batch's length);
    ``sequence_mean``'s direction differs from TRL's: the two unit gradients differ (L2) by more
    than 1e-3 (100 x the bar)."""
    name = "RLOO aggregation, TRL's sum over tokens / N vs the project's"
    ours, _, _ = run_project(rloo_config("token_mean"), weights, weights.old, weights.old)
    theirs = run_trl(weights, all_rows(ours), tmp_path, weights.old, weights.old)
    tokens, sequences = float(ours.mask.sum()), len(ours.rows)
    check_gradients(f"{name}: TRL's = token_mean x tokens / N", scaled(ours.grads, tokens / sequences), theirs.grads)
    means, _, _ = run_project(rloo_config("sequence_mean"), weights, weights.old, weights.old)
    assert means.rows == ours.rows
    mine, other = flat(means.grads), flat(theirs.grads)
    check_departure_vectors(
        name,
        "gradient direction, the project's sequence_mean vs TRL's (departure, L2 of unit vectors)",
        mine / mine.norm(),
        other / other.norm(),
        steps=FIXED,
    )
