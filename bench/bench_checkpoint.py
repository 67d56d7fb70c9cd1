"""Checkpoint speed on S3: the project's save and load against plain s3fs, and the training
step stall of an asynchronous save against a synchronous one.

Run: ``.venv/bin/python bench/bench_checkpoint.py [--rounds 3] [--steps 24] [--save-every 4]``
(about 5 minutes on 2 busy cores).
Prints two tables; writes ``.bench/checkpoint.json`` (``checkpoint-<part>.json`` with ``--only``).

The S3 endpoint is a moto server in its own process on 127.0.0.1 (so it does not share this
process's GIL; it does share the machine's CPUs). The model is the speed benchmarks' Llama
(hidden 256, 4 layers, vocab 4096: 4.2M parameters, fp32), after one optimizer step, so a
checkpoint holds weights, both AdamW moments, scheduler, RNG and trainer state (~50 MB).

1. Throughput (MB/s of checkpoint bytes), best of ``--rounds`` rounds per side, sides in
   alternating order:

   - save, project: what the checkpoint session's background saver runs after the snapshot:
     ``StagedWriter.replay`` into a ``RankWriter`` (clear the target, upload each file while
     hashing it), then ``RankWriter.commit`` (``manifest.json`` last).
     Plain: ``s3fs.pipe_file`` of the same bytes, file by file.
   - load, project: what a resumed stage does: ``find_latest`` (list, read the manifest,
     check every file's size and SHA-256 by streaming it) then ``load_checkpoint_state`` (read
     every file again and restore model, optimizer, scheduler and RNG). Plain:
     ``s3fs.cat_file`` of every file once. The two parts are also timed on their own.
   - snapshot: ``put_train_state`` into a ``StagedWriter`` (state to bytes in host memory; no
     I/O): the part of an asynchronous save the training step always waits for.

2. Step stall: ``TrainLoop`` in process on the same model (synthetic ``--loop-tokens``-token
   rows, micro-batch ``--loop-batch``, no accumulation: short steps, the same checkpoint),
   ``--steps`` steps with a checkpoint to S3 every ``--save-every`` steps (a
   ``CheckpointSession``), with ``async_save`` True, False, and without checkpoints
   (``save_every`` > steps). A step's time is the wall time between the per-step calls of the
   session's metrics printer (``MetricsBuffer(printer=...)``); a save runs after the metrics of
   step N, so it lands in the time of step N+1 ("after a save"). Reported: median time of
   normal steps and of steps after a save, the difference (the stall), the session's own
   logged values (``trainer_core.checkpoint.session``: ``step stalled``, the snapshot time, for
   an async save; the whole in-step save time for a sync one), the wall time of all timed steps and its
   excess over the run without checkpoints. On a CPU-only machine the background upload (and
   the moto server parsing it) competes with training for the same cores, so an async save
   also slows the steps it overlaps; the wall-time excess is the number that counts.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import boto3
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common import MODEL_INIT, MICRO_BATCH_SIZE, VOCAB_SIZE, others_load, set_threads, write_result
from trainer_core import storage
from trainer_core.backends import build_backend
from trainer_core.backends.single import SingleDeviceBackend
from trainer_core.checkpoint.components import RankWriter, Sharing, StagedWriter, per_rank_path
from trainer_core.checkpoint.manifest import find_latest
from trainer_core.checkpoint.session import CheckpointSession, MetricsBuffer
from trainer_core.checkpoint.train_state import TrainProgress, load_checkpoint_state, put_train_state
from trainer_core.config import BackendConfig, SFTConfig, StorageConfig
from trainer_core.training.loop import TrainLoop, build_optimizer, build_scheduler
from trainer_core.training.supervised import SFTObjective, causal_source

S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
SEQ_TOKENS = 128
MB = 2**20


# ---------------------------------------------------------------- S3 endpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int) -> subprocess.Popen:
    """A moto server process on 127.0.0.1:``port``, answering requests when this returns.

    Raises:
        RuntimeError: it did not answer within 60 s.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"moto server on port {port} did not start")


def s3_bucket(endpoint: str) -> str:
    """Point the process's storage at ``endpoint`` and create a fresh bucket there."""
    os.environ.update(S3_ENV)
    storage.configure(StorageConfig(endpoint_url=endpoint, region="us-east-1"))
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket


# ---------------------------------------------------------------- model and state


