"""Data at scale: prepare_data and the first SFT steps on 10k to 1M rows, wall time and peak RSS.

For each row count N, GSM8K (``../shared/data/gsm8k/train.jsonl``, 7,473 problems) is repeated
to N rows in a JSONL file; the preference set stays the 2,000 HH-RLHF pairs. Then, each as its
own process (``python -m trainer_core.run <spec>``, the way the stage tasks launch them):

1. ``prepare_data`` with ``data.num_proc`` = each of ``--num-proc`` (the outputs must be
   identical: the manifests' file hashes are compared);
2. ``sft`` on that output for ``--steps`` optimizer steps (micro-batch 8, the tiny Llama of
   ``configs/gsm8k-hh.yaml``, one process, no evaluation or checkpoint before the end).

Per process it reports the wall time and the peak resident set: ``VmHWM`` from
``/proc/<pid>/status``, sampled every 0.1 s for the process and its children (prepare_data's
workers), and the peak anonymous RSS (``RssAnon``, sampled: memory the process itself
allocated, without the file pages it maps), plus ``ru_maxrss`` from ``wait4`` (the largest of
the process and its children), and the CPU seconds of the main process and of its workers
(``/proc/<pid>/stat``, sampled likewise). For SFT it also reports the time to the first step line.

``--code-root`` runs another checkout's code (e.g. a ``git archive`` of the commit before the
change) on the same data, for a before/after comparison. The machine's load is recorded with
each run (``cpu_s``: CPU seconds of the process and its children; ``others_cpu_share``: the
share of the machine's CPU capacity other processes used meanwhile).

    .venv/bin/python bench/bench_data_scale.py --rows 10000 100000 --num-proc 1 2
    .venv/bin/python bench/bench_data_scale.py --rows 1000000 --num-proc 2 --sft-cache cold warm
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.procfs import cpu_ticks  # noqa: E402
from trainer_core.checkpoint.manifest import read_manifest  # noqa: E402
from trainer_core.config import load_config  # noqa: E402
from trainer_core.spec import build_spec  # noqa: E402
from trainer_core.storage import StageLayout  # noqa: E402

DATA_DIR = Path(os.environ.get("POSTTRAIN_DATA_DIR", REPO_ROOT.parent / "shared" / "data"))
GSM8K = DATA_DIR / "gsm8k" / "train.jsonl"
HH_PAIRS = DATA_DIR / "hh-rlhf-harmless" / "pairs.jsonl"
SAMPLE_S = 0.1


def write_repeated_gsm8k(path: Path, num_rows: int) -> None:
    """``num_rows`` JSON lines: GSM8K's problems repeated in file order."""
    lines = [line for line in GSM8K.read_text(encoding="utf-8").splitlines() if line.strip()]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(num_rows):
            f.write(lines[i % len(lines)] + "\n")


def _status_kb(pid: int) -> dict[str, int]:
    """``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssFile`` of a live process, in kB ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0])
    except (OSError, ValueError):
        return {}
    return out


def _cpu_ticks_of(pid: int) -> int:
    """User + system CPU clock ticks of a live process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return 0


def _children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return found


