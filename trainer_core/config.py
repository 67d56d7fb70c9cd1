"""Pydantic configuration of a post-training pipeline.

One :class:`PipelineConfig` holds the stage list and every hyper-parameter. Each field has a
description: they become the CLI help and the Prefect UI form. YAML files select and
override; ``--set key.path=value`` overrides one leaf (see :func:`apply_overrides`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from trainer_core.errors import ConfigError

STAGE_ORDER: tuple[str, ...] = ("prepare_data", "sft", "reward_model", "score", "dpo", "ppo", "grpo", "evaluate")
"""Every stage the pipeline knows, in pipeline order."""

TRAINING_STAGES: tuple[str, ...] = ("sft", "reward_model", "dpo", "ppo", "grpo")
"""Stages that run an optimizer loop and write step checkpoints."""


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StorageConfig(_Base):
    """Where outputs go: any fsspec URI (local directory, ``s3://bucket/prefix``, ``memory://``)."""

    root: str = Field("./outputs", description="Output root URI; runs are written under <root>/runs/<run_id>/.")
    endpoint_url: str | None = Field(
        None, description="S3 endpoint URL (MinIO, moto); default: AWS_ENDPOINT_URL or AWS itself."
    )
    region: str | None = Field(None, description="S3 region; default: AWS_DEFAULT_REGION.")
    access_key_id: SecretStr | None = Field(None, description="S3 access key id; default: AWS_ACCESS_KEY_ID.")
    secret_access_key: SecretStr | None = Field(
        None, description="S3 secret access key; default: AWS_SECRET_ACCESS_KEY. Never logged."
    )


class TrackingConfig(_Base):
    """MLflow tracking."""

    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI; default: MLFLOW_TRACKING_URI, else sqlite:///<root>/mlflow.db "
        "for a local root.",
    )
    experiment_name: str = Field("posttrain", description="MLflow experiment holding the pipeline runs.")


class DataSource(_Base):
    """One input data set."""

    uri: str | None = Field(
        None,
        description="JSONL / Parquet file URI (any fsspec URI) or 'hf://<dataset id>' for a Hugging Face "
        "datasets id. None: use the generated synthetic task.",
    )
    format: Literal["auto", "prompt_completion", "gsm8k", "hh_rlhf"] = Field(
        "auto", description="Record format; 'auto' detects it from the first record's keys."
    )
    split: str = Field("train", description="Split name, for 'hf://' data set ids only.")
    max_rows: int | None = Field(None, ge=1, description="Read at most this many rows (None: all).")


class SyntheticConfig(_Base):
    """The offline synthetic task: multi-step arithmetic word problems with worked solutions."""

    num_problems: int = Field(3000, ge=10, description="Number of generated problems (SFT and eval).")
    num_pairs: int = Field(1500, ge=10, description="Number of generated preference pairs.")
    max_operand: int = Field(20, ge=2, description="Largest operand in a generated problem.")


class DataConfig(_Base):
    """Input data sets and how they are split and tokenised."""

    sft: DataSource = Field(default_factory=DataSource, description="SFT data (prompt/completion or GSM8K).")
    preference: DataSource = Field(
        default_factory=DataSource, description="Preference pairs (HH-RLHF dialogues) for reward model and DPO."
    )
    eval: DataSource = Field(
        default_factory=DataSource,
        description="Held-out GSM8K-format problems for generation eval; None: a seeded split of the SFT data.",
    )
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig, description="Synthetic task settings.")
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Fraction of each data set held out.")
    max_eval_rows: int = Field(256, ge=1, description="Cap on rows of each held-out split.")
    max_length_tokens: int = Field(256, ge=8, description="Max tokens of prompt + completion; longer rows are truncated.")
    max_prompt_length_tokens: int = Field(
        192, ge=4, description="Max prompt tokens; longer prompts keep their last tokens."
    )

    @model_validator(mode="after")
    def _prompt_fits(self) -> DataConfig:
        if self.max_prompt_length_tokens >= self.max_length_tokens:
            raise ValueError("max_prompt_length_tokens must be smaller than max_length_tokens")
        return self


