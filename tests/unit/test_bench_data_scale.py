"""``bench/bench_data_scale.py``'s instruments: the data it writes and the per-process memory and
CPU it samples from ``/proc``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_data_scale", BENCH / "bench_data_scale.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_data_scale"] = module
    spec.loader.exec_module(module)
    return module


def test_gsm8k_is_repeated_in_file_order(bench, tmp_path, monkeypatch):
    source = tmp_path / "train.jsonl"
    source.write_text('{"q": 1}\n\n{"q": 2}\n{"q": 3}\n')
    monkeypatch.setattr(bench, "GSM8K", source)
    bench.write_repeated_gsm8k(tmp_path / "out.jsonl", 7)
    assert (tmp_path / "out.jsonl").read_text().splitlines() == ['{"q": 1}', '{"q": 2}', '{"q": 3}'] * 2 + ['{"q": 1}']


CHILD = """
import os, time
held = bytearray(150 * 2**20)  # 150 MB, touched
held[::4096] = b"x" * len(held[::4096])
pid = os.fork()
if pid == 0:  # a worker: 60 MB of its own, some CPU
    mine = bytearray(60 * 2**20)
    mine[::4096] = b"y" * len(mine[::4096])
    end = time.process_time() + 0.6
    while time.process_time() < end:
        pass
    time.sleep(0.4)
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_tree_monitor_sees_the_process_and_its_worker(bench):
    proc = subprocess.Popen([sys.executable, "-c", CHILD])
    monitor = bench.TreeMonitor(proc.pid)
    monitor.start()
    proc.wait(timeout=60)
    time.sleep(0.2)
    monitor.stop()
    main = monitor.peaks[proc.pid]
    (worker,) = [p for pid, p in monitor.peaks.items() if pid != proc.pid and p]
    assert main["VmHWM"] > 150 * 1024 and main["RssAnon"] > 150 * 1024
    assert worker["RssAnon"] > 60 * 1024  # its own pages (it shares its parent's too: VmHWM counts those)
    assert worker["cpu_ticks"] >= 0.4 * bench.os.sysconf("SC_CLK_TCK")
