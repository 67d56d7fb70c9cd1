"""Causal-LM forwards that score counted tokens only, the LM head in chunks, inside any wrapper.

SFT and DPO need log-probabilities of completion tokens only. A plain forward materialises
logits [B, T, V] for every position, prompts and padding included; here the decoder runs on
the whole sequence and the LM head only on the N hidden states of counted positions, a chunk
at a time (:mod:`trainer_core.objectives.chunked`): the head's matmul costs O(N V) instead of
O(B T V), and its extra memory O(chunk_size V) instead of O(N V) float32.

Wrapped models (DDP, FSDP2, a DeepSpeed engine) run the same computation inside the wrapper's
forward call, so that DDP's forward bookkeeping, FSDP2's all-gather of the root's parameters
(the LM head's weight is one of them) with its pre-backward hook on the output, and ZeRO-3's
parameter fetch happen as for a plain forward. Like Liger-Kernel's model patches
(``liger_kernel.transformers.model.llama.lce_forward`` replaces ``LlamaForCausalLM.forward``
so that the wrapped module's forward computes the loss), the causal LM's ``forward`` is
replaced; here only on the instance and only for the duration of one call
(:func:`forward_replaced`), and ``loss_mask`` travels through the wrapper's forward as a
keyword argument. The class, the parameters and the state dict stay those of the HF model,
and nothing stays on the instance afterwards (no reference cycle keeps a freed model alive).

Shape legend: B batch, T tokens, H hidden, V vocabulary, N counted tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from trainer_core.errors import ConfigError
from trainer_core.objectives.chunked import CHUNK_SIZE_TOKENS, NLL_SUM_KERNELS, chunked_linear_logprobs, nll_sum_kernel
from trainer_core.objectives.logprobs import compute_logprobs, sequence_logprobs, shift_mask

IMPLICIT_REWARD_KEY = "posttrain_implicit_reward"
"""Attribute of an HF config (saved in its ``config.json``) that makes a causal LM a reward model
with the reference-free implicit reward; its value is ``{"beta": float}``
(:func:`implicit_reward_beta`)."""

HeadFn = Callable[[Tensor, Tensor, "Tensor | None", Tensor, int], Tensor]
"""(hidden [N, H], weight [V, H], bias [V] | None, targets [N] long, chunk_size) -> a tensor."""


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The HF model inside a DDP module or a DeepSpeed engine (``.module``); FSDP2 shards in place."""
    while not isinstance(model, PreTrainedModel) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def implicit_reward_beta(model: nn.Module) -> float | None:
    """``beta`` of a causal LM that is an implicit reward model (:data:`IMPLICIT_REWARD_KEY` in its
    config), or None: the model is a scalar-head (sequence-classification) reward model or a policy.

    Args:
        model: an HF model, plain or as a backend wrapped it.
    """
    spec = getattr(getattr(unwrap_causal_lm(model), "config", None), IMPLICIT_REWARD_KEY, None)
    return None if spec is None else float(spec["beta"])


def mark_implicit_reward(model: nn.Module, beta: float) -> None:
    """Make the causal LM ``model`` an implicit reward model of scale ``beta`` (written to its
    config, and so to the ``config.json`` of every directory it is saved to).

    Raises:
        ValueError: ``beta`` is not positive.
    """
    if not beta > 0:
        raise ValueError(f"implicit reward beta must be > 0, got {beta}")
    setattr(unwrap_causal_lm(model).config, IMPLICIT_REWARD_KEY, {"beta": float(beta)})


