"""Padding-free packing: the token-budget sampler, the packed collation, and packed == padded.

A packed micro-batch is one [1, S] row of whole sequences end to end, ``position_ids``
restarting at each; transformers then masks attention block-diagonally (sdpa here, on CPU).
The SFT loss sum and its gradients, the DPO sequence log-probs and the reward model's pair
scores of a packed batch must equal those of the same rows padded into a [B, T] batch (fp32,
1e-5), so packing changes the speed and nothing else. The first token of each packed row gets
``loss_mask`` 0: it is never a prediction target (the unpacked shift never scores it either).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

from tests.tiny import LLAMA_2X32
from trainer_core.config import SFTConfig, load_config
from trainer_core.data.batching import (
    DataPosition,
    PackedBatchSampler,
    collate_causal,
    collate_causal_packed,
    collate_pairs,
    collate_pairs_packed,
    iterate_batches,
)
from trainer_core.errors import ConfigError
from trainer_core.modeling.forwards.pairs import pair_logprobs, pair_rewards
from trainer_core.training.supervised import (
    DPOObjective,
    RewardObjective,
    SFTObjective,
    causal_source,
    collate_with_reference,
)

PAD = 0
VOCAB = 64


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 40) for _ in range(n)]


def _rows(lengths: list[int], seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for n in lengths:
        prompt = max(1, n // 3)
        rows.append(
            {"input_ids": [rng.randint(1, VOCAB - 1) for _ in range(n)], "loss_mask": [0] * prompt + [1] * (n - prompt)}
        )
    return rows


def _pairs(num: int) -> list[dict]:
    rows = _rows(_lengths(2 * num, seed=3))
    return [
        {
            "chosen_input_ids": rows[i]["input_ids"],
            "chosen_loss_mask": rows[i]["loss_mask"],
            "rejected_input_ids": rows[num + i]["input_ids"],
            "rejected_loss_mask": rows[num + i]["loss_mask"],
            "ref_chosen_logprobs": -10.0 - i,
            "ref_rejected_logprobs": -12.0 + i,
        }
        for i in range(num)
    ]


def _config(**extra) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        **LLAMA_2X32,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        **extra,
    )


def _causal_lm() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)


def _step(model, objective, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    out = objective.step(model, batch)
    out.loss_sum.backward()
    return out.loss_sum.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _assert_same_step(model, objective, padded, packed) -> None:
    loss, grads = _step(model, objective, padded)
    packed_loss, packed_grads = _step(model, objective, packed)
    assert packed_loss.item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-5)
    assert len(grads) == len(packed_grads) > 0
    for g, h in zip(grads, packed_grads):
        torch.testing.assert_close(h, g, rtol=1e-5, atol=1e-5)


# --- sampler ----------------------------------------------------------------------------------


def test_packed_sampler_fills_the_budget_with_every_row_once_per_epoch():
    lengths = _lengths(300)
    sampler = PackedBatchSampler(lengths, 200, seed=0)
    for epoch in range(3):
        batches = sampler.batches(epoch)
        assert sorted(itertools.chain.from_iterable(batches)) == list(range(300))
        assert all(sum(lengths[i] for i in b) <= 200 for b in batches)
        # first-fit decreasing leaves little room: all but a few micro-batches are near full
        assert sum(lengths) / (200 * len(batches)) > 0.9
    assert sampler.batches(1) == PackedBatchSampler(lengths, 200, seed=0).batches(1)
    assert sampler.batches(1) != sampler.batches(2)
    assert PackedBatchSampler(lengths, 200, seed=0, shuffle=False).batches(0) == PackedBatchSampler(
        lengths, 200, seed=5, shuffle=False
    ).batches(3)


def test_packed_sampler_resumes_exactly_across_epochs_of_different_lengths():
    lengths = _lengths(57, seed=4)
    sampler = PackedBatchSampler(lengths, 64, seed=2, chunk_rows=16)
    counts = {len(sampler.batches(e)) for e in range(8)}
    full = list(itertools.islice(iterate_batches(sampler, DataPosition(0, 0)), 60))
    assert len(counts) > 1, "the scenario needs epochs that pack into different numbers of micro-batches"
    for stop in (1, len(sampler.batches(0)), 41):
        positions = list(itertools.islice(iterate_batches(sampler, DataPosition(0, 0)), stop))
        restored = DataPosition.from_dict(positions[-1][1].to_dict())
        resumed = list(
            itertools.islice(
                iterate_batches(PackedBatchSampler(lengths, 64, seed=2, chunk_rows=16), restored), 60 - stop
            )
        )
        assert resumed == full[stop:]


def test_packed_sampler_rejects_a_row_over_the_budget_naming_it():
    with pytest.raises(ValueError, match=r"row 2 has 50 tokens, more than max_tokens_per_micro_batch=40"):
        PackedBatchSampler([10, 20, 50, 5], 40, seed=0)
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch=8"):
        causal_source(_rows([5, 9]), PAD, 4, 0, torch.device("cpu"), max_tokens=8)


def test_packing_config_is_per_supervised_stage_and_excludes_global_batch_size():
    assert SFTConfig(max_tokens_per_micro_batch=4096).max_tokens_per_micro_batch == 4096
    with pytest.raises(ValueError, match="global_batch_size counts examples"):
        SFTConfig(max_tokens_per_micro_batch=4096, global_batch_size=64)
    config = load_config("configs/demo.yaml", overrides={"dpo.max_tokens_per_micro_batch": 512})
    assert config.dpo.max_tokens_per_micro_batch == 512 and config.sft.max_tokens_per_micro_batch is None
    with pytest.raises(Exception, match="max_tokens_per_micro_batch"):
        load_config("configs/demo.yaml", overrides={"grpo.max_tokens_per_micro_batch": 512})


# --- collation --------------------------------------------------------------------------------


def test_packed_collation_restarts_positions_and_drops_first_token_targets():
    rows = [
        {"input_ids": [5, 6, 7], "loss_mask": [1, 1, 1]},
        {"input_ids": [9], "loss_mask": [1]},
        {"input_ids": [3, 4, PAD], "loss_mask": [0, 1, 1]},
    ]
    batch = collate_causal_packed(rows, PAD)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 9, 3, 4, PAD]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 0, 1, 1]]
    assert batch["sequence_ids"].tolist() == [[0, 0, 0, 1, 2, 2, 2]]
    assert batch["last_token_index"].tolist() == [2, 3, 5]  # the last token that is not padding
    assert "attention_mask" not in batch
    with pytest.raises(ValueError, match="empty row"):
        collate_causal_packed([{"input_ids": [1, 2]}, {"input_ids": []}], PAD)


def test_packed_pairs_put_the_chosen_first_then_the_rejected():
    pairs = _pairs(3)
    batch = collate_with_reference(pairs, PAD, packed=True)
    lengths = [len(p["chosen_input_ids"]) for p in pairs] + [len(p["rejected_input_ids"]) for p in pairs]
    assert batch["input_ids"].shape == (1, sum(lengths))
    assert torch.bincount(batch["sequence_ids"][0]).tolist() == lengths
    assert batch["ref_chosen_logprobs"].tolist() == [-10.0, -11.0, -12.0]
    assert RewardObjective(None, 1).count(batch) == 3
    assert DPOObjective(0.1, None, 1).num_tokens(batch) == sum(lengths)


# --- packed == padded -------------------------------------------------------------------------


def test_packed_sft_loss_and_gradients_equal_the_padded_ones():
    model = _causal_lm()
    rows = _rows([5, 17, 3, 40, 12, 9])
    objective = SFTObjective(None, 1, chunk_size=16)
    padded, packed = collate_causal(rows, PAD), collate_causal_packed(rows, PAD)
    assert objective.count(packed) == objective.count(padded)
    assert objective.num_tokens(packed) == objective.num_tokens(padded) == sum(len(r["input_ids"]) for r in rows)
    _assert_same_step(model, objective, padded, packed)


def test_no_token_attends_across_packed_rows():
    """Changing one row changes no other row's log-probs: attention stops at the row boundaries."""
    model = _causal_lm()
    rows = _rows([6, 11, 8])
    changed = [dict(r) for r in rows]
    changed[0] = {**rows[0], "input_ids": [(t % (VOCAB - 1)) + 1 for t in rows[0]["input_ids"][::-1]]}

    def as_pairs(rows: list[dict]) -> list[dict]:
        return [
            {
                "chosen_input_ids": r["input_ids"],
                "chosen_loss_mask": r["loss_mask"],
                "rejected_input_ids": r["input_ids"],
                "rejected_loss_mask": r["loss_mask"],
            }
            for r in rows
        ]

    with torch.no_grad():
        before, _ = pair_logprobs(model, collate_pairs_packed(as_pairs(rows), PAD))
        after, _ = pair_logprobs(model, collate_pairs_packed(as_pairs(changed), PAD))
    assert before[0] != after[0]
    torch.testing.assert_close(after[1:], before[1:], rtol=1e-6, atol=1e-6)


