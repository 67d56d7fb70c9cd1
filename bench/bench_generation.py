"""Generation speed: the project's rollout engines against HF ``generate``; generated tokens/s.

Run on the GPU machine: ``python3 bench/bench_generation.py`` (with ``PYTHONPATH`` holding the
checkout and the wheels of ``/work/shared/device/README.md``). CPU smoke run:
``.venv/bin/python bench/bench_generation.py --device cpu --tiny``. Writes
``<--results-dir>/generation.json``.

Workload: a seeded Qwen2 of Qwen2.5-0.5B's sizes built from config (random weights; the sizes of
``qwen2_sizes.QWEN2_0_5B``, vocabulary 151,936 so the LM head has its real size), bf16 weights on
CUDA, fp32 on CPU, ``sdpa`` attention. 128 prompts of random tokens, lengths drawn uniformly from
64..128 and left-padded, then 256 new tokens each, sampled at temperature 1, top-p 1 (no top-k).
Every row generates the full 256 tokens: the engines get an EOS id no token has (-1), HF
``generate`` gets ``min_new_tokens = max_new_tokens`` (EOS suppressed until then); so every side
computes the same number of tokens.

Sides (``--engines``): ``hf`` (:class:`trainer_core.generation.engines.HFEngine`: dynamic KV cache, the
RL loop's default), ``static`` (:class:`trainer_core.generation.engines.StaticCacheEngine`: static cache,
batched prefill, on CUDA a CUDA-graph decode step checked for "all ended" every 16 steps),
``generate`` (``model.generate(do_sample=True)`` with its default dynamic cache) and, on request,
``generate_static`` (``cache_implementation="static"``, which ``generate`` compiles on CUDA).
Each engine call is made as the RL loop makes it: ``load_weights`` before, ``release`` after (so
the static engine reserves its cache, and captures its CUDA graph again, in every timed call; with
``--keep-cache`` it keeps both).

Measured per side: ``--warmup`` untimed calls (compilation and CUDA-graph recording happen
there), then ``--rounds`` timed calls, each from ``torch.cuda.synchronize()`` to
``torch.cuda.synchronize()``; tokens/s = real generated tokens / wall seconds, the best round
reported with every round listed; ratios against the peers of the same run (``static/hf``,
``static/generate``). Peak memory (CUDA): ``torch.cuda.max_memory_allocated`` over the side's
calls, reset before them; it includes the model's weights.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.qwen2_sizes import QWEN2_0_5B, TINY_QWEN2
from trainer_core.config import RolloutGenerationConfig
from trainer_core.generation.engines import build_engine

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / ".bench"

PAD_ID, EOS_ID = 0, 1
NEVER_SAMPLED = -1
"""The EOS id given to the engines: no token has it, so every row runs to ``max_new_tokens``."""

ENGINE_SIDES = ("hf", "static", "generate", "generate_static")
NUM_THREADS = 2
"""CPU intra-op threads (as ``common.NUM_THREADS``)."""


def build_model(sizes: dict[str, Any], device: torch.device, seed: int) -> torch.nn.Module:
    """A seeded Qwen2 causal LM of ``sizes`` in eval mode: bf16 on CUDA, fp32 on CPU."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        **sizes, pad_token_id=PAD_ID, bos_token_id=EOS_ID, eos_token_id=EOS_ID, use_sliding_window=False
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return model.to(dtype).eval()


def make_prompts(
    num: int, min_tokens: int, max_tokens: int, vocab_size: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``num`` random-token prompts of lengths uniform in ``min_tokens..max_tokens``, left-padded:
    ([num, P] long ids, [num, P] float mask, 1 = real token)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_tokens, max_tokens + 1, (num,), generator=g)
    width = int(lengths.max())
    ids = torch.full((num, width), PAD_ID, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, width - n :] = torch.randint(2, vocab_size, (n,), generator=g)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).float()
    return ids.to(device), mask.to(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_call(
    name: str, model, device: torch.device, gen: RolloutGenerationConfig, keep_cache: bool, seed: int
) -> Callable[[torch.Tensor, torch.Tensor, int], int]:
    """A call of side ``name`` as the RL loop makes it: (ids, mask, round) -> real generated tokens."""
    if name in ("hf", "static"):
        engine = build_engine(name, model, device=device, compile=None, sync=None)

        def call(ids: torch.Tensor, mask: torch.Tensor, round_index: int) -> int:
            engine.load_weights(model)
            generator = torch.Generator(device=device).manual_seed(seed + round_index)
            out = engine.generate(ids, mask, gen, eos_id=NEVER_SAMPLED, pad_id=PAD_ID, generator=generator)
            if not keep_cache:
                engine.release()
            return int(out.completion_mask.sum())

        return call

    extra = {"cache_implementation": "static"} if name == "generate_static" else {}

    def call_generate(ids: torch.Tensor, mask: torch.Tensor, round_index: int) -> int:
        torch.manual_seed(seed + round_index)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask.long(),
            do_sample=True,
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=0,
            max_new_tokens=gen.max_new_tokens,
            min_new_tokens=gen.max_new_tokens,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            **extra,
        )
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    return call_generate


