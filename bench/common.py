"""What the speed benchmarks against TRL share: the workload, the step timers, the report.

One workload feeds both sides: the project's own ``prepare_data`` stage trains the BPE
tokenizer and tokenises the data; the same tokenizer, the same train rows (given to TRL as
text in its conversational prompt-completion / preference format) and the same model weights
(a ~4.2M-parameter Llama built once from a seeded ``LlamaConfig`` and saved to a directory
both sides load) go to each trainer. Rows longer than the benchmark's max length are left
out before the final ``prepare_data`` pass, so neither side truncates anything and both see
exactly the same token ids (checked: see ``check_same_lengths``).

Timing, identical on both sides: a step is timed from the end of the previous optimizer
step to the end of this one (wall clock), so it holds fetching and collating the batch,
forward, backward, clipping, the optimizer and the per-step bookkeeping of each trainer;
the first ``warmup`` steps are excluded. Throughput = real (non-padding) tokens of the
examples of the timed steps / their wall seconds; pairs/s = pairs of the timed steps / their
wall seconds. One-off work (data preparation, tokenisation, model loading, the reference
log-prob pass of DPO, the evaluations, the final save) is outside the step timing and
reported separately where it matters.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from procfs import cpu_ticks

from trainer_core.config import PipelineConfig, load_config
from trainer_core.data.formats import to_preference_example, to_sft_example
from trainer_core.data.prepared import load_tokenizer_from
from trainer_core.data.synthetic import make_preference_records, make_sft_records
from trainer_core.data.tokenizer import encode_chat
from trainer_core.errors import DataError
from trainer_core.modeling.models import count_parameters, load_causal_lm
from trainer_core.spec import StageSpec, build_spec
from trainer_core.stages.runner import run_spec
from trainer_core.storage import StageLayout, configure

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(os.environ.get("POSTTRAIN_BENCH_RESULTS_DIR", REPO_ROOT / ".bench"))
"""Where the benchmarks write their JSON (``POSTTRAIN_BENCH_RESULTS_DIR``; default ``.bench/``)."""
DATA_DIR = Path(os.environ.get("POSTTRAIN_DATA_DIR", REPO_ROOT.parent / "shared" / "data"))
GSM8K = DATA_DIR / "gsm8k" / "train.jsonl"
HH_PAIRS = DATA_DIR / "hh-rlhf-harmless" / "pairs.jsonl"

NUM_THREADS = 2
MICRO_BATCH_SIZE = 8
VOCAB_SIZE = 4096
MODEL_INIT = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
}
"""With the 4096-token vocabulary (tied embeddings): 4,212,992 parameters."""

TARGET_RATIO = 2.0
"""The issue's target: the project's throughput at least 2x TRL's."""


@dataclass
class Workload:
    """One benchmark's prepared data and model, shared by both trainers.

    Attributes:
        kind: ``"sft"`` or ``"dpo"``.
        root: temporary storage root (deleted by :func:`cleanup`).
        config: the pipeline config of the final ``prepare_data`` pass and the stage runs.
        data_uri: the committed ``prepare_data`` output.
        model_dir: HF directory of the seeded initial model (weights + tokenizer).
        max_length_tokens: longest row kept (prompt + completion), the same ``max_length`` for TRL.
        num_params: parameters of the model (tied embeddings counted once).
        source: where the records came from.
    """

    kind: str
    root: str
    config: PipelineConfig
    data_uri: str
    model_dir: str
    max_length_tokens: int
    num_params: int
    source: str


def set_threads() -> None:
    """Both sides run with :data:`NUM_THREADS` intra-op threads (the 2-core CI machine), unless
    ``OMP_NUM_THREADS`` is set: then the count torch took from it stands, for both sides alike
    (the suite's smoke runs set 1, so that a benchmark does not run 2 threads on the core the
    other test worker uses; the result's ``environment.torch_threads`` says which count ran)."""
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(NUM_THREADS)


