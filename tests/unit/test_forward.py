"""The chunked LM head equals the full-logits computation (values and gradients), never holds
[N, V] logits, and runs inside whatever wrapper calls the model.

Shape legend: B batch, T tokens, H hidden, V vocabulary, N counted tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.tiny import LLAMA_2X32
from trainer_core.modeling.forwards.kernels import chunked_linear_logprobs, nll_sum_kernel
from trainer_core.modeling.forwards.token import masked_nll_sum, masked_token_logprobs
from trainer_core.objectives.logprobs import compute_logprobs, shift_mask
from trainer_core.objectives.sft import sft_loss

VOCAB = 97


def _model(vocab: int = VOCAB):
    torch.manual_seed(0)
    config = LlamaConfig(
        **LLAMA_2X32,
        vocab_size=vocab,
    )
    return AutoModelForCausalLM.from_config(config)


def _batch():
    """3 sequences of 12; N = 7 + 5 + 2 = 14 counted next tokens."""
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 5:] = 1
    loss_mask[1, 4:9] = 1
    loss_mask[2, 10:] = 1
    return ids, attention, loss_mask


def _full(model, ids, attention, loss_mask):
    """The reference: [B, T - 1] log-probs from the whole [B, T, V] logits."""
    return compute_logprobs(model(input_ids=ids, attention_mask=attention).logits, ids) * shift_mask(loss_mask)


def _grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_grads(actual: dict, expected: dict, atol: float) -> None:
    assert sorted(actual) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, atol=atol, rtol=0, msg=name)


# --- the pure chunked head -------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 5, 37, 4096])
def test_chunked_linear_logprobs_equals_log_softmax_gather(chunk_size, with_bias):
    """Against ``log_softmax(h W^T + b)`` gathered at the targets, with an upstream gradient that is
    not all ones (DPO weighs each token by its pair's sigmoid): values and the gradients of
    hidden, weight and bias within 1e-5 (fp32), whether one chunk or 37 run."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    weight = torch.randn(101, 16, generator=gen, requires_grad=True)
    bias = torch.randn(101, generator=gen, requires_grad=True) if with_bias else None
    targets = torch.randint(0, 101, (37,), generator=gen)
    upstream = torch.randn(37, generator=gen)
    leaves = [t for t in (hidden, weight, bias) if t is not None]

    expected = torch.log_softmax(F.linear(hidden, weight, bias), -1).gather(1, targets[:, None])[:, 0]
    expected_grads = torch.autograd.grad(expected, leaves, upstream)
    actual = chunked_linear_logprobs(hidden, weight, bias, targets, chunk_size)
    actual_grads = torch.autograd.grad(actual, leaves, upstream)

    assert actual.dtype == torch.float32 and actual.shape == (37,)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    for got, want in zip(actual_grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_chunked_linear_logprobs_rejects_a_bad_chunk_size_or_shapes():
    hidden, weight, targets = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        chunked_linear_logprobs(hidden, weight, None, targets, 0)
    with pytest.raises(ValueError, match="expected hidden"):
        chunked_linear_logprobs(hidden, weight.t(), None, targets)


# --- the causal-LM forward -------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [4, 1024])
def test_values_and_gradients_match_the_full_logits_path(chunk_size):
    """Token log-probs and every parameter's gradient equal the full-logits path (1e-6), with 4
    chunks of N = 14 or one; the uncounted positions are exactly 0."""
    ids, attention, loss_mask = _batch()
    model = _model()
    full = _full(model, ids, attention, loss_mask)
    full_grads = _grads(model, full.sum())
    fast = masked_token_logprobs(model, ids, attention, loss_mask, chunk_size=chunk_size)
    fast_grads = _grads(model, fast.sum())
    torch.testing.assert_close(fast, full, atol=1e-6, rtol=0)
    assert torch.count_nonzero(fast) == int(loss_mask[:, 1:].sum()) == 14
    _assert_same_grads(fast_grads, full_grads, atol=1e-6)


def test_nll_sum_equals_sft_loss_of_the_full_logits():
    """``masked_nll_sum`` (the CPU kernel: the chunked head) is SFT's loss sum: value and gradients."""
    ids, attention, loss_mask = _batch()
    model = _model()
    assert nll_sum_kernel(torch.device("cpu")) == "torch"
    expected, _ = sft_loss(_full(model, ids, attention, loss_mask), shift_mask(loss_mask))
    expected_grads = _grads(model, expected)
    actual = masked_nll_sum(model, ids, attention, loss_mask, chunk_size=3)
    actual_grads = _grads(model, actual)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    _assert_same_grads(actual_grads, expected_grads, atol=1e-6)


def test_under_bf16_autocast_the_head_computes_as_the_full_path():
    """bf16-mixed (the loop's ``backend.autocast()``): the chunked head's matmuls run in bf16 in the
    forward and in the backward (which autocast does not cover): log-probs within 1e-5 of the full
    path under autocast; every gradient equal within 1e-5 but the head weight's, which sums the
    chunks' bf16 products in float32 (one bf16 matmul on the full path): within 1% of its largest."""
    ids, attention, loss_mask = _batch()
    model = _model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = _full(model, ids, attention, loss_mask)
    full_grads = _grads(model, full.sum())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = masked_token_logprobs(model, ids, attention, loss_mask, chunk_size=4)
    fast_grads = _grads(model, fast.sum())
    torch.testing.assert_close(fast, full, atol=1e-5, rtol=0)
    head = full_grads.pop("lm_head.weight")
    torch.testing.assert_close(fast_grads.pop("lm_head.weight"), head, atol=1e-2 * float(head.abs().max()), rtol=0)
    _assert_same_grads(fast_grads, full_grads, atol=1e-5)


def test_no_grad_forward_keeps_no_graph():
    """The reference pass (``torch.no_grad``) gets the same values and no autograd graph."""
    ids, attention, loss_mask = _batch()
    model = _model()
    with torch.no_grad():
        expected = _full(model, ids, attention, loss_mask)
        actual = masked_token_logprobs(model, ids, attention, loss_mask, chunk_size=4)
    assert actual.grad_fn is None
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)


def test_models_with_logit_softcapping_take_the_full_path():
    ids, attention, loss_mask = _batch()
    model = _model()
    model.config.final_logit_softcapping = 30.0
    outputs = []
    model.register_forward_hook(lambda mod, args, out: outputs.append(out))
    masked_token_logprobs(model, ids, attention, loss_mask)
    assert outputs and outputs[0].logits.shape == (3, 12, VOCAB), "the model's own forward (full logits) must run"


def test_the_full_path_keeps_packed_rows_apart():
    """A packed micro-batch through the full-logits path (here: a soft-capped head) scores each row
    as that row alone: the model runs without a KV cache, without which transformers would not
    read the rows' boundaries from ``position_ids`` and every row would attend to the ones before it."""
    from trainer_core.data.batching import collate_causal_packed

    model = _model()
    model.config.final_logit_softcapping = 30.0
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 1, 1, 1, 1]},
        {"input_ids": [10, 11, 12], "loss_mask": [0, 1, 1]},
    ]
    batch = collate_causal_packed(rows, pad_id=0)
    with torch.no_grad():
        packed = masked_token_logprobs(
            model,
            batch["input_ids"],
            None,
            batch["loss_mask"],
            position_ids=batch["position_ids"],
            counted_index=batch["counted_index"],
        )
        alone = [
            masked_token_logprobs(
                model,
                torch.tensor([r["input_ids"]]),
                torch.ones(1, len(r["input_ids"])),
                torch.tensor([r["loss_mask"]]),
            )[0]
            for r in rows
        ]
    torch.testing.assert_close(packed[0][packed[0] != 0], torch.cat(alone), atol=1e-6, rtol=0)


