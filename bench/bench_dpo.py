"""DPO speed: the project's DPO stage against TRL's ``DPOTrainer``, same model, pairs and batch.

Run: ``.venv/bin/python bench/bench_dpo.py [--steps 30] [--warmup 3] [--synthetic]``.
Prints pairs/s of both and their ratio, with and without the one-off reference log-prob pass;
writes ``.bench/dpo.json``.

Both sides use their fast way of getting the reference log-probs: the project always computes
them once before training (a frozen reference, freed afterwards); TRL does the same with
``precompute_ref_log_probs=True`` (without it, every training step runs a second, reference
forward). Policy and reference start from the same weights on both sides. The reference pass is
timed on its own and is NOT in the step timing; the "including reference pass" rows add it back,
amortised over one epoch of the train pairs and over the timed steps alone.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bench_sft import (
    add_arguments,
    count_collated,
    probe_stage,
    run_stage_probed,
    stage_overrides,
    step_timer,
    trl_args,
)
from common import (
    MICRO_BATCH_SIZE,
    StepLog,
    Workload,
    alternate,
    best_round,
    cleanup,
    environment,
    patched,
    prepare_workload,
    print_rounds,
    print_table,
    quiet_libraries,
    ratio_row,
    set_niceness,
    set_threads,
    stage_spec,
    summarize_steps,
    write_result,
)
from trainer_core.data.prepared import load_split, load_tokenizer_from
from trainer_core.stages import reference as reference_stage
from trainer_core.training.supervised import DPOObjective


def timed_reference(record: dict[str, float]):
    """Wrap ``reference_logprobs`` (``trainer_core.training.supervised``, called by name from
    ``trainer_core.stages.reference``, where it is patched) to add its seconds and pairs to ``record``."""

    def make(original):
        def reference_logprobs(model, rows, *args, **kwargs):
            t0 = time.perf_counter()
            out = original(model, rows, *args, **kwargs)
            record["reference_s"] = record.get("reference_s", 0.0) + time.perf_counter() - t0
            record["reference_pairs"] = record.get("reference_pairs", 0) + len(rows)
            return out

        return reference_logprobs

    return make


def run_project(w: Workload, warmup: int, steps: int, round_index: int = 0) -> dict[str, Any]:
    """The project's DPO stage in this process (policy and reference: the shared initial model)."""
    log, reference = StepLog(), {}
    hooks = probe_stage(log, DPOObjective, lambda b: int(b["chosen_input_ids"].shape[0]))
    spec = stage_spec(w, "dpo", {"model": w.model_dir, "reference": w.model_dir}, run_id=f"round-{round_index}")
    with patched(reference_stage, "reference_logprobs", timed_reference(reference)):
        total_s = run_stage_probed(spec, hooks)
    return {**summarize_steps(log, warmup, steps), **reference, "stage_total_s": total_s}


