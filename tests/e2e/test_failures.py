"""Failure semantics through the real CLI (``python -m posttrain`` in a child process).

- nothing NaN is committed: a diverging SFT fails at the step it diverges, exit 2, no checkpoint;
- one live ``run``/``resume`` per run id: a second is refused at once, naming the holder, and
  writes nothing;
- nothing outlives the CLI: a signal to its process group (``timeout``'s SIGTERM, a terminal's
  Ctrl-C) ends the run within seconds with exit 143/130, the stage cut short ``interrupted``, no
  process of the run left (trainers, the temporary Prefect API server in its own session); after
  SIGKILL the trainer and the server notice within seconds and ``status`` says the stage was
  interrupted;
- every error names its input, before anything is written when it can be known up front
  (pre-flight), and plainly (no emoji codes, no traceback before the message).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.helpers import DEMO_CONFIG
from tests.processes import alive, command_lines
from tests.tiny import TINY_DATA, TINY_MODEL, as_sets

REPO = Path(__file__).resolve().parents[2]
SMALL = as_sets({**TINY_DATA, **TINY_MODEL, "launch.retries": 0})
"""The demo's task and model at tiny sizes (``tests/tiny.py``), no retries: ``--set`` items."""


def cli_env(api_url: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    if api_url is None:
        env.pop("PREFECT_API_URL", None)
    else:
        env["PREFECT_API_URL"] = api_url
    return env


def posttrain(api_url: str | None, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posttrain", *args],
        cwd=REPO,
        env=cli_env(api_url),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def sft_run_args(root: Path, run_id: str, *sets: str) -> list[str]:
    """``posttrain``'s arguments for the tiny demo's ``prepare_data`` and ``sft`` as run ``run_id``
    under the storage root ``root``, with ``sets`` (``key=value`` items) as more ``--set`` overrides."""
    overrides = [item for kv in sets for item in ("--set", kv)]
    return [
        "run",
        str(DEMO_CONFIG),
        "--run-id",
        run_id,
        *SMALL,
        "--set",
        f"storage.root={root}",
        "--set",
        "stages=prepare_data,sft",
        *overrides,
    ]


def launch_marked(pid: int) -> bool:
    """Whether ``pid`` carries ``POSTTRAIN_LAUNCH_ID`` in its environment (False once it is gone)."""
    try:
        return b"POSTTRAIN_LAUNCH_ID=" in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def marked_processes(root: Path) -> list[int]:
    """Processes of a launch (``POSTTRAIN_LAUNCH_ID`` in their environment) working under ``root``."""
    return [pid for pid, cmdline in command_lines().items() if str(root) in cmdline and launch_marked(pid)]


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def wait_for(path: Path, deadline_s: float = 180) -> None:
    end = time.monotonic() + deadline_s
    while not path.exists():
        assert time.monotonic() < end, f"{path} did not appear"
        time.sleep(0.2)


@contextlib.contextmanager
def sft_run(root: Path, run_id: str) -> Iterator[subprocess.Popen]:
    """A demo run of prepare_data and a long SFT, with its own temporary Prefect API server, in
    its own process group (as in a terminal); yields the CLI's process once the SFT trainer
    holds its stage's lease. The group is SIGKILLed afterwards if the CLI still runs."""
    args = [sys.executable, "-m", "posttrain", *sft_run_args(root, run_id, "sft.max_steps=5000")]
    cli = subprocess.Popen(
        args,
        cwd=REPO,
        env=cli_env(None),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(root / "runs" / run_id / "stages" / "sft" / "lease.json")
        yield cli
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)


def stop_group_and_check(cli: subprocess.Popen, root: Path, run_id: str, sig: signal.Signals) -> None:
    """Send ``sig`` to the CLI's process group: it exits ``128 + sig`` within 10 s, nothing of the
    run is left, the summary says the run and its SFT were interrupted."""
    trainers, helpers = marked_processes(root), children_of(cli.pid)
    assert trainers and len(helpers) >= 2, (trainers, helpers)  # the trainer and the API server
    t0 = time.monotonic()
    os.killpg(cli.pid, sig)
    output, _ = cli.communicate(timeout=60)
    stopped_s = time.monotonic() - t0
    print(f"{sig.name} to the group: exit {cli.returncode} in {stopped_s:.1f}s")
    assert cli.returncode == 128 + sig, output[-3000:]
    assert stopped_s < 10, output[-3000:]
    assert f"error: pipeline interrupted by {sig.name}; resume it with: posttrain resume {run_id}" in output
    assert "Stopping temporary Prefect API server" in output
    deadline = time.monotonic() + 10
    while (left := [p for p in trainers + helpers if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left and not marked_processes(root), left
    summary = json.loads((root / "runs" / run_id / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["interrupted"].endswith(f"signal {sig.name}"), summary
    assert summary["stages"]["sft"]["status"] == "interrupted", summary["stages"]["sft"]
    assert summary["stages"]["prepare_data"]["status"] == "completed"
    assert not (root / "runs" / run_id / "stages" / "sft" / "final").exists()


@pytest.mark.slow
def test_sigterm_to_the_group_stops_everything_and_a_second_run_of_the_id_is_refused_at_once(tmp_path):
    """What ``timeout 45 posttrain run ...`` does (SIGTERM to the group); it used to kill Prefect's
    temporary server too and leave the flow retrying the dead API for minutes."""
    root, run_id = tmp_path / "out", "held"
    with sft_run(root, run_id) as cli:
        config_before = (root / "runs" / run_id / "config.json").read_text()

        t0 = time.monotonic()
        second = posttrain(None, *sft_run_args(root, run_id, "sft.learning_rate=0.5"))
        print(f"second run refused after {time.monotonic() - t0:.1f}s")
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"{root / 'runs' / run_id / 'lease.json'} is held by" in second.stderr
        assert f"(pid {cli.pid} on" in second.stderr and "another posttrain run or resume" in second.stderr
        assert (root / "runs" / run_id / "config.json").read_text() == config_before
        assert not (root / "runs" / run_id / "summary.json").exists()

        stop_group_and_check(cli, root, run_id, signal.SIGTERM)
        status = posttrain(None, "status", run_id, "--root", str(root))
        assert "not running" in status.stdout and "interrupted" in status.stdout, status.stdout


@pytest.mark.slow
def test_ctrl_c_to_the_group_stops_everything_with_exit_130(tmp_path):
    root, run_id = tmp_path / "out", "ctrl-c"
    with sft_run(root, run_id) as cli:
        stop_group_and_check(cli, root, run_id, signal.SIGINT)


@pytest.mark.slow
def test_after_sigkill_of_the_cli_the_trainer_stops_within_seconds(tmp_path):
    root, run_id = tmp_path / "out", "killed"
    helpers: list[int] = []
    try:
        with sft_run(root, run_id) as cli:
            trainers = marked_processes(root)
            helpers = [p for p in children_of(cli.pid) if p not in marked_processes(root)]
            assert trainers
            cli.kill()
            cli.wait(timeout=10)
            t0 = time.monotonic()
            while any(alive(p) for p in trainers) and time.monotonic() - t0 < 15:
                time.sleep(0.1)
            gone_s = time.monotonic() - t0
            print(f"trainer gone {gone_s:.1f}s after SIGKILL of the CLI")
            assert not any(alive(p) for p in trainers) and gone_s < 10
            while any(alive(p) for p in helpers) and time.monotonic() - t0 < 15:
                time.sleep(0.1)
            print(f"temporary API server gone {time.monotonic() - t0:.1f}s after SIGKILL of the CLI")
            assert helpers and not any(alive(p) for p in helpers), helpers  # it watches the CLI
            status = posttrain(None, "status", run_id, "--root", str(root))
            assert status.returncode == 0, status.stderr
            sft = next(line for line in status.stdout.splitlines() if " sft " in line)
            assert "interrupted" in sft, status.stdout
            assert not (root / "runs" / run_id / "stages" / "sft" / "final").exists()
    finally:
        for pid in helpers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_diverging_stage_commits_nothing_and_exits_2(prefect_api, tmp_path):
    root = tmp_path / "out"
    result = posttrain(
        prefect_api,
        *sft_run_args(
            root, "nan", "sft.learning_rate=1e6", "sft.warmup_steps=0", "sft.save_every=1", "sft.max_steps=10"
        ),
    )
    assert result.returncode == 2, result.stderr[-3000:]
    message = result.stderr.split("error: pipeline failed:", 1)[1]
    assert "stage sft: non-finite" in message and "at global_step" in message and "Traceback" not in result.stderr
    step = int(message.split("at global_step ", 1)[1].split()[0])
    summary = json.loads((root / "runs" / "nan" / "summary.json").read_text())
    assert summary["status"] == "failed" and "non-finite" in summary["stages"]["sft"]["error"]
    sft = root / "runs" / "nan" / "stages" / "sft"
    assert not (sft / "final").exists()
    assert all(int(d.name.split("-")[1]) < step for d in (sft / "checkpoints").glob("step-*")), step


def test_a_file_line_location_reaches_the_console_as_written(prefect_api, tmp_path):
    """``sft.jsonl:100:`` is an emoji code to rich; the CLI and the Prefect console print it plainly."""
    good = {"question": "Ann has 2 apples and buys 3. How many now?", "answer": "2+3=<<2+3=5>>5\n#### 5"}
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps(good) + "\n" for _ in range(99)) + '{"question": oops}\n')
    result = posttrain(
        prefect_api,
        "run",
        str(REPO / "configs" / "gsm8k-hh.yaml"),
        "--run-id",
        "emoji",
        "--set",
        f"storage.root={tmp_path / 'out'}",
        "--set",
        f"data.sft.uri={sft}",
        "--set",
        "launch.retries=2",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{sft}:100: invalid JSON" in result.stderr.split("error: pipeline failed:", 1)[1]
    assert "\U0001f4af" not in result.stdout + result.stderr
    assert result.stderr.count("stage prepare_data: spec") <= 1  # bad input: one attempt


@pytest.mark.parametrize("case", ["storage-under-a-file", "missing-model-dir", "missing-data-file"])
def test_preflight_refuses_before_anything_is_written(prefect_api, tmp_path, case):
    (tmp_path / "a-file").write_text("")
    root = tmp_path / "out"
    overrides, needle = {
        "storage-under-a-file": ([f"storage.root={tmp_path / 'a-file' / 'out'}"], "storage.root"),
        "missing-model-dir": ([f"storage.root={root}", f"sft.init_from={tmp_path / 'no-model'}"], "sft.init_from"),
        "missing-data-file": ([f"storage.root={root}", f"data.sft.uri={tmp_path / 'none.jsonl'}"], "data.sft.uri"),
    }[case]
    args = [arg for item in overrides for arg in ("--set", item)]
    result = posttrain(prefect_api, "run", str(DEMO_CONFIG), "--run-id", "pre", *args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"error: {needle}" in result.stderr
    assert "summary.json" not in result.stdout and "Traceback" not in result.stderr
    assert not (root / "runs").exists() and not list(tmp_path.rglob("mlflow.db"))
    if needle == "storage.root":  # the CLI's own check, before it reads the run or starts the flow
        assert "run id:" not in result.stdout, result.stdout


def test_a_model_needing_remote_code_names_the_field(prefect_api, tmp_path):
    model = tmp_path / "remote-model"
    model.mkdir()
    auto_map = {"AutoConfig": "configuration_x.XConfig", "AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    (model / "config.json").write_text(json.dumps({"model_type": "remote_only", "auto_map": auto_map}))
    (model / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map, "tokenizer_class": "XTokenizer"}))
    result = posttrain(
        prefect_api,
        "run",
        str(DEMO_CONFIG),
        "--run-id",
        "remote",
        *SMALL,
        "--set",
        f"storage.root={tmp_path / 'out'}",
        "--set",
        "stages=prepare_data",
        "--set",
        f"model={{name_or_path: {model}}}",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "set model.trust_remote_code: true" in result.stderr.split("error: pipeline failed:", 1)[1]


def test_status_and_resume_check_the_run_id_and_name_a_damaged_config(tmp_path):
    for command in (["status", "../x"], ["resume", "../x"]):
        result = posttrain(None, *command, "--root", str(tmp_path))
        assert result.returncode == 2 and "run_id '../x' must match" in result.stderr, result.stderr
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{damaged")
    for command in (["status", "r1"], ["resume", "r1"]):
        result = posttrain(None, *command, "--root", str(tmp_path))
        assert result.returncode == 2 and f"{run / 'config.json'} is damaged" in result.stderr, result.stderr
