"""Sampling from a tiny random policy: EOS handling, masks, seeded determinism, and log-probs
from the full forward equal to the sampling distribution's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.tiny import LLAMA_1X16
from trainer_core.config import GenerationConfig
from trainer_core.generation.engines import HFEngine
from trainer_core.modeling.forwards.completion import Completions, PolicyAndValue, completion_forward, value_head_for
from trainer_core.training.rl.rollout import RolloutBatch

PAD, EOS, VOCAB = 0, 1, 12


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        **LLAMA_1X16,
        max_position_embeddings=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
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
    out = HFEngine(policy).generate(
        ids, mask, gen, eos_id=EOS, pad_id=PAD, generator=torch.Generator().manual_seed(seed)
    )
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
        prompt_ids=torch.arange(n)[:, None],
        prompt_mask=torch.ones(n, 1),
        completion_ids=torch.zeros(n, t, dtype=torch.long),
        completion_mask=torch.ones(n, t),
        logprobs=torch.zeros(n, t),
        scores=torch.arange(n).float(),
        prompt_index=torch.arange(n) // 2,
        sampled=False,
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
    full = completion_forward(model, batch, temperature=temperature, with_values=True, full_logits=True)
    out = completion_forward(model, batch, temperature=temperature, with_values=True)
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
    out = completion_forward(
        model, Completions(ids, p_mask, tokens, torch.zeros(tokens.shape)), temperature=1.0, with_values=False
    )
    assert (out.logprobs == 0).all() and (out.entropies == 0).all()
    out.logprobs.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and (g == 0).all() for g in grads)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("full_logits", [False, True])
def test_padding_free_forwards_equal_padded(policy, full_logits):
    """``padding_free`` runs the RL forwards on the real tokens only (rows end to end, position
    ids restarting per row): log-probs, entropies, values on real tokens, the teacher's hidden
    states and the gradients equal the padded forward's within 1e-5, an environment's tokens and
    a row that counts nothing included."""
    from trainer_core.modeling.forwards.completion import completion_hidden

    ids, p_mask = _prompts()
    tokens, c_mask = _sample(policy, 2, max_new_tokens=6)
    observed = torch.zeros(c_mask.shape)
    observed[1, 1:3] = c_mask[1, 1:3]  # two of row 1's tokens are an environment's: attended, not counted
    batches = [
        Completions(ids, p_mask, tokens, c_mask - observed, observation_mask=observed),
        Completions(ids, p_mask, tokens, c_mask * torch.tensor([[1.0], [0.0]])),
    ]
    torch.manual_seed(1)
    head = value_head_for(policy)
    torch.nn.init.normal_(head.weight)
    model = PolicyAndValue(policy, head)
    params = list(model.parameters())
    for batch in batches:
        mask = batch.completion_mask
        weights = torch.randn(mask.shape) * mask
        outs, grads = [], []
        for padding_free in (False, True):
            out = completion_forward(
                model, batch, temperature=0.7, with_values=True, full_logits=full_logits, padding_free=padding_free
            )
            outs.append(out)
            grads.append(torch.autograd.grad((out.logprobs * weights).sum() + (out.values * mask).sum(), params))
        padded, packed = outs
        torch.testing.assert_close(packed.logprobs, padded.logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed.entropies, padded.entropies, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed.values * mask, padded.values * mask, atol=1e-5, rtol=1e-5)
        for (name, _), got, want in zip(model.named_parameters(), grads[1], grads[0]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=name)
        with torch.no_grad():
            ref = [
                completion_forward(policy, batch, temperature=0.7, full_logits=full_logits, padding_free=flag)
                for flag in (False, True)
            ]
        torch.testing.assert_close(ref[1].logprobs, ref[0].logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            completion_hidden(policy, batch, padding_free=True), completion_hidden(policy, batch), atol=1e-5, rtol=1e-5
        )


def test_a_micro_batch_forwards_its_own_longest_row(policy):
    """Columns that are padding in every row (prompt columns on the left, completion columns on the
    right: a micro-batch cut from a wider rollout) are cut before the forward and come back as
    zero columns: the decoder sees the rows' own width, the outputs equal the tight batch's."""
    ids, p_mask = _prompts()
    tokens, c_mask = _sample(policy, 2, max_new_tokens=6)
    tight = Completions(ids, p_mask, tokens, c_mask)
    wide = Completions(
        torch.nn.functional.pad(ids, (3, 0)),
        torch.nn.functional.pad(p_mask, (3, 0)),
        torch.nn.functional.pad(tokens, (0, 4)),
        torch.nn.functional.pad(c_mask, (0, 4)),
    )
    trimmed = wide.trimmed()
    assert trimmed.prompt_ids.shape == ids.shape and trimmed.completion_ids.shape == tokens.shape
    seen = []
    hook = policy.model.register_forward_pre_hook(
        lambda mod, args, kw: seen.append(kw["input_ids"].shape), with_kwargs=True
    )
    try:
        model = PolicyAndValue(policy)
        with torch.no_grad():
            got = completion_forward(model, wide, temperature=1.0, with_values=False)
            want = completion_forward(model, tight, temperature=1.0, with_values=False)
            ref = completion_forward(policy, wide, temperature=1.0)
    finally:
        hook.remove()
    assert seen == [(2, ids.shape[1] + tokens.shape[1])] * 3
    width = tokens.shape[1]
    assert got.logprobs.shape == (2, width + 4) and (got.logprobs[:, width:] == 0).all()
    torch.testing.assert_close(got.logprobs[:, :width], want.logprobs, atol=1e-6, rtol=0)
    torch.testing.assert_close(ref.logprobs, got.logprobs, atol=1e-6, rtol=0)


def test_micro_batches_take_rows_of_like_length_together():
    """Rows go longest first (ties in row order) into micro-batches of the given size; None or a
    size past the row count keeps one micro-batch of every row in order."""
    from trainer_core.training.rl.batches import micro_batch_rows

    lengths = torch.tensor([3, 9, 9, 1, 5])
    assert [g.tolist() for g in micro_batch_rows(lengths, 2)] == [[1, 2], [4, 0], [3]]
    assert [g.tolist() for g in micro_batch_rows(lengths, None)] == [[0, 1, 2, 3, 4]]
    assert [g.tolist() for g in micro_batch_rows(lengths, 8)] == [[0, 1, 2, 3, 4]]