def build_model(seed: int = 0) -> LlamaForCausalLM:
    """The speed benchmarks' Llama (``common.MODEL_INIT``, vocab 4096, tied embeddings)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, tie_word_embeddings=True, **MODEL_INIT)
    return LlamaForCausalLM(config)


def train_cfg(**overrides: Any) -> SFTConfig:
    return SFTConfig(**{"max_steps": 24, "warmup_steps": 2, "micro_batch_size": MICRO_BATCH_SIZE, **overrides})


def stepped_state() -> tuple[LlamaForCausalLM, torch.optim.Optimizer, Any, TrainProgress]:
    """The model after one optimizer step (AdamW moments populated)."""
    model = build_model()
    optimizer = build_optimizer(model, train_cfg())
    scheduler = build_scheduler(optimizer, train_cfg())
    ids = torch.randint(0, VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_TOKENS))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler, TrainProgress(global_step=1, consumed_samples=MICRO_BATCH_SIZE)


# ---------------------------------------------------------------- throughput


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class FileBytes:
    """A one-rank ``RankWriter`` stand-in that keeps what is put: relative path -> bytes, the
    files a single-process checkpoint directory holds (no manifest), for the plain-s3fs side."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def put(self, name: str, sharing: Sharing, data: bytes, checksum: str | None = None) -> None:
        self.files[per_rank_path(name, 0) if sharing is Sharing.PER_RANK else name] = data


def snapshot(
    backend: SingleDeviceBackend, model: Any, optimizer: Any, scheduler: Any, progress: TrainProgress
) -> StagedWriter:
    """``put_train_state`` into a ``StagedWriter``: the state as bytes in host memory, no I/O
    (what an asynchronous save does in step)."""
    staged = StagedWriter()
    put_train_state(
        staged, backend=backend, model=model, optimizer=optimizer, scheduler=scheduler, progress=progress, files={}
    )
    return staged


def throughput(bucket: str, rounds: int) -> dict[str, Any]:
    """Save and load MB/s of the project and of plain s3fs, best round each (see module doc)."""
    model, optimizer, scheduler, progress = stepped_state()
    backend = SingleDeviceBackend("cpu")
    snapshot_s = [timed(lambda: snapshot(backend, model, optimizer, scheduler, progress)) for _ in range(rounds)]
    staged = snapshot(backend, model, optimizer, scheduler, progress)
    plain = FileBytes()
    staged.replay(plain)
    files = plain.files
    size_mb = sum(len(b) for b in files.values()) / MB
    fs, _ = storage.url_to_fs(f"s3://{bucket}")
    fields = {
        "stage": "sft",
        "run_id": "bench",
        "config_hash": "bench",
        "backend": backend.name,
        "world_size": backend.world_size,
        "extra": {"checkpoint_format": backend.checkpoint_format},
    }
    fresh = build_model(seed=1)
    fresh_opt = build_optimizer(fresh, train_cfg())
    fresh_sched = build_scheduler(fresh_opt, train_cfg())

    def save(uri: str) -> None:
        out = RankWriter(uri, backend)
        staged.replay(out)
        out.commit(
            kind="checkpoint",
            global_step=progress.global_step,
            consumed_samples=progress.consumed_samples,
            consumed_tokens=progress.consumed_tokens,
            **fields,
        )

    def project_save(i: int) -> dict[str, float]:
        uri = f"s3://{bucket}/project/{i}/checkpoints/step-00000001"
        return {"save_s": timed(lambda: save(uri))}

    def plain_save(i: int) -> dict[str, float]:
        return {"save_s": timed(lambda: [fs.pipe_file(f"{bucket}/plain/{i}/{n}", d) for n, d in files.items()])}

    def project_load(i: int) -> dict[str, float]:
        ckpts = f"s3://{bucket}/project/{i}/checkpoints"
        found: list = []
        verify_s = timed(lambda: found.append(find_latest(ckpts)))
        uri, manifest = found[0]
        restore_s = timed(
            lambda: load_checkpoint_state(
                uri, manifest, backend=backend, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched
            )
        )
        return {"load_s": verify_s + restore_s, "find_latest_s": verify_s, "load_checkpoint_state_s": restore_s}

    def plain_load(i: int) -> dict[str, float]:
        return {"load_s": timed(lambda: [fs.cat_file(f"{bucket}/plain/{i}/{n}") for n in files])}

    out: dict[str, Any] = {"checkpoint_mb": size_mb, "files": {n: len(b) for n, b in files.items()}}
    for op, sides in (
        ("save", {"project": project_save, "plain_s3fs": plain_save}),
        ("load", {"project": project_load, "plain_s3fs": plain_load}),
    ):
        results: dict[str, list[dict]] = {name: [] for name in sides}
        for i in range(rounds):
            for name in list(sides) if i % 2 == 0 else list(sides)[::-1]:
                load: dict[str, Any] = {}
                with others_load(load):
                    result = sides[name](i)
                results[name].append({**result, **load})
        for name, rounds_ in results.items():
            best = min(rounds_, key=lambda r: r[f"{op}_s"])
            out[f"{op}_{name}"] = {
                **best,
                "mb_per_s": size_mb / best[f"{op}_s"],
                "rounds_s": [r[f"{op}_s"] for r in rounds_],
            }
        out[f"{op}_ratio"] = out[f"{op}_project"]["mb_per_s"] / out[f"{op}_plain_s3fs"]["mb_per_s"]
    out["snapshot_s"] = {"best": min(snapshot_s), "rounds": snapshot_s}
    # Restoring does what a plain read does, plus hashing and deserialising: parts of the load.
    restore = out["load_project"]
    out["load_parts_mb_per_s"] = {
        "find_latest (list + manifest + sha256 of every file)": size_mb / restore["find_latest_s"],
        "load_checkpoint_state (read + restore)": size_mb / restore["load_checkpoint_state_s"],
    }
    return out