def set_niceness(niceness: int) -> None:
    """Give every thread of this process the scheduling priority ``niceness`` (Linux; below 0
    needs root). On a machine shared with other CPU-bound work, a negative value makes the
    measured numbers far less dependent on what else runs. Threads started later inherit it.
    With scheduler autogroups (``/proc/sys/kernel/sched_autogroup_enabled``) a thread's nice
    value only counts within its session, so the session's autogroup gets it too.

    Raises:
        PermissionError: a negative ``niceness`` without the privilege to set it.
    """
    if niceness == 0:
        return
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tids:
        os.setpriority(os.PRIO_PROCESS, tid, niceness)
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text(f"{niceness}\n")


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise DataError(f"{path} not found; pass --synthetic to use the generated task")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def raw_records(kind: str, synthetic: bool, seed: int, num: int) -> tuple[list[dict], str, str]:
    """(records, format, source name) of the benchmark's data, before any filtering.

    ``num`` caps the synthetic generator only; real files are read whole and capped later.
    """
    if kind == "sft":
        if synthetic:
            return make_sft_records(num, seed, 20), "gsm8k", "synthetic"
        return _read_jsonl(GSM8K), "gsm8k", str(GSM8K)
    if synthetic:
        return make_preference_records(num, seed, 20), "prompt_completion", "synthetic"
    return _read_jsonl(HH_PAIRS), "hh_rlhf", str(HH_PAIRS)


def _full_lengths(kind: str, record: dict, fmt: str, tokenizer: Any) -> list[int] | None:
    """Untruncated token counts of a record's sequence(s); None when it does not parse."""
    try:
        ex = to_sft_example(record, fmt) if kind == "sft" else to_preference_example(record, fmt)
    except DataError:
        return None
    completions = [ex["completion"]] if kind == "sft" else [ex["chosen"], ex["rejected"]]
    big = 1 << 20
    return [len(encode_chat(tokenizer, ex["messages"], c, big, big - 1)["input_ids"]) for c in completions]


def fitting_records(
    kind: str, records: list[dict], fmt: str, tokenizer: Any, max_length: int, limit: int
) -> list[dict]:
    """The first ``limit`` records whose every sequence fits in ``max_length`` tokens untruncated."""
    kept = []
    for record in records:
        lengths = _full_lengths(kind, record, fmt, tokenizer)
        if lengths is not None and max(lengths) <= max_length:
            kept.append(record)
            if len(kept) >= limit:
                break
    return kept


def _write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({k: v for k, v in r.items() if k != "_source"}, ensure_ascii=False) + "\n")


def _config(overrides: dict[str, Any]) -> PipelineConfig:
    return load_config(None, overrides=overrides)


def _run_prepare(config: PipelineConfig, run_id: str) -> str:
    """Run ``prepare_data`` in this process (output ``<root>/runs/<run_id>/stages/prepare_data``);
    returns its committed final directory."""
    spec = build_spec(config, "prepare_data", run_id, {})
    run_spec(spec)
    return StageLayout(spec.output_uri).final


def _data_overrides(kind: str, uri: str | None, fmt: str, max_length: int) -> dict[str, Any]:
    source = "data.sft" if kind == "sft" else "data.preference"
    other = "data.preference" if kind == "sft" else "data.sft"
    out = {
        f"{source}.uri": uri,
        f"{source}.format": fmt,
        "data.max_eval_rows": 16,
        "data.max_length_tokens": max_length,
        "data.max_prompt_length_tokens": max_length - 1,
        "data.synthetic.num_problems": 64,
        "data.synthetic.num_pairs": 64,
    }
    out[f"{other}.uri"] = None  # the unused data set: a small synthetic one
    return out