def sequence_rewards(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor, counted_index: Tensor | None = None
) -> Tensor:
    """A reward model's reward of each padded (prompt + completion) row, [B] float32.

    Two parameterisations, told apart by the model (:func:`implicit_reward_beta`):

    - scalar head (InstructGPT, Ouyang et al. 2022; TRL's ``RewardTrainer``): an HF
      ``*ForSequenceClassification`` with one label, read at each row's last real token;
      ``loss_mask`` is not used.
    - implicit, reference-free (SimPO, Meng et al. 2024, eq. 4): a causal LM's mean log-probability
      of the completion tokens times ``beta``, ``r(x, y) = beta / |y| * log pi(y | x)``; the
      completion is where ``loss_mask`` is 1 (:func:`masked_token_logprobs`).

    Args:
        model: the reward model, plain or as a backend wrapped it.
        input_ids: [B, T] long, right-padded.
        attention_mask: [B, T] long, 1 = real token.
        loss_mask: [B, T] long, 1 = completion token.
        counted_index: the collated batch's ``counted_index`` of ``loss_mask``, or None.
    """
    beta = implicit_reward_beta(model)
    if beta is None:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float()
    token_logprobs = masked_token_logprobs(model, input_ids, attention_mask, loss_mask, counted_index=counted_index)
    mask = shift_mask(loss_mask)
    return beta * sequence_logprobs(token_logprobs, mask).float() / mask.sum(-1).clamp(min=1)


def head_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(decoder, lm_head) of an unwrapped model whose logits are exactly ``lm_head(decoder(x))``, else None.

    None for models that transform the logits after the head (Gemma-2's soft-capping,
    Cohere's ``logit_scale``, Granite's ``logits_scaling``) and for non-HF modules.
    """
    if not isinstance(model, PreTrainedModel):
        return None
    config = getattr(model, "config", None)
    if config is None or getattr(config, "final_logit_softcapping", None) is not None:
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in ("logit_scale", "logits_scaling")):
        return None
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or not isinstance(head, nn.Linear):
        return None
    return decoder, head


def frozen_head(model: nn.Module) -> tuple[Tensor, Tensor | None]:
    """A frozen causal LM's whole output projection, ``(weight [V, H], bias [V] or None)``, detached:
    gathered from its shards under FSDP2 (``DTensor.full_tensor``) and ZeRO-3
    (``deepspeed.zero.GatheredParameters``, copied), so collective there (every rank calls it).

    Raises:
        ValueError: the model's logits are not a plain linear head.
    """
    parts = head_parts(unwrap_causal_lm(model))
    if parts is None:
        raise ValueError(f"{type(unwrap_causal_lm(model)).__name__}: its logits are not a plain linear head")
    head = parts[1]
    params = [p for p in (head.weight, head.bias) if p is not None]
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return head.weight.detach().clone(), None if head.bias is None else head.bias.detach().clone()
    whole = lambda p: None if p is None else (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
    return whole(head.weight), whole(head.bias)


@contextlib.contextmanager
def forward_replaced(module: nn.Module, forward: Callable[..., Tensor]) -> Iterator[None]:
    """``module.forward`` is ``forward`` inside the block (an instance attribute shadowing the class's)."""
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def _counted_head_forward(
    decoder: nn.Module, head: nn.Linear, head_fn: HeadFn, chunk_size: int,
    input_ids: Tensor, attention_mask: Tensor | None, loss_mask: Tensor, position_ids: Tensor | None = None,
    counted_index: Tensor | None = None,
) -> Tensor:
    """The causal LM's forward for one call: the decoder on the whole batch, ``head_fn`` on counted positions.

    Args:
        decoder: the model's decoder (returns ``last_hidden_state`` [B, T, H]).
        head: the LM head; its weight and bias go to ``head_fn`` (the module itself is not
            called, so no per-chunk hook or collective runs, whatever each rank's N).
        head_fn: see :data:`HeadFn`.
        chunk_size: tokens per chunk of the head.
        input_ids: [B, T] long.
        attention_mask: [B, T] long, 1 = real token; None for a packed batch.
        loss_mask: [B, T] long, 1 = token counted (aligned with ``input_ids``).
        position_ids: [B, T] long restarting at each packed sequence, or None (positions 0..T-1).
        counted_index: [N] long from the host (:func:`~trainer_core.data.batching.counted_index`):
            the positions are selected without waiting for the device; None: by the boolean mask
            (a host synchronisation on CUDA).

    Returns:
        What ``head_fn`` returns for the N counted next-token predictions.
    """
    hidden = decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state  # [B, T, H]
    if counted_index is None:
        counted = loss_mask[:, 1:].bool()
        selected = hidden[:, :-1][counted]  # [N, H]
        targets = input_ids[:, 1:][counted]  # [N]
    else:
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, counted_index)  # [N, H]
        targets = input_ids.reshape(-1).index_select(0, counted_index + 1)  # [N]
    return head_fn(selected, head.weight, head.bias, targets, chunk_size)


