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
from functools import partial
from typing import Any

from bench_sft import parse_args, run_probed, stage_overrides, time_trl, trl_args
from common import MICRO_BATCH_SIZE, Workload, best_round, patched, ratio_row, report_title, time_sides, write_report
from trainer_core.data.prepared import load_split
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
    """The project's DPO stage in this process (policy and reference: the shared initial model),
    with its reference pass timed on its own."""
    reference: dict[str, float] = {}
    with patched(reference_stage, "reference_logprobs", timed_reference(reference)):
        result = run_probed(
            w,
            "dpo",
            {"model": w.model_dir, "reference": w.model_dir},
            DPOObjective,
            lambda b: int(b["chosen_input_ids"].shape[0]),
            warmup,
            steps,
            round_index,
        )
    return {**result, **reference}


def trl_rows(w: Workload) -> tuple[list[dict], list[tuple[int, int]]]:
    """The project's prepared train pairs as TRL conversational preference examples, with the
    project's (chosen, rejected) sequence lengths (for the equality check)."""
    rows = load_split(w.data_uri, "preference/train")
    examples = [
        {
            "prompt": json.loads(r["messages_json"]),
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in rows
    ]
    return examples, [(len(r["chosen_input_ids"]), len(r["rejected_input_ids"])) for r in rows]


def same_lengths(dataset, lengths: list[tuple[int, int]]) -> bool:
    """True when TRL tokenised every pair to the project's chosen and rejected lengths."""
    trl = [
        (len(p) + len(c), len(p) + len(r))
        for p, c, r in zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"])
    ]
    return sorted(trl) == sorted(lengths)


def run_trl(w: Workload, warmup: int, steps: int, round_index: int = 0, precompute: bool = True) -> dict[str, Any]:
    """TRL's ``DPOTrainer`` (sigmoid loss, beta from the config) on the same pairs and weights; its
    reference pass (in the trainer's construction) is timed on its own."""
    from trl import DPOConfig, DPOTrainer

    examples, lengths = trl_rows(w)
    reference: dict[str, float] = {}
    config = DPOConfig(
        **trl_args(
            w,
            "dpo",
            warmup,
            steps,
            beta=w.config.dpo.beta,
            loss_type=["sigmoid"],
            precompute_ref_log_probs=precompute,
            precompute_ref_batch_size=MICRO_BATCH_SIZE,
        )
    )

    def timed_precompute(original):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            t0 = time.perf_counter()
            out = original(self, dataset, name, batch_size)
            reference["reference_s"] = time.perf_counter() - t0
            reference["reference_pairs"] = len(dataset)
            return out

        return _precompute_ref_logps

    with patched(DPOTrainer, "_precompute_ref_logps", timed_precompute):
        result = time_trl(
            w, DPOTrainer, config, examples, warmup, steps, lambda dataset: same_lengths(dataset, lengths)
        )
    return {**result, **reference, "precompute_ref_log_probs": precompute, "num_train_pairs": len(examples)}


def with_reference(result: dict[str, Any], num_pairs: int) -> dict[str, float]:
    """Pairs/s once the reference pass is added: over one epoch of ``num_pairs`` train pairs
    (at the measured step rate) and over the timed steps alone."""
    ref_s = result.get("reference_s", 0.0)
    epoch_s = num_pairs / result["examples_per_s"] + ref_s
    return {
        "pairs_per_s_incl_reference_epoch": num_pairs / epoch_s,
        "pairs_per_s_incl_reference_timed_steps": result["examples"] / (result["wall_s"] + ref_s),
    }


def report_rows(project: dict[str, Any], trl: dict[str, Any], trl_online: dict[str, Any] | None) -> list[dict]:
    rows = [
        ratio_row(
            "DPO pairs/s (step wall clock, reference pass excluded)", project["examples_per_s"], trl["examples_per_s"]
        ),
        ratio_row(
            "DPO pairs per CPU-second (load-robust)",
            project["examples"] / project["cpu_s"],
            trl["examples"] / trl["cpu_s"],
            None,
        ),
        ratio_row("DPO train tokens/s (chosen + rejected)", project["tokens_per_s"], trl["tokens_per_s"], None),
        ratio_row(
            "DPO reference pass, pairs/s",
            project["reference_pairs"] / project["reference_s"],
            trl["reference_pairs"] / trl["reference_s"],
            None,
        ),
        ratio_row(
            "DPO pairs/s incl. reference pass, 1 epoch",
            project["pairs_per_s_incl_reference_epoch"],
            trl["pairs_per_s_incl_reference_epoch"],
        ),
        ratio_row(
            "DPO pairs/s incl. reference pass, timed steps only",
            project["pairs_per_s_incl_reference_timed_steps"],
            trl["pairs_per_s_incl_reference_timed_steps"],
        ),
    ]
    if trl_online is not None:
        rows.append(
            ratio_row(
                "DPO pairs/s vs TRL precompute_ref_log_probs=False",
                project["examples_per_s"],
                trl_online["examples_per_s"],
            )
        )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Prepare the DPO workload, time the project's stage then TRL's trainer, report."""
    sides = {"project": run_project, "trl": run_trl}
    if args.trl_online_reference:
        sides["trl_online"] = partial(run_trl, precompute=False)
    w, results, prep_s = time_sides(
        "dpo",
        args,
        sides,
        max_length=args.dpo_max_length,
        num_examples=args.dpo_pairs,
        overrides={**stage_overrides("dpo", args.warmup, args.steps), "dpo.beta": 0.1},
    )
    num_pairs = results["trl"][0]["num_train_pairs"]
    for side in results.values():
        for r in side:
            r.update(with_reference(r, num_pairs))
    project, trl = (best_round(results[k], "examples_per_s") for k in ("project", "trl"))
    trl_online = best_round(results["trl_online"], "examples_per_s") if args.trl_online_reference else None
    title = report_title("DPO", w, args, batch_unit=" pairs", detail=f"{num_pairs} train pairs, ")
    return write_report(
        "dpo",
        title,
        report_rows(project, trl, trl_online),
        {"project": project, "trl": trl, "trl_online_reference": trl_online},
        results,
        "examples_per_s",
        w,
        num_train_pairs=num_pairs,
        prepare_s=prep_s,
    )


def add_dpo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dpo-max-length", type=int, default=256, help="max prompt + completion tokens per side")
    parser.add_argument("--dpo-pairs", type=int, default=280, help="pairs kept (train + 16 held out)")
    parser.add_argument(
        "--trl-online-reference",
        action="store_true",
        help="also time TRL with precompute_ref_log_probs=False (reference forward every step)",
    )


def main() -> None:
    run(parse_args(__doc__, add_dpo_arguments))


if __name__ == "__main__":
    main()
