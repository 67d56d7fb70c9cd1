"""GPU speed against TRL: SFT and DPO on the Qwen2.5-0.5B architecture; tokens/s, MFU, peak memory.

Run on the GPU machine: ``python3 bench/bench_gpu.py --data-dir .bench/data`` (``bench/GPU.md``:
setup, the workload in full, results). CPU smoke run: ``.venv/bin/python bench/bench_gpu.py
--device cpu --tiny --synthetic --steps 2 --warmup 1``. Writes ``<--results-dir>/gpu.json``.

Workload: ``common.prepare_workload`` (the project's tokenizer and rows), and a seeded Qwen2 of
Qwen2.5-0.5B's sizes (:data:`QWEN2_0_5B`, vocabulary 151,936 so the LM head has its real size)
saved once in bf16; both sides load it in fp32. Cases (:data:`CASES`): SFT at micro-batch 16 and
64 (padded), SFT packed under a 16,384-token budget (project: ``sft.max_tokens_per_micro_batch``
with ``flex_attention``; TRL: ``packing=True``, bfd, so padding-free, ``max_length`` = the budget,
``per_device_train_batch_size=1``), DPO at 8 pairs (reference log-probs precomputed by both).
Project on CUDA: ``backend.precision=bf16-mixed`` (``--compile``, ``--activation-checkpointing``
optional); TRL: ``bf16=True``, no gradient checkpointing.

Measured per case and side: tokens/s (pairs/s) as ``common.summarize_steps`` defines them, each
step's end read after ``torch.cuda.synchronize()``, tokens counted on the host batches (no sync
inside a step); MFU = model FLOPs / wall seconds / ``--peak-tflops``, where a token costs 6 x
matmul params + 6 x layers x hidden x n (n: its row's length; causal attention, half of PaLM's
12 L d n), i.e. 6 N tokens + 6 L d sum(n^2) a step, the same formula for both sides; peak memory
= ``torch.cuda.max_memory_allocated`` over the side's run, reset between sides. Targets (the
issue): SFT >= 1.5x TRL, MFU >= 40% at the 16k budget, peak memory <= TRL, DPO >= 1.5x TRL; the
script reports and does not fail on a miss.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import common
import torch
from bench_dpo import timed_reference, with_reference
from bench_dpo import trl_rows as dpo_trl_rows
from bench_sft import run_stage_probed, stage_overrides, stamp_step_ends, step_timer, trl_args
from bench_sft import same_lengths as sft_same_lengths
from bench_sft import trl_rows as sft_trl_rows
from common import (
    StepLog,
    Workload,
    alternate,
    best_round,
    cleanup,
    patched,
    prepare_workload,
    set_threads,
    stage_spec,
    summarize_steps,
    write_result,
)
from qwen2_sizes import QWEN2_0_5B, TINY_QWEN2
from torch import nn

from trainer_core.config import PipelineConfig, load_config
from trainer_core.data.prepared import load_tokenizer_from
from trainer_core.modeling.models import count_parameters
from trainer_core.stages import reference as reference_stage
from trainer_core.training.supervised import DPOObjective, SFTObjective

PEAK_TFLOPS = 989.0
"""H100 / H200 SXM dense bf16 peak, TFLOP/s (NVIDIA's data sheets; 1979 is with 2:4 sparsity)."""

SPEED_TARGET, MFU_TARGET = 1.5, 0.40


@dataclass(frozen=True)
class Case:
    """One benchmark case: ``stage`` at ``micro_batch_size`` rows (pairs), or packed under ``--max-tokens``."""

    name: str
    stage: str
    micro_batch_size: int
    packed: bool = False


CASES = (
    Case("sft_mb16", "sft", 16),
    Case("sft_mb64", "sft", 64),
    Case("sft_budget", "sft", 16, packed=True),
    Case("dpo_mb8", "dpo", 8),
)


@dataclass(frozen=True)
class ModelInfo:
    """What MFU needs of the model, and where it lives (``model_dir``, loaded by both sides)."""

    model_dir: str
    num_params: int
    matmul_params: int
    num_layers: int
    hidden_size: int
    vocab_size: int


@dataclass
class SyncedStepLog(StepLog):
    """A :class:`common.StepLog` that synchronises CUDA before stamping a step's end, and keeps
    ``square_tokens``: the sum over each step's rows of (row tokens)^2, for the attention FLOPs."""

    synchronize: bool = False
    square_tokens: list[int] = field(default_factory=list)
    on_end: Any = None  # called after each step's end is stamped (the profiler's ``step``), or None

    def mark_end(self, compute_s: float | None = None) -> None:
        if self.synchronize:
            torch.cuda.synchronize()
        super().mark_end(compute_s)
        if self.on_end is not None:
            self.on_end()

    def add_batch(self, batch: dict[str, torch.Tensor], rows_per_example: int) -> None:
        """Record a host batch (project or TRL layout): real tokens, examples, computed positions, sum n^2."""
        lengths = row_lengths(batch)
        self.tokens.append(sum(lengths))
        self.examples.append(len(lengths) // rows_per_example)
        self.padded_tokens.append(sum(v.numel() for k, v in batch.items() if k.endswith("input_ids")))
        self.square_tokens.append(sum(n * n for n in lengths))


def row_lengths(batch: dict[str, torch.Tensor]) -> list[int]:
    """Real tokens of each sequence of a host batch: project packed (``sequence_ids`` [1,S]), TRL
    padding-free (``cu_seq_lens_q`` [R+1]), or padded (every ``*attention_mask`` [B,T], 1 = real)."""
    if "sequence_ids" in batch:
        return torch.bincount(batch["sequence_ids"].flatten()).tolist()
    if "cu_seq_lens_q" in batch:
        return batch["cu_seq_lens_q"].diff().tolist()
    masks = [v for k, v in batch.items() if k.endswith("attention_mask")]
    if not masks:
        ids = batch["input_ids"]
        return [ids.shape[1]] * ids.shape[0]
    return [int(n) for m in masks for n in m.sum(dim=1).tolist()]


# --- model and workload -------------------------------------------------------------------------


def matmul_params(model: nn.Module) -> int:
    """Weights of every ``nn.Linear`` (the LM head's tied weight once, as its matmul)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def build_qwen2(model_dir: str, tokenizer: Any, sizes: dict[str, Any], device: torch.device, seed: int) -> ModelInfo:
    """Build a seeded Qwen2 causal LM of ``sizes`` on ``device`` (vocabulary at least the
    tokenizer's), save it in bf16 with ``tokenizer`` to ``model_dir``; returns its :class:`ModelInfo`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        **{**sizes, "vocab_size": max(sizes["vocab_size"], len(tokenizer))},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        use_sliding_window=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    info = ModelInfo(
        model_dir,
        count_parameters(model),
        matmul_params(model),
        config.num_hidden_layers,
        config.hidden_size,
        config.vocab_size,
    )
    model.to(torch.bfloat16).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    del model
    free_device_memory(device)
    return info


def with_overrides(config: PipelineConfig, overrides: dict[str, Any]) -> PipelineConfig:
    """``config`` with ``{key.path: value}`` overrides applied and validated (``load_config``).

    Raises:
        ConfigError: an override the config rejects (e.g. a field this checkout does not have).
    """
    return load_config(None, overrides=overrides, base=config.model_dump(mode="json"))


def prepare(stage: str, args: argparse.Namespace, device: torch.device) -> tuple[Workload, ModelInfo]:
    """The stage's data (``common.prepare_workload``) and the Qwen2 model both sides train."""
    num = args.sft_examples if stage == "sft" else args.dpo_pairs
    w = prepare_workload(
        stage,
        synthetic=args.synthetic,
        max_length=args.max_length,
        num_examples=num,
        seed=args.seed,
        overrides=stage_overrides(stage, args.warmup, args.steps),
    )
    sizes = TINY_QWEN2 if args.tiny else QWEN2_0_5B
    info = build_qwen2(os.path.join(w.root, "qwen2"), load_tokenizer_from(w.data_uri), sizes, device, args.seed)
    w = replace(
        w,
        config=with_overrides(w.config, {"model.name_or_path": info.model_dir}),
        model_dir=info.model_dir,
        num_params=info.num_params,
    )
    return w, info


def case_attn(case: Case, args: argparse.Namespace, device: torch.device) -> str:
    """Attention kernel of a case, the same on both sides."""
    if case.packed:
        return args.packed_attn or ("flex_attention" if device.type == "cuda" else "sdpa")
    return args.attn


def case_config(w: Workload, case: Case, args: argparse.Namespace, device: torch.device) -> PipelineConfig:
    """The project's stage config of ``case`` (micro-batch or token budget, precision, kernels)."""
    s = case.stage
    out = {
        **stage_overrides(s, args.warmup, args.steps),
        f"{s}.micro_batch_size": case.micro_batch_size,
        "backend.device": device.type,
        "backend.precision": "bf16-mixed" if device.type == "cuda" else "fp32",
        "backend.compile": args.compile,
        "backend.activation_checkpointing": args.activation_checkpointing,
        "model.attn_implementation": case_attn(case, args, device),
    }
    if case.packed:
        out[f"{s}.max_tokens_per_micro_batch"] = args.max_tokens  # the field of issue 12's packing
    if s == "dpo":
        out["dpo.beta"] = 0.1
    return with_overrides(w.config, out)


# --- the two sides ------------------------------------------------------------------------------


def free_device_memory(device: torch.device) -> None:
    """Collect garbage (FSDP / trainer cycles), empty the CUDA cache and reset its peak counter."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_bytes(device: torch.device) -> int | None:
    """``torch.cuda.max_memory_allocated`` since the last reset; None off CUDA."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def project_hooks(log: SyncedStepLog, objective: type, rows_per_example: int) -> list[tuple]:
    """Hooks (for ``bench_sft.run_stage_probed``): the loop's metric printer stamps each
    optimizer step's end (``bench_sft.stamp_step_ends``); the objective's host-side
    ``num_tokens`` (called by the loop on each training micro-batch before its copy to the
    device, never in evaluation) records the batch."""

    def on_num_tokens(original):
        def num_tokens(self, batch):
            log.add_batch(batch, rows_per_example)
            return original(self, batch)

        return num_tokens

    return [stamp_step_ends(log), (objective, "num_tokens", on_num_tokens)]


@contextlib.contextmanager
def step_profile(log: SyncedStepLog, args: argparse.Namespace, name: str):
    """With ``--profile-steps N``: ``torch.profiler`` over N optimizer steps after the warmup
    steps (one more step warms the profiler up), driven by ``log``'s step ends; its table of the
    40 costliest operators (by self CUDA time on CUDA, self CPU time on CPU) is written to
    ``<results-dir>/profile_<name>.txt`` and printed. Profiling slows the profiled steps: a
    profiled run's tokens/s are not the bench's numbers. Without the option, nothing."""
    if not args.profile_steps:
        yield
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = torch.cuda.is_available() and args.device == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    plan = schedule(wait=max(args.warmup - 1, 0), warmup=1, active=args.profile_steps, repeat=1)
    with profile(activities=activities, schedule=plan) as prof:
        log.on_end = prof.step
        try:
            yield
        finally:
            log.on_end = None
    table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=40)
    path = Path(args.results_dir) / f"profile_{name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table)
    print(f"profile of {name} ({args.profile_steps} steps), {path}:\n{table}")


def run_project(w: Workload, info: ModelInfo, case: Case, args, device, round_index: int = 0) -> dict[str, Any]:
    """The project's stage of ``case`` in this process (``run_spec``); its output is deleted after."""
    dpo = case.stage == "dpo"
    log = SyncedStepLog(synchronize=device.type == "cuda")
    hooks = project_hooks(log, DPOObjective if dpo else SFTObjective, 2 if dpo else 1)
    inputs = {"model": w.model_dir, **({"reference": w.model_dir} if dpo else {})}
    spec = stage_spec(
        replace(w, config=case_config(w, case, args, device)), case.stage, inputs, run_id=f"{case.name}-{round_index}"
    )
    reference: dict[str, float] = {}
    free_device_memory(device)
    if args.compile:
        torch._dynamo.reset()
    timing = (
        patched(reference_stage, "reference_logprobs", timed_reference(reference)) if dpo else contextlib.nullcontext()
    )
    try:
        with timing, step_profile(log, args, f"{case.name}_project"):
            total_s = run_stage_probed(spec, hooks)
    finally:
        shutil.rmtree(spec.output_uri, ignore_errors=True)
    return {
        **measured(log, info, args),
        **reference,
        "stage_total_s": total_s,
        "peak_memory_bytes": peak_memory_bytes(device),
    }


def measured(log: SyncedStepLog, info: ModelInfo, args) -> dict[str, Any]:
    """``summarize_steps`` of the timed steps plus their model FLOP/s and MFU (see the module docstring)."""
    out = summarize_steps(log, args.warmup, args.steps)
    window = slice(args.warmup, args.warmup + args.steps)
    flops = 6 * info.matmul_params * out["tokens"] + 6 * info.num_layers * info.hidden_size * sum(
        log.square_tokens[window]
    )
    out["model_flops_per_s"] = flops / out["wall_s"]
    out["mfu"] = out["model_flops_per_s"] / (args.peak_tflops * 1e12)
    out["mean_row_tokens_for_attention"] = sum(log.square_tokens[window]) / max(out["tokens"], 1)
    return out


def trl_config_kwargs(w: Workload, case: Case, args, device, liger: bool = False) -> dict[str, Any]:
    """``bench_sft.trl_args`` with this case's batch, device and precision; ``liger``: TRL's
    ``use_liger_kernel`` (Liger's RMSNorm, SwiGLU, RoPE and, for SFT, fused linear cross-entropy)."""
    kwargs = trl_args(w, case.stage, args.warmup, args.steps)
    if liger:
        kwargs["use_liger_kernel"] = True
    cuda = device.type == "cuda"
    kwargs.update(
        per_device_train_batch_size=1 if case.packed else case.micro_batch_size,
        use_cpu=not cuda,
        bf16=cuda,
        max_length=args.max_tokens if case.packed else w.max_length_tokens,
    )
    kwargs["output_dir"] = os.path.join(w.root, f"trl-{case.name}")
    return kwargs


def probe_collator(trainer, log: SyncedStepLog, rows_per_example: int) -> None:
    """Wrap the trainer's collator to record each batch (drawn in step order: one per step)."""
    collate = trainer.data_collator

    def recording(features):
        batch = collate(features)
        log.add_batch(batch, rows_per_example)
        return batch

    trainer.data_collator = recording


def trl_model(w: Workload, case: Case, args, device):
    """The shared initial weights in fp32 (TRL's master weights under ``bf16=True``), the case's kernel."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        w.model_dir, dtype=torch.float32, attn_implementation=case_attn(case, args, device)
    )


def run_trl_sft(
    w: Workload, info: ModelInfo, case: Case, args, device, round_index: int = 0, liger: bool = False
) -> dict[str, Any]:
    """TRL's ``SFTTrainer`` on the same rows, tokenizer, weights and micro-batch (or packed budget)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    examples, lengths, completion_tokens = sft_trl_rows(w)
    log = SyncedStepLog(synchronize=device.type == "cuda")
    free_device_memory(device)
    config = SFTConfig(
        **trl_config_kwargs(w, case, args, device, liger), packing=case.packed, completion_only_loss=True
    )
    trainer = SFTTrainer(
        model=trl_model(w, case, args, device),
        args=config,
        train_dataset=Dataset.from_list(examples),
        processing_class=load_tokenizer_from(w.data_uri),
        callbacks=[step_timer(log)],
    )
    same = None if case.packed else sft_same_lengths(trainer.train_dataset, lengths, completion_tokens)
    probe_collator(trainer, log, 1)
    with step_profile(log, args, f"{case.name}_trl{'_liger' if liger else ''}"):
        trainer.train()
    return {
        **measured(log, info, args),
        "peak_memory_bytes": peak_memory_bytes(device),
        "packing": case.packed,
        "same_token_ids_as_project": same,
    }


def timed_trl_reference(record: dict[str, float]):
    """Wrap TRL's ``DPOTrainer._precompute_ref_logps`` to time it (as ``bench_dpo.run_trl`` does)."""

    def make(original):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            t0 = time.perf_counter()
            out = original(self, dataset, name, batch_size)
            record["reference_s"] = record.get("reference_s", 0.0) + time.perf_counter() - t0
            record["reference_pairs"] = record.get("reference_pairs", 0) + len(dataset)
            return out

        return _precompute_ref_logps

    return make


def run_trl_dpo(
    w: Workload, info: ModelInfo, case: Case, args, device, round_index: int = 0, liger: bool = False
) -> dict[str, Any]:
    """TRL's ``DPOTrainer`` (sigmoid, beta 0.1, precomputed reference log-probs) on the same pairs."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    examples, _ = dpo_trl_rows(w)
    log, reference = SyncedStepLog(synchronize=device.type == "cuda"), {}
    free_device_memory(device)
    config = DPOConfig(
        **trl_config_kwargs(w, case, args, device, liger),
        beta=0.1,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=True,
        precompute_ref_batch_size=case.micro_batch_size,
    )
    with patched(DPOTrainer, "_precompute_ref_logps", timed_trl_reference(reference)):
        trainer = DPOTrainer(
            model=trl_model(w, case, args, device),
            args=config,
            train_dataset=Dataset.from_list(examples),
            processing_class=load_tokenizer_from(w.data_uri),
            callbacks=[step_timer(log)],
        )
    probe_collator(trainer, log, 2)
    with step_profile(log, args, f"{case.name}_trl{'_liger' if liger else ''}"):
        trainer.train()
    return {
        **measured(log, info, args),
        **reference,
        "peak_memory_bytes": peak_memory_bytes(device),
        "num_train_pairs": len(examples),
    }


# --- report -------------------------------------------------------------------------------------


def row(
    metric: str, project: float, trl: float | None, target: str | None = None, met: bool | None = None
) -> dict[str, Any]:
    """One line of the table; ``trl`` None (``--no-trl``) gives NaN and no ratio."""
    trl_value = float("nan") if trl is None else trl
    ratio = project / trl_value if trl_value and not math.isnan(trl_value) else float("nan")
    return {"metric": metric, "project": project, "trl": trl_value, "ratio": ratio, "target": target, "met": met}


def case_rows(case: Case, result: dict[str, Any], budget: int, peer: str = "trl") -> list[dict[str, Any]]:
    """Speed, MFU and memory rows of one case against ``peer`` (``trl``: TRL's defaults;
    ``trl_liger``: with ``use_liger_kernel``), with the issue's targets."""
    p, t = result["project"], result.get(peer)
    label = f"{case.name} ({'budget ' + str(budget) + ' tokens' if case.packed else 'micro-batch ' + str(case.micro_batch_size)})"
    if peer != "trl":
        label = f"{label} vs {peer}"
    have = t is not None and "error" not in t
    key, unit = ("examples_per_s", "pairs/s") if case.stage == "dpo" else ("tokens_per_s", "tokens/s")
    speed = row(f"{label} {unit}", p[key], t[key] if have else None, f">= {SPEED_TARGET:g}x TRL")
    speed["met"] = speed["ratio"] >= SPEED_TARGET if have else None
    mfu_target = case.packed
    out = [
        speed,
        row(
            f"{label} MFU",
            p["mfu"],
            t["mfu"] if have else None,
            f">= {MFU_TARGET:.0%}" if mfu_target else None,
            p["mfu"] >= MFU_TARGET if mfu_target else None,
        ),
    ]
    if case.stage == "dpo" and have:
        out.append(
            row(
                f"{label} pairs/s incl. reference pass, 1 epoch",
                p["pairs_per_s_incl_reference_epoch"],
                t["pairs_per_s_incl_reference_epoch"],
            )
        )
    if p["peak_memory_bytes"] is not None:
        tm = t["peak_memory_bytes"] / 2**30 if have else None
        out.append(
            row(
                f"{label} peak memory GiB",
                p["peak_memory_bytes"] / 2**30,
                tm,
                "<= TRL",
                p["peak_memory_bytes"] <= t["peak_memory_bytes"] if have else None,
            )
        )
    return out


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    """The table: metric, project, TRL, ratio (project / TRL), target and whether it is met."""
    print(f"\n{title}")
    print(f"{'metric':<62} {'project':>12} {'TRL':>12} {'ratio':>7}  target")
    for r in rows:
        target = "-" if r["target"] is None else f"{r['target']} " + {True: "ok", False: "MISSED", None: "?"}[r["met"]]
        print(f"{r['metric']:<62} {r['project']:>12.4g} {r['trl']:>12.4g} {r['ratio']:>6.2f}x  {target}")


def environment_facts(device: torch.device) -> dict[str, Any]:
    """``common.environment`` (without TRL when it is not installed) and the GPU's name."""
    try:
        env = common.environment()
    except ImportError as e:
        env = {"torch": torch.__version__, "trl": None, "environment_error": str(e)}
    env["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return env


# --- main ---------------------------------------------------------------------------------------


def guarded(run_side, key: str):
    """``run_side`` whose failure is recorded (``error``, ``key`` NaN) instead of ending the bench:
    an optional peer setting (TRL with Liger) that this machine's versions cannot run."""

    def run(i: int) -> dict[str, Any]:
        try:
            return run_side(i)
        except Exception as e:  # noqa: BLE001 - reported in the JSON and the table
            print(f"peer run failed: {e!r}")
            return {"error": repr(e), key: float("nan")}

    return run


def run_stage_cases(stage: str, cases: list[Case], args, device) -> tuple[dict[str, Any], ModelInfo]:
    """Prepare one stage's workload and run each of its cases on both sides (``args.rounds``)."""
    w, info = prepare(stage, args, device)
    out: dict[str, Any] = {}
    try:
        for case in cases:
            runs = {"project": lambda i, c=case: run_project(w, info, c, args, device, i)}
            if not args.no_trl:
                trl = run_trl_dpo if stage == "dpo" else run_trl_sft
                runs["trl"] = lambda i, c=case, f=trl: f(w, info, c, args, device, i)
                if args.trl_liger:
                    runs["trl_liger"] = guarded(
                        lambda i, c=case, f=trl: f(w, info, c, args, device, i, liger=True),
                        "examples_per_s" if stage == "dpo" else "tokens_per_s",
                    )
            results = alternate(args.rounds, runs)
            key = "examples_per_s" if stage == "dpo" else "tokens_per_s"
            best = {side: best_round(results[side], key) for side in results}
            if stage == "dpo" and "trl" in best:
                for side in best.values():
                    if "error" not in side:
                        side.update(with_reference(side, best["trl"]["num_train_pairs"]))
            settings = {
                "micro_batch_size": case.micro_batch_size,
                "max_tokens_per_micro_batch": args.max_tokens if case.packed else None,
                "attn_implementation": case_attn(case, args, device),
                "trl_per_device_train_batch_size": 1 if case.packed else case.micro_batch_size,
                "trl_packing": case.packed,
                "max_length_tokens": w.max_length_tokens,
            }
            out[case.name] = {
                "settings": settings,
                "project": best["project"],
                "trl": best.get("trl"),
                "trl_liger": best.get("trl_liger"),
            }
            print(
                f"case {case.name}: "
                + ", ".join(
                    f"{side} {r.get(key, float('nan')):.4g} {'pairs' if stage == 'dpo' else 'tokens'}/s, mfu "
                    f"{r.get('mfu', float('nan')):.3f}, peak {(r.get('peak_memory_bytes') or 0) / 2**30:.2f} GiB"
                    for side, r in best.items()
                ),
                flush=True,
            )
    finally:
        cleanup(w)
    return out, info


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected cases; print the table; write ``<results-dir>/gpu.json``."""
    device = torch.device(args.device)
    if device.type == "cpu":
        set_threads()
    with contextlib.suppress(ImportError):
        common.quiet_libraries()
    if args.data_dir:
        common.GSM8K = Path(args.data_dir) / "gsm8k" / "train.jsonl"
        common.HH_PAIRS = Path(args.data_dir) / "hh-rlhf-harmless" / "pairs.jsonl"
    common.RESULTS_DIR = Path(args.results_dir)
    selected = [c for c in CASES if c.name in args.cases]
    cases: dict[str, Any] = {}
    info = None
    for stage in ("sft", "dpo"):
        if any(c.stage == stage for c in selected):
            done, info = run_stage_cases(stage, [c for c in selected if c.stage == stage], args, device)
            cases.update(done)
    peers = ["trl", "trl_liger"] if args.trl_liger else ["trl"]
    rows = [r for c in selected for peer in peers for r in case_rows(c, cases[c.name], args.max_tokens, peer)]
    print_rows(
        f"Qwen2 {info.num_params / 1e6:.1f}M params ({info.matmul_params / 1e6:.1f}M in matmuls), {device}, "
        f"{args.steps} timed steps after {args.warmup}, peak {args.peak_tflops:g} TFLOP/s, "
        f"data {'synthetic' if args.synthetic else 'files'}",
        rows,
    )
    payload = {
        "benchmark": "gpu",
        "rows": rows,
        "cases": cases,
        "model": {"architecture": "qwen2", **(TINY_QWEN2 if args.tiny else QWEN2_0_5B), **vars(info)},
        "settings": dict(vars(args)),
        "environment": environment_facts(device),
    }
    print(f"wrote {write_result('gpu', payload)}")
    return payload


def device_parser(description: str, tiny_help: str) -> argparse.ArgumentParser:
    """The start of this family's command lines (this bench, ``bench_grpo_gpu.py``): ``--device``
    (cuda; cpu for a smoke run) and ``--tiny`` (``tiny_help``: the smoke-test sizes it selects)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help=tiny_help)
    return p


def parse_sized(
    p: argparse.ArgumentParser, argv: list[str] | None, defaults: dict[str, tuple[Any, Any]]
) -> argparse.Namespace:
    """Parse ``argv``; each option named in ``defaults`` that was not given (None) takes the first
    of its (tiny, full) values with ``--tiny``, the second without."""
    args = p.parse_args(argv)
    for name, (tiny, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = device_parser(__doc__, "a 2-layer, hidden-64 Qwen2 (CPU smoke test)")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per side and case")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them (>= 1; compile needs a few)")
    p.add_argument("--rounds", type=int, default=1, help="runs per side, alternating the order; the best is reported")
    p.add_argument("--cases", nargs="+", default=[c.name for c in CASES], choices=[c.name for c in CASES])
    p.add_argument("--synthetic", action="store_true", help="the generated arithmetic task instead of the files")
    p.add_argument("--data-dir", help="folder holding gsm8k/train.jsonl and hh-rlhf-harmless/pairs.jsonl")
    p.add_argument("--results-dir", default=str(common.RESULTS_DIR), help="where gpu.json is written")
    p.add_argument("--max-length", type=int, default=512, help="longest row (prompt + completion) kept, tokens")
    p.add_argument("--max-tokens", type=int, default=None, help="token budget of the packed case (16384; --tiny 1024)")
    p.add_argument("--sft-examples", type=int, default=None, help="SFT rows kept (4000; --tiny 400)")
    p.add_argument("--dpo-pairs", type=int, default=None, help="DPO pairs kept (1000; --tiny 200)")
    p.add_argument("--attn", default="sdpa", help="model.attn_implementation of the padded cases (both sides)")
    p.add_argument("--packed-attn", default=None, help="of the packed case (flex_attention on CUDA, sdpa on CPU)")
    p.add_argument("--compile", action="store_true", help="project: backend.compile")
    p.add_argument("--activation-checkpointing", action="store_true", help="project: backend.activation_checkpointing")
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="the device's dense bf16 peak, for MFU")
    p.add_argument("--no-trl", action="store_true", help="time the project only (TRL not installed)")
    p.add_argument("--trl-liger", action="store_true", help="also TRL with use_liger_kernel (its fastest kernels)")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="profile this many steps of each side after the warmup (its times are then not comparable)",
    )
    p.add_argument("--seed", type=int, default=0)
    return parse_sized(p, argv, {"max_tokens": (1024, 16384), "sft_examples": (400, 4000), "dpo_pairs": (200, 1000)})


if __name__ == "__main__":
    run(parse_args())