def prepare_workload(
    kind: str, *, synthetic: bool, max_length: int, num_examples: int, seed: int, overrides: dict[str, Any]
) -> Workload:
    """Prepare the data twice with the project's ``prepare_data`` and build the shared model.

    Pass 1 trains the tokenizer on all records (``model.init``: tokenizer trained on the data).
    The first ``num_examples`` records that fit ``max_length`` untruncated are written to a
    JSONL file; pass 2 prepares them with that tokenizer, loaded from the saved model
    directory (``model.name_or_path``), which both trainers then load.

    Args:
        kind: ``"sft"`` (GSM8K) or ``"dpo"`` (HH-RLHF harmless pairs).
        synthetic: use the generated arithmetic task instead of the files.
        max_length: longest prompt + completion kept, in tokens.
        num_examples: records kept (train + held-out split).
        seed: the pipeline seed (split, init, shuffling).
        overrides: extra config overrides for the stage runs (``sft.*`` / ``dpo.*``).
    """
    root = tempfile.mkdtemp(prefix=f"posttrain-bench-{kind}-")
    records, fmt, source = raw_records(kind, synthetic, seed, max(4 * num_examples, 200))
    tmp_jsonl = os.path.join(root, f"{kind}.jsonl")
    _write_jsonl(tmp_jsonl, records)
    common = {"seed": seed, "storage.root": root, "tokenizer.vocab_size": VOCAB_SIZE, "backend.device": "cpu"}
    first = _config(
        {
            **common,
            **_data_overrides(kind, tmp_jsonl, fmt, 2048),
            **{f"model.init.{k}": v for k, v in MODEL_INIT.items()},
        }
    )
    tokenizer = load_tokenizer_from(_run_prepare(first, "tokenizer"))
    kept = fitting_records(kind, records, fmt, tokenizer, max_length, num_examples)
    _write_jsonl(tmp_jsonl, kept)
    model_dir = os.path.join(root, "init-model")
    model = load_causal_lm("init", first.model, tokenizer, seed)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    second = _config(
        {
            **common,
            **_data_overrides(kind, tmp_jsonl, fmt, max_length),
            **overrides,
            "model.init": None,
            "model.name_or_path": model_dir,
        }
    )
    configure(second.storage)
    return Workload(
        kind=kind,
        root=root,
        config=second,
        data_uri=_run_prepare(second, "bench"),
        model_dir=model_dir,
        max_length_tokens=max_length,
        num_params=count_parameters(model),
        source=source,
    )


def cleanup(workload: Workload) -> None:
    """Delete the workload's temporary storage root."""
    shutil.rmtree(workload.root, ignore_errors=True)


def stage_spec(workload: Workload, stage: str, inputs: dict[str, str], run_id: str) -> StageSpec:
    """A spec running ``stage`` of the workload's config with ``inputs`` (``data`` added); a
    fresh ``run_id`` gives a fresh output directory (nothing to resume or reuse). Run it with
    ``trainer_core.stages.runner.run_spec``. Built after the inputs are committed: the spec's
    fingerprint is computed from their manifests."""
    return build_spec(workload.config, stage, run_id, {"data": workload.data_uri, **inputs})


@dataclass
class StepLog:
    """What a trainer did at each optimizer step, in step order (index 0 = step 1).

    Attributes:
        ends_s: ``time.perf_counter()`` at the end of each step.
        tokens: real (non-padding) tokens of each step's examples.
        examples: examples (SFT rows or preference pairs) of each step.
        padded_tokens: token positions each step computed on, padding included.
        cpu_s: ``time.process_time()`` (CPU seconds of this process, all threads) at the same points.
        compute_s: the trainer's own forward + backward + optimizer time of each step, when known.
    """

    ends_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    examples: list[int] = field(default_factory=list)
    padded_tokens: list[int] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)

    def mark_end(self, compute_s: float | None = None) -> None:
        """Record the end of a step (and the trainer's own compute seconds of it, if known)."""
        self.ends_s.append(time.perf_counter())
        self.cpu_s.append(time.process_time())
        if compute_s is not None:
            self.compute_s.append(compute_s)


def summarize_steps(log: StepLog, warmup: int, steps: int) -> dict[str, float]:
    """Throughput over steps ``warmup + 1 .. warmup + steps`` (1-based).

    Raises:
        RuntimeError: fewer steps were logged than asked for, or ``warmup`` < 1 (the first
            timed step starts at the end of the last warmup step).
    """
    if warmup < 1:
        raise RuntimeError("need at least 1 warmup step: a timed step starts when the previous one ends")
    if len(log.ends_s) < warmup + steps or len(log.tokens) < warmup + steps:
        raise RuntimeError(
            f"asked for {warmup}+{steps} steps, the trainer logged {len(log.ends_s)} step ends "
            f"and {len(log.tokens)} token counts"
        )
    window = slice(warmup, warmup + steps)
    wall_s = log.ends_s[warmup + steps - 1] - log.ends_s[warmup - 1]
    step_s = [b - a for a, b in zip(log.ends_s[warmup - 1 : warmup + steps - 1], log.ends_s[window])]
    tokens, examples = sum(log.tokens[window]), sum(log.examples[window])
    out = {
        "timed_steps": steps,
        "warmup_steps": warmup,
        "wall_s": wall_s,
        "tokens": tokens,
        "examples": examples,
        "tokens_per_s": tokens / wall_s,
        "examples_per_s": examples / wall_s,
        "median_step_s": statistics.median(step_s),
    }
    if len(log.padded_tokens) >= warmup + steps:
        out["padded_tokens"] = sum(log.padded_tokens[window])
        out["padding_share"] = 1.0 - tokens / out["padded_tokens"]
    if len(log.cpu_s) >= warmup + steps:
        out["cpu_s"] = log.cpu_s[warmup + steps - 1] - log.cpu_s[warmup - 1]
        out["tokens_per_cpu_s"] = tokens / out["cpu_s"]
    if len(log.compute_s) >= warmup + steps:
        out["compute_s"] = sum(log.compute_s[window])
        out["compute_share"] = out["compute_s"] / wall_s
    return out