class TokenizerConfig(_Base):
    """BPE tokenizer trained in prepare_data when the model is built from config."""

    vocab_size: int = Field(2048, ge=64, description="Target vocabulary size including special tokens.")
    min_frequency: int = Field(2, ge=1, description="Minimum pair frequency for a BPE merge.")


class ModelInit(_Base):
    """Architecture and sizes of a model built from config (random init)."""

    architecture: Literal["llama"] = Field("llama", description="Model family (transformers config class).")
    hidden_size: int = Field(64, ge=8, description="Hidden size.")
    intermediate_size: int = Field(172, ge=8, description="MLP inner size.")
    num_hidden_layers: int = Field(4, ge=1, description="Number of transformer blocks.")
    num_attention_heads: int = Field(4, ge=1, description="Attention heads.")
    num_key_value_heads: int = Field(2, ge=1, description="Key/value heads (GQA).")
    max_position_embeddings: int = Field(512, ge=16, description="Max sequence length.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base.")
    tie_word_embeddings: bool = Field(True, description="Tie input and output embeddings.")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelInit:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        return self


class ModelConfig(_Base):
    """The base model: a pretrained one by name/path, or one built from config."""

    name_or_path: str | None = Field(
        None, description="Hugging Face model id, or local / fsspec path of an HF-format model directory."
    )
    init: ModelInit | None = Field(None, description="Build a model from these sizes instead of loading one.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub (off unless set).")

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelConfig:
        if (self.name_or_path is None) == (self.init is None):
            raise ValueError("set exactly one of model.name_or_path and model.init")
        return self


BACKENDS: tuple[str, ...] = ("single", "ddp", "fsdp2", "deepspeed")
"""Training backends; every one but ``single`` runs one process per rank under a launcher."""


