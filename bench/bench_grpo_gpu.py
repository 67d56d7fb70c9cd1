"""GRPO iteration throughput against TRL's ``GRPOTrainer``: the same model, prompts, reward and sampling.

Run on the GPU machine: ``python3 bench/bench_grpo_gpu.py --data-dir .bench/data`` (``bench/GPU.md``).
CPU smoke run: ``.venv/bin/python bench/bench_grpo_gpu.py --device cpu --tiny --synthetic``.
Writes ``<--results-dir>/grpo_gpu.json``.

Workload (issue 39's part B): ``--prompts`` (16) GSM8K prompts a rollout, ``--group`` (8)
completions each, at most ``--new-tokens`` (256) new tokens, temperature 1, top-p 1; the
verifier reward (``trainer_core.training.rl.rewards.VerifierReward``: exact match of the final number plus
0.1 for a ``#### n`` line) on both sides; no KL term (the project's ``grpo.kl_coef`` 0, TRL's
``beta`` 0), one optimisation epoch cut into 4 optimizer steps of 32 completions, 16 rows a
forward. The model is ``bench_gpu``'s: Qwen2.5-0.5B's architecture, random init, so completions
seldom end before the limit and both sides generate about the same number of tokens.

- project: the GRPO stage in this process (``run_spec``, backend ``single``, ``bf16-mixed`` on
  CUDA, generation ``--engine``, ``static`` by default), ``grpo.max_steps`` = ``--iterations``;
- TRL: ``GRPOTrainer`` generating with transformers (vLLM cannot reach the GPU machine),
  ``per_device_train_batch_size`` 16, ``gradient_accumulation_steps`` 2,
  ``generation_batch_size`` = prompts x group (so one generation feeds the 4 optimizer steps),
  ``bf16``, no gradient checkpointing; the prompts are the project's prompt token ids decoded to
  text (TRL re-tokenizes them).

Measured per iteration, after ``torch.cuda.synchronize()``: wall seconds from the start of its
rollout to the end of its last optimizer step, completion tokens generated (the completion
mask's sum), and the rollout's share (TRL: ``_generate_and_score_completions``; project: its
``time/generation_s + time/reward_s + time/logprobs_s``). Iteration throughput = completion tokens
/ wall seconds, over the iterations after the first (which compiles / warms up); target: the
project >= 3x TRL (the issue). Peak memory: ``torch.cuda.max_memory_allocated`` of the side's run.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import common
import torch
from bench_gpu import (
    device_parser,
    environment_facts,
    free_device_memory,
    parse_sized,
    peak_memory_bytes,
    prepare,
    print_rows,
    row,
    with_overrides,
)
from common import cleanup, patched, set_threads, stage_spec, write_result

from trainer_core.data.prepared import load_split, load_tokenizer_from
from trainer_core.generation.completions import messages_of, prompt_ids
from trainer_core.stages.runner import run_spec
from trainer_core.training.rl.rewards import has_answer_line, is_correct
from trainer_core.training.rl.trainer import RLTrainer

THROUGHPUT_TARGET = 3.0
"""Project / TRL completion tokens per second of the whole iteration (issue 39)."""

MINI_BATCHES = 4
"""Optimizer steps per rollout (one epoch): 32 completions each at 16 x 8."""

FORMAT_BONUS = 0.1
"""The verifier reward's bonus for a ``#### n`` line (``grpo.reward.format_bonus``'s default)."""


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA) before a clock is read."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grpo_overrides(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The project's GRPO settings of this workload (see the module docstring)."""
    cuda = device.type == "cuda"
    return {
        "backend.name": "single",
        "backend.device": device.type,
        "backend.precision": "bf16-mixed" if cuda else "fp32",
        "backend.compile": False,
        "model.dtype": "float32",
        "grpo.max_steps": args.iterations,
        "grpo.prompts_per_rollout": args.prompts,
        "grpo.group_size": args.group,
        "grpo.num_mini_batches": MINI_BATCHES,
        "grpo.forward_micro_batch_size": args.micro_batch_size,
        "grpo.learning_rate": 1e-6,
        "grpo.kl_coef": 0.0,
        "grpo.warmup_steps": 0,
        "grpo.min_lr_ratio": 1.0,
        "grpo.generation.max_new_tokens": args.new_tokens,
        "grpo.generation.temperature": 1.0,
        "grpo.generation.top_p": 1.0,
        "grpo.generation.engine": args.engine,
        "grpo.save_every": 10**6,
        "grpo.reward.kind": "verifier",
        "grpo.reward.format_bonus": FORMAT_BONUS,
        "grpo.ptx_coef": 0.0,
    }


