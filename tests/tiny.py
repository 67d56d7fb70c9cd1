"""The suite's one tiny configuration: ``configs/demo.yaml`` shrunk to seconds a stage.

Every test that needs a small pipeline derives its config from here and states what it needs
differently as dotted overrides on it (``--set`` items for the CLI, ``overrides`` for
:func:`~trainer_core.config.load_config`):

* :data:`TINY_MODEL`: the model and tokenizer (a 1-layer, 32-wide Llama; 256 BPE tokens);
* :data:`TINY_DATA`: the synthetic task's sizes;
* :data:`TINY_GATES`: no gates (each test that judges gates states its own);
* :data:`TINY_DEMO`: all three, and every stage of the demo at tiny sizes (the whole demo in about
  70 s on one process here, against ~6 minutes at the demo's sizes);
* :func:`tiny_demo`: :data:`TINY_DEMO` with a test's own overrides on top;
* :data:`TINY_PREPARE`: the data of ``prepare_data``'s own unit tests (it trains the tokenizer).

The integration tests' stage-by-stage config (``tests/integration/helpers.py``:
``tiny_overrides``) is :data:`TINY_MODEL` and :data:`TINY_DATA` with the variations its bit-exact
resume checks need (12 steps, a checkpoint every 4, a 2-layer model).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"

TINY_MODEL: dict[str, object] = {
    "tokenizer.vocab_size": 256,
    "model.init.hidden_size": 32,
    "model.init.intermediate_size": 64,
    "model.init.num_hidden_layers": 1,
}
"""The model built from config and its tokenizer, at the smallest size the stages accept."""

TINY_DATA: dict[str, object] = {
    "data.synthetic.num_problems": 120,
    "data.synthetic.num_pairs": 60,
    "data.max_eval_rows": 8,
}
"""The synthetic task: 120 problems and 60 preference pairs, at most 8 held-out rows a set."""

TINY_PREPARE: dict[str, object] = {
    "seed": 5,
    "data.synthetic.num_problems": 40,
    "data.synthetic.num_pairs": 20,
    "data.eval_fraction": 0.25,
    "data.max_eval_rows": 8,
    "tokenizer.vocab_size": 400,
}
"""``prepare_data`` in the unit tests of its splits and formats: 40 problems and 20 pairs, a
quarter held out (at most 8 rows a set), a 400-token BPE vocabulary, seed 5."""

TINY_GATES: dict[str, object] = {"evaluate.gates": []}
"""No gates at tiny sizes (a test that judges gates sets its own): ``configs/demo.yaml``'s second
gate (GRPO's gain over SFT beyond one standard error) speaks of the demo's sizes, where no tiny
policy solves a held-out problem (gain 0, standard error 0), and its champion gate needs the
registered model that configs without one (``demo-extended.yaml``, the defaults) do not name."""

TINY_DEMO: dict[str, object] = {
    **TINY_DATA,
    **TINY_MODEL,
    **TINY_GATES,
    "sft.max_steps": 4,
    "sft.eval_every": 2,
    "sft.save_every": 2,
    "reward_model.max_steps": 2,
    "dpo.max_steps": 2,
    "dpo.grad_accum_steps": 1,
    "ppo.max_steps": 2,
    "ppo.prompts_per_rollout": 2,
    "ppo.save_every": 2,
    "ppo.generation.max_new_tokens": 8,
    "grpo.max_steps": 2,
    "grpo.prompts_per_rollout": 2,
    "grpo.group_size": 2,
    "grpo.save_every": 2,
    "grpo.generation.max_new_tokens": 8,
    "score.num_prompts": 2,
    "score.generation.max_new_tokens": 8,
    "evaluate.num_problems": 2,
    "evaluate.num_winrate_prompts": 2,
    "evaluate.generation.max_new_tokens": 8,
    "launch.retries": 0,
    "launch.timeout_s": 240,
}
"""``configs/demo.yaml``'s every stage at tiny sizes, as dotted overrides."""


def tiny_demo(**overrides: object) -> dict[str, object]:
    """:data:`TINY_DEMO` with ``overrides`` (dotted keys, e.g. ``{"stages": "prepare_data,sft"}``) on top."""
    return {**TINY_DEMO, **overrides}


def as_sets(overrides: dict[str, object]) -> list[str]:
    """``overrides`` as the CLI's arguments: ``["--set", "key=value", ...]`` (mappings, lists,
    booleans and None written as JSON, which the CLI reads as YAML)."""

    def text(value: object) -> str:
        return json.dumps(value) if value is None or isinstance(value, (dict, list, bool)) else str(value)

    return [arg for key, value in overrides.items() for arg in ("--set", f"{key}={text(value)}")]


def write_tiny_demo(path: Path, **overrides: object) -> None:
    """``configs/demo.yaml`` with :func:`tiny_demo` ``(**overrides)`` applied, as YAML at ``path``
    (its comments dropped)."""
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    for key, value in tiny_demo(**overrides).items():
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def tiny_llama(tokenizer, **attn: str):
    """The unit tests' random 2-layer, 32-wide Llama (4 heads, 2 KV heads, 128 positions) over
    ``tokenizer``'s vocabulary and pad/EOS ids, built after ``torch.manual_seed(0)``, in eval mode;
    ``attn``: ``attn_implementation=...`` where a test pins it."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        **LLAMA_2X32,
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attn).eval()


LLAMA_2X32: dict[str, int] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""The unit tests' random Llama: 2 layers, 32 wide, 4 heads over 2 KV heads (``LlamaConfig``
arguments; each test adds its vocabulary, positions and special ids)."""

LLAMA_1X16: dict[str, int] = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
"""The smallest random Llama of the tests: 1 layer, 16 wide, 2 heads over 1 KV head."""