def test_packing_is_refused_for_a_model_whose_rows_would_see_each_other():
    """OPT builds its causal mask without ``position_ids``: packed rows would attend across rows,
    so packing is refused with an error naming the setting and the class; Llama keeps them apart.
    The probe leaves the model in the mode it found it in."""
    from transformers import OPTConfig

    from trainer_core.errors import ConfigError
    from trainer_core.modeling.forwards.padding_free import check_packed_rows_apart

    llama = _model().train()
    check_packed_rows_apart(_Wrapper(llama), "sft.max_tokens_per_micro_batch")
    assert llama.training
    torch.manual_seed(0)
    opt = AutoModelForCausalLM.from_config(
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            ffn_dim=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            word_embed_proj_dim=16,
        )
    )
    with pytest.raises(ConfigError, match=r"grpo.padding_free: OPTForCausalLM lets packed rows attend to each other"):
        check_packed_rows_apart(opt, "grpo.padding_free")


class _Wrapper(nn.Module):
    """What DDP and a DeepSpeed engine look like to the forward: ``.module``, called with the kwargs."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_a_wrapped_model_computes_the_head_inside_one_call_of_its_module():
    """Through a wrapper, the inner model's forward hooks (where FSDP2 all-gathers, ZeRO-3 fetches,
    DDP's wrapper does its bookkeeping around the call) fire once per forward, around the whole
    computation: they see ``loss_mask`` and the [N] log-probs come out of that one call. The
    values equal the plain model's; afterwards the model is the plain HF model again (no
    instance ``forward``, same class and state-dict keys, its own forward returns logits)."""
    ids, attention, loss_mask = _batch()
    model = _model()
    keys, cls = list(model.state_dict()), type(model)
    calls, head_calls = [], []
    hooks = [
        model.register_forward_pre_hook(lambda mod, args, kw: calls.append(("pre", sorted(kw))), with_kwargs=True),
        model.register_forward_hook(lambda mod, args, out: calls.append(("post", tuple(out.shape)))),
        model.lm_head.register_forward_pre_hook(lambda mod, args: head_calls.append(1)),
    ]

    wrapped = masked_token_logprobs(_Wrapper(model), ids, attention, loss_mask, chunk_size=4)
    assert calls == [
        ("pre", ["attention_mask", "counted_index", "input_ids", "loss_mask", "position_ids"]),
        ("post", (14,)),
    ]
    assert head_calls == []  # its weight is used, the module not called: no per-chunk hook or collective
    for hook in hooks:
        hook.remove()
    plain = masked_token_logprobs(model, ids, attention, loss_mask, chunk_size=4)
    torch.testing.assert_close(wrapped, plain, atol=0, rtol=0)
    assert "forward" not in model.__dict__ and type(model) is cls and list(model.state_dict()) == keys
    assert model(input_ids=ids, attention_mask=attention).logits.shape == (3, 12, VOCAB)


def test_an_instance_forward_already_there_is_put_back():
    ids, attention, loss_mask = _batch()
    model = _model()
    own = model.forward
    model.forward = own  # e.g. a patch some library installed on the instance
    masked_token_logprobs(model, ids, attention, loss_mask)
    assert model.__dict__["forward"] is own


# --- memory: no [N, V] -------------------------------------------------------------------


class _VocabRows(TorchDispatchMode):
    """Records the rows of every tensor an operator allocates whose last dim is the vocabulary
    (views allocate nothing and are left out: the head weight's transpose [H, V] is one)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.ndim and t.shape[-1] == self.vocab:
                    self.rows.append(t.numel() // self.vocab)
        return out


def _peak_batch(vocab: int):
    """4 sequences of 24 with N = 64 counted next tokens (16 per sequence)."""
    ids = torch.randint(0, vocab, (4, 24), generator=torch.Generator().manual_seed(2))
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 8:] = 1
    return ids, torch.ones_like(ids), loss_mask


def _vocab_tensors(fn, vocab: int) -> tuple[list[int], list[int]]:
    """(rows of every [.., V] tensor made in forward and backward, numel of every tensor saved for backward)."""
    saved: list[int] = []
    mode = _VocabRows(vocab)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t), mode:
        loss = fn()
    with mode:
        loss.backward()
    return mode.rows, saved


