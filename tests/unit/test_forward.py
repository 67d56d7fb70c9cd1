"""The masked-head forward equals the full-logits computation, values and gradients."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from trainer_core.forward import masked_token_logprobs
from trainer_core.objectives.logprobs import compute_logprobs, shift_mask


def _model():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97)
    return AutoModelForCausalLM.from_config(config)


def _batch():
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(1))
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 5:] = 1
    loss_mask[1, 4:9] = 1
    loss_mask[2, 10:] = 1
    return ids, attention, loss_mask


def test_values_and_gradients_match_the_full_logits_path():
    ids, attention, loss_mask = _batch()
    model = _model()
    full = compute_logprobs(model(input_ids=ids, attention_mask=attention).logits, ids) * shift_mask(loss_mask)
    full.sum().backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    fast = masked_token_logprobs(model, ids, attention, loss_mask)
    fast.sum().backward()
    assert torch.allclose(fast, full, atol=1e-6)
    assert torch.count_nonzero(fast) == int(loss_mask[:, 1:].sum())
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, full_grads[name], atol=1e-6), name


def test_models_with_logit_softcapping_take_the_full_path():
    ids, attention, loss_mask = _batch()
    model = _model()
    model.config.final_logit_softcapping = 30.0
    calls = []
    model.register_forward_hook(lambda mod, args, out: calls.append(out))
    masked_token_logprobs(model, ids, attention, loss_mask)
    assert calls, "the whole model (not just its decoder) must run when the head is not a plain linear map"
