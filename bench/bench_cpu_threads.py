"""OpenMP's wait policy on a shared CPU: a trainer's step time with libgomp's default policy and
with ``OMP_WAIT_POLICY=PASSIVE`` (the default posttrain gives its trainers:
``tasks.stages.SHARED_CPU_ENV``), on an idle CPU and beside busy processes.

Three workloads, each run in a fresh child process so that the environment variable reaches
libgomp before torch loads it: a training step of the demo's tiny Llama (16 x 160 tokens), a
training step of a SmolLM2-shaped 4-layer Llama (hidden 576, 4 x 256 tokens), and a greedy
generation of 64 tokens for 64 prompts with the tiny Llama. Each child times ``--repeats`` calls
after one warm-up call with ``time.perf_counter``; "busy" starts ``--busy`` pure-Python busy loops
(one per core by default) before the children and stops them after.

Prints one row per (workload, load) pair: seconds per call with each policy and the ratio
default / passive (above 1: passive is faster). Writes ``.bench/cpu_threads.json``.

    python bench/bench_cpu_threads.py            # idle and busy, all workloads
    python bench/bench_cpu_threads.py --repeats 2 --workloads tiny_generate
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

WORKLOAD = textwrap.dedent(
    """
    import sys, time, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    name, repeats = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    shapes = {
        "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
        "smollm2_shaped": dict(vocab_size=8192, hidden_size=576, intermediate_size=1536,
                               num_hidden_layers=4, num_attention_heads=9, num_key_value_heads=3,
                               max_position_embeddings=512),
    }
    model_name = "smollm2_shaped" if name.startswith("smollm2") else "tiny"
    cfg = LlamaConfig(**shapes[model_name])
    model = LlamaForCausalLM(cfg)
    if name.endswith("generate"):
        model.eval()
        ids = torch.randint(0, cfg.vocab_size, (64, 40))
        def call():
            with torch.no_grad():
                model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    else:
        shape = (4, 256) if model_name == "smollm2_shaped" else (16, 160)
        ids = torch.randint(0, cfg.vocab_size, shape)
        opt = torch.optim.AdamW(model.parameters())
        def call():
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    print((time.perf_counter() - start) / repeats)
    """
)
WORKLOADS = ("tiny_train", "smollm2_train", "tiny_generate")
BUSY_LOOP = "import time\nwhile True:\n    sum(range(100000))\n"


def seconds_per_call(workload: str, repeats: int, policy: str | None) -> float:
    """One child's mean seconds per call of ``workload`` (after a warm-up call) with
    ``OMP_WAIT_POLICY`` set to ``policy`` (``None``: unset, libgomp's default)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run(
        [sys.executable, "-c", WORKLOAD, workload, str(repeats)], env=env, check=True, capture_output=True, text=True
    ).stdout
    return float(out.strip().splitlines()[-1])


def measure(workloads: list[str], repeats: int, busy: int, loads: list[str]) -> list[dict]:
    rows = []
    for load in loads:
        spinners = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(busy if load == "busy" else 0)]
        try:
            for workload in workloads:
                default = seconds_per_call(workload, repeats, None)
                passive = seconds_per_call(workload, repeats, "PASSIVE")
                rows.append(
                    {
                        "workload": workload,
                        "load": f"{load} ({len(spinners)} busy loops)",
                        "default_s": round(default, 3),
                        "passive_s": round(passive, 3),
                        "default_over_passive": round(default / passive, 2),
                    }
                )
                print(rows[-1], flush=True)
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per child (after one warm-up)")
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="busy loops for the 'busy' load")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--loads", nargs="+", choices=["idle", "busy"], default=["idle", "busy"])
    args = parser.parse_args(argv)
    import torch

    rows = measure(args.workloads, args.repeats, args.busy, args.loads)
    print(f"{'workload':<16} {'load':<20} {'default s':>10} {'passive s':>10} {'ratio':>6}")
    for row in rows:
        print(
            f"{row['workload']:<16} {row['load']:<20} {row['default_s']:>10.3f} {row['passive_s']:>10.3f} "
            f"{row['default_over_passive']:>6.2f}"
        )
    out = Path(".bench") / "cpu_threads.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "cpus": os.cpu_count(),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
