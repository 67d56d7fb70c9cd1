"""SFT speed: the project's SFT stage against TRL's ``SFTTrainer``, same model, data and batch.

Run: ``.venv/bin/python bench/bench_sft.py [--steps 30] [--warmup 3] [--synthetic]``.
Prints train tokens/s of both and their ratio; writes ``.bench/sft.json``. See ``common.py``
for what the timing holds and ``docs/benchmarks/index.md`` for the latest numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from common import (
    MICRO_BATCH_SIZE,
    StepLog,
    Workload,
    best_round,
    captured_stdout,
    patched,
    ratio_row,
    report_title,
    stage_spec,
    summarize_steps,
    time_sides,
    write_report,
)
from trainer_core.data.prepared import load_split, load_tokenizer_from
from trainer_core.spec import StageSpec
from trainer_core.stages.runner import run_spec
from trainer_core.training.loop import TrainLoop
from trainer_core.training.supervised import SFTObjective


def stage_overrides(stage: str, warmup: int, steps: int) -> dict[str, Any]:
    """Config overrides that make a training stage a pure timed run: micro-batch 8, no
    accumulation, one log line per step, evaluation only before step 1 and after the last
    (one micro-batch), no step checkpoints."""
    total = warmup + steps
    return {
        f"{stage}.max_steps": total,
        f"{stage}.micro_batch_size": MICRO_BATCH_SIZE,
        f"{stage}.grad_accum_steps": 1,
        f"{stage}.eval_every": total,
        f"{stage}.eval_max_batches": 1,
        f"{stage}.save_every": 10**9,
        f"{stage}.log_every": 1,
    }


def stamp_step_ends(log: StepLog) -> tuple[type, str, Callable]:
    """The hook (for :func:`common.patched`) stamping each training step's end in ``log``.

    The loop emits its metrics through its checkpoint session's ``MetricsBuffer``, whose
    ``printer`` is called at once, once per optimizer step (``log_every=1``) with ``train/*``
    metrics; the printer is wrapped as each ``TrainLoop`` is built, and stamps the step's end
    with the loop's forward + backward + optimizer seconds.
    """

    def on_init(original):
        def __post_init__(self):
            original(self)
            buffer = self.metrics  # the session's MetricsBuffer
            inner = buffer.printer

            def printer(metrics, step):
                if "train/loss" in metrics:
                    log.mark_end(sum(metrics.get(f"time/{k}_s", 0.0) for k in ("forward", "backward", "optimizer")))
                if inner is not None:
                    inner(metrics, step)

            buffer.printer = printer

        return __post_init__

    return TrainLoop, "__post_init__", on_init


def probe_stage(log: StepLog, objective: type, count_examples):
    """Hooks recording each training step's end time (:func:`stamp_step_ends`), tokens and
    examples while a stage runs. The objective's ``step`` is counted only in training mode
    (evaluation calls it too)."""

    def on_step(original):
        def step(self, model, batch):
            out = original(self, model, batch)
            if model.training:
                counted = self.num_tokens(batch) if hasattr(self, "num_tokens") else out.num_tokens
                log.tokens.append(int(counted))
                log.examples.append(count_examples(batch))
                log.padded_tokens.append(sum(v.numel() for k, v in batch.items() if k.endswith("input_ids")))
            return out

        return step

    return [stamp_step_ends(log), (objective, "step", on_step)]


def run_stage_probed(spec: StageSpec, hooks) -> float:
    """Run a stage spec in-process (``run_spec``: backend, lease, context, the stage's ``run``)
    with ``hooks`` applied; returns its wall seconds."""
    t0 = time.perf_counter()
    with captured_stdout() as tail:
        try:
            with patched(*hooks[0]), patched(*hooks[1]):
                run_spec(spec)
        except BaseException:
            print("\n".join(tail))
            raise
    return time.perf_counter() - t0


def run_probed(
    w: Workload,
    stage: str,
    inputs: dict[str, str],
    objective: type,
    count_examples: Callable[[dict], int],
    warmup: int,
    steps: int,
    round_index: int,
) -> dict[str, Any]:
    """The project's ``stage`` of the workload on ``inputs``, in this process, probed by
    :func:`probe_stage` (``count_examples`` of each training batch): the summary of its timed
    steps (:func:`common.summarize_steps`) and its wall seconds, ``stage_total_s``."""
    log = StepLog()
    spec = stage_spec(w, stage, inputs, run_id=f"round-{round_index}")
    total_s = run_stage_probed(spec, probe_stage(log, objective, count_examples))
    return {**summarize_steps(log, warmup, steps), "stage_total_s": total_s}


def run_project(w: Workload, warmup: int, steps: int, round_index: int = 0) -> dict[str, Any]:
    """The project's SFT stage, in this process; per-step times from the loop's metric printer."""
    return run_probed(
        w,
        "sft",
        {"model": w.model_dir},
        SFTObjective,
        lambda b: int(b["input_ids"].shape[0]),
        warmup,
        steps,
        round_index,
    )


def trl_rows(w: Workload) -> tuple[list[dict], list[int], list[int]]:
    """The project's prepared train rows as TRL conversational prompt-completion examples,
    with the project's sequence and completion token counts (for the equality check)."""
    rows = load_split(w.data_uri, "sft/train")
    examples = [
        {"prompt": json.loads(r["messages_json"]), "completion": [{"role": "assistant", "content": r["completion"]}]}
        for r in rows
    ]
    return examples, [len(r["input_ids"]) for r in rows], [sum(r["loss_mask"]) for r in rows]


def trl_args(w: Workload, stage: str, warmup: int, steps: int, **extra) -> dict[str, Any]:
    """TRL/``TrainingArguments`` kwargs matching the project's run: fp32 on CPU, batch 8, no
    accumulation, the same optimiser settings, no eval, no saving, no logging in the timed steps,
    no gradient checkpointing (TRL's default is on: it trades speed for memory)."""
    cfg = getattr(w.config, stage)
    return dict(
        output_dir=os.path.join(w.root, f"trl-{stage}"),
        max_steps=warmup + steps,
        per_device_train_batch_size=MICRO_BATCH_SIZE,
        gradient_accumulation_steps=1,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_betas[0],
        adam_beta2=cfg.adam_betas[1],
        max_grad_norm=cfg.max_grad_norm or 0.0,
        logging_steps=10**6,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        seed=w.config.seed,
        disable_tqdm=True,
        max_length=w.max_length_tokens,
        **extra,
    )


def step_timer(log: StepLog):
    """A ``TrainerCallback`` stamping each optimizer step's end (and its begin, for compute time)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        begin_s = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin_s = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            log.mark_end(time.perf_counter() - self.begin_s)

    return StepTimer()


def count_collated(trainer, log: StepLog, examples_per_row: int = 1) -> None:
    """Wrap the trainer's collator to record each batch's real tokens and examples, in order.

    Real tokens: ``attention_mask.sum()``; a padding-free / packed batch has no padding, so all
    of ``input_ids``. Batches are drawn in step order (one per step without accumulation).
    """
    collate = trainer.data_collator

    def counting(features):
        batch = collate(features)
        mask = batch.get("attention_mask")
        log.tokens.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        log.examples.append(len(features) // examples_per_row)
        log.padded_tokens.append(int(batch["input_ids"].numel()))
        return batch

    trainer.data_collator = counting


def time_trl(
    w: Workload,
    trainer_class: type,
    config: Any,
    examples: list[dict],
    warmup: int,
    steps: int,
    same_ids: Callable[[Any], bool | None],
) -> dict[str, Any]:
    """Build TRL's ``trainer_class`` with ``config`` on ``examples`` from the workload's tokenizer
    and initial weights (fp32), then train it, timing each step (:func:`step_timer`) and counting
    each collated batch (:func:`count_collated`).

    Returns:
        :func:`common.summarize_steps` of the timed steps, ``init_s`` (building the trainer:
        tokenisation and what it precomputes), ``train_total_s`` and ``same_token_ids_as_project``
        (``same_ids`` of the trainer's tokenised train set).
    """
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    log = StepLog()
    tokenizer = load_tokenizer_from(w.data_uri)
    model = AutoModelForCausalLM.from_pretrained(w.model_dir, dtype="float32")
    t0 = time.perf_counter()
    trainer = trainer_class(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(examples),
        processing_class=tokenizer,
        callbacks=[step_timer(log)],
    )
    init_s = time.perf_counter() - t0
    same = same_ids(trainer.train_dataset)
    count_collated(trainer, log)
    t0 = time.perf_counter()
    trainer.train()
    return {
        **summarize_steps(log, warmup, steps),
        "init_s": init_s,
        "train_total_s": time.perf_counter() - t0,
        "same_token_ids_as_project": same,
    }


def run_trl(w: Workload, warmup: int, steps: int, round_index: int = 0, packing: bool = False) -> dict[str, Any]:
    """TRL's ``SFTTrainer`` on the same rows, tokenizer and initial weights."""
    from trl import SFTConfig, SFTTrainer

    examples, lengths, completion_tokens = trl_rows(w)
    config = SFTConfig(**trl_args(w, "sft", warmup, steps, packing=packing, completion_only_loss=True))
    result = time_trl(
        w,
        SFTTrainer,
        config,
        examples,
        warmup,
        steps,
        lambda dataset: None if packing else same_lengths(dataset, lengths, completion_tokens),
    )
    return {**result, "packing": packing}


def same_lengths(dataset, lengths: list[int], completion_tokens: list[int]) -> bool:
    """True when TRL tokenised every row to the project's length and completion-token count."""
    trl_lengths = [len(x) for x in dataset["input_ids"]]
    trl_completion = [sum(1 for t in x if t != -100) for x in dataset["labels"]]
    return sorted(trl_lengths) == sorted(lengths) and sorted(trl_completion) == sorted(completion_tokens)


def report_rows(project: dict[str, Any], trl: dict[str, Any], trl_packed: dict[str, Any] | None) -> list[dict]:
    rows = [
        ratio_row("SFT train tokens/s (step wall clock)", project["tokens_per_s"], trl["tokens_per_s"]),
        ratio_row(
            "SFT train tokens per CPU-second (load-robust)", project["tokens_per_cpu_s"], trl["tokens_per_cpu_s"], None
        ),
        ratio_row("SFT examples/s (step wall clock)", project["examples_per_s"], trl["examples_per_s"], None),
        ratio_row(
            "SFT median step ms (lower is better)", 1e3 * project["median_step_s"], 1e3 * trl["median_step_s"], None
        ),
    ]
    if trl_packed is not None:
        rows.append(
            ratio_row("SFT train tokens/s vs TRL packing=True", project["tokens_per_s"], trl_packed["tokens_per_s"])
        )
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments shared with ``run_all.py``."""
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per trainer")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them (>= 1)")
    parser.add_argument("--synthetic", action="store_true", help="generated arithmetic task instead of the files")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs per side, alternating the order; the best round of each side is reported",
    )
    parser.add_argument(
        "--quiet-wait-s",
        type=float,
        default=30.0,
        help="before each run, wait up to this long for other processes to leave the CPUs idle",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="scheduling priority of the benchmark process (e.g. -10 on a shared machine; needs root)",
    )
    parser.add_argument("--seed", type=int, default=0)


def parse_args(
    description: str, add_own_arguments: Callable[[argparse.ArgumentParser], None], argv: list[str] | None = None
) -> argparse.Namespace:
    """A speed benchmark's command line: the shared arguments (:func:`add_arguments`) and its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    add_own_arguments(parser)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Prepare the SFT workload, time the project's stage then TRL's trainer, report."""
    sides = {"project": run_project, "trl": run_trl}
    if args.trl_packing:
        sides["trl_packing"] = partial(run_trl, packing=True)
    w, results, prep_s = time_sides(
        "sft",
        args,
        sides,
        max_length=args.sft_max_length,
        num_examples=args.sft_examples,
        overrides=stage_overrides("sft", args.warmup, args.steps),
    )
    project, trl = (best_round(results[k], "tokens_per_s") for k in ("project", "trl"))
    trl_packed = best_round(results["trl_packing"], "tokens_per_s") if args.trl_packing else None
    return write_report(
        "sft",
        report_title("SFT", w, args),
        report_rows(project, trl, trl_packed),
        {"project": project, "trl": trl, "trl_packing": trl_packed},
        results,
        "tokens_per_s",
        w,
        examples=args.sft_examples,
        prepare_s=prep_s,
    )


def add_sft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sft-max-length", type=int, default=256, help="max prompt + completion tokens")
    parser.add_argument("--sft-examples", type=int, default=2000, help="records kept (train + 16 held out)")
    parser.add_argument("--trl-packing", action="store_true", help="also time TRL with packing=True")


def main() -> None:
    run(parse_args(__doc__, add_sft_arguments))


if __name__ == "__main__":
    main()