def _through_wrapper(
    model: nn.Module, head_fn: HeadFn, chunk_size: int, input_ids: Tensor, attention_mask: Tensor | None,
    loss_mask: Tensor, position_ids: Tensor | None, counted_index: Tensor | None,
) -> Tensor | None:
    """``head_fn`` on the counted positions, computed by one call of ``model`` (wrapped or not).

    Returns None when the unwrapped model's logits are not a plain linear head (the caller
    then takes the full-logits path).
    """
    inner = unwrap_causal_lm(model)
    parts = head_parts(inner)
    if parts is None:
        return None
    forward = partial(_counted_head_forward, *parts, head_fn, chunk_size)
    with forward_replaced(inner, forward):
        return model(
            input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, position_ids=position_ids,
            counted_index=counted_index,
        )


def _full_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, loss_mask: Tensor, position_ids: Tensor | None,
    counted_index: Tensor | None = None,
) -> Tensor:
    # No KV cache: transformers keeps a packed batch's rows apart (by ``position_ids``) only without one.
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits  # [B, T, V]
    return compute_logprobs(logits, input_ids) * shift_mask(loss_mask)


def masked_token_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, loss_mask: Tensor, *,
    chunk_size: int = CHUNK_SIZE_TOKENS, position_ids: Tensor | None = None, counted_index: Tensor | None = None,
) -> Tensor:
    """Next-token log-probs at counted positions, zero elsewhere.

    Equal (up to float rounding) to ``compute_logprobs(model(...).logits, input_ids) *
    shift_mask(loss_mask)``, without the [B, T, V] logits: the LM head runs on the counted
    positions, ``chunk_size`` at a time (:func:`~trainer_core.objectives.chunked.chunked_linear_logprobs`).
    Models whose logits are not a plain linear head over the decoder's last hidden state
    (soft-capping, logit scaling) take that full path.

    Args:
        model: an HF causal LM, plain or as a backend wrapped it (DDP, FSDP2, DeepSpeed engine).
        input_ids: [B, T] long.
        attention_mask: [B, T] long, 1 = real token; None for a packed batch (``position_ids`` given).
        loss_mask: [B, T] long, 1 = token counted in the loss (aligned with ``input_ids``); 0 on
            the first token of each packed sequence.
        chunk_size: tokens per chunk of the LM head (the extra memory is O(chunk_size x V)).
        position_ids: [B, T] long, restarting at 0 at each packed sequence
            (:func:`~trainer_core.data.batching.collate_causal_packed`); None: 0..T-1.
        counted_index: [N] long, the host's :func:`~trainer_core.data.batching.counted_index` of
            ``loss_mask`` (the collated batches carry it): no host synchronisation; None: the
            positions come from ``loss_mask`` on the device.

    Returns:
        [B, T - 1] float32; position t holds log p(input_ids[:, t + 1]) where
        ``loss_mask[:, t + 1] == 1``, else 0.
    """
    args = (input_ids, attention_mask, loss_mask, position_ids, counted_index)
    logprobs = _through_wrapper(model, chunked_linear_logprobs, chunk_size, *args)  # [N]
    if logprobs is None:
        return _full_logprobs(model, *args)
    num_rows, length = input_ids.shape
    if counted_index is None:
        counted = loss_mask[:, 1:].bool()
        out = torch.zeros(counted.shape, dtype=logprobs.dtype, device=logprobs.device)
        return out.masked_scatter(counted, logprobs)
    out = torch.zeros(num_rows * (length - 1), dtype=logprobs.dtype, device=logprobs.device)
    # b * T + t (a position of [B, T]) -> b * (T - 1) + t (one of [B, T - 1]): minus b.
    return out.index_copy(0, counted_index - torch.div(counted_index, length, rounding_mode="floor"), logprobs).view(
        num_rows, length - 1
    )