# ---------------------------------------------------------------- step stall


class StallLog(logging.Handler):
    """Collects, from the checkpoint session's log, the seconds each committed checkpoint held
    the training step: ``step stalled`` of an asynchronous save (its in-memory snapshot), or
    the whole in-step save of a synchronous one (``committed by N rank(s) in``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.stalls: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        if ("step stalled" in msg or "committed by" in msg) and record.args:
            self.stalls.append(float(record.args[-1]))


def synthetic_rows(num: int, tokens: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB_SIZE, (num, tokens), generator=gen).tolist()
    return [{"input_ids": row, "loss_mask": [0] * (tokens // 4) + [1] * (tokens - tokens // 4)} for row in ids]


def run_loop(bucket: str, mode: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """Train ``args.steps`` steps with checkpoints in ``mode`` (``async``, ``sync`` or ``none``)."""
    steps, save_every = args.steps, args.save_every
    backend = build_backend(BackendConfig(device="cpu"))
    cfg = train_cfg(
        max_steps=steps,
        warmup_steps=2,
        eval_every=10**6,
        eval_max_batches=1,
        log_every=1,
        micro_batch_size=args.loop_batch,
        save_every=save_every if mode != "none" else steps + 1,
        async_save=mode == "async",
    )
    device = backend.device
    train = causal_source(synthetic_rows(512, args.loop_tokens, 0), 0, cfg.micro_batch_size, 0, device)
    held_out = causal_source(synthetic_rows(8, args.loop_tokens, 1), 0, cfg.micro_batch_size, 0, device, shuffle=False)
    step_ends: dict[int, float] = {}

    def step_end(metrics: dict[str, float], step: int) -> None:
        if "train/loss" in metrics:  # not the evaluations (steps 0 and last), which log too
            step_ends[step] = time.perf_counter()

    stall_log = StallLog()
    loop_logger = logging.getLogger("trainer_core.checkpoint.session")
    loop_logger.addHandler(stall_log)
    loop_logger.setLevel(logging.INFO)
    loop_logger.propagate = False
    session = CheckpointSession(
        f"s3://{bucket}/loop/{tag}/checkpoints",
        backend,
        fingerprint="bench",
        metrics=MetricsBuffer(printer=step_end),
        stage="sft",
        run_id="bench",
        keep_last=cfg.keep_last_checkpoints,
        asynchronous=cfg.async_save,
    )
    loop = TrainLoop(
        model=backend.wrap(build_model()),
        backend=backend,
        objective=SFTObjective(held_out, cfg.eval_max_batches),
        batches=train,
        cfg=cfg,
        session=session,
    )
    try:
        t0 = time.perf_counter()
        loop.run()
        run_s = time.perf_counter() - t0
    finally:
        loop_logger.removeHandler(stall_log)
        loop_logger.propagate = True
    # Step k's time: from the end of step k-1 to its own end (step 1 follows the step-0 eval).
    durations = {k: step_ends[k] - step_ends[k - 1] for k in range(2, steps + 1)}
    saved_before = {k for k in durations if mode != "none" and (k - 1) % save_every == 0}
    after_save = [d for k, d in durations.items() if k in saved_before]
    normal = [d for k, d in durations.items() if k not in saved_before]
    return {
        "mode": mode,
        "normal_step_s": statistics.median(normal),
        "after_save_step_s": statistics.median(after_save) if after_save else float("nan"),
        "stall_s": statistics.median(after_save) - statistics.median(normal) if after_save else 0.0,
        "logged_stall_s": statistics.median(stall_log.stalls) if stall_log.stalls else float("nan"),
        "num_saves": len(stall_log.stalls),
        "timed_steps_wall_s": step_ends[steps] - step_ends[1],
        "run_s": run_s,
        "step_s": durations,
    }


def step_stall(bucket: str, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run_loop` in each mode, alternating order; the round with the least total wall."""
    modes = ["async", "sync", "none"]
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for i in range(args.rounds):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            load: dict[str, Any] = {}
            with others_load(load):
                result = run_loop(bucket, mode, args, f"{mode}-{i}")
            results[mode].append({**result, **load})
    best = {
        mode: {**min(rs, key=lambda r: r["timed_steps_wall_s"]), "rounds_wall_s": [r["timed_steps_wall_s"] for r in rs]}
        for mode, rs in results.items()
    }
    for r in best.values():
        r["wall_excess_over_none_s"] = r["timed_steps_wall_s"] - best["none"]["timed_steps_wall_s"]
    return best


