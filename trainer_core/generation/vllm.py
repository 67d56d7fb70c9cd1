"""The ``vllm`` rollout engine: a vLLM server samples the rollouts; the policy's weights are synced
into it after every optimizer update.

Server mode, as TRL's ``vllm_mode="server"`` and prime-rl run vLLM: an OpenAI-compatible vLLM
server (``vllm.entrypoints.openai.api_server``) in a process of its own, in the Python environment
vLLM is installed in (vLLM pins fastapi, transformers and setuptools against the project's: ``make
vllm`` builds ``.venv-vllm``; ``bench/vllm_cpu_probe.md``). The stage starts it on 127.0.0.1 in its
own session (rank 0), waits for ``/health``, copies its output into the stage log (``[vllm]``
lines) and stops it when the stage ends, on an error too; it carries the stage's launch id
(``trainer_core.processes``), so the launcher's sweep stops it when a killed stage could not. Or ``generation.vllm.url`` names a server already running (started with
``VLLM_SERVER_DEV_MODE=1``, on a machine that reads ``weights_dir``).

Sampling (:meth:`VLLMEngine._sample`): one ``/v1/completions`` request per row, the prompt as token
ids (no tokenizer round trip), with ``seed`` drawn from the stage's checkpointed generator on CUDA
(so a row's sample is a function of the seed and the weights: two rows of one GRPO group, sent
with their own seeds, sample apart; on CPU the rows draw from the server's own generator, seeded
with the stage's seed: vllm-cpu 0.32 kills its engine rewinding a seeded request's CPU generator
after a partial prefill, "CPU Generator does not use offset", ``gpu_model_runner._bookkeeping_sync``),
``logprobs: 0`` and ``return_token_ids``: the sampled ids and the
log-prob of each under the temperature-scaled distribution (the server runs with
``--logprobs-mode processed_logprobs``; with ``top_p < 1`` vLLM's processed log-probs are
renormalised over the kept tokens, which the trainer's are not). Requests run concurrently (up to
``max_concurrency``); the server batches them.

Weight sync (:meth:`VLLMEngine.load_weights`, ``time/weight_sync_s``): every rank takes part in
gathering the policy's full weights (``Backend.full_state_dict``: FSDP2 and ZeRO-3 shards
gathered; a LoRA policy's adapters merged, ``W + scaling B A``), rank 0 writes them with
``save_pretrained`` into ``weights_dir`` and asks the server to reload them
(``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": dir}}``, then
``POST /reset_prefix_cache``: cached prefixes were computed with the old weights). A directory and
a reload, not vLLM's NCCL weight-transfer API: it works on the CPU build and has kept its shape
across vLLM versions (trl#7001: 0.28 changed the transfer API).

The guard: the RL loop compares the engine's log-probs of the sampled tokens with its own
(``rollout/logprob_diff_mean``) after every sync and fails the stage with
:class:`~trainer_core.errors.EngineStateError` beyond ``generation.vllm.max_logprob_diff``
(:func:`check_engine_logprobs`).

A server that stops answering mid-stage raises :class:`~trainer_core.errors.EngineUnavailable`
(transient: the retry starts a new server and resumes from the last checkpoint); one that cannot
start, or refuses a request, raises :class:`~trainer_core.errors.ConfigError` naming the field.
vLLM does not draw from the stage's ``torch.Generator``: a resumed run samples from the same
seeds, but vLLM's batching may round its logits differently, so its tokens are not promised
bit-identical to an uninterrupted run's (the ``hf`` engine's are).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import safetensors.torch
import torch
from torch import Tensor, nn

from trainer_core.config.generation import VLLMConfig
from trainer_core.errors import ConfigError, EngineStateError, EngineUnavailable
from trainer_core.generation.engines import GenerationEngine, Generated
from trainer_core.modeling.lora import has_lora, merged_state_dict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainer_core.backends import Backend
    from trainer_core.config import GenerationConfig
    from trainer_core.generation.decode_session import DecodeSession

log = logging.getLogger(__name__)

VLLM_PYTHON_ENV = "POSTTRAIN_VLLM_PYTHON"
"""Environment variable naming the Python of the vLLM environment (``generation.vllm.python`` wins)."""

DEFAULT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
"""The checkout's vLLM environment, built by ``make vllm``."""

SERVED_MODEL_NAME = "policy"
"""The name the server the stage starts serves the policy under (``--served-model-name``)."""

SEED_BOUND = 2**31 - 1
"""Request seeds are drawn in ``[0, SEED_BOUND)`` (vLLM takes a signed 32-bit seed)."""


