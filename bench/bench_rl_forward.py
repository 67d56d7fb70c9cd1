"""The RL stages' forwards padded against ``padding_free``, per attention implementation.

Run on the GPU machine: ``python3 bench/bench_rl_forward.py`` (``bench/GPU.md``).
CPU run: ``.venv/bin/python bench/bench_rl_forward.py --device cpu --tiny``.
Writes ``<--results-dir>/rl_forward.json``.

Workload: a GRPO rollout's forwards, ``--rows`` (128: part B's 16 x 8) sequences of a left-padded
prompt and a right-padded completion in micro-batches of ``--micro-batch-size`` (16) rows, as
the RL stages cut them (``forward_micro_batch_size``), their lengths drawn (seeded) uniformly from
``--prompt-tokens`` (60-200: GSM8K's chat-templated prompts) and ``--completion-tokens`` (32-256:
answers of a policy that stops, up to part B's 256-token limit; ``--completion-tokens 256 256``
is part B's random-init model, whose completions all reach the limit), random token ids. The
model is ``bench_gpu``'s Qwen2.5-0.5B architecture, random init, fp32 parameters under bf16
autocast on CUDA (the RL stages' ``bf16-mixed``), fp32 on CPU; the LM head chunked as in the
stages (:func:`~trainer_core.modeling.forwards.completion.completion_forward`).

The median over ``--repeats`` of two phases over every micro-batch:

- log-probs: ``completion_forward`` without gradients (the rollout's old log-probs; the reference's is
  the same forward);
- update: ``completion_forward`` with gradients and the backward of a weighted sum of the log-probs
  (gradients accumulated over the micro-batches, as in one optimizer step).

Compared, as real tokens (prompt and completion) per second, the ratio the first over the second:

- padding-free against padded, per attention implementation (``sdpa``, and ``eager`` on CPU,
  ``flex_attention`` on CUDA, ``flash_attention_2`` where the flash-attn package imports), the
  micro-batches cut as the stages cut them (longest rows first,
  :func:`~trainer_core.training.rl.batches.micro_batch_rows`);
- padded micro-batches longest first against micro-batches in row order (each forwards its own
  longest row either way), on sdpa.

Also: peak memory of the update (CUDA), the padding share of each layout, and the largest
log-prob difference between padding-free and padded (the correctness check on this device and
dtype). After a ``torch.cuda.synchronize()`` before each clock read.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from typing import Any

import common
import torch
from bench_gpu import QWEN2_0_5B, TINY_QWEN2, device_parser, environment_facts, parse_sized, print_rows, row
from common import set_threads, write_result

from trainer_core.modeling.forwards.completion import Completions, PolicyAndValue, completion_forward
from trainer_core.training.rl.batches import micro_batch_rows


def attention_implementations(device: torch.device) -> list[str]:
    """The implementations compared on ``device``: sdpa, then eager (CPU) or flex_attention and,
    when the flash-attn package imports, flash_attention_2 (CUDA)."""
    if device.type != "cuda":
        return ["sdpa", "eager"]
    return ["sdpa", "flex_attention"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])


def make_batch(args: argparse.Namespace, vocab: int, device: torch.device) -> Completions:
    """``args.rows`` left-padded prompts and right-padded completions of seeded random lengths and ids."""
    gen = torch.Generator().manual_seed(args.seed)
    draw = lambda lo, hi: torch.randint(lo, hi + 1, (args.rows,), generator=gen)  # noqa: E731
    p_len, c_len = draw(*args.prompt_tokens), draw(*args.completion_tokens)
    p_max, c_max = int(p_len.max()), int(c_len.max())
    prompt_mask = (torch.arange(p_max) >= (p_max - p_len)[:, None]).long()
    completion_mask = (torch.arange(c_max) < c_len[:, None]).float()
    prompt_ids = torch.randint(2, vocab, (args.rows, p_max), generator=gen) * prompt_mask
    completion_ids = torch.randint(2, vocab, (args.rows, c_max), generator=gen) * completion_mask.long()
    return Completions(
        prompt_ids.to(device), prompt_mask.to(device), completion_ids.to(device), completion_mask.to(device)
    )


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The seeded Qwen2 policy (``--tiny``: the smoke size), fp32, on ``device``, train mode."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**(TINY_QWEN2 if args.tiny else QWEN2_0_5B), use_sliding_window=False)
    torch.manual_seed(args.seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def timed(fn, device: torch.device, repeats: int, warmup: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def select(batch: Completions, rows: torch.Tensor) -> Completions:
    """The rows ``rows`` of ``batch`` at its full width (the forward trims them)."""
    return Completions(
        batch.prompt_ids[rows], batch.prompt_mask[rows], batch.completion_ids[rows], batch.completion_mask[rows]
    )


def padding_share(batch: Completions, groups: list[torch.Tensor]) -> float:
    """Padding's share of the positions the micro-batches forward, each at its own longest row."""
    real = total = 0
    for rows in groups:
        part = select(batch, rows).trimmed()
        real += int(part.prompt_mask.sum() + part.completion_mask.sum())
        total += part.prompt_ids.numel() + part.completion_ids.numel()
    return 1 - real / total


