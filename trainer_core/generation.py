"""Batched generation from a policy and reward-model scoring of completions.

Used by the ``score`` and ``evaluate`` stages. Generation uses ``transformers``'
``generate`` on left-padded prompts; scoring runs the reward model on the chat-rendered
prompt + completion and reads the score at the last non-padding token.
"""

from __future__ import annotations

import json

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from trainer_core.config import DataConfig, GenerationConfig
from trainer_core.data.batching import collate_causal, collate_prompts_left
from trainer_core.data.tokenizer import encode_chat


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], data: DataConfig) -> list[int]:
    """Token ids of a chat prompt ending with the assistant generation prefix."""
    return encode_chat(tokenizer, messages, None, data.max_length_tokens, data.max_prompt_length_tokens)["input_ids"]


@torch.no_grad()
def generate_completions(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    gen: GenerationConfig,
    device: torch.device,
    seed: int,
) -> list[str]:
    """Generate one completion per prompt.

    Args:
        model: a causal LM in eval mode.
        tokenizer: its tokenizer (pad and eos ids are used).
        prompts: token ids of each prompt.
        gen: max new tokens, temperature (0 = greedy), top-p, batch size.
        device: where ``model`` is.
        seed: seeds sampling, so the same call gives the same completions.

    Returns:
        The decoded completions (special tokens dropped), in prompt order.
    """
    torch.manual_seed(seed)
    out: list[str] = []
    was_training = model.training
    model.eval()
    for start in range(0, len(prompts), gen.batch_size):
        rows = [{"input_ids": p} for p in prompts[start : start + gen.batch_size]]
        batch = {k: v.to(device) for k, v in collate_prompts_left(rows, tokenizer.pad_token_id).items()}
        sampling = {"do_sample": True, "temperature": gen.temperature, "top_p": gen.top_p} if gen.temperature > 0 else {"do_sample": False}
        sequences = model.generate(
            **batch,
            max_new_tokens=gen.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
        new_tokens = sequences[:, batch["input_ids"].shape[1] :]
        out.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    model.train(was_training)
    return [text.strip() for text in out]


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
    """The reward model's scalar score of each (prompt messages, completion).

    Raises:
        ValueError: ``messages`` and ``completions`` differ in length.
    """
    if len(messages) != len(completions):
        raise ValueError(f"{len(messages)} prompts but {len(completions)} completions")
    rows = [
        encode_chat(tokenizer, m, c, data.max_length_tokens, data.max_prompt_length_tokens)
        for m, c in zip(messages, completions)
    ]
    scores: list[float] = []
    for start in range(0, len(rows), batch_size):
        batch = collate_causal(rows[start : start + batch_size], tokenizer.pad_token_id)
        logits = reward_model(
            input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
        ).logits
        scores.extend(logits.squeeze(-1).float().tolist())
    return scores


def messages_of(row: dict) -> list[dict]:
    """The prompt messages of a prepared row (stored as JSON)."""
    return json.loads(row["messages_json"])