def masked_nll_sum(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, loss_mask: Tensor, *,
    chunk_size: int = CHUNK_SIZE_TOKENS, position_ids: Tensor | None = None, counted_index: Tensor | None = None,
) -> Tensor:
    """Summed next-token NLL of the counted tokens: SFT's ``loss_sum``.

    Equal (up to float rounding) to ``sft_loss(masked_token_logprobs(...), shift_mask(loss_mask))[0]``.
    On CUDA with ``liger-kernel`` installed, Liger's fused linear cross-entropy computes it
    (:data:`~trainer_core.objectives.chunked.NLL_SUM_KERNELS`); elsewhere the chunked head.

    Args:
        model: as :func:`masked_token_logprobs`.
        input_ids: [B, T] long.
        attention_mask: [B, T] long, 1 = real token; None for a packed batch.
        loss_mask: [B, T] long, 1 = token counted in the loss.
        chunk_size: tokens per chunk of the torch implementation.
        position_ids: as :func:`masked_token_logprobs`.
        counted_index: as :func:`masked_token_logprobs`.

    Returns:
        Scalar float32 sum of ``-log p`` over the counted next tokens.
    """
    args = (input_ids, attention_mask, loss_mask, position_ids, counted_index)
    kernel = NLL_SUM_KERNELS[nll_sum_kernel(input_ids.device)]
    loss_sum = _through_wrapper(model, kernel, chunk_size, *args)
    if loss_sum is None:
        return -_full_logprobs(model, *args).sum()
    return loss_sum