def time_side(
    name: str, call: Callable, ids: torch.Tensor, mask: torch.Tensor, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Warm up, then time ``args.rounds`` calls; the best round's tokens/s with every round's."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(args.warmup):
        call(ids, mask, -1 - i)
    rounds = []
    for i in range(args.rounds):
        synchronize(device)
        start = time.perf_counter()
        tokens = call(ids, mask, i)
        synchronize(device)
        wall_s = time.perf_counter() - start
        rounds.append({"tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s})
    best = max(rounds, key=lambda r: r["tokens_per_s"])
    expected = ids.shape[0] * args.new_tokens
    if best["tokens"] != expected:
        raise RuntimeError(f"{name} generated {best['tokens']} tokens, expected {expected} (every row full length)")
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return {**best, "rounds_tokens_per_s": [r["tokens_per_s"] for r in rounds], "peak_memory_bytes": peak}


def ratio(results: dict[str, dict], num: str, den: str) -> float | None:
    if num not in results or den not in results:
        return None
    return results[num]["tokens_per_s"] / results[den]["tokens_per_s"]


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every side; print the rates, ratios and peak memory; write ``generation.json``."""
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(NUM_THREADS)
    sizes = TINY_QWEN2 if args.tiny else QWEN2_0_5B
    model = build_model(sizes, device, args.seed)
    ids, mask = make_prompts(
        args.num_prompts, args.min_prompt_tokens, args.max_prompt_tokens, sizes["vocab_size"], args.seed, device
    )
    gen = RolloutGenerationConfig(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0)
    results: dict[str, dict] = {}
    for name in args.engines:
        results[name] = time_side(
            name, engine_call(name, model, device, gen, args.keep_cache, args.seed), ids, mask, args, device
        )
    ratios = {"static/hf": ratio(results, "static", "hf"), "static/generate": ratio(results, "static", "generate")}
    print(
        f"Qwen2 {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {device}, "
        f"{args.num_prompts} prompts ({args.min_prompt_tokens}-{args.max_prompt_tokens} tokens) x "
        f"{args.new_tokens} new tokens, best of {args.rounds} after {args.warmup} warmup"
    )
    for name, r in results.items():
        memory = "" if r["peak_memory_bytes"] is None else f", peak {r['peak_memory_bytes'] / 2**30:.2f} GiB"
        print(f"  {name:<16} {r['tokens_per_s']:>12.1f} tokens/s{memory}")
    for name, value in ratios.items():
        if value is not None:
            print(f"  ratio {name:<16} {value:>6.2f}x")
    payload = {
        "benchmark": "generation",
        "engines": results,
        "ratios": ratios,
        "model": {"architecture": "qwen2", **sizes, "dtype": str(next(model.parameters()).dtype)},
        "prompt_tokens": int(mask.sum()),
        "settings": dict(vars(args)),
        "environment": environment(device),
    }
    out_dir = Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "generation.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return payload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, hidden-64 Qwen2 and a small workload (CPU smoke)")
    p.add_argument("--num-prompts", type=int, default=None, help="rows per call (128; --tiny 4)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per row (256; --tiny 8)")
    p.add_argument("--min-prompt-tokens", type=int, default=None, help="shortest prompt (64; --tiny 4)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt (128; --tiny 12)")
    p.add_argument("--engines", nargs="+", default=["hf", "static", "generate"], choices=ENGINE_SIDES)
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per side (2; --tiny 1)")
    p.add_argument("--rounds", type=int, default=None, help="timed calls per side, the best reported (3; --tiny 1)")
    p.add_argument("--keep-cache", action="store_true", help="no release() between calls of the engines")
    p.add_argument("--results-dir", default=str(RESULTS_DIR), help="where generation.json is written")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    defaults = {
        "num_prompts": (4, 128),
        "new_tokens": (8, 256),
        "min_prompt_tokens": (4, 64),
        "max_prompt_tokens": (12, 128),
        "warmup": (1, 2),
        "rounds": (1, 3),
    }
    for name, (tiny, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