def trl_rows(w: Workload) -> tuple[list[dict], list[tuple[int, int]]]:
    """The project's prepared train pairs as TRL conversational preference examples, with the
    project's (chosen, rejected) sequence lengths (for the equality check)."""
    rows = load_split(w.data_uri, "preference/train")
    examples = [{"prompt": json.loads(r["messages_json"]),
                 "chosen": [{"role": "assistant", "content": r["chosen"]}],
                 "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows]
    return examples, [(len(r["chosen_input_ids"]), len(r["rejected_input_ids"])) for r in rows]


def same_lengths(dataset, lengths: list[tuple[int, int]]) -> bool:
    """True when TRL tokenised every pair to the project's chosen and rejected lengths."""
    trl = [(len(p) + len(c), len(p) + len(r))
           for p, c, r in zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"])]
    return sorted(trl) == sorted(lengths)


def run_trl(w: Workload, warmup: int, steps: int, round_index: int = 0, precompute: bool = True) -> dict[str, Any]:
    """TRL's ``DPOTrainer`` (sigmoid loss, beta from the config) on the same pairs and weights."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    examples, lengths = trl_rows(w)
    log, reference = StepLog(), {}
    tokenizer = load_tokenizer_from(w.data_uri)
    model = AutoModelForCausalLM.from_pretrained(w.model_dir, dtype="float32")
    args = DPOConfig(**trl_args(w, "dpo", warmup, steps, beta=w.config.dpo.beta, loss_type=["sigmoid"],
                                precompute_ref_log_probs=precompute, precompute_ref_batch_size=MICRO_BATCH_SIZE))

    def timed_precompute(original):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            t0 = time.perf_counter()
            out = original(self, dataset, name, batch_size)
            reference["reference_s"] = time.perf_counter() - t0
            reference["reference_pairs"] = len(dataset)
            return out

        return _precompute_ref_logps

    t0 = time.perf_counter()
    with patched(DPOTrainer, "_precompute_ref_logps", timed_precompute):
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(examples),
                             processing_class=tokenizer, callbacks=[step_timer(log)])
    init_s = time.perf_counter() - t0
    same = same_lengths(trainer.train_dataset, lengths)
    count_collated(trainer, log, examples_per_row=1)
    t0 = time.perf_counter()
    trainer.train()
    return {**summarize_steps(log, warmup, steps), **reference, "init_s": init_s,
            "train_total_s": time.perf_counter() - t0, "precompute_ref_log_probs": precompute,
            "num_train_pairs": len(examples), "same_token_ids_as_project": same}


def with_reference(result: dict[str, Any], num_pairs: int) -> dict[str, float]:
    """Pairs/s once the reference pass is added: over one epoch of ``num_pairs`` train pairs
    (at the measured step rate) and over the timed steps alone."""
    ref_s = result.get("reference_s", 0.0)
    epoch_s = num_pairs / result["examples_per_s"] + ref_s
    return {"pairs_per_s_incl_reference_epoch": num_pairs / epoch_s,
            "pairs_per_s_incl_reference_timed_steps": result["examples"] / (result["wall_s"] + ref_s)}


def report_rows(project: dict[str, Any], trl: dict[str, Any], trl_online: dict[str, Any] | None) -> list[dict]:
    rows = [
        ratio_row("DPO pairs/s (step wall clock, reference pass excluded)", project["examples_per_s"],
                  trl["examples_per_s"]),
        ratio_row("DPO pairs per CPU-second (load-robust)", project["examples"] / project["cpu_s"],
                  trl["examples"] / trl["cpu_s"], None),
        ratio_row("DPO train tokens/s (chosen + rejected)", project["tokens_per_s"], trl["tokens_per_s"], None),
        ratio_row("DPO reference pass, pairs/s", project["reference_pairs"] / project["reference_s"],
                  trl["reference_pairs"] / trl["reference_s"], None),
        ratio_row("DPO pairs/s incl. reference pass, 1 epoch", project["pairs_per_s_incl_reference_epoch"],
                  trl["pairs_per_s_incl_reference_epoch"]),
        ratio_row("DPO pairs/s incl. reference pass, timed steps only",
                  project["pairs_per_s_incl_reference_timed_steps"], trl["pairs_per_s_incl_reference_timed_steps"]),
    ]
    if trl_online is not None:
        rows.append(ratio_row("DPO pairs/s vs TRL precompute_ref_log_probs=False", project["examples_per_s"],
                              trl_online["examples_per_s"]))
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Prepare the DPO workload, time the project's stage then TRL's trainer, report."""
    set_niceness(args.nice)
    set_threads()
    quiet_libraries()
    t0 = time.perf_counter()
    overrides = {**stage_overrides("dpo", args.warmup, args.steps), "dpo.beta": 0.1}
    w = prepare_workload("dpo", synthetic=args.synthetic, max_length=args.dpo_max_length,
                         num_examples=args.dpo_pairs, seed=args.seed, overrides=overrides)
    try:
        prep_s = time.perf_counter() - t0
        runs = {"project": lambda i: run_project(w, args.warmup, args.steps, i),
                "trl": lambda i: run_trl(w, args.warmup, args.steps, i)}
        if args.trl_online_reference:
            runs["trl_online"] = lambda i: run_trl(w, args.warmup, args.steps, i, precompute=False)
        results = alternate(args.rounds, runs, args.quiet_wait_s)
    finally:
        cleanup(w)
    num_pairs = results["trl"][0]["num_train_pairs"]
    for side in results.values():
        for r in side:
            r.update(with_reference(r, num_pairs))
    project, trl = (best_round(results[k], "examples_per_s") for k in ("project", "trl"))
    trl_online = best_round(results["trl_online"], "examples_per_s") if args.trl_online_reference else None
    rows = report_rows(project, trl, trl_online)
    print_table(f"DPO, {w.num_params / 1e6:.2f}M-param Llama, batch {MICRO_BATCH_SIZE} pairs, max_length "
                f"{w.max_length_tokens}, {num_pairs} train pairs, {args.steps} timed steps after {args.warmup} "
                f"warmup, best of {args.rounds} rounds, data {w.source}", rows)
    payload = {"benchmark": "dpo", "rows": rows, "project": project, "trl": trl, "trl_online_reference": trl_online,
               "all_rounds": results,
               "workload": {"source": w.source, "num_params": w.num_params, "max_length": w.max_length_tokens,
                            "micro_batch_size": MICRO_BATCH_SIZE, "num_train_pairs": num_pairs,
                            "prepare_s": prep_s},
               "environment": environment()}
    print_rounds(results, "examples_per_s")
    print(f"wrote {write_result('dpo', payload)}")
    return payload


def add_dpo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dpo-max-length", type=int, default=256, help="max prompt + completion tokens per side")
    parser.add_argument("--dpo-pairs", type=int, default=280, help="pairs kept (train + 16 held out)")
    parser.add_argument("--trl-online-reference", action="store_true",
                        help="also time TRL with precompute_ref_log_probs=False (reference forward every step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    add_dpo_arguments(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