def busy_share(interval_s: float = 1.0) -> float:
    """Fraction of the machine's CPU capacity in use over ``interval_s`` (NaN off Linux)."""
    before = cpu_ticks()
    time.sleep(interval_s)
    after = cpu_ticks()
    if before is None or after is None or after[0] == before[0]:
        return float("nan")
    return 1.0 - (after[1] - before[1]) / (after[0] - before[0])


def wait_for_quiet(max_wait_s: float, threshold: float = 0.25) -> float:
    """Wait (at most ``max_wait_s``) until other processes use under ``threshold`` of the CPUs.

    The benchmark shares its 2 cores with whatever else runs; a busy machine slows both sides,
    but not equally. Returns the last busy share measured.
    """
    deadline = time.monotonic() + max_wait_s
    share = busy_share()
    while share > threshold and time.monotonic() < deadline:
        share = busy_share(2.0)
    return share


@contextlib.contextmanager
def others_load(into: dict[str, Any]) -> Iterator[None]:
    """Measure the share of the CPUs used by OTHER processes during the block into
    ``into["others_cpu_share"]`` (0 = the benchmark had the machine to itself)."""
    ticks, cpu0 = cpu_ticks(), time.process_time()
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    yield
    after, cpu1 = cpu_ticks(), time.process_time()
    if ticks is None or after is None or after[0] == ticks[0]:
        into["others_cpu_share"] = float("nan")
        return
    total, busy = after[0] - ticks[0], (after[0] - ticks[0]) - (after[1] - ticks[1])
    into["others_cpu_share"] = max(0.0, (busy - (cpu1 - cpu0) * hz) / total)


def alternate(rounds: int, runs: dict[str, Callable[[int], dict]], quiet_wait_s: float = 0.0) -> dict[str, list[dict]]:
    """Run each side once per round, in reversed order every other round (A B, B A, ...), so
    that a drift in the machine's load hits both sides alike. Before each run, wait up to
    ``quiet_wait_s`` for the machine to be idle; each result records the busy share seen just
    before it started and the share other processes used while it ran.
    """
    names = list(runs)
    out: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            load: dict[str, Any] = {"busy_share_before": wait_for_quiet(quiet_wait_s) if quiet_wait_s else None}
            with others_load(load):
                result = runs[name](i)
            out[name].append({**result, **load})
    return out


def best_round(results: list[dict], key: str) -> dict:
    """The round with the highest ``key`` (the least disturbed), with every round's value listed."""
    top = max(results, key=lambda r: r[key])
    return {**top, f"rounds_{key}": [r[key] for r in results]}


def time_sides(
    kind: str,
    args: argparse.Namespace,
    sides: dict[str, Callable[..., dict[str, Any]]],
    *,
    max_length: int,
    num_examples: int,
    overrides: dict[str, Any],
) -> tuple[Workload, dict[str, list[dict]], float]:
    """A speed benchmark's measurement: set the process up (``args.nice``, :func:`set_threads`,
    :func:`quiet_libraries`), prepare the ``kind`` workload (:func:`prepare_workload`), then run
    every side ``side(workload, args.warmup, args.steps, round_index)`` for ``args.rounds``
    alternating rounds (:func:`alternate`, waiting up to ``args.quiet_wait_s`` for a quiet
    machine); the workload's storage is deleted afterwards.

    Returns:
        The workload (its facts, for the report), each side's rounds, and the seconds the
        preparation took.
    """
    set_niceness(args.nice)
    set_threads()
    quiet_libraries()
    t0 = time.perf_counter()
    w = prepare_workload(
        kind,
        synthetic=args.synthetic,
        max_length=max_length,
        num_examples=num_examples,
        seed=args.seed,
        overrides=overrides,
    )
    try:
        prep_s = time.perf_counter() - t0
        runs = {name: functools.partial(side, w, args.warmup, args.steps) for name, side in sides.items()}
        results = alternate(args.rounds, runs, args.quiet_wait_s)
    finally:
        cleanup(w)
    return w, results, prep_s