def test_packed_dpo_logprobs_loss_and_gradients_equal_the_padded_ones():
    model = _causal_lm()
    pairs = _pairs(4)
    padded, packed = collate_with_reference(pairs, PAD), collate_with_reference(pairs, PAD, packed=True)
    with torch.no_grad():
        for got, want in zip(pair_logprobs(model, packed, chunk_size=8), pair_logprobs(model, padded, chunk_size=8)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _assert_same_step(model, DPOObjective(0.1, None, 1, chunk_size=8), padded, packed)


def test_packed_reward_scores_and_gradients_equal_the_padded_ones():
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(_config(num_labels=1), dtype=torch.float32)
    pairs = _pairs(4)
    pairs[1]["rejected_input_ids"] = pairs[1]["rejected_input_ids"][:-1] + [PAD]  # pools before a trailing pad
    padded, packed = collate_pairs(pairs, PAD), collate_pairs_packed(pairs, PAD)
    with torch.no_grad():
        for got, want in zip(pair_rewards(model, packed), pair_rewards(model, padded)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _assert_same_step(model, RewardObjective(None, 1), padded, packed)


def test_flex_attention_document_masks_score_packed_rows_as_padded_ones():
    """``model.attn_implementation: flex_attention`` on a packed batch: transformers builds a
    BlockMask from the restarting positions (document masks); the DPO log-probs (a no-grad
    forward: CPU flex attention has no backward; the GPU test covers training) equal the padded
    batch's through sdpa."""
    torch.manual_seed(0)
    flex = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32, attn_implementation="flex_attention")
    pairs = _pairs(4)
    with torch.no_grad():
        padded = pair_logprobs(_causal_lm(), collate_pairs(pairs, PAD))
        packed = pair_logprobs(flex, collate_pairs_packed(pairs, PAD))
    for got, want in zip(packed, padded):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_scores_need_a_sequence_classifier():
    with pytest.raises(ValueError, match="not a sequence classifier"):
        pair_rewards(_causal_lm(), collate_pairs_packed(_pairs(2), PAD))


@pytest.mark.gpu
@pytest.mark.parametrize("attn_implementation", ["sdpa", "flex_attention"])
def test_packed_equals_padded_with_the_cuda_attention_kernels(attn_implementation):
    """On CUDA, packed rows through transformers' sdpa (block-diagonal mask) and flex_attention
    (document mask, a BlockMask from the restarting positions): SFT loss and gradients, and DPO
    log-probs, equal the padded batch's (fp32, 1e-4: the kernels differ from the padded path's)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32, attn_implementation=attn_implementation)
    model.to(device)
    rows = _rows([5, 17, 3, 40, 12, 9])

    def on_device(batch):
        return {k: v.to(device) for k, v in batch.items()}

    objective = SFTObjective(None, 1, chunk_size=16)
    loss, grads = _step(model, objective, on_device(collate_causal(rows, PAD)))
    packed_loss, packed_grads = _step(model, objective, on_device(collate_causal_packed(rows, PAD)))
    assert packed_loss.item() == pytest.approx(loss.item(), rel=1e-4, abs=1e-4)
    for g, h in zip(grads, packed_grads):
        torch.testing.assert_close(h, g, rtol=1e-4, atol=1e-4)
    pairs = _pairs(4)
    with torch.no_grad():
        padded = pair_logprobs(model, on_device(collate_pairs(pairs, PAD)))
        packed = pair_logprobs(model, on_device(collate_pairs_packed(pairs, PAD)))
    for got, want in zip(packed, padded):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
