"""The GRPO family's estimators, loss aggregations, overlong shaping and clip-higher against
hand-worked values (trainer_core/objectives/grpo_family.py)."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch.testing import assert_close

from trainer_core.objectives.grpo import group_advantages
from trainer_core.objectives.grpo_family import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGGREGATIONS,
    clipped_policy_loss_asymmetric,
    dapo_overlong_penalty,
)
from trainer_core.objectives.ppo import clipped_policy_loss

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0])


def _per_token(values: list[float]) -> torch.Tensor:
    return torch.tensor(values)[:, None] * MASK


def test_grpo_group_mean_and_std():
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735; 0.5 / (0.57735 + 1e-4) = 0.86588
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert_close(ADVANTAGE_ESTIMATORS["grpo"](SCORES, MASK, 4), _per_token([a, -a, -a, a]))
    # the same numbers as the existing per-sequence group_advantages, broadcast over real tokens
    assert_close(ADVANTAGE_ESTIMATORS["grpo"](SCORES, MASK, 4), group_advantages(SCORES, 4)[:, None] * MASK)


def test_dr_grpo_group_mean_only():
    assert_close(ADVANTAGE_ESTIMATORS["dr_grpo"](SCORES, MASK, 4), _per_token([0.5, -0.5, -0.5, 0.5]))


def test_rloo_leave_one_out_baseline():
    # r_0 = 1 minus the mean of (0, 0, 1) = 1/3 -> 2/3; r_1 = 0 minus mean of (1, 0, 1) -> -2/3
    third = 2 / 3
    assert_close(ADVANTAGE_ESTIMATORS["rloo"](SCORES, MASK, 4), _per_token([third, -third, -third, third]))
    # two groups of two: [3, 1] -> [2, -2]; [5, 5] -> [0, 0]
    scores, mask = torch.tensor([3.0, 1.0, 5.0, 5.0]), torch.ones(4, 1)
    assert_close(ADVANTAGE_ESTIMATORS["rloo"](scores, mask, 2), torch.tensor([[2.0], [-2.0], [0.0], [0.0]]))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_a_group_of_equal_scores_has_zero_advantage(name):
    out = ADVANTAGE_ESTIMATORS[name](torch.tensor([0.7, 0.7, 0.7, 0.7]), MASK, 4)
    assert_close(out, torch.zeros_like(MASK))


def test_reinforce_pp_without_kl():
    # scores [1, 0], mask [[1, 1, 0], [1, 1, 1]]: returns-to-go [[1, 1, 0], [0, 0, 0]]; the 5 real
    # tokens have mean 0.4 and unbiased variance (2 * 0.36 + 3 * 0.16) / 4 = 0.3:
    # (1 - 0.4) / sqrt(0.3) = 1.09545, (0 - 0.4) / sqrt(0.3) = -0.73030
    scores, mask = torch.tensor([1.0, 0.0]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    hi, lo = 0.6 / math.sqrt(0.3 + 1e-8), -0.4 / math.sqrt(0.3 + 1e-8)
    want = torch.tensor([[hi, hi, 0.0], [lo, lo, lo]])
    assert_close(ADVANTAGE_ESTIMATORS["reinforce_pp"](scores, mask, 2), want)


def test_reinforce_pp_credits_every_policy_token_of_a_multi_turn_completion():
    """The first row's second token is an observation (mask 0): its policy tokens, either side
    of it, get the return of a row of two policy tokens, as without the observation."""
    scores = torch.tensor([1.0, 0.0])
    gapped = ADVANTAGE_ESTIMATORS["reinforce_pp"](scores, torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]), 2)
    plain = ADVANTAGE_ESTIMATORS["reinforce_pp"](scores, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]), 2)
    assert_close(gapped[0, [0, 2]], plain[0, [0, 1]]) and gapped[0, 1] == 0
    assert_close(gapped[1], plain[1])


def test_reinforce_pp_puts_token_kl_in_the_reward():
    # one row of 3 real tokens, kl_coef 0.5, k1 KL = logp - ref_logp = [0.2, 0.0, 0.4]:
    # rewards [-0.1, 0, -0.2 + 1] = [-0.1, 0, 0.8]; returns-to-go [0.7, 0.8, 0.8];
    # mean 0.76667, unbiased var ((-0.06667)^2 + 2 * 0.03333^2) / 2 = 0.0033333
    scores, mask = torch.tensor([1.0, 1.0]), torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.2, -1.0, -1.4], [0.0, 0.0, 0.0]])
    returns = torch.tensor([0.7, 0.8, 0.8])
    mean, var = returns.mean(), returns.var()
    assert var.item() == pytest.approx(1 / 300)
    want = torch.zeros(2, 3)
    want[0] = (returns - mean) / torch.sqrt(var + 1e-8)
    got = ADVANTAGE_ESTIMATORS["reinforce_pp"](scores, mask, 2, logprobs=logprobs, ref_logprobs=ref, kl_coef=0.5)
    assert_close(got, want)
    with pytest.raises(ValueError, match="needs logprobs"):
        ADVANTAGE_ESTIMATORS["reinforce_pp"](scores, mask, 2, kl_coef=0.5)


class _ThreadSum:
    """An all-reduce sum between two threads (ranks): each call returns both ranks' tensors summed."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.slots: list[torch.Tensor | None] = [None, None]

    def rank(self, r: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.slots[r] = t
            self.barrier.wait()
            total = self.slots[0] + self.slots[1]
            self.barrier.wait()
            return total

        return reduce


def test_reinforce_pp_whitens_across_ranks_as_on_one():
    """Two ranks holding half the rows each, their statistics summed, get the single-process
    whitening of all the rows."""
    torch.manual_seed(0)
    scores = torch.rand(4)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    whole = ADVANTAGE_ESTIMATORS["reinforce_pp"](scores, mask, 2)
    reduce, parts = _ThreadSum(), [None, None]

    def run(r: int) -> None:
        rows = slice(2 * r, 2 * r + 2)
        parts[r] = ADVANTAGE_ESTIMATORS["reinforce_pp"](scores[rows], mask[rows], 2, all_reduce_sum=reduce.rank(r))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert_close(torch.cat(parts), whole)
    assert not torch.allclose(parts[0], ADVANTAGE_ESTIMATORS["reinforce_pp"](scores[:2], mask[:2], 2))


LOSSES = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
LMASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def test_loss_aggregations_worked_values():
    kw = {"num_tokens": 3.0, "num_sequences": 2.0, "max_new_tokens": 4}
    assert LOSS_AGGREGATIONS["token_mean"](LOSSES, LMASK, **kw).item() == pytest.approx(6 / 3)
    assert LOSS_AGGREGATIONS["sequence_mean"](LOSSES, LMASK, **kw).item() == pytest.approx((1.5 + 3.0) / 2)
    assert LOSS_AGGREGATIONS["constant"](LOSSES, LMASK, **kw).item() == pytest.approx(6 / 8)


@pytest.mark.parametrize("name", ["token_mean", "sequence_mean", "constant"])
def test_rank_shares_sum_to_the_whole_and_empty_rows_count_nothing(name):
    torch.manual_seed(1)
    losses, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1.0
    kw = {"num_tokens": mask.sum(), "num_sequences": torch.tensor(6.0), "max_new_tokens": 5}
    whole = LOSS_AGGREGATIONS[name](losses, mask, **kw)
    shares = LOSS_AGGREGATIONS[name](losses[:2], mask[:2], **kw) + LOSS_AGGREGATIONS[name](losses[2:], mask[2:], **kw)
    assert_close(shares, whole)
    empty = LOSS_AGGREGATIONS[name](losses[:1], torch.zeros(1, 5), **kw)
    assert empty.item() == 0.0 and math.isfinite(empty.item())


def test_overlong_penalty_regimes_and_boundaries():
    lengths = torch.tensor([10, 16, 17, 18, 20, 21])
    got = dapo_overlong_penalty(lengths, max_new_tokens=20, buffer_tokens=4)
    assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    assert_close(dapo_overlong_penalty(torch.tensor([18]), 20, 4, penalty=0.5), torch.tensor([-0.25]))
    with pytest.raises(ValueError, match="buffer_tokens"):
        dapo_overlong_penalty(lengths, 20, 21)


def test_clip_higher():
    logp = torch.log(torch.tensor([[1.3, 0.7, 1.1]]))
    old = torch.zeros(1, 3)
    losses, m = clipped_policy_loss_asymmetric(logp, old, torch.tensor([[1.0, -1.0, 1.0]]), 0.2, 0.28)
    # ratio 1.3, A 1: clipped at 1.28 -> -1.28; ratio 0.7, A -1: clipped at 0.8 -> 0.8; 1.1 inside -> -1.1
    assert_close(losses, torch.tensor([[-1.28, 0.8, -1.1]]))
    assert m["clipped"].tolist() == [[1.0, 1.0, 0.0]]
    # symmetric ranges give PPO's clipped loss exactly
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    assert_close(
        clipped_policy_loss_asymmetric(logp, old, adv, 0.2, 0.2)[0], clipped_policy_loss(logp, old, adv, 0.2)[0]
    )


def test_truncated_importance_weights_scale_the_policy_term_not_the_kl():
    """With ``is_weights`` the policy loss of each token is weighted (verl's tis_imp_ratio_cap),
    the KL term is not: at ratio 1, A = 1, weights 0 the loss is kl_coef x KL alone."""
    from trainer_core.config import GRPOConfig
    from trainer_core.modeling.forwards.completion import PolicyForward
    from trainer_core.training.rl.algorithms import GRPOAlgorithm
    from trainer_core.training.rl.batches import MiniBatchCounts
    from trainer_core.training.rl.rollout import RolloutBatch

    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    ref = torch.tensor([[-1.5, -2.0], [-0.5, 0.0]])
    batch = RolloutBatch(
        prompt_ids=torch.zeros(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1),
        completion_ids=torch.zeros(2, 2, dtype=torch.long),
        completion_mask=mask,
        logprobs=logprobs,
        scores=torch.tensor([1.0, 0.0]),
        prompt_index=torch.zeros(2, dtype=torch.long),
        ref_logprobs=ref,
    )
    batch.advantages = mask.clone()
    algo = GRPOAlgorithm(GRPOConfig(group_size=2, kl_coef=0.1))
    out = PolicyForward(logprobs, torch.zeros_like(mask), None)
    counts = MiniBatchCounts(num_tokens=torch.tensor(3.0), num_sequences=torch.tensor(2.0))
    unweighted, _ = algo.loss(batch, out, counts, kl_coef=0.1)
    batch.is_weights = torch.zeros_like(mask)
    weighted, _ = algo.loss(batch, out, counts, kl_coef=0.1)
    # k3 KL of token (-1.0 vs -1.5): exp(-0.5) - (-0.5) - 1 = 0.10653; the others 0.
    kl = math.exp(-0.5) + 0.5 - 1.0
    assert weighted.item() == pytest.approx(0.1 * kl / 3, rel=1e-5)
    assert unweighted.item() == pytest.approx((-3.0 + 0.1 * kl) / 3, rel=1e-5)  # -A x ratio 1 on 3 tokens


def test_masked_out_rows_keep_their_tokens_and_count_nothing():
    from trainer_core.generation.engines import Generated
    from trainer_core.training.rl.batches import SampledRound, masked_out
    from trainer_core.training.rl.rewards import PromptItem

    g = Generated(torch.tensor([[5, 6]]), torch.ones(1, 2), torch.tensor([[-0.5, -0.25]]))
    item = PromptItem([{"role": "user", "content": "q"}], [1], "1")
    sample = SampledRound([item], torch.tensor([[1]]), torch.ones(1, 1), g, ["t"], torch.tensor([0.0]))
    out = masked_out(sample)
    assert out.generated.completion_ids.tolist() == [[5, 6]]
    assert out.generated.completion_mask.sum() == 0 and out.generated.logprobs.abs().sum() == 0
    assert sample.generated.completion_mask.sum() == 2  # the original is left as it was
