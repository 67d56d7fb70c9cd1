"""``generate_completions`` (the score and evaluate stages' generation) through transformers'
``generate`` (engine ``hf``) and through the ``static`` engine, on a tiny seeded Llama and a BPE
tokenizer trained here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny import tiny_llama
from trainer_core.config import GenerationConfig, SampledGenerationConfig, load_config
from trainer_core.data.tokenizer import train_tokenizer
from trainer_core.errors import ConfigError
from trainer_core.generation.completions import check_generation_engine, generate_completions

TEXTS = ["one plus two is three", "four minus one is three", "two times two is four", "five and five make ten"]
PROMPTS = [
    "one plus",
    "four minus one is",
    "two",
    "five and five make ten and",
    "one",
    "two times two is four and",
    "four",
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS * 20, 96, 1)


@pytest.fixture(scope="module")
def policy(tokenizer):
    return tiny_llama(tokenizer, attn_implementation="sdpa")


def _prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def test_greedy_completions_are_the_same_through_generate_and_the_static_engine(policy, tokenizer):
    """Left-padded prompts of 1-6 tokens in batches of 3 (the last batch of 1: the static engine's
    cache, reserved for 3 rows, is released and reserved again): the same greedy texts."""
    prompts = _prompt_ids(tokenizer)
    assert len({len(p) for p in prompts}) > 3
    greedy = {"max_new_tokens": 12, "temperature": 0.0, "batch_size": 3}
    want = generate_completions(policy, tokenizer, prompts, GenerationConfig(**greedy), torch.device("cpu"), 0)
    got = generate_completions(
        policy, tokenizer, prompts, GenerationConfig(**greedy, engine="static"), torch.device("cpu"), 0
    )
    assert got == want and len(got) == len(PROMPTS) and any(got)
    assert not policy.training and not [m for m in policy.modules() if "forward" in vars(m)]  # fused forwards gone


def test_sampled_static_completions_follow_the_seed(policy, tokenizer):
    prompts = _prompt_ids(tokenizer)
    gen = SampledGenerationConfig(max_new_tokens=12, batch_size=4, engine="static")
    first = generate_completions(policy, tokenizer, prompts, gen, torch.device("cpu"), 3)
    assert generate_completions(policy, tokenizer, prompts, gen, torch.device("cpu"), 3) == first
    assert generate_completions(policy, tokenizer, prompts, gen, torch.device("cpu"), 4) != first


def test_a_static_engine_on_a_sharding_backend_is_refused_naming_the_field():
    gen = load_config(overrides={"evaluate.generation.engine": "static"}).evaluate.generation
    with pytest.raises(ConfigError, match=r"evaluate\.generation\.engine='static' needs an unsharded policy.*fsdp2"):
        check_generation_engine("evaluate.generation", gen, SimpleNamespace(name="fsdp2", sharded_forward=True))
    check_generation_engine("evaluate.generation", gen, SimpleNamespace(name="ddp", sharded_forward=False))
    hf = GenerationConfig()
    assert hf.engine == "hf"
    check_generation_engine("evaluate.generation", hf, SimpleNamespace(name="fsdp2", sharded_forward=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_static_engine_on_cuda_matches_generates_greedy_completions(policy, tokenizer):
    """On CUDA the static engine compiles its decode step and replays it as a CUDA graph; in fp32
    its greedy completions are transformers' ``generate``'s, batch after batch (3, 3, then 1 row:
    two shapes compiled, the cache reserved again), for two policies served one after the other."""
    prompts = _prompt_ids(tokenizer)
    greedy = {"max_new_tokens": 12, "temperature": 0.0, "batch_size": 3}
    cuda = torch.device("cuda")
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(policy.config, dtype=torch.float32, attn_implementation="sdpa")
        model = model.to(cuda).eval()
        want = generate_completions(model, tokenizer, prompts, GenerationConfig(**greedy), cuda, 0)
        got = generate_completions(model, tokenizer, prompts, GenerationConfig(**greedy, engine="static"), cuda, 0)
        assert got == want and any(got), seed
    torch.cuda.synchronize()
