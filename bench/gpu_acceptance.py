"""Issue 39's GPU acceptance run: every GPU claim measured by one command, in two parts that each fit one call.

On the GPU machine (``bench/GPU.md``: wheels and data carried, ``PYTHONPATH`` set)::

    python3 bench/gpu_acceptance.py --part A --data-dir .bench/data --results-dir $OUT
    python3 bench/gpu_acceptance.py --part B --data-dir .bench/data --results-dir $OUT

CPU smoke run of both parts (CI: ``tests/unit/test_gpu_acceptance.py``)::

    .venv/bin/python bench/gpu_acceptance.py --part all --device cpu --tiny --synthetic

- Part A, supervised (``bench_gpu.py``): SFT at micro-batch 16 and 64, SFT packed under a 16k
  token budget, DPO at 8 pairs, against TRL's defaults and TRL with Liger (``--trl-liger``); then
  a profile of 3 steps of SFT at micro-batch 16 and packed, each side (``--profile-steps``: the
  40 costliest operators by CUDA time, ``profile_<case>_<side>.txt``); then the packed case with
  ``backend.compile`` (project only). The last two on CUDA only (inductor on a CPU smoke run
  would spend minutes compiling).
- Part B: GRPO 16 x 8 x 256 against TRL's ``GRPOTrainer`` (``bench_grpo_gpu.py``); on CUDA also
  LoRA / QLoRA SFT peak memory against full fine-tuning (``tests/gpu/test_lora_memory.py``) and
  the generation engines' GPU tests, the static engine's top-p path inside its CUDA graph among
  them (``tests/unit/test_engines.py -m gpu``). ``--with-8b`` adds ``tests/gpu/test_8b_fits.py``,
  which needs a call of its own (it builds and saves a 16 GB model). Last, with what is left of
  the budget: the RL forwards padded against ``padding_free`` per attention implementation, and
  micro-batches longest first against row order (``bench_rl_forward.py``).

Each piece runs as a subprocess under its own time limit, cut to what is left of ``--budget-s``
(470 s: a part fits one 10-minute call with the machine's start-up), so one that fails or hangs
costs its own numbers only. Writes ``<--results-dir>/gpu_acceptance_<part>.json`` (each piece's
command, exit status, seconds, its JSON where it writes one, and its output's tail) and prints
one table: the pieces' metric rows (project, TRL, ratio, target) and the tests' outcomes. Exit
status 0 whether or not targets are met (it measures); 1 when a piece fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"


@dataclass
class Piece:
    """One measured piece of a part: a command, its time cap (seconds), the JSON it writes (if any)."""

    name: str
    argv: list[str]
    cap_s: int
    result_json: str | None = None
    outcome: dict[str, Any] = field(default_factory=dict)


def pieces(part: str, args: argparse.Namespace) -> list[Piece]:
    """The pieces of ``part`` (``A`` or ``B``) for ``args`` (device, size, data, results)."""
    py, cuda = sys.executable, args.device == "cuda"
    common = ["--device", args.device, "--results-dir", args.results_dir]
    common += ["--tiny"] if args.tiny else []
    common += ["--synthetic"] if args.synthetic else []
    common += ["--data-dir", args.data_dir] if args.data_dir else []
    trl = ["--no-trl"] if args.no_trl else ["--trl-liger"] if cuda else []
    steps = (
        ["--steps", "2", "--warmup", "1"]
        if args.tiny
        else ["--steps", "10", "--warmup", "3", "--sft-examples", "2000", "--dpo-pairs", "200"]
    )
    pytest = [py, "-m", "pytest", "-m", "gpu", "-s", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rA"]
    if part == "A":
        out = [Piece("supervised", [py, str(BENCH / "bench_gpu.py"), *common, *steps, *trl], 300, "gpu.json")]
        if cuda:
            out.append(
                Piece(
                    "supervised-profile",
                    [
                        py,
                        str(BENCH / "bench_gpu.py"),
                        *common,
                        "--steps",
                        "4",
                        "--warmup",
                        "3",
                        "--profile-steps",
                        "3",
                        "--sft-examples",
                        "1000",
                        "--cases",
                        "sft_mb16",
                        "sft_budget",
                        *trl,
                    ],
                    150,
                    "gpu.json",
                )
            )
            out.append(
                Piece(
                    "supervised-compile",
                    [
                        py,
                        str(BENCH / "bench_gpu.py"),
                        *common,
                        *steps,
                        "--no-trl",
                        "--cases",
                        "sft_budget",
                        "--compile",
                        "--warmup",
                        "4",
                    ],
                    150,
                    "gpu.json",
                )
            )
        return out
    out = [
        Piece(
            "grpo",
            [py, str(BENCH / "bench_grpo_gpu.py"), *common, *(["--no-trl"] if args.no_trl else [])],
            270,
            "grpo_gpu.json",
        )
    ]
    if cuda:
        out.append(Piece("lora-memory", [*pytest, str(REPO / "tests" / "gpu" / "test_lora_memory.py")], 160))
        out.append(Piece("engines", [*pytest, str(REPO / "tests" / "unit" / "test_engines.py")], 100))
        if args.with_8b:
            out.append(Piece("llama3-8b", [*pytest, str(REPO / "tests" / "gpu" / "test_8b_fits.py")], 590))
    quick = ["--repeats", "3", "--warmup", "1", "--rounds", "1"] if cuda else []
    out.append(
        Piece(
            "rl-forward",
            [
                py,
                str(BENCH / "bench_rl_forward.py"),
                "--device",
                args.device,
                "--results-dir",
                args.results_dir,
                *(["--tiny"] if args.tiny else []),
                *quick,
            ],
            120,
            "rl_forward.json",
        )
    )
    return out


def run_piece(piece: Piece, left_s: float, results_dir: Path) -> None:
    """Run ``piece`` under ``min(cap, left_s)`` seconds; record exit status, seconds, its JSON
    (moved aside so the next piece writing the same name does not overwrite it; kept whatever the
    exit status, for a piece that writes as it goes) and output tail."""
    limit = max(1, int(min(piece.cap_s, left_s)))
    start = time.perf_counter()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    }
    try:
        done = subprocess.run(piece.argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit, check=False)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc = 124
        output = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or "") + (
            (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        )
    (results_dir / f"{piece.name}.log").write_text(output)
    payload = None
    if piece.result_json and (results_dir / piece.result_json).exists():
        kept = results_dir / f"{piece.name}.{piece.result_json}"
        (results_dir / piece.result_json).replace(kept)
        payload = json.loads(kept.read_text())  # a piece cut by its limit keeps what it wrote before
    piece.outcome = {
        "name": piece.name,
        "argv": piece.argv,
        "rc": rc,
        "limit_s": limit,
        "wall_s": round(time.perf_counter() - start, 1),
        "result": payload,
        "tests": pytest_outcomes(output) if "pytest" in piece.argv else None,
        "tail": output.splitlines()[-40:],
    }


def pytest_outcomes(output: str) -> dict[str, str]:
    """``test id -> PASSED / FAILED / SKIPPED / ERROR`` from pytest's ``-rA`` summary, and the
    lines the tests printed that name a GiB or tokens/s (their measurements)."""
    out = {m.group(2): m.group(1) for m in re.finditer(r"^(PASSED|FAILED|SKIPPED|ERROR) (\S+)", output, re.M)}
    out.update(
        {
            f"printed {i}": line.strip()
            for i, line in enumerate(
                ln for ln in output.splitlines() if re.search(r"GiB|tokens/s", ln) and not ln.startswith(("E ", ">"))
            )
        }
    )
    return out


def table(outcomes: list[dict[str, Any]]) -> list[str]:
    """One table of every piece: its metric rows, or its tests, or why it gave nothing."""
    lines = [f"{'piece / metric':<66} {'project':>12} {'TRL':>12} {'ratio':>7}  target"]
    for o in outcomes:
        lines.append(f"-- {o['name']}: exit {o['rc']} in {o['wall_s']} s (limit {o['limit_s']} s)")
        for r in (o["result"] or {}).get("rows", []):
            target = (
                "-" if r["target"] is None else f"{r['target']} " + {True: "ok", False: "MISSED", None: "?"}[r["met"]]
            )
            lines.append(
                f"{r['metric'][:66]:<66} {r['project']:>12.4g} {r['trl']:>12.4g} {r['ratio']:>6.2f}x  {target}"
            )
        for test, outcome in (o["tests"] or {}).items():
            lines.append(f"   {outcome}" if test.startswith("printed") else f"   {outcome:<8} {test}")
    return lines


def git_commit() -> str | None:
    """The checkout's commit, when git and the repository are there (the GPU machine may lack both)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
    except OSError:
        return None
    return done.stdout.strip() or None