def _packed_scores_forward(
    base: nn.Module, score: nn.Module, input_ids: Tensor, position_ids: Tensor, last_token_index: Tensor
) -> Tensor:
    """A sequence classifier's forward for one packed call: the base model, then ``score`` at the pooled positions."""
    hidden = base(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state  # [1, S, H]
    return score(hidden[0, last_token_index])  # [R, 1]


def packed_sequence_scores(model: nn.Module, input_ids: Tensor, position_ids: Tensor, last_token_index: Tensor) -> Tensor:
    """Scalar scores of the R sequences of a packed batch from a ``*ForSequenceClassification`` model.

    Equal (up to float rounding) to the pooled ``logits`` of the same sequences padded into a
    [R, T] batch: the base model runs on the packed tokens (``position_ids`` restart per sequence,
    so no token attends across sequences) and the ``score`` head on each sequence's pooled
    position only, inside one call of ``model`` (wrapped or not, as :func:`masked_token_logprobs`).

    Args:
        model: an HF sequence classifier with one label (``score`` head), plain or wrapped by a backend.
        input_ids: [1, S] long.
        position_ids: [1, S] long, restarting at 0 at each sequence.
        last_token_index: [R] long, each sequence's pooled position
            (:func:`~trainer_core.data.batching.collate_pairs_packed`).

    Returns:
        [R] float32 scores.

    Raises:
        ValueError: the unwrapped model has no ``score`` head.
    """
    inner = unwrap_causal_lm(model)
    score = getattr(inner, "score", None)
    if not isinstance(inner, PreTrainedModel) or not isinstance(score, nn.Module):
        raise ValueError(f"{type(inner).__name__} is not a sequence classifier with a `score` head: cannot score packed rows")
    base = getattr(inner, inner.base_model_prefix)
    with forward_replaced(inner, partial(_packed_scores_forward, base, score)):
        scores = model(input_ids=input_ids, position_ids=position_ids, last_token_index=last_token_index)
    return scores.squeeze(-1).float()


def _reshard(model: nn.Module) -> None:
    """Put FSDP2's sharded parameters back on ``model`` after a forward without backward (the root
    module keeps its parameters unsharded after its forward, for the backward that here never
    comes; an optimizer or a state dict taken then would see the unsharded ones)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def check_packed_rows_apart(model: nn.Module, setting: str) -> None:
    """Refuse packed forwards for a model whose attention lets packed rows see each other.

    Packing (``max_tokens_per_micro_batch``, the RL stages' ``padding_free``) relies on
    transformers reading the rows' boundaries from ``position_ids`` when it builds the causal
    mask. Architectures whose mask is built without them (OPT and BLOOM in transformers 5.24)
    would silently let every row attend to the rows packed before it. The probe: the last hidden
    states of a row packed behind two different first rows, in eval mode (no dropout). Rows kept
    apart give the same states; rows that see each other differ by the first row's influence.
    Collective under FSDP2 and ZeRO-3 (the forward gathers parameters): every rank calls it.

    Args:
        model: the model as the stage calls it (a backend's wrapper, a ``PolicyAndValue``, a plain
            HF causal LM or sequence classifier): called with ``input_ids`` and ``position_ids``
            [1, 11] and ``output_hidden_states``.
        setting: the config field that asked for packing (named in the error).

    Raises:
        ConfigError: the second row's states depend on the first row.
    """
    params, inner = next(model.parameters()), unwrap_causal_lm(model)
    inner = getattr(inner, "policy", inner)  # the RL stages' PolicyAndValue: its policy
    vocab = getattr(getattr(inner, "config", None), "vocab_size", None) or 2
    gen = torch.Generator().manual_seed(0)
    second, firsts = torch.randint(0, vocab, (6,), generator=gen), torch.randint(0, vocab, (2, 5), generator=gen)
    positions = torch.cat([torch.arange(5), torch.arange(6)])[None].to(params.device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            states = [model(input_ids=torch.cat([first, second])[None].to(params.device), position_ids=positions,
                            use_cache=False, output_hidden_states=True).hidden_states[-1][0, 5:].float()
                      for first in firsts]
    finally:
        model.train(training)
        _reshard(model)
    drift, scale = float((states[0] - states[1]).abs().max()), float(states[0].abs().max())
    if drift > 1e-3 * max(scale, 1.0):
        name = type(inner).__name__
        raise ConfigError(f"{setting}: {name} lets packed rows attend to each other (a row's hidden states moved by "
                          f"{drift:.3g} when the row packed before it changed): its attention mask is not built from "
                          "position_ids in this transformers version; turn packing off for this model")


def padding_free_index(attention_mask: Tensor) -> Tensor:
    """The flat positions of a padded batch's real tokens, row-major: the order
    :func:`padding_free_outputs` packs them in.

    Args:
        attention_mask: [N, L] int or float, nonzero = a real token.

    Returns:
        [S] long indices into the flattened [N * L] batch, S = the number of real tokens.
    """
    return attention_mask.reshape(-1).nonzero().squeeze(1)


def padding_free_outputs(
    run: Callable[..., tuple[Tensor, ...]], input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
    pack_index: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """``run``'s per-token outputs over a padded batch, computed on its real tokens only when
    ``pack_index`` is given (verl's ``use_remove_padding``, OpenRLHF's ``packing_samples``).

    Without ``pack_index``, ``run`` sees the padded batch as it is. With it, the real tokens run end
    to end as one [1, S] row with ``position_ids`` restarting at 0 at each original row, no
    attention mask and no KV cache: transformers then lets no token attend across rows (a block-diagonal causal
    mask on sdpa and eager, document masks with flex_attention, varlen with flash_attention_2;
    ``transformers.masking_utils.find_packed_sequence_indices``), and each output is scattered
    back to the padded layout, zeros at padding. The forward then costs the real tokens' compute
    instead of N x L (for sdpa and eager the attention's mask is S x S, so the gain needs the
    padding to outweigh it; flex and flash attention skip the masked blocks).

    Args:
        run: ``run(input_ids=, attention_mask=, position_ids=, use_cache=False)`` -> tensors of shape
            [B, L', ...] (``use_cache`` False: transformers looks for packed rows only without a cache).
        input_ids: [N, L] long.
        attention_mask: [N, L], 1 = a real token.
        position_ids: [N, L] long, 0 at each row's first real token and counting up over its real
            tokens (``(attention_mask.cumsum(-1) - 1).clamp(min=0)``).
        pack_index: [S] long from :func:`padding_free_index` of ``attention_mask``, or None.

    Returns:
        ``run``'s outputs, each [N, L, ...] (padding positions 0 with ``pack_index``); gradients
        flow to the real positions.
    """
    if pack_index is None:
        return run(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    rows, length = input_ids.shape
    packed = run(input_ids=input_ids.reshape(-1)[pack_index][None], attention_mask=None,
                 position_ids=position_ids.reshape(-1)[pack_index][None], use_cache=False)
    padded = []
    for out in packed:  # [1, S, ...]
        whole = out.new_zeros((rows * length, *out.shape[2:]))
        padded.append(whole.index_copy(0, pack_index, out[0]).view(rows, length, *out.shape[2:]))
    return tuple(padded)