def summarize(iterations: list[dict[str, float]], skip: int) -> dict[str, Any]:
    """Mean wall seconds, completion tokens and rollout share of the iterations after ``skip``,
    and their throughput (total tokens / total seconds)."""
    timed = iterations[skip:] or iterations
    wall = sum(i["wall_s"] for i in timed)
    tokens = sum(i["completion_tokens"] for i in timed)
    return {
        "timed_iterations": len(timed),
        "iteration_s": wall / len(timed),
        "completion_tokens": tokens / len(timed),
        "tokens_per_s": tokens / wall,
        "rollout_s": statistics.fmean(i["rollout_s"] for i in timed),
        "update_s": statistics.fmean(i["wall_s"] - i["rollout_s"] for i in timed),
        "iterations": iterations,
    }


# --- the project --------------------------------------------------------------------------------


def run_project(w, args, device: torch.device) -> dict[str, Any]:
    """The project's GRPO stage in this process; each iteration timed by wrapping ``RLTrainer.iteration``."""
    record: list[dict[str, float]] = []

    def timed(original):
        def iteration(self):
            sync(device)
            start, tokens_before = time.perf_counter(), self.progress.consumed_tokens
            metrics = original(self)
            sync(device)
            split = {k: v for k, v in metrics.items() if k.startswith("time/")}
            record.append(
                {
                    "wall_s": time.perf_counter() - start,
                    "completion_tokens": self.progress.consumed_tokens - tokens_before,
                    "rollout_s": sum(split.get(f"time/{k}_s", 0.0) for k in ("generation", "reward", "logprobs")),
                    **split,
                }
            )
            return metrics

        return iteration

    config = with_overrides(w.config, grpo_overrides(args, device))
    spec = stage_spec(
        replace(w, config=config), "grpo", {"model": w.model_dir, "reference": w.model_dir}, run_id="grpo-bench"
    )
    free_device_memory(device)
    try:
        with patched(RLTrainer, "iteration", timed):
            run_spec(spec)
    finally:
        shutil.rmtree(spec.output_uri, ignore_errors=True)
    return {**summarize(record, args.skip), "peak_memory_bytes": peak_memory_bytes(device), "engine": args.engine}


# --- TRL ----------------------------------------------------------------------------------------


def trl_prompts(w, num: int) -> list[dict[str, str]]:
    """The project's RL prompts (``sft/train`` rows with an answer) as TRL text prompts: the
    chat-templated prompt ids decoded, and the normalised answer the reward compares with."""
    tokenizer = load_tokenizer_from(w.data_uri)
    split = load_split(w.data_uri, "sft/train")
    rows = [split[i] for i in split.nonnull_indices("answer").tolist()[:num]]
    return [
        {"prompt": tokenizer.decode(prompt_ids(tokenizer, messages_of(r), w.config.data)), "answer": r["answer"]}
        for r in rows
    ]


def verifier(prompts, completions, answer, **kwargs) -> list[float]:
    """The project's verifier reward for TRL (``reward_funcs``): exact match plus the format bonus."""
    return [
        float(is_correct(c, a)) + (FORMAT_BONUS if has_answer_line(c) else 0.0)
        for c, a in zip(completions, answer, strict=True)
    ]