class BackendConfig(_Base):
    """How a training stage runs its processes: backend, world size, launcher and rendezvous.

    World size is ``nnodes * nproc_per_node``. ``single`` runs one plain process; the others
    run under ``torchrun`` (or the ``deepspeed`` launcher) with one process per rank: gloo
    process groups on CPU, NCCL on GPU. Multi-node: every node's worker runs the same stage
    command with its own ``node_rank`` and the same ``rdzv_endpoint`` (host:port of node 0).
    """

    name: Literal["single", "ddp", "fsdp2", "deepspeed"] = Field(
        "single", description="Training backend: single (one device), ddp, fsdp2 or deepspeed (ZeRO)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device; 'auto' picks cuda when present.")
    nproc_per_node: int = Field(1, ge=1, description="Processes (ranks) per node; 1 with the single backend.")
    nnodes: int = Field(1, ge=1, description="Nodes in the job (multi-node: one worker per node).")
    node_rank: int = Field(0, ge=0, description="This node's rank in [0, nnodes).")
    rdzv_endpoint: str | None = Field(
        None, description="host:port of the c10d rendezvous (node 0); default on one node: 127.0.0.1 and a free port."
    )
    rdzv_id: str | None = Field(None, description="Rendezvous id shared by the job's nodes; default: run id + stage.")
    launcher: Literal["torchrun", "deepspeed"] = Field(
        "torchrun", description="Launcher of multi-process stages: torchrun, or the deepspeed launcher."
    )
    dist_timeout_s: float = Field(600.0, gt=0, description="Collective timeout: a rank that waits longer fails.")
    mixed_precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Compute dtype of fsdp2/deepspeed: auto = bf16 on CUDA, fp32 on CPU."
    )
    cpu_offload: bool = Field(False, description="fsdp2: keep parameters, gradients and optimizer state on CPU.")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="deepspeed: ZeRO stage.")
    offload_optimizer: bool = Field(False, description="deepspeed: ZeRO optimizer-state offload to CPU (DeepSpeedCPUAdam).")
    offload_params: bool = Field(False, description="deepspeed: ZeRO-3 parameter offload to CPU.")
    ds_config: dict[str, Any] = Field(
        default_factory=dict,
        description="deepspeed: raw DeepSpeed config merged (recursively) over the generated one, for experts.",
    )
    validate_replicas: bool = Field(
        True, description="At each checkpoint, check by checksum that replicated state is identical on every rank."
    )

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return self.nnodes * self.nproc_per_node

    @model_validator(mode="after")
    def _check(self) -> BackendConfig:
        if self.name == "single" and self.world_size != 1:
            raise ValueError(
                f"backend.name=single runs one process; got nnodes={self.nnodes}, nproc_per_node={self.nproc_per_node}"
                " (choose ddp, fsdp2 or deepspeed)"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(f"backend.node_rank={self.node_rank} must be < backend.nnodes={self.nnodes}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("backend.rdzv_endpoint (host:port of node 0) is required when backend.nnodes > 1")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("backend.offload_params needs backend.zero_stage=3")
        return self


class TrainStageConfig(_Base):
    """Optimisation settings shared by every training stage."""

    init_from: str | None = Field(
        None, description="Model URI to start from; None: the previous stage's output (or model config)."
    )
    backend: dict[str, Any] = Field(
        default_factory=dict,
        description="Override of the pipeline-wide backend for this stage (e.g. {name: ddp}); merged over `backend`.",
    )
    max_steps: int = Field(100, ge=1, description="Optimizer steps (global_step at the end).")
    micro_batch_size: int = Field(8, ge=1, description="Examples per forward/backward.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches per rank per optimizer step.")
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Examples per optimizer step over all ranks. When set, grad_accum_steps is ignored and "
        "derived as global_batch_size / (micro_batch_size x world size), so a run resumed at another world "
        "size (elastic) keeps the same batch.",
    )

    def accum_steps(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step at ``world_size`` ranks.

        Raises:
            ConfigError: ``global_batch_size`` is not a multiple of ``micro_batch_size x world_size``.
        """
        if self.global_batch_size is None:
            return self.grad_accum_steps
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not a multiple of micro_batch_size x world size "
                f"= {self.micro_batch_size} x {world_size}"
            )
        return self.global_batch_size // per_step
    learning_rate: float = Field(1e-3, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps, then cosine decay.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of the peak.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global grad norm (None: no clipping).")
    eval_every: int = Field(25, ge=1, description="Evaluate every N optimizer steps (and at the end).")
    eval_max_batches: int = Field(8, ge=1, description="Max eval micro-batches per evaluation.")
    save_every: int = Field(50, ge=1, description="Write a checkpoint every N optimizer steps.")
    keep_last_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept; older ones are purged.")
    keep_best_metric: str | None = Field(
        "eval/loss", description="Also keep the checkpoint with the lowest value of this metric (None: off)."
    )
    async_save: bool = Field(
        True, description="Upload checkpoints in a background thread (at most one save in flight)."
    )
    early_stopping_patience: int | None = Field(
        None, ge=1, description="Stop after this many evaluations without a better eval loss (None: off)."
    )
    log_every: int = Field(1, ge=1, description="Log metrics every N optimizer steps.")


class SFTConfig(TrainStageConfig):
    """Supervised fine-tuning: causal-LM loss on completion tokens only."""


class RewardModelConfig(TrainStageConfig):
    """Bradley-Terry reward model on preference pairs."""

    learning_rate: float = Field(5e-4, gt=0, description="Peak learning rate (AdamW).")


class DPOConfig(TrainStageConfig):
    """Direct Preference Optimization (sigmoid loss) against a frozen reference."""

    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate (AdamW).")
    beta: float = Field(0.1, gt=0, description="DPO beta: strength of the implicit KL constraint.")
    reference_from: str | None = Field(
        None, description="Reference model URI; None: the policy's starting model (the SFT output)."
    )


class GenerationConfig(_Base):
    """Sampling settings for generation."""

    max_new_tokens: int = Field(64, ge=1, description="Max generated tokens per completion.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    batch_size: int = Field(16, ge=1, description="Prompts per generate call.")


class SampledGenerationConfig(GenerationConfig):
    """Sampling settings for scoring completions (a YAML override of one field keeps these defaults)."""

    temperature: float = Field(0.7, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling threshold.")


class RolloutGenerationConfig(GenerationConfig):
    """Rollout sampling from the policy: on-policy, so temperature 1 and no truncation by default."""

    max_new_tokens: int = Field(48, ge=1, description="Max generated tokens per completion.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (must be > 0 for RL).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")


class ScoreConfig(_Base):
    """Sample completions from the SFT policy for held-out prompts and score them."""

    policy_from: str | None = Field(None, description="Policy URI; None: the SFT output.")
    reward_model_from: str | None = Field(None, description="Reward model URI; None: the reward_model output.")
    num_prompts: int = Field(
        64, ge=1, description="Held-out prompts scored from each set (GSM8K-style problems and preference prompts)."
    )
    generation: SampledGenerationConfig = Field(
        default_factory=SampledGenerationConfig, description="Sampling settings."
    )


class EvaluateConfig(_Base):
    """Held-out evaluation of every trained stage."""

    num_problems: int = Field(64, ge=1, description="Held-out problems for generation exact-match.")
    num_winrate_prompts: int = Field(64, ge=1, description="Held-out prompts for the reward-model win rate.")
    eval_max_batches: int = Field(16, ge=1, description="Max micro-batches per loss/accuracy evaluation.")
    micro_batch_size: int = Field(16, ge=1, description="Examples per forward in loss/accuracy evaluation.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Generation settings.")


class RewardConfig(_Base):
    """How an online RL stage scores a completion: learned, verifiable, or a weighted sum."""

    kind: Literal["reward_model", "verifier", "weighted"] = Field(
        "verifier", description="'reward_model': the trained RM's score; 'verifier': exact match of the final "
        "number (1/0) plus format bonus; 'weighted': weights.reward_model * RM + weights.verifier * verifier."
    )
    reward_model_from: str | None = Field(None, description="Reward model URI; None: the reward_model output.")
    reward_model_weight: float = Field(1.0, description="Weight of the RM score in 'weighted'.")
    verifier_weight: float = Field(1.0, description="Weight of the verifier score in 'weighted'.")
    format_bonus: float = Field(
        0.1, ge=0, description="Verifier: added when the completion has a '#### <number>' final line."
    )


class RLStageConfig(TrainStageConfig):
    """Settings shared by online RL stages (PPO, GRPO). ``max_steps`` counts rollout-update iterations."""

    learning_rate: float = Field(1e-4, gt=0, description="Peak policy learning rate (AdamW).")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps, then cosine decay.")
    reference_from: str | None = Field(None, description="Reference model URI; None: the policy's starting model.")
    prompts_per_rollout: int = Field(8, ge=1, description="Prompts sampled per rollout-update iteration.")
    ppo_epochs: int = Field(1, ge=1, description="Optimisation passes over each rollout batch.")
    num_mini_batches: int = Field(1, ge=1, description="Mini-batches (optimizer steps) per epoch of a rollout batch.")
    clip_eps: float = Field(0.2, gt=0, description="Policy ratio clip range epsilon.")
    kl_coef: float = Field(0.05, ge=0, description="KL penalty coefficient (initial value when adaptive).")
    kl_estimator: Literal["k1", "k3"] = Field("k1", description="Per-token KL estimator (Schulman's k1 or k3).")
    adaptive_kl: bool = Field(False, description="Adapt kl_coef towards kl_target (Ziegler et al. 2019).")
    kl_target: float = Field(6.0, gt=0, description="Target KL for the adaptive controller.")
    kl_horizon: int = Field(10000, ge=1, description="Horizon of the adaptive KL controller.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward function.")
    generation: RolloutGenerationConfig = Field(
        default_factory=RolloutGenerationConfig, description="Rollout sampling settings."
    )


class PPOConfig(RLStageConfig):
    """PPO with a value head, GAE, and a per-token KL penalty against the reference."""

    reward: RewardConfig = Field(
        default_factory=lambda: RewardConfig(kind="reward_model"), description="Reward function."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    vf_coef: float = Field(0.1, ge=0, description="Value loss coefficient.")
    value_clip_eps: float = Field(0.2, gt=0, description="Value prediction clip range.")
    whiten_advantages: bool = Field(True, description="Normalise advantages to zero mean, unit variance.")


class GRPOConfig(RLStageConfig):
    """GRPO: G samples per prompt, group-normalised advantages, no critic."""

    group_size: int = Field(4, ge=2, description="Completions sampled per prompt (G).")
    scale_rewards: bool = Field(True, description="Divide group advantages by the group std (False: Dr. GRPO).")
    kl_coef: float = Field(0.0, ge=0, description="KL-to-reference coefficient (0: no KL term, no reference).")
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="Per-token KL estimator (k3 as in DeepSeekMath).")


class LaunchConfig(_Base):
    """How the stage tasks run the trainer processes."""

    retries: int = Field(2, ge=0, description="Prefect retries of a failed stage task (resumes from checkpoint).")
    retry_delay_s: float = Field(2.0, ge=0, description="Seconds between retries.")
    timeout_s: float | None = Field(None, gt=0, description="Kill a stage's trainer after this many seconds.")
    lease_ttl_s: float = Field(
        30.0, gt=0, description="Lifetime of a stage's writer lease without renewal (renewed every third of it); "
        "a relaunch after a hard kill waits at most this long for the dead writer's lease.",
    )
    gpu_concurrency_limit: str | None = Field(
        None,
        description="Prefect global concurrency limit whose slots (one per GPU) a GPU stage holds while it "
        "trains, so pipelines sharing a node queue; default: $POSTTRAIN_GPU_CONCURRENCY_LIMIT, else none.",
    )


class PipelineConfig(_Base):
    """The whole pipeline: stage list, data, model, and every stage's hyper-parameters."""

    name: str = Field("posttrain", description="Pipeline name (used in run names).")
    seed: int = Field(0, description="Global seed: data split, shuffling, init, sampling.")
    stages: list[str] = Field(
        default_factory=lambda: list(STAGE_ORDER),
        description="Stages to run, in pipeline order: " + ", ".join(STAGE_ORDER) + ".",
    )
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Output storage.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    data: DataConfig = Field(default_factory=DataConfig, description="Input data.")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer training.")
    model: ModelConfig = Field(
        default_factory=lambda: ModelConfig(init=ModelInit()), description="Base model."
    )
    backend: BackendConfig = Field(default_factory=BackendConfig, description="Training backend.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="Stage task launching and retries.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="SFT stage.")
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig, description="Reward model stage.")
    score: ScoreConfig = Field(default_factory=ScoreConfig, description="Scoring stage.")
    dpo: DPOConfig = Field(default_factory=DPOConfig, description="DPO stage.")
    ppo: PPOConfig = Field(default_factory=PPOConfig, description="PPO stage.")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="GRPO stage.")
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig, description="Evaluation stage.")

    @field_validator("stages", mode="before")
    @classmethod
    def _split_stages(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [s.strip() for s in value.split(",") if s.strip()]
        return value

    @field_validator("stages")
    @classmethod
    def _check_stages(cls, value: list[str]) -> list[str]:
        unknown = [s for s in value if s not in STAGE_ORDER]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; known stages: {list(STAGE_ORDER)}")
        if len(set(value)) != len(value):
            raise ValueError(f"duplicate stage in {value}")
        if not value:
            raise ValueError("at least one stage is required")
        return sorted(value, key=STAGE_ORDER.index)

    @model_validator(mode="after")
    def _check_stage_backends(self) -> PipelineConfig:
        for stage in TRAINING_STAGES:
            world_size = self.backend_for(stage).world_size
            try:
                getattr(self, stage).accum_steps(world_size)
            except ConfigError as e:
                raise ValueError(f"{stage}: {e}") from None
        return self

    def backend_for(self, stage: str) -> BackendConfig:
        """The backend ``stage`` runs on: the pipeline's, with the stage's ``backend`` override merged.

        Stages without an optimizer loop (prepare_data, score, evaluate) run one process on
        the pipeline's device whatever the backend: they generate and score, they do not train.

        Raises:
            ValueError: the merged override is not a valid :class:`BackendConfig` (the message
                names ``<stage>.backend``).
        """
        if stage not in TRAINING_STAGES:
            return BackendConfig(device=self.backend.device)
        override = getattr(self, stage).backend
        if not override:
            return self.backend
        try:
            return BackendConfig.model_validate({**self.backend.model_dump(), **override})
        except ValidationError as e:
            raise ValueError(f"{stage}.backend: {e}") from None


def stage_config(config: PipelineConfig, stage: str) -> BaseModel | None:
    """The sub-config of ``stage`` (None for stages without one, e.g. ``prepare_data``)."""
    return getattr(config, stage, None) if stage != "prepare_data" else config.data


def config_hash(obj: BaseModel | dict) -> str:
    """SHA-256 (hex, first 16 chars) of a config's canonical JSON; secrets are excluded."""
    data = obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"  {path}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _set_path(data: dict, path: str, value: Any) -> None:
    keys = path.split(".")
    node = data
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override '{path}': '{k}' is not a section")
        node = nxt
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``key.path=value``; the value is read as YAML (numbers, booleans, null, lists).

    Raises:
        ConfigError: when ``text`` has no ``=`` or an empty key.
    """
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_overrides(data: dict, overrides: dict[str, Any] | None) -> dict:
    """Return a copy of ``data`` with each ``{key.path: value}`` override set."""
    out = json.loads(json.dumps(data, default=str))
    for key, value in (overrides or {}).items():
        _set_path(out, key, value)
    return out


def load_config(
    uri: str | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    base: dict | None = None,
) -> PipelineConfig:
    """Load a YAML config (any fsspec URI), apply overrides and validate.

    Args:
        uri: YAML file; None: defaults only (or ``base``).
        overrides: ``{key.path: value}`` or a list of ``key.path=value`` strings.
        base: a dict to start from instead of reading ``uri``.

    Raises:
        ConfigError: unreadable YAML, a bad override, or a validation failure; the message
            names each failing field path.
    """
    import fsspec

    data: dict = dict(base or {})
    source = uri or "defaults"
    if uri is not None:
        try:
            with fsspec.open(uri, "r") as f:
                loaded = yaml.safe_load(f) or {}
        except FileNotFoundError as e:
            raise ConfigError(f"config file not found: {uri}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {uri} is not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {uri}: top level must be a mapping")
        data = loaded
    if isinstance(overrides, list):
        overrides = dict(parse_override(o) for o in overrides)
    data = apply_overrides(data, overrides)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def resolve_local_root(config: PipelineConfig) -> PipelineConfig:
    """Make a relative local ``storage.root`` absolute, so child processes agree on it."""
    root = config.storage.root
    if "://" not in root:
        root = os.path.abspath(root)
    elif root.startswith("file://"):
        root = os.path.abspath(root[len("file://") :])
    if root != config.storage.root:
        config = config.model_copy(deep=True)
        config.storage.root = root
    return config