def measure(
    model: PolicyAndValue, batch: Completions, groups: list[torch.Tensor], padding_free: bool, args, device
) -> dict[str, Any]:
    """Seconds of the log-probs forwards and of the update's forwards and backwards over the
    micro-batches ``groups``, the update's peak memory (CUDA) and the log-probs [N, T], for one layout."""
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    weights = torch.randn(batch.completion_mask.shape, generator=torch.Generator().manual_seed(1)).to(device)
    parts = [select(batch, rows) for rows in groups]

    def logprobs() -> torch.Tensor:
        out = torch.zeros(batch.completion_mask.shape, device=device)
        with torch.no_grad(), autocast:
            for rows, part in zip(groups, parts):
                out[rows] = completion_forward(
                    model, part, temperature=1.0, with_values=False, padding_free=padding_free
                ).logprobs.float()
        return out

    def update() -> None:
        for rows, part in zip(groups, parts):
            with autocast:
                out = completion_forward(model, part, temperature=1.0, with_values=False, padding_free=padding_free)
            (out.logprobs * weights[rows]).sum().backward()
        model.zero_grad(set_to_none=True)

    result = {"logprobs_s": timed(logprobs, device, args.repeats, args.warmup)}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result["update_s"] = timed(update, device, args.repeats, args.warmup)
    result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    result["logprobs"] = logprobs().float().cpu()
    return result


def best_of_rounds(
    model: PolicyAndValue, batch: Completions, layouts: dict[str, tuple[list[torch.Tensor], bool]], args, device
) -> dict[str, dict[str, Any]]:
    """:func:`measure` of each layout (``name -> (micro-batches, padding_free)``) in ``--rounds``
    rounds, the order reversed every other round; each phase's fastest round is kept."""
    best: dict[str, dict[str, Any]] = {}
    for r in range(args.rounds):
        for name in list(layouts)[:: -1 if r % 2 else 1]:
            got = measure(model, batch, *layouts[name], args, device)
            kept = best.setdefault(name, got)
            for key in ("logprobs_s", "update_s"):
                kept[key] = min(kept[key], got[key])
    return best


