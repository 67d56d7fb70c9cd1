"""Sampling from a tiny random policy: EOS handling, masks, seeded determinism, and log-probs
from the full forward equal to the sampling distribution's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from trainer_core.config import GenerationConfig
from trainer_core.generation.engines import HFEngine
from trainer_core.training.rl.rollout import (
    Completions,
    PolicyAndValue,
    RolloutBatch,
    completion_forward,
    policy_forward,
    value_head_for,
)

PAD, EOS, VOCAB = 0, 1, 12


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight[EOS] += 0.6  # make EOS likely enough that some rows stop early
    return model


def _prompts():
    ids = torch.tensor([[PAD, PAD, 5, 6], [3, 4, 5, 7]])
    return ids, (ids != PAD).float()


def _sample(policy, seed: int, max_new_tokens: int = 10):
    ids, mask = _prompts()
    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0)
    out = HFEngine(policy).generate(ids, mask, gen, eos_id=EOS, pad_id=PAD, generator=torch.Generator().manual_seed(seed))
    return out.completion_ids, out.completion_mask


def test_rows_stop_after_eos_and_are_padded(policy):
    for seed in range(5):
        tokens, mask = _sample(policy, seed)
        assert tokens.shape == mask.shape and tokens.shape[1] <= 10
        for row, m in zip(tokens.tolist(), mask.tolist()):
            n = int(sum(m))
            assert m == [1.0] * n + [0.0] * (len(m) - n)
            assert all(t == PAD for t in row[n:])
            assert EOS not in row[: n - 1]  # EOS, if any, is the last real token


def test_same_generator_state_same_tokens(policy):
    a, _ = _sample(policy, 3)
    b, _ = _sample(policy, 3)
    c, _ = _sample(policy, 4)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_forward_logprobs_match_stepwise_distribution(policy):
    """log p(token_t) from one forward over [prompt | completion] equals log_softmax of the logits
    of the unpadded prefix, for every real completion token; padding positions are 0."""
    ids, p_mask = _prompts()
    tokens, c_mask = _sample(policy, 1, max_new_tokens=6)
    with torch.no_grad():
        full = completion_forward(policy, Completions(ids, p_mask, tokens, c_mask), temperature=1.0, full_logits=True)
    logprobs, entropies = full.logprobs, full.entropies
    assert logprobs.shape == tokens.shape and (entropies >= 0).all()
    for i in range(2):
        prompt = ids[i][p_mask[i] > 0]
        for t in range(int(c_mask[i].sum())):
            prefix = torch.cat([prompt, tokens[i, :t]])[None]
            with torch.no_grad():
                want = torch.log_softmax(policy(input_ids=prefix).logits[0, -1], -1)[tokens[i, t]]
            assert logprobs[i, t].item() == pytest.approx(want.item(), abs=1e-5)
        assert (logprobs[i][c_mask[i] == 0] == 0).all()


def test_rollout_batch_select_takes_rows():
    n, t = 4, 3
    batch = RolloutBatch(
        prompt_ids=torch.arange(n)[:, None], prompt_mask=torch.ones(n, 1), completion_ids=torch.zeros(n, t, dtype=torch.long),
        completion_mask=torch.ones(n, t), logprobs=torch.zeros(n, t), scores=torch.arange(n).float(),
        prompt_index=torch.arange(n) // 2, sampled=False,
    )
    mb = batch.select(torch.tensor([3, 0]))
    assert mb.scores.tolist() == [3.0, 0.0] and mb.prompt_ids[:, 0].tolist() == [3, 0]
    assert mb.ref_logprobs is None and mb.num_sequences == 2
    assert mb.sampled is False  # a mini-batch of the dataset's completions says so (its metrics read it)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_completion_forward_equals_full_logits(policy, temperature):
    """The RL forwards that never form [N, T, V] logits (the chunked LM head on completion tokens,
    inside the policy-and-value module's forward and, for the reference, inside the HF model's)
    give the full-logits path's log-probs, entropies and values within 1e-5, gradients included."""
    ids, p_mask = _prompts()
    tokens, c_mask = _sample(policy, 2, max_new_tokens=6)
    batch = Completions(ids, p_mask, tokens, c_mask)
    torch.manual_seed(1)
    head = value_head_for(policy)
    torch.nn.init.normal_(head.weight)
    model = PolicyAndValue(policy, head)
    full = policy_forward(model, batch, temperature=temperature, with_values=True, full_logits=True)
    out = policy_forward(model, batch, temperature=temperature, with_values=True)
    torch.testing.assert_close(out.logprobs, full.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropies, full.entropies, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.values, full.values, atol=1e-5, rtol=1e-5)
    assert not out.entropies.requires_grad and (out.logprobs[c_mask == 0] == 0).all()
    ref = completion_forward(policy, batch, temperature=temperature)
    torch.testing.assert_close(ref.logprobs, full.logprobs, atol=1e-5, rtol=1e-5)
    assert ref.values is None
    ref_full = completion_forward(policy, batch, temperature=temperature, full_logits=True)
    torch.testing.assert_close(ref_full.logprobs, full.logprobs, atol=0, rtol=0)
    # Gradients of a weighted sum of log-probs and values, through the chunked head and the full one.
    weights = torch.randn(c_mask.shape) * c_mask
    params = list(model.parameters())
    chunked = torch.autograd.grad((out.logprobs * weights).sum() + out.values.sum(), params)
    want = torch.autograd.grad((full.logprobs * weights).sum() + full.values.sum(), params)
    for (name, _), got, expected in zip(model.named_parameters(), chunked, want):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=name)


def test_masked_row_scores_nothing(policy):
    """A row whose completion mask is all zero (the placeholder a rank forwards when it has no row
    of a mini-batch) gives zero log-probs and entropies and a zero gradient, without NaN."""
    ids, p_mask = _prompts()
    tokens, _ = _sample(policy, 2, max_new_tokens=4)
    model = PolicyAndValue(policy)
    out = policy_forward(model, Completions(ids, p_mask, tokens, torch.zeros(tokens.shape)), temperature=1.0,
                         with_values=False)
    assert (out.logprobs == 0).all() and (out.entropies == 0).all()
    out.logprobs.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and (g == 0).all() for g in grads)
    model.zero_grad(set_to_none=True)
