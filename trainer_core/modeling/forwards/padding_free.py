"""Packed forwards: a padded batch's real tokens run as one row (:func:`padding_free_outputs`), and
the check that a model keeps packed rows apart (:func:`check_packed_rows_apart`).

Shape legend: N rows, L tokens per padded row, S real tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from trainer_core.errors import ConfigError
from trainer_core.modeling.forwards.heads import unwrap_causal_lm


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
            states = [
                model(
                    input_ids=torch.cat([first, second])[None].to(params.device),
                    position_ids=positions,
                    use_cache=False,
                    output_hidden_states=True,
                )
                .hidden_states[-1][0, 5:]
                .float()
                for first in firsts
            ]
    finally:
        model.train(training)
        _reshard(model)
    drift, scale = float((states[0] - states[1]).abs().max()), float(states[0].abs().max())
    if drift > 1e-3 * max(scale, 1.0):
        name = type(inner).__name__
        raise ConfigError(
            f"{setting}: {name} lets packed rows attend to each other (a row's hidden states moved by "
            f"{drift:.3g} when the row packed before it changed): its attention mask is not built from "
            "position_ids in this transformers version; turn packing off for this model"
        )


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
    run: Callable[..., tuple[Tensor, ...]],
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
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
    packed = run(
        input_ids=input_ids.reshape(-1)[pack_index][None],
        attention_mask=None,
        position_ids=position_ids.reshape(-1)[pack_index][None],
        use_cache=False,
    )
    padded = []
    for out in packed:  # [1, S, ...]
        whole = out.new_zeros((rows * length, *out.shape[2:]))
        padded.append(whole.index_copy(0, pack_index, out[0]).view(rows, length, *out.shape[2:]))
    return tuple(padded)