def compare(label: str, first: dict[str, Any], second: dict[str, Any], real_tokens: int) -> list[dict[str, Any]]:
    """Table rows: throughput of both phases and the update's peak memory, ``first`` against ``second``."""
    rows = [
        row(f"{label} log-probs tokens/s", real_tokens / first["logprobs_s"], real_tokens / second["logprobs_s"]),
        row(f"{label} update tokens/s", real_tokens / first["update_s"], real_tokens / second["update_s"]),
    ]
    if first["peak_memory_bytes"] is not None:
        rows.append(
            row(f"{label} update peak GiB", first["peak_memory_bytes"] / 2**30, second["peak_memory_bytes"] / 2**30)
        )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every implementation in both layouts, print the table, write ``rl_forward.json``."""
    device = torch.device(args.device)
    if device.type == "cpu":
        set_threads()
    common.RESULTS_DIR = common.Path(args.results_dir)
    policy = build_model(args, device)
    model = PolicyAndValue(policy)
    batch = make_batch(args, policy.config.vocab_size, device)
    real = int(batch.prompt_mask.sum() + batch.completion_mask.sum())
    lengths = batch.prompt_mask.sum(1) + batch.completion_mask.sum(1)
    grouped = micro_batch_rows(lengths, args.micro_batch_size)
    in_order = list(torch.arange(args.rows, device=device).split(args.micro_batch_size))
    padding = {
        "longest_first": padding_share(batch, grouped),
        "row_order": padding_share(batch, in_order),
        "whole_batch": padding_share(batch, [torch.arange(args.rows, device=device)]),
    }
    rows, results = [], {"padding_share": padding}
    payload = {
        "benchmark": "rl_forward",
        "rows": rows,
        "result": results,
        "settings": dict(vars(args)),
        "real_tokens": real,
        "environment": environment_facts(device),
        "complete": False,
    }
    for attn in attention_implementations(device):
        policy.set_attn_implementation(attn)
        layouts = {"padded": (grouped, False), "padding_free": (grouped, True)}
        if attn == "sdpa":
            layouts["padded_row_order"] = (in_order, False)
        try:
            best = best_of_rounds(model, batch, layouts, args, device)
        except Exception as e:  # an implementation this machine's versions cannot run: recorded, not fatal
            results[attn] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"{attn}: {results[attn]['error']}")
            continue
        diff = float((best["padding_free"]["logprobs"] - best["padded"]["logprobs"]).abs().max())
        results[attn] = {
            **{k: {n: v for n, v in r.items() if n != "logprobs"} for k, r in best.items()},
            "max_abs_logprob_diff": diff,
        }
        rows += compare(f"{attn}: padding-free | padded", best["padding_free"], best["padded"], real)
        if "padded_row_order" in best:
            rows += compare(
                f"{attn}: padded, longest first | row order", best["padded"], best["padded_row_order"], real
            )
        write_result("rl_forward", payload)  # what is measured so far survives a time limit that cuts the rest
    print_rows(
        f"RL forwards, {args.rows} rows in micro-batches of {args.micro_batch_size}, prompts "
        f"{args.prompt_tokens}, completions {args.completion_tokens} tokens, {real} real; padding: "
        f"{padding['longest_first']:.0%} longest first, {padding['row_order']:.0%} in row order, "
        f"{padding['whole_batch']:.0%} whole batch; {device}; columns: the first layout named, the second",
        rows,
    )
    for attn, r in results.items():
        if "max_abs_logprob_diff" in r:
            print(f"{attn}: largest |log-prob difference| padding-free vs padded {r['max_abs_logprob_diff']:.3g}")
    payload["complete"] = True
    print(f"wrote {write_result('rl_forward', payload)}")
    return payload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = device_parser(__doc__, "a 2-layer, hidden-64 Qwen2, 16 rows in micro-batches of 4 (CPU smoke test)")
    p.add_argument("--rows", type=int, default=None, help="sequences in the rollout (128; --tiny 16)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="rows a forward (16; --tiny 4)")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=[60, 200], metavar=("MIN", "MAX"))
    p.add_argument(
        "--completion-tokens",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="completion lengths (32 256; --tiny 8 32)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed calls per phase (10; --tiny 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before them")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the layouts, the order reversed every other one")
    p.add_argument("--results-dir", default=str(common.RESULTS_DIR), help="where rl_forward.json is written")
    p.add_argument("--seed", type=int, default=0)
    return parse_sized(
        p,
        argv,
        {"rows": (16, 128), "micro_batch_size": (4, 16), "completion_tokens": ([8, 32], [32, 256]), "repeats": (2, 10)},
    )


if __name__ == "__main__":
    run(parse_args())