def test_the_chunked_path_never_holds_n_by_v():
    """Chunk 8, N = 64, V = 300: no tensor made in the forward or the backward has more than 8
    rows of V, and nothing saved for the backward has N x V elements; the full path, checked the
    same way, makes [B, T, V] tensors and saves [B(T - 1), V] log-softmax (so the check can fail)."""
    vocab, chunk = 300, 8
    model = _model(vocab)
    ids, attention, loss_mask = _peak_batch(vocab)
    num_counted = int(loss_mask[:, 1:].sum())
    assert num_counted == 64

    rows, saved = _vocab_tensors(
        lambda: -masked_token_logprobs(model, ids, attention, loss_mask, chunk_size=chunk).sum(), vocab
    )
    assert rows and max(rows) <= chunk, sorted(set(rows))
    assert max(saved) < num_counted * vocab

    rows, saved = _vocab_tensors(lambda: -_full(model, ids, attention, loss_mask).sum(), vocab)
    assert max(rows) >= 4 * 24 and max(saved) >= num_counted * vocab


# --- CUDA: Liger's fused linear cross-entropy ------------------------------------------------


@pytest.mark.gpu
def test_liger_nll_sum_matches_the_chunked_head_on_cuda():
    """On CUDA with liger-kernel, SFT's loss sum comes from Liger's fused linear cross-entropy and
    equals the chunked torch head's (fp32): value and every gradient."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("liger_kernel")
    from trainer_core.modeling.forwards.kernels import NLL_SUM_KERNELS

    device = torch.device("cuda")
    assert nll_sum_kernel(device) == "liger"
    model = _model(vocab=VOCAB).to(device)
    ids, attention, loss_mask = (t.to(device) for t in _batch())
    liger = masked_nll_sum(model, ids, attention, loss_mask)
    liger_grads = _grads(model, liger)
    kernels = dict(NLL_SUM_KERNELS)
    try:
        NLL_SUM_KERNELS["liger"] = kernels["torch"]
        chunked = masked_nll_sum(model, ids, attention, loss_mask, chunk_size=4)
    finally:
        NLL_SUM_KERNELS.update(kernels)
    chunked_grads = _grads(model, chunked)
    torch.testing.assert_close(liger, chunked, rtol=1e-4, atol=1e-4)
    _assert_same_grads(liger_grads, chunked_grads, atol=1e-4)