# ---------------------------------------------------------------- report


def print_report(tp: dict[str, Any] | None, stall: dict[str, Any] | None, steps: int, save_every: int) -> None:
    if tp is not None:
        print_throughput(tp)
    if stall is not None:
        print_stall(stall, steps, save_every)


def print_throughput(tp: dict[str, Any]) -> None:
    size, count = tp["checkpoint_mb"], len(tp["files"])
    print(f"\nCheckpoint throughput to moto S3 ({size:.1f} MB checkpoint, {count} files; best round)")
    print(f"{'operation':<58} {'project MB/s':>13} {'s3fs MB/s':>10} {'ratio':>7}")
    for op in ("save", "load"):
        p, s = tp[f"{op}_project"], tp[f"{op}_plain_s3fs"]
        print(f"{op:<58} {p['mb_per_s']:>13.1f} {s['mb_per_s']:>10.1f} {tp[f'{op}_ratio']:>6.2f}x")
    for part, rate in tp["load_parts_mb_per_s"].items():
        print(f"  load part: {part:<45} {rate:>13.1f}")
    snap = tp["snapshot_s"]["best"]
    print(f"  snapshot (put_train_state to host bytes, no I/O): {snap:.3f} s = {tp['checkpoint_mb'] / snap:.0f} MB/s")


def print_stall(stall: dict[str, Any], steps: int, save_every: int) -> None:
    print(f"\nTraining-step stall, {steps} steps, checkpoint every {save_every} (best round; seconds)")
    print(
        f"{'mode':<8} {'normal step':>12} {'after a save':>13} {'stall':>8} {'logged stall':>13} {'saves':>6} "
        f"{'steps wall':>11} {'vs none':>8} {'others CPU':>11}"
    )
    for mode, r in stall.items():
        print(
            f"{mode:<8} {r['normal_step_s']:>12.3f} {r['after_save_step_s']:>13.3f} {r['stall_s']:>8.3f} "
            f"{r['logged_stall_s']:>13.3f} {r['num_saves']:>6d} {r['timed_steps_wall_s']:>11.2f} "
            f"{r['wall_excess_over_none_s']:>+8.2f} {r.get('others_cpu_share', float('nan')):>10.0%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side / mode (best one reported)")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per TrainLoop run")
    parser.add_argument("--save-every", type=int, default=4, help="checkpoint interval of the loop runs")
    parser.add_argument("--loop-tokens", type=int, default=64, help="tokens per row in the loop runs")
    parser.add_argument("--loop-batch", type=int, default=4, help="micro-batch size of the loop runs")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: common.NUM_THREADS)")
    parser.add_argument("--only", choices=["throughput", "stall"], default=None, help="run one part only")
    args = parser.parse_args()
    set_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    port = free_port()
    server = start_moto(port)
    try:
        bucket = s3_bucket(f"http://127.0.0.1:{port}")
        tp = throughput(bucket, args.rounds) if args.only != "stall" else None
        stall = step_stall(bucket, args) if args.only != "throughput" else None
    finally:
        server.terminate()
        server.wait(timeout=30)
    print_report(tp, stall, args.steps, args.save_every)
    env = {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_1m_5m_15m_at_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    name = "checkpoint" if args.only is None else f"checkpoint-{args.only}"
    path = write_result(name, {"throughput": tp, "step_stall": stall, "args": vars(args), "environment": env})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