@contextlib.contextmanager
def patched(owner: Any, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace ``owner.name`` by ``make(original)`` for the duration of the block."""
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def captured_stdout(keep_lines: int = 20) -> Iterator[list[str]]:
    """Capture stdout (the stages print one line per step); the last lines come back in the list."""
    buffer, tail = io.StringIO(), []
    try:
        with contextlib.redirect_stdout(buffer):
            yield tail
    finally:
        tail.extend(buffer.getvalue().splitlines()[-keep_lines:])


def ratio_row(metric: str, project: float, trl: float, target: float | None = TARGET_RATIO) -> dict[str, Any]:
    """One line of the report; ``met`` is None for rows without a target."""
    ratio = project / trl if trl else float("nan")
    return {
        "metric": metric,
        "project": project,
        "trl": trl,
        "ratio": ratio,
        "target": target,
        "met": None if target is None else ratio >= target,
    }


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    """Print rows of :func:`ratio_row` as a fixed-width table."""
    print(f"\n{title}")
    print(f"{'metric':<52} {'project':>10} {'TRL':>10} {'ratio':>7}  target")
    for r in rows:
        target = "-" if r["target"] is None else f">= {r['target']:g}x " + ("ok" if r["met"] else "MISSED")
        print(f"{r['metric']:<52} {r['project']:>10.2f} {r['trl']:>10.2f} {r['ratio']:>6.2f}x  {target}")


def print_rounds(results: dict[str, list[dict]], key: str) -> None:
    """One line per side: ``key`` of every round, with the CPU share other processes took meanwhile."""
    for name, rounds in results.items():
        values = ", ".join(f"{r[key]:.2f} (others {r.get('others_cpu_share', float('nan')):.0%})" for r in rounds)
        print(f"  {name} {key} per round: {values}")


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every result."""
    import subprocess

    import transformers
    import trl

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
            return done.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "trainer_core_modified": bool(git("status", "--porcelain", "trainer_core")),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_1m_5m_15m_at_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as ``.bench/<name>.json``; returns the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    return path


def quiet_libraries() -> None:
    """Silence progress bars and info logs of datasets / transformers / TRL (not warnings)."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_warning()
    transformers.logging.set_verbosity_warning()


def report_title(stage: str, w: Workload, args: argparse.Namespace, batch_unit: str = "", detail: str = "") -> str:
    """The heading of a speed benchmark's table: the stage, the model's size, the micro-batch
    (``batch_unit``: what it counts, when not rows), the max length, ``detail``, the timed steps,
    the rounds and the data."""
    return (
        f"{stage}, {w.num_params / 1e6:.2f}M-param Llama, batch {MICRO_BATCH_SIZE}{batch_unit}, max_length "
        f"{w.max_length_tokens}, {detail}{args.steps} timed steps after {args.warmup} warmup, best of "
        f"{args.rounds} rounds, data {w.source}"
    )


def write_report(
    name: str,
    title: str,
    rows: list[dict[str, Any]],
    best: dict[str, dict | None],
    results: dict[str, list[dict]],
    key: str,
    w: Workload,
    **workload_facts: Any,
) -> dict[str, Any]:
    """Print the report (the table of ``rows`` under ``title``, then each side's ``key`` per round)
    and write it as ``.bench/<name>.json``: the rows, the best round of each side (``best``),
    every round, the workload's facts (with ``workload_facts``) and the environment.

    Returns:
        That payload.
    """
    print_table(title, rows)
    payload = {
        "benchmark": name,
        "rows": rows,
        **best,
        "all_rounds": results,
        "workload": {
            "source": w.source,
            "num_params": w.num_params,
            "max_length": w.max_length_tokens,
            "micro_batch_size": MICRO_BATCH_SIZE,
            **workload_facts,
        },
        "environment": environment(),
    }
    print_rounds(results, key)
    print(f"wrote {write_result(name, payload)}")
    return payload