def run_trl(w, args, device: torch.device) -> dict[str, Any]:
    """TRL's ``GRPOTrainer`` on the same model, prompts, reward and sampling (module docstring)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = device.type == "cuda"
    rollouts: list[dict[str, float]] = []
    step_ends: list[float] = []

    def timed(original):
        def _generate_and_score_completions(self, inputs):
            sync(device)
            start = time.perf_counter()
            out = original(self, inputs)
            sync(device)
            rollouts.append(
                {
                    "start_s": start,
                    "rollout_s": time.perf_counter() - start,
                    "completion_tokens": float(out["completion_mask"].sum()),
                }
            )
            return out

        return _generate_and_score_completions

    class StepEnd(TrainerCallback):
        def on_step_end(self, *a, **k):
            sync(device)
            step_ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=os.path.join(w.root, "trl-grpo"),
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.prompts * args.group // MINI_BATCHES // args.micro_batch_size,
        generation_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        learning_rate=1e-6,
        beta=0.0,
        num_iterations=1,
        max_steps=args.iterations * MINI_BATCHES,
        lr_scheduler_type="constant",
        warmup_steps=0,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=False,
        logging_steps=10**6,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(w.model_dir, dtype=torch.float32)
    dataset = Dataset.from_list(trl_prompts(w, max(args.prompts * (args.iterations + 1), 64)))
    free_device_memory(device)
    with patched(GRPOTrainer, "_generate_and_score_completions", timed):
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=verifier,
            args=config,
            train_dataset=dataset,
            processing_class=load_tokenizer_from(w.data_uri),
            callbacks=[StepEnd()],
        )
        trainer.train()
    iterations = []
    for i, r in enumerate(rollouts):
        end = step_ends[(i + 1) * MINI_BATCHES - 1] if len(step_ends) >= (i + 1) * MINI_BATCHES else math.nan
        iterations.append(
            {"wall_s": end - r["start_s"], "completion_tokens": r["completion_tokens"], "rollout_s": r["rollout_s"]}
        )
    return {**summarize(iterations, args.skip), "peak_memory_bytes": peak_memory_bytes(device)}


# --- report and main ----------------------------------------------------------------------------


def report_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Throughput (with the issue's target), the time split and peak memory, project against TRL."""
    p, t = result["project"], result.get("trl")
    have = t is not None
    get = lambda side, key: side[key] if side is not None else None  # noqa: E731
    speed = row(
        "GRPO iteration completion tokens/s",
        p["tokens_per_s"],
        get(t, "tokens_per_s"),
        f">= {THROUGHPUT_TARGET:g}x TRL",
    )
    speed["met"] = speed["ratio"] >= THROUGHPUT_TARGET if have else None
    rows = [
        speed,
        row("iteration s", p["iteration_s"], get(t, "iteration_s")),
        row("rollout s (generation, reward, log-probs)", p["rollout_s"], get(t, "rollout_s")),
        row("update s (the rest of the iteration)", p["update_s"], get(t, "update_s")),
        row("completion tokens an iteration", p["completion_tokens"], get(t, "completion_tokens")),
    ]
    if p["peak_memory_bytes"] is not None:
        rows.append(
            row("peak memory GiB", p["peak_memory_bytes"] / 2**30, t["peak_memory_bytes"] / 2**30 if have else None)
        )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Prepare the workload, run both sides, print the table, write ``grpo_gpu.json``."""
    device = torch.device(args.device)
    if device.type == "cpu":
        set_threads()
    if args.data_dir:
        common.GSM8K = Path(args.data_dir) / "gsm8k" / "train.jsonl"
    common.RESULTS_DIR = Path(args.results_dir)
    prep = argparse.Namespace(
        sft_examples=max(4 * args.prompts * args.iterations, 200),
        synthetic=args.synthetic,
        max_length=args.max_length,
        seed=args.seed,
        warmup=1,
        steps=1,
        tiny=args.tiny,
    )
    w, info = prepare("sft", prep, device)
    try:
        result = {"project": run_project(w, args, device)}
        result["trl"] = None if args.no_trl else run_trl(w, args, device)
    finally:
        cleanup(w)
    rows = report_rows(result)
    print_rows(
        f"GRPO {args.prompts} x {args.group} x {args.new_tokens}, Qwen2 {info.num_params / 1e6:.1f}M params, "
        f"{device}, engine {args.engine}, iterations {args.iterations} ({args.skip} untimed)",
        rows,
    )
    payload = {
        "benchmark": "grpo_gpu",
        "rows": rows,
        "result": result,
        "settings": dict(vars(args)),
        "model": vars(info),
        "environment": environment_facts(device),
    }
    print(f"wrote {write_result('grpo_gpu', payload)}")
    return payload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = device_parser(__doc__, "a 2-layer, hidden-64 Qwen2, 2 x 2 x 8 (CPU smoke test)")
    p.add_argument("--synthetic", action="store_true", help="the generated arithmetic task instead of GSM8K")
    p.add_argument("--data-dir", help="folder holding gsm8k/train.jsonl")
    p.add_argument("--results-dir", default=str(common.RESULTS_DIR), help="where grpo_gpu.json is written")
    p.add_argument("--prompts", type=int, default=None, help="prompts a rollout (16; --tiny 2)")
    p.add_argument("--group", type=int, default=None, help="completions a prompt (8; --tiny 2)")
    p.add_argument("--new-tokens", type=int, default=None, help="max new tokens a completion (256; --tiny 8)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="rows a forward (16; --tiny 1)")
    p.add_argument("--iterations", type=int, default=3, help="rollout-update iterations per side")
    p.add_argument("--skip", type=int, default=1, help="untimed first iterations (compilation, warm-up)")
    p.add_argument("--engine", default="static", choices=("static", "hf"), help="the project's generation engine")
    p.add_argument("--max-length", type=int, default=512, help="longest SFT row kept when preparing the prompts")
    p.add_argument("--no-trl", action="store_true", help="time the project only (TRL not installed)")
    p.add_argument("--seed", type=int, default=0)
    args = parse_sized(
        p, argv, {"prompts": (2, 16), "group": (2, 8), "new_tokens": (8, 256), "micro_batch_size": (1, 16)}
    )
    if args.prompts * args.group % (MINI_BATCHES * args.micro_batch_size):
        p.error(
            f"--prompts x --group ({args.prompts * args.group}) must split into {MINI_BATCHES} mini-batches of "
            f"--micro-batch-size multiples"
        )
    return args


if __name__ == "__main__":
    run(parse_args())