def vllm_python(cfg: VLLMConfig, field: str) -> str:
    """The interpreter of the vLLM environment: ``cfg.python``, ``$POSTTRAIN_VLLM_PYTHON``, or the
    checkout's ``.venv-vllm``.

    Raises:
        ConfigError: that interpreter does not exist (naming ``<field>.python`` and ``make vllm``).
    """
    python = cfg.python or os.environ.get(VLLM_PYTHON_ENV) or str(DEFAULT_VENV / "bin" / "python")
    if not os.access(python, os.X_OK):
        raise ConfigError(
            f"{field}.python: no vLLM environment at {python}: run `make vllm` (builds .venv-vllm), or set "
            f"{field}.python or ${VLLM_PYTHON_ENV} to the Python of an environment with vllm installed"
        )
    return python


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VLLMServer:
    """A vLLM OpenAI-compatible server process started by this stage (:meth:`start`); :meth:`stop`.

    Attributes:
        url: ``http://127.0.0.1:<port>``.
        process: the server's process (the leader of its own session).
        tail: its last output lines (for error messages).
    """

    def __init__(self, url: str, process: subprocess.Popen, field: str) -> None:
        self.url, self.process, self.field = url, process, field
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        self._reader = threading.Thread(target=self._copy_output, daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, model_dir: str, cfg: VLLMConfig, field: str, *, seed: int, on_cpu: bool = True) -> VLLMServer:
        """Start a server of ``model_dir`` (an HF model directory) on a free port of 127.0.0.1 and
        wait until it answers ``/health`` (:meth:`wait_healthy`). ``on_cpu``: the trainer runs on CPU
        (``cfg.dtype`` None then means float32).

        Raises:
            ConfigError: no vLLM environment; the server exited while starting (the model is
                one it cannot serve, an argument it does not know: its last lines quoted).
            EngineUnavailable: it did not answer within ``cfg.startup_timeout_s``.
        """
        python, port = vllm_python(cfg, field), _free_port()
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
        cmd += ["--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
        dtype = cfg.dtype or ("float32" if on_cpu else "auto")
        cmd += ["--dtype", dtype, "--seed", str(seed), "--logprobs-mode", "processed_logprobs"]
        cmd += ["--max-model-len", str(cfg.max_model_len)] if cfg.max_model_len else []
        cmd += ["--enforce-eager"] if cfg.enforce_eager else []
        cmd += ["--disable-uvicorn-access-log"]  # not a line per request in the stage log
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONUNBUFFERED": "1"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the trainer waits while it samples
        for name in ("PYTHONPATH", "VIRTUAL_ENV"):  # the project's environment is not vLLM's
            env.pop(name, None)
        process = subprocess.Popen(
            [*cmd, *cfg.extra_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        print(f"[vllm] server pid {process.pid} starting on 127.0.0.1:{port} for {model_dir}", flush=True)
        server = cls(f"http://127.0.0.1:{port}", process, field)
        try:
            server.wait_healthy(cfg.startup_timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def _copy_output(self) -> None:
        """Copy the server's output into the stage log, ``[vllm]``-prefixed, keeping a tail."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            line = line.rstrip()
            self.tail.append(line)
            print(f"[vllm] {line}", file=sys.stderr, flush=True)

    def problem(self) -> str | None:
        """Why the server is gone (its exit code and last error lines), or None while it runs."""
        rc = self.process.poll()
        if rc is None:
            return None
        self._reader.join(timeout=5)
        errors = [line for line in self.tail if "Error" in line or "error" in line] or list(self.tail)
        return f"the vLLM server (pid {self.process.pid}) exited with code {rc}: " + " | ".join(errors[-4:])[-1500:]

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200.

        Raises:
            ConfigError: the process exited first.
            EngineUnavailable: no answer within ``timeout_s``.
        """
        deadline, start = time.monotonic() + timeout_s, time.monotonic()
        while time.monotonic() < deadline:
            problem = self.problem()
            if problem:
                raise ConfigError(f"{self.field}: {problem}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    log.info("vllm server %s healthy after %.1f s", self.url, time.monotonic() - start)
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise EngineUnavailable(
            f"{self.field}: the vLLM server at {self.url} did not answer /health in {timeout_s:g} s"
        )

    def stop(self) -> None:
        """SIGTERM to the server's session, SIGKILL after 20 s; waits for it."""
        if self.process.poll() is None:
            with _no_such_process():
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with _no_such_process():
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        with _no_such_process():  # its engine processes, if any outlived it
            os.killpg(self.process.pid, signal.SIGKILL)
        self._reader.join(timeout=5)


class _no_such_process:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        return kind is ProcessLookupError


class VLLMClient:
    """HTTP calls to a vLLM server: completions by token ids, the weight reload, checks.

    Args:
        url: the server's base URL.
        cfg: timeouts and concurrency.
        field: the config section, for messages (e.g. ``grpo.generation.vllm``).
        server: the process behind ``url`` when this stage started it (its exit is reported).
    """

    def __init__(self, url: str, cfg: VLLMConfig, field: str, server: VLLMServer | None = None) -> None:
        self.url, self.field, self.server = url.rstrip("/"), field, server
        limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
        self.http = httpx.Client(base_url=self.url, timeout=cfg.request_timeout_s, limits=limits)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request in the stage log
        self.model = SERVED_MODEL_NAME

    def _post(self, path: str, body: dict[str, Any], what: str) -> Any:
        try:
            response = self.http.post(path, json=body)
        except httpx.TransportError as e:
            gone = self.server.problem() if self.server is not None else None
            raise EngineUnavailable(
                f"{self.field}: the vLLM server at {self.url} did not answer while {what} "
                f"({type(e).__name__}: {e}){'; ' + gone if gone else ''}; transient: a retry resumes from the "
                "last checkpoint"
            ) from e
        if response.status_code >= 500:
            raise EngineUnavailable(
                f"{self.field}: the vLLM server at {self.url} failed while {what}: {response.status_code} "
                f"{response.text[:500]}"
            )
        if response.status_code != 200:
            raise ConfigError(
                f"{self.field}: the vLLM server at {self.url} refused {what}: {response.status_code} "
                f"{response.text[:500]}"
            )
        return response.json() if response.content else None

    def check(self, wait_s: float = 10.0) -> None:
        """That the server answers (within ``wait_s``), which model it serves, and that it has the
        weight reload's routes.

        Raises:
            ConfigError: no answer (naming ``<field>.url``), or no ``/collective_rpc`` (a server
                started without ``VLLM_SERVER_DEV_MODE=1``).
        """
        deadline = time.monotonic() + wait_s
        while True:
            try:
                models = self.http.get("/v1/models", timeout=5)
                break
            except httpx.TransportError as e:
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"{self.field}.url: no vLLM server answers at {self.url} ({type(e).__name__}: {e})"
                    ) from e
                time.sleep(0.5)
        if models.status_code != 200:
            raise ConfigError(
                f"{self.field}.url: {self.url}/v1/models answered {models.status_code}: not a vLLM server"
            )
        self.model = models.json()["data"][0]["id"]
        if self.http.get("/is_sleeping", timeout=5).status_code == 404:
            raise ConfigError(
                f"{self.field}.url: the vLLM server at {self.url} has no weight-reload routes: start it with "
                "VLLM_SERVER_DEV_MODE=1"
            )
        body = {"model": self.model, "prompt": [0], "max_tokens": 1, "temperature": 0.0}
        try:  # vLLM finds some models it cannot run only at their first step (a CPU attention head size)
            self._post("/v1/completions", body, "sampling one token")
        except EngineUnavailable as e:
            time.sleep(1.0)  # the server's own report of the failure, into its tail
            why = self._server_errors() or str(e)
            engine = self.field.removesuffix(".vllm") + ".engine"
            raise ConfigError(f"{engine}='vllm': the vLLM server cannot serve this model: {why}") from e

    def _server_errors(self) -> str | None:
        """The last error lines of the server this stage started, or None."""
        if self.server is None:
            return None
        lines = [line for line in self.server.tail if "Error" in line]
        return " | ".join(lines[-2:])[-1500:] or None

    def complete(
        self, prompt: list[int], seed: int | None, gen: GenerationConfig, eos_id: int
    ) -> tuple[list[int], list[float]]:
        """One sampled completion of ``prompt`` (token ids): its token ids (EOS included when
        sampled; ``eos_id`` < 0: none ends a row, as no token has that id) and the log-prob of each;
        ``seed`` None: drawn from the server's generator."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": gen.max_new_tokens,
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        body.update({"seed": seed} if seed is not None else {})
        # a negative eos_id is a token no row samples (as for the other engines): every row runs on
        body.update({"stop_token_ids": [eos_id]} if eos_id >= 0 else {"ignore_eos": True})
        choice = self._post("/v1/completions", body, "sampling a rollout")["choices"][0]
        ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        return list(ids), [float(x) for x in logprobs]

    def reload_weights(self, weights_dir: str) -> None:
        """Reload the served model's weights from ``weights_dir``; drop the prefix cache."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}}
        self._post("/collective_rpc", body, f"reloading the weights of {weights_dir}")
        self._post("/reset_prefix_cache", {}, "resetting the prefix cache")

    def close(self) -> None:
        self.http.close()


def serving_weights(backend: Backend, policy: nn.Module) -> dict[str, Tensor] | None:
    """Collective: the policy's plain HF state dict at rank 0 (None elsewhere): gathered from every
    rank under a process group (``Backend.full_state_dict``), a LoRA policy's adapters merged."""
    weights = backend.full_state_dict(policy) if backend.process_group else None
    if backend.rank != 0:
        return None
    plain = backend.unwrap(policy)
    full = weights if weights is not None else plain.state_dict()
    return merged_state_dict(plain, full, copy=weights is None) if has_lora(plain) else full


class VLLMEngine(GenerationEngine):
    """Rollouts from a vLLM server (module docstring); build with :meth:`launch`.

    Args:
        client: this rank's client of the server.
        cfg: the ``generation.vllm`` section.
        backend: the stage's backend (rank, collectives, the weights' gathering).
        policy: the HF policy whose weights are served.
        weights_dir: where rank 0 writes them for the server.
        server: the server process when the stage started it (rank 0), else None.
        owns_dir: remove ``weights_dir`` on :meth:`close`.
    """

    name = "vllm"

    def __init__(
        self,
        client: VLLMClient,
        cfg: VLLMConfig,
        backend: Backend,
        policy: nn.Module,
        weights_dir: str,
        server: VLLMServer | None,
        owns_dir: bool,
    ) -> None:
        self.client, self.cfg, self.backend, self.policy = client, cfg, backend, policy
        self.weights_dir, self.server, self.owns_dir = weights_dir, server, owns_dir

    @classmethod
    def launch(
        cls,
        cfg: VLLMConfig,
        field: str,
        backend: Backend,
        policy: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        seed: int,
    ) -> VLLMEngine:
        """Write the policy (weights, config, tokenizer) into the weights directory, start the
        server on it (rank 0; or reach ``cfg.url``), and connect every rank. Collective.

        Raises:
            ConfigError, EngineUnavailable: see :meth:`VLLMServer.start` and :meth:`VLLMClient.check`.
        """
        owns_dir = cfg.weights_dir is None
        weights_dir = cfg.weights_dir or (tempfile.mkdtemp(prefix="posttrain-vllm-") if backend.rank == 0 else None)
        weights_dir = backend.broadcast_object(weights_dir)
        weights = serving_weights(backend, policy)
        server, url = None, cfg.url
        if backend.rank == 0:
            _write_model(backend.unwrap(policy), weights, weights_dir, tokenizer)
            if url is None:
                server = VLLMServer.start(weights_dir, cfg, field, seed=seed, on_cpu=backend.device.type == "cpu")
                url = server.url
        url = backend.broadcast_object(url)
        engine = cls(VLLMClient(url, cfg, field, server), cfg, backend, policy, weights_dir, server, owns_dir)
        try:
            engine.client.check()
            if backend.rank == 0 and cfg.url is not None:
                engine.client.reload_weights(weights_dir)  # a server already running serves other weights
            backend.barrier()
        except BaseException:
            engine.close()
            raise
        return engine

    def _sample(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        gen: GenerationConfig,
        eos_id: int,
        pad_id: int,
        generator: torch.Generator,
        session: DecodeSession | None = None,
    ) -> Generated:
        if session is not None:
            raise ConfigError("the vllm engine samples single-turn rollouts: a tool session needs 'hf' or 'static'")
        device = prompt_ids.device
        drawn = torch.randint(0, SEED_BOUND, (prompt_ids.shape[0],), generator=generator, device=generator.device)
        seeds = drawn.tolist() if device.type == "cuda" else [None] * len(drawn)  # CPU: module docstring
        prompts = [row[mask > 0].tolist() for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        with ThreadPoolExecutor(max_workers=min(self.cfg.max_concurrency, len(prompts))) as pool:
            outs = list(pool.map(lambda args: self.client.complete(*args, gen, eos_id), zip(prompts, seeds)))
        width = max(1, max(len(ids) for ids, _ in outs))
        completion_ids = torch.full((len(outs), width), pad_id, dtype=torch.long)
        completion_mask = torch.zeros(len(outs), width)
        logprobs = torch.zeros(len(outs), width)
        for i, (ids, lps) in enumerate(outs):
            completion_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            completion_mask[i, : len(ids)] = 1.0
            logprobs[i, : len(lps)] = torch.tensor(lps)
        return Generated(completion_ids.to(device), completion_mask.to(device), logprobs.to(device))

    def load_weights(self, model: nn.Module) -> None:
        """Sync the policy's current weights into the server (module docstring). Collective.

        ``model`` is the module the loop samples from (the policy-and-value module); what is served
        is always ``policy``'s weights, gathered."""
        del model
        weights = serving_weights(self.backend, self.policy)
        if self.backend.rank == 0:
            _write_model(self.backend.unwrap(self.policy), weights, self.weights_dir, None)
            self.client.reload_weights(self.weights_dir)
        self.backend.barrier()

    @property
    def max_logprob_diff(self) -> float:
        """The guard's bound: ``cfg.max_logprob_diff``, or by default 1e-3 for an fp32 server (what
        the stage starts on CPU) and 0.02 for any other."""
        if self.cfg.max_logprob_diff is not None:
            return self.cfg.max_logprob_diff
        fp32 = self.cfg.dtype == "float32" or (self.cfg.dtype is None and self.backend.device.type == "cpu")
        return 1e-3 if fp32 else 0.02

    def release(self) -> None:
        """Nothing: the server keeps its KV cache (its own memory, not the trainer's)."""

    def close(self) -> None:
        """Stop the server the stage started and remove the weights directory it made."""
        self.client.close()
        if self.server is not None:
            self.server.stop()
        if self.owns_dir and self.backend.rank == 0:
            shutil.rmtree(self.weights_dir, ignore_errors=True)


WEIGHTS_FILE = "model.safetensors"
"""The served weights' one file in the weights directory (replaced whole at each sync)."""


def _write_model(
    plain: nn.Module, weights: dict[str, Tensor] | None, out_dir: str, tokenizer: PreTrainedTokenizerBase | None
) -> None:
    """Write ``weights`` (None: ``plain``'s own) into ``out_dir`` as :data:`WEIGHTS_FILE`, replacing
    it in one rename; with ``tokenizer`` (the launch), also the model's config, generation config
    and tokenizer.

    A model with tied input and output embeddings is served untied: the output head's weight is
    written as a tensor of its own and the config says ``tie_word_embeddings: false``. vLLM 0.32's
    weight reload leaves a tied head stale (on CPU its kernel keeps a packed copy of the old
    weights): after a reload the served model embedded with the new weights and scored with the old
    ones, a log-prob difference of 2e-3 to 9e-3 per token on the demo's model that grew with
    training (measured, bench/README.md "The vllm engine").
    """
    state = weights if weights is not None else plain.state_dict()
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    tied = bool(getattr(plain.config, "tie_word_embeddings", False))
    if tied:
        head = next(name for name, module in plain.named_modules() if module is plain.get_output_embeddings())
        embedding = next(name for name, module in plain.named_modules() if module is plain.get_input_embeddings())
        tensors[f"{head}.weight"] = tensors[f"{embedding}.weight"].clone()
    partial = Path(out_dir, WEIGHTS_FILE + ".partial")
    safetensors.torch.save_file(tensors, str(partial), metadata={"format": "pt"})
    os.replace(partial, Path(out_dir, WEIGHTS_FILE))
    if tokenizer is None:
        return
    config = plain.config.to_dict()
    config.pop("quantization_config", None)  # a QLoRA base is served dequantized (merged)
    config["tie_word_embeddings"] = False
    config["architectures"] = config.get("architectures") or [type(plain).__name__]
    Path(out_dir, "config.json").write_text(json.dumps(config, indent=2, default=str))
    if getattr(plain, "generation_config", None) is not None:
        plain.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def check_engine_logprobs(stats: dict[str, float], bound: float, stage: str, global_step: int) -> None:
    """The guard: refuse a rollout whose engine log-probs differ from the trainer's beyond ``bound``.

    Args:
        stats: the rollout's statistics (``rollout/logprob_diff_mean`` and ``_max``, from
            :func:`~trainer_core.training.rl.batches.logprob_diff_metrics`; every rank's tokens).
        bound: the engine's :attr:`VLLMEngine.max_logprob_diff` (mean |difference| per sampled token).
        stage: the stage, for the message.
        global_step: the optimizer step whose weights the engine should serve.

    Raises:
        EngineStateError: the mean difference exceeds ``bound``.
    """
    mean = stats.get("rollout/logprob_diff_mean")
    if mean is None or mean <= bound:
        return
    raise EngineStateError(
        f"{stage}: the vllm engine's log-probs of its sampled tokens differ from the trainer's by "
        f"{mean:.4g} per token on average (max {stats.get('rollout/logprob_diff_max', float('nan')):.4g}) after "
        f"the weight sync of global step {global_step}, beyond {stage}.generation.vllm.max_logprob_diff ({bound:g}): "
        "the engine serves weights other than the policy's (a sync that did not land, a stale server); nothing of "
        "this step is committed"
    )