def run(args: argparse.Namespace) -> int:
    """Run the part(s); write ``gpu_acceptance_<part>.json`` per part; print the table; exit status."""
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    status = 0
    for part in ("A", "B") if args.part == "all" else (args.part,):
        start, outcomes = time.perf_counter(), []
        for piece in pieces(part, args):
            left = args.budget_s - (time.perf_counter() - start)
            if left < 20:
                outcomes.append(
                    {
                        "name": piece.name,
                        "argv": piece.argv,
                        "rc": None,
                        "limit_s": 0,
                        "wall_s": 0,
                        "result": None,
                        "tests": None,
                        "tail": ["not run: the part's budget was spent"],
                    }
                )
                continue
            run_piece(piece, left, results_dir)
            outcomes.append(piece.outcome)
        status |= int(any(o["rc"] != 0 for o in outcomes))
        lines = table(outcomes)
        print(
            f"\nGPU acceptance, part {part} ({args.device}{', tiny' if args.tiny else ''}), "
            f"{time.perf_counter() - start:.0f} s\n" + "\n".join(lines)
        )
        payload = {
            "part": part,
            "commit": git_commit(),
            "settings": dict(vars(args)),
            "pieces": outcomes,
            "table": lines,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        path = results_dir / f"gpu_acceptance_{part}.json"
        path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        print(f"wrote {path}")
    return status


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("A", "B", "all"), required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes (CPU)")
    p.add_argument("--synthetic", action="store_true", help="the generated arithmetic task instead of the data files")
    p.add_argument("--data-dir", help="folder holding gsm8k/ and hh-rlhf-harmless/ (the GPU machine has no ../shared)")
    p.add_argument("--results-dir", default=str(REPO / ".bench" / "gpu-acceptance"))
    p.add_argument("--budget-s", type=float, default=470.0, help="seconds a part may take in all")
    p.add_argument("--no-trl", action="store_true", help="the project alone (TRL not installed)")
    p.add_argument("--with-8b", action="store_true", help="part B also runs the 8B test (a call of its own)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(run(parse_args()))