@dataclass
class TreeMonitor:
    """Peak memory of a process and its descendants, sampled every :data:`SAMPLE_S` seconds."""

    root: int
    peaks: dict[int, dict[str, int]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            stack, seen = [self.root], set()
            while stack:
                pid = stack.pop()
                if pid in seen:
                    continue
                seen.add(pid)
                stack.extend(_children(pid))
                status = _status_kb(pid)
                status["cpu_ticks"] = _cpu_ticks_of(pid)
                peak = self.peaks.setdefault(pid, {})
                for key, value in status.items():
                    peak[key] = max(peak.get(key, 0), value)
            self._stop.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_process(spec_path: Path, code_root: Path, env: dict[str, str], log_path: Path) -> dict:
    """Run one stage process; wall time, memory peaks and the time of its first step line."""
    first_step: list[float] = []
    ticks, children = cpu_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer_core.run", str(spec_path)],
            cwd=code_root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        monitor = TreeMonitor(proc.pid)
        monitor.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if not first_step and "] step " in line:
                first_step.append(time.monotonic() - t0)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall_s = time.monotonic() - t0
        monitor.stop()
    own_cpu_s = _cpu_s(resource.getrusage(resource.RUSAGE_CHILDREN)) - _cpu_s(children)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec_path.name} exited {proc.returncode}; see {log_path}")
    main = monitor.peaks.get(proc.pid, {})
    workers = [p for pid, p in monitor.peaks.items() if pid != proc.pid and p]
    return {
        "wall_s": wall_s,
        "first_step_s": first_step[0] if first_step else None,
        "peak_rss_mb": main.get("VmHWM", 0) / 1024,
        "peak_anon_mb": main.get("RssAnon", 0) / 1024,
        "peak_file_mb": main.get("RssFile", 0) / 1024,
        "main_cpu_s": main.get("cpu_ticks", 0) / os.sysconf("SC_CLK_TCK"),
        "workers": len(workers),
        "workers_cpu_s": sum(p.get("cpu_ticks", 0) for p in workers) / os.sysconf("SC_CLK_TCK"),
        "worker_peak_rss_mb": max((p.get("VmHWM", 0) for p in workers), default=0) / 1024,
        "maxrss_tree_mb": usage.ru_maxrss / 1024,
        "cpu_s": own_cpu_s,
        "others_cpu_share": _others_share(ticks, cpu_ticks(), own_cpu_s),
    }


