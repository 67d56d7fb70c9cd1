"""Batched generation from a policy and reward-model scoring of completions.

Used by the ``score`` and ``evaluate`` stages. Generation runs on left-padded prompts through
``transformers``' ``generate`` (``generation.engine`` "hf") or the ``static`` engine of
:mod:`trainer_core.generation.engines`; scoring runs the reward model on the chat-rendered prompt +
completion and reads the score at the last non-padding token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from trainer_core.config import DataConfig, GenerationConfig
from trainer_core.config.generation import engine_problem
from trainer_core.data.batching import collate_causal, collate_prompts_left
from trainer_core.data.tokenizer import encode_chat
from trainer_core.errors import ConfigError
from trainer_core.modeling.forwards.rewards import sequence_rewards

if TYPE_CHECKING:
    from trainer_core.backends import Backend
    from trainer_core.generation.decode_session import DecodeSession


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], data: DataConfig, tools: list[dict] | None = None
) -> list[int]:
    """Token ids of a chat prompt (with its declared ``tools``, JSON schemas, when given) ending
    with the assistant generation prefix."""
    return encode_chat(tokenizer, messages, None, data.max_length_tokens, data.max_prompt_length_tokens, tools=tools)[
        "input_ids"
    ]


def check_generation_engine(field: str, gen: GenerationConfig, backend: Backend) -> None:
    """Refuse a generation engine that cannot serve ``backend``'s models.

    Args:
        field: the config section, for the message (e.g. ``grpo.generation``).

    Raises:
        ConfigError: an engine other than ``hf`` with a backend whose forward needs every rank
            (``Backend.sharded_forward``: FSDP2, ZeRO-3).
    """
    problem = engine_problem(field, gen.engine, backend.name, backend.sharded_forward)
    if problem:
        raise ConfigError(problem)


@torch.no_grad()
def generate_completions(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    gen: GenerationConfig,
    device: torch.device,
    seed: int,
    session_for: Callable[[int, int], DecodeSession] | None = None,
) -> list[str]:
    """Generate one completion per prompt, ``gen.batch_size`` prompts at a time.

    With ``gen.engine`` "hf", transformers' ``generate`` (sampling seeded through ``torch.manual_seed``);
    with "static", :class:`trainer_core.generation.engines.StaticCacheEngine` (its cache kept while it
    fits, released at the end; sampling from a generator seeded with ``seed``). Greedy decoding picks
    the same tokens in both, up to the float rounding of their different attention kernels.

    Args:
        model: a causal LM in eval mode (unsharded for "static").
        tokenizer: its tokenizer (pad and eos ids are used).
        prompts: token ids of each prompt.
        gen: max new tokens, temperature (0 = greedy), top-p, batch size, engine.
        device: where ``model`` is.
        seed: seeds sampling, so the same call gives the same completions.
        session_for: with a tool, ``session_for(start, stop)`` gives the session (a :class:`~trainer_core.generation.decode_session.DecodeSession`: a ``ToolSession``) of prompts
            ``start:stop`` (a batch); "hf" then samples through ``HFEngine`` (``generate`` cannot
            feed observations).

    Returns:
        The decoded completions (special tokens dropped, observations kept), in prompt order.

    Raises:
        ValueError: "static" with a sharded ``model`` (FSDP2, ZeRO-3): see
            :func:`check_generation_engine`.
    """
    torch.manual_seed(seed)
    out: list[str] = []
    was_training = model.training
    model.eval()
    engine = None
    if gen.engine != "hf" or session_for is not None:
        from trainer_core.generation.engines import build_engine

        engine = build_engine(
            gen.engine, model, device=device, compile=gen.compile, fuse_projections=gen.fuse_projections
        )
        generator = torch.Generator(device=device).manual_seed(seed)
    try:
        for start in range(0, len(prompts), gen.batch_size):
            rows = [{"input_ids": p} for p in prompts[start : start + gen.batch_size]]
            batch = {k: v.to(device) for k, v in collate_prompts_left(rows, tokenizer.pad_token_id).items()}
            if engine is not None:
                session = None if session_for is None else session_for(start, start + len(rows))
                new_tokens = engine.generate(
                    batch["input_ids"],
                    batch["attention_mask"],
                    gen,
                    eos_id=tokenizer.eos_token_id,
                    pad_id=tokenizer.pad_token_id,
                    generator=generator,
                    session=session,
                ).completion_ids
            else:
                new_tokens = _hf_generate(model, batch, gen, tokenizer)
            out.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    finally:
        if engine is not None:
            engine.release()
        model.train(was_training)
    return [text.strip() for text in out]


def _hf_generate(
    model: nn.Module, batch: dict[str, torch.Tensor], gen: GenerationConfig, tokenizer: PreTrainedTokenizerBase
) -> torch.Tensor:
    """transformers' ``generate`` on a left-padded batch; the [N, T] new tokens."""
    sampling = (
        {"do_sample": True, "temperature": gen.temperature, "top_p": gen.top_p}
        if gen.temperature > 0
        else {"do_sample": False}
    )
    sequences = model.generate(
        **batch,
        max_new_tokens=gen.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **sampling,
    )
    return sequences[:, batch["input_ids"].shape[1] :]


@torch.no_grad()
def reward_scores(
    reward_model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    messages: list[list[dict]],
    completions: list[str],
    data: DataConfig,
    batch_size: int,
    device: torch.device,
) -> list[float]:
    """The reward model's score of each (prompt messages, completion), in either parameterisation
    (:func:`~trainer_core.modeling.forwards.rewards.sequence_rewards`), in the order given.

    The rows go to the model ``batch_size`` at a time, longest first, so that each padded batch
    holds rows of like length (as many forwards as in the given order: ranks that score their own
    rows under a sharded model stay in step).

    Raises:
        ValueError: ``messages`` and ``completions`` differ in length.
    """
    if len(messages) != len(completions):
        raise ValueError(f"{len(messages)} prompts but {len(completions)} completions")
    rows = [
        encode_chat(tokenizer, m, c, data.max_length_tokens, data.max_prompt_length_tokens)
        for m, c in zip(messages, completions)
    ]
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]["input_ids"]))
    scores = [0.0] * len(rows)
    keys = ("input_ids", "attention_mask", "loss_mask", "counted_index")
    for start in range(0, len(rows), batch_size):
        picked = order[start : start + batch_size]
        batch = collate_causal([rows[i] for i in picked], tokenizer.pad_token_id)
        for i, score in zip(picked, sequence_rewards(reward_model, *(batch[k].to(device) for k in keys)).tolist()):
            scores[i] = score
    return scores


def messages_of(row: dict) -> list[dict]:
    """The prompt messages of a prepared row (stored as JSON)."""
    return json.loads(row["messages_json"])