def _cpu_s(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def _others_share(before: tuple[int, int] | None, after: tuple[int, int] | None, own_cpu_s: float) -> float | None:
    """Share of the machine's CPU capacity that processes other than the measured tree used."""
    if before is None or after is None or after[0] == before[0]:
        return None
    total = after[0] - before[0]
    busy = total - (after[1] - before[1])
    return max(0.0, (busy - own_cpu_s * os.sysconf("SC_CLK_TCK")) / total)


def _config(root: Path, sft_uri: Path, num_proc: int, steps: int):
    return load_config(
        str(REPO_ROOT / "configs" / "gsm8k-hh.yaml"),
        overrides={
            "storage.root": str(root),
            "data.sft.uri": str(sft_uri),
            "data.preference.uri": str(HH_PAIRS),
            "data.num_proc": num_proc,
            "tracking.log_models": False,
            "sft.max_steps": steps,
            "sft.eval_every": 10**6,
            "sft.save_every": 10**6,
            "sft.log_every": 1,
            "sft.eval_max_batches": 2,
        },
    )


def _write_spec(spec, path: Path) -> Path:
    """The spec as JSON; ``data.num_proc`` left out at its default, so that a checkout from before
    the field (``--code-root``) reads it too (the fingerprint does not hash it at 1)."""
    payload = json.loads(spec.model_dump_json())
    if payload["config"]["data"].get("num_proc") == 1:
        del payload["config"]["data"]["num_proc"]
    path.write_text(json.dumps(payload))
    return path


def bench_rows(
    num_rows: int, num_procs: list[int], steps: int, work: Path, code_root: Path, env: dict, sft_cache: list[str]
) -> list[dict]:
    """prepare_data at each num_proc, then SFT once per ``sft_cache`` state (``cold``: the Arrow
    cache emptied first, ``warm``: as the previous run left it), on ``num_rows`` rows; one result
    per process."""
    sft_uri = work / f"gsm8k-{num_rows}.jsonl"
    write_repeated_gsm8k(sft_uri, num_rows)
    results, files = [], {}
    for num_proc in num_procs:
        run_id = f"rows{num_rows}-np{num_proc}"
        config = _config(work, sft_uri, num_proc, steps)
        spec = build_spec(config, "prepare_data", run_id, {})
        r = run_process(
            _write_spec(spec, work / f"{run_id}-prepare.json"), code_root, env, work / f"{run_id}-prepare.log"
        )
        final = StageLayout(spec.output_uri).final
        manifest = read_manifest(final)
        files[num_proc] = {f.path: f.sha256 for f in manifest.files}
        results.append(
            {
                "rows": num_rows,
                "process": "prepare_data",
                "num_proc": num_proc,
                "train_rows": int(manifest.metrics["num_sft_train"]),
                **r,
            }
        )
        print(json.dumps(results[-1]), flush=True)
        data_uri = final
    identical = len({json.dumps(f, sort_keys=True) for f in files.values()}) == 1
    for r in results:
        r["outputs_identical_across_num_proc"] = identical
    spec = build_spec(
        _config(work, sft_uri, num_procs[-1], steps), "sft", f"rows{num_rows}", {"data": data_uri, "model": "init"}
    )
    spec_path = _write_spec(spec, work / f"rows{num_rows}-sft.json")
    for cache in sft_cache:
        if cache == "cold":  # the first reader on a machine converts the split to the Arrow cache
            shutil.rmtree(Path(env["TMPDIR"]) / "posttrain-cache", ignore_errors=True)
        shutil.rmtree(spec.output_uri, ignore_errors=True)  # a fresh stage, not a resume
        r = run_process(spec_path, code_root, env, work / f"rows{num_rows}-sft-{cache}.log")
        results.append({"rows": num_rows, "process": f"sft ({steps} steps, {cache})", "num_proc": None, **r})
        print(json.dumps(results[-1]), flush=True)
    sft_uri.unlink()
    return results


def print_table(results: list[dict]) -> None:
    print(
        f"\n{'rows':>9} {'process':<22} {'np':>2} {'wall s':>7} {'CPU s':>6} {'main':>6} {'workers':>7} "
        f"{'1st step':>8} {'peak RSS':>8} {'anon':>5} {'wk RSS':>6} {'others':>6}"
    )
    for r in results:
        first = "-" if r["first_step_s"] is None else f"{r['first_step_s']:.1f}"
        print(
            f"{r['rows']:>9,} {r['process']:<22} {r['num_proc'] or '-':>2} {r['wall_s']:>7.1f} {r['cpu_s']:>6.1f} "
            f"{r['main_cpu_s']:>6.1f} {r['workers_cpu_s']:>7.1f} {first:>8} {r['peak_rss_mb']:>8.0f} "
            f"{r['peak_anon_mb']:>5.0f} {r['worker_peak_rss_mb']:>6.0f} {r['others_cpu_share'] or 0:>6.0%}"
        )
    print(
        "(seconds; memory in MB; CPU s: the process and its children; main / workers: sampled per process; "
        "wk RSS: the largest child's peak; others: the CPU share other processes took meanwhile)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--sft-cache",
        nargs="+",
        choices=["cold", "warm"],
        default=["cold", "warm"],
        help="SFT runs per row count: with the Arrow cache emptied first (cold) or kept (warm)",
    )
    parser.add_argument("--code-root", type=Path, default=REPO_ROOT, help="checkout whose code the processes run")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a fresh temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (outputs, logs, specs)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".bench" / "data_scale.json")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="posttrain-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_"))}
    env.update(
        PYTHONPATH=str(args.code_root), PYTHONUNBUFFERED="1", TQDM_DISABLE="1", TMPDIR=str(work / "tmp")
    )  # the Arrow cache and prepare_data's staging: removed with the work dir
    (work / "tmp").mkdir(exist_ok=True)
    results = []
    try:
        for num_rows in args.rows:
            results += bench_rows(
                num_rows, args.num_proc, args.steps, work, args.code_root.resolve(), env, args.sft_cache
            )
    finally:
        print_table(results)
        args.out.parent.mkdir(exist_ok=True)
        meta = {
            "code_root": str(args.code_root),
            "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "loadavg_at_end": os.getloadavg(),
        }
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        print(f"\nwrote {args.out}")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
