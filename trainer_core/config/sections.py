"""The pipeline-wide config sections: storage, tracking, data, tokenizer, model, launch.

Each field has a description: they become the CLI help and the Prefect UI form.
"""

from __future__ import annotations

import posixpath
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from trainer_core.config.base import ConfigBase, Neutral, override_of


class StorageConfig(ConfigBase):
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


class TrackingConfig(ConfigBase):
    """MLflow tracking."""

    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI; default: MLFLOW_TRACKING_URI, else sqlite:///<root>/mlflow.db "
        "for a local root.",
    )
    experiment_name: str = Field("posttrain", description="MLflow experiment holding the pipeline runs.")
    ui_url: str | None = Field(
        None,
        description="Base URL of the MLflow UI that shows this store (e.g. http://mlflow.internal:5000), used for "
        "links from Prefect artifacts. Default: the tracking URI when it is http(s); no links for a sqlite store.",
    )
    log_models: bool = Field(
        True,
        description="Log the final model of every training stage as an MLflow transformers model (weights, "
        "tokenizer and task) in its stage run; the flow process loads each model once to do so.",
    )
    registered_model_name: str | None = Field(
        None,
        description="Register the pipeline's final policy as a new version of this MLflow registered model, "
        "with alias 'champion' when every evaluate gate passes, else 'candidate'. None: register nothing.",
    )
    registered_stage: str | None = Field(
        None,
        description="The stage whose final model is registered. Default: the last policy stage the run trains, "
        "in pipeline order (grpo, else ppo, else dpo, else sft).",
    )

    @field_validator("registered_model_name")
    @classmethod
    def _check_registered_model_name(cls, name: str | None) -> str | None:
        """MLflow's rules for a registered model name (``mlflow.utils.validation._validate_model_name``),
        checked when the config is read rather than when the release registers the model, after
        every stage has trained: not blank, no ``/`` or ``:``, and a name that is its own normal
        path (no ``.``/``..`` segments, no leading ``/``, no doubled or trailing ``/``)."""
        if name is None:
            return None
        if not name.strip():
            raise ValueError("must not be blank")
        if "/" in name or ":" in name:
            raise ValueError(f"{name!r}: MLflow model names cannot contain '/' or ':'")
        norm = posixpath.normpath(name)
        if norm != name or norm == "." or norm.startswith(".."):
            raise ValueError(f"{name!r}: MLflow would read it as the path {norm!r}")
        return name


class DataSource(ConfigBase):
    """One input data set."""

    uri: str | None = Field(
        None,
        description="JSONL / Parquet file URI (any fsspec URI) or 'hf://<dataset id>' for a Hugging Face "
        "datasets id. None: use the generated synthetic task.",
    )
    format: Literal["auto", "prompt_completion", "gsm8k", "hh_rlhf", "kto", "messages", "text"] = Field(
        "auto",
        description="Record format; 'auto' detects it from the first record's keys. 'messages': a conversation "
        "{messages: [{role, content}, ...]} ending in an assistant turn (SFT and eval). 'kto': unpaired "
        "{prompt, completion, label} examples; 'text': raw text (the text_field of JSONL/Parquet records, or each "
        "line of a .txt file).",
    )
    text_field: Annotated[str, Neutral("text")] = Field(
        "text", description="Field holding the document of a 'text' record (JSONL/Parquet)."
    )
    split: str = Field("train", description="Split name, for 'hf://' data set ids only.")
    max_rows: int | None = Field(None, ge=1, description="Read at most this many rows (None: all).")


class SyntheticConfig(ConfigBase):
    """The offline synthetic task: multi-step arithmetic word problems with worked solutions."""

    num_problems: int = Field(3000, ge=10, description="Number of generated problems (SFT and eval).")
    num_pairs: int = Field(1500, ge=10, description="Number of generated preference pairs.")
    max_operand: int = Field(20, ge=2, description="Largest operand in a generated problem.")
    annotation_fraction: Annotated[float, Neutral(1.0)] = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of SFT solutions written with GSM8K's calculator annotations "
        "('3+5=<<3+5=8>>8'; the others '3+5=8'): a model then calls the calculator environment on about this share "
        "of its answers. 1.0: all.",
    )
    annotation_unit: Annotated[Literal["solution", "step"], Neutral("solution")] = Field(
        "solution",
        description="What annotation_fraction draws: 'solution' (a solution is annotated on every step or on "
        "none) or 'step' (each step on its own draw, so every answer mixes calls and plain sums).",
    )


class DataConfig(ConfigBase):
    """Input data sets and how they are split and tokenised."""

    sft: DataSource = Field(default_factory=DataSource, description="SFT data (prompt/completion or GSM8K).")
    preference: DataSource = Field(
        default_factory=DataSource, description="Preference pairs (HH-RLHF dialogues) for reward model and DPO."
    )
    eval: DataSource = Field(
        default_factory=DataSource,
        description="Held-out GSM8K-format problems for generation eval; None: a seeded split of the SFT data.",
    )
    kto: Annotated[DataSource | None, Neutral(None)] = Field(
        None,
        description="Unpaired desirable/undesirable examples for the kto stage: 'kto' records, or preference pairs "
        "(prompt_completion, hh_rlhf) each split into a desirable and an undesirable example; uri None: the "
        "synthetic preference pairs, unpaired. None: no kto splits (the kto stage needs them).",
    )
    pretrain: Annotated[DataSource | None, Neutral(None)] = Field(
        None,
        description="Raw text for the pretrain stage (format 'text'), packed into sequences of max_length_tokens; "
        "uri None: the synthetic problems and solutions as plain text. None: no pretrain splits (the pretrain stage "
        "needs them).",
    )
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig, description="Synthetic task settings.")
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Fraction of each data set held out.")
    max_eval_rows: int = Field(256, ge=1, description="Cap on rows of each held-out split.")
    max_length_tokens: int = Field(
        256, ge=8, description="Max tokens of prompt + completion; longer rows are truncated."
    )
    max_prompt_length_tokens: int = Field(
        192, ge=4, description="Max prompt tokens; longer prompts keep their last tokens."
    )
    assistant_turns: Annotated[Literal["last", "all"], Neutral("last")] = Field(
        "last",
        description="SFT rows of a conversation (a 'messages' record, or a prompt with assistant turns): "
        "'last' counts only the final assistant reply in the loss, 'all' every assistant reply (system, user "
        "and the template's headers are never counted). Preference and KTO rows count their final reply.",
    )
    num_proc: int = Field(
        1,
        ge=1,
        description="Processes that tokenise in prepare_data (chunks of rows, results in order: the "
        "output is the same for any value); 1: in the prepare_data process itself.",
    )

    @model_validator(mode="after")
    def _prompt_fits(self) -> DataConfig:
        if self.max_prompt_length_tokens >= self.max_length_tokens:
            raise ValueError("max_prompt_length_tokens must be smaller than max_length_tokens")
        return self


class TokenizerConfig(ConfigBase):
    """BPE tokenizer trained in prepare_data when the model is built from config."""

    vocab_size: int = Field(2048, ge=64, description="Target vocabulary size including special tokens.")
    min_frequency: int = Field(2, ge=1, description="Minimum pair frequency for a BPE merge.")


class ModelInit(ConfigBase):
    """Architecture and sizes of a model built from config (random init)."""

    architecture: Literal["llama", "mixtral"] = Field(
        "llama",
        description="Model family (transformers config class): llama (dense) or mixtral (a sparse mixture "
        "of experts in every block: a top-k router over num_local_experts MLPs of intermediate_size).",
    )
    num_local_experts: Annotated[int | None, Neutral(None)] = Field(
        None, ge=2, description="Experts per block (mixtral; None: 4)."
    )
    num_experts_per_tok: Annotated[int | None, Neutral(None)] = Field(
        None, ge=1, description="Experts each token is routed to, top-k (mixtral; None: 2)."
    )
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
        experts = {"num_local_experts": self.num_local_experts, "num_experts_per_tok": self.num_experts_per_tok}
        if self.architecture != "mixtral" and any(v is not None for v in experts.values()):
            raise ValueError(
                f"{[k for k, v in experts.items() if v is not None]} apply to a mixture of experts: set "
                "architecture: mixtral"
            )
        if self.architecture == "mixtral" and self.experts_per_token > self.experts:
            raise ValueError(f"num_experts_per_tok={self.experts_per_token} exceeds num_local_experts={self.experts}")
        return self

    @property
    def experts(self) -> int:
        """Experts per block of a mixtral model (``num_local_experts``, default 4)."""
        return self.num_local_experts or 4

    @property
    def experts_per_token(self) -> int:
        """Top-k of a mixtral model's router (``num_experts_per_tok``, default 2)."""
        return self.num_experts_per_tok or 2


class ModelConfig(ConfigBase):
    """The base model: a pretrained one by name/path, or one built from config."""

    name_or_path: str | None = Field(
        None, description="Hugging Face model id, or local / fsspec path of an HF-format model directory."
    )
    init: ModelInit | None = Field(None, description="Build a model from these sizes instead of loading one.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub (off unless set).")
    attn_implementation: Annotated[
        Literal["sdpa", "eager", "flex_attention", "flash_attention_2"] | None, Neutral(None)
    ] = Field(
        None,
        description="transformers' attention kernel for every model the stages load; None: transformers' default "
        "(sdpa). With packed micro-batches on CUDA, flex_attention (document masks) or flash_attention_2 (varlen, "
        "needs the flash-attn package) keep attention from costing S x S per micro-batch.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelConfig:
        if (self.name_or_path is None) == (self.init is None):
            raise ValueError("set exactly one of model.name_or_path and model.init")
        return self


class LoraConfig(ConfigBase):
    """Low-rank adapters (LoRA, Hu et al. 2021) on a training stage's model, built with ``peft``.

    Set pipeline-wide under ``lora`` and per stage under ``<stage>.lora`` (:class:`LoraOverride`:
    the fields set there replace the pipeline's, as ``<stage>.backend`` does). With ``enabled``, the stage trains only the
    adapters (and the reward model's score head, PPO's value head); the reference of DPO, PPO and
    GRPO is the policy with its adapter disabled when the policy starts from the reference's
    weights (no second model); checkpoints hold the trainable weights and their optimizer state
    only; the committed model is merged (``W + (alpha / r) B A``) into a plain HF model, or with
    ``merge_on_commit: false`` committed as the adapter (PEFT format) over its base, which the next
    stage merges or, with ``continue_adapter``, trains further.
    """

    enabled: bool = Field(False, description="Train low-rank adapters instead of the full weights.")
    rank: int = Field(16, ge=1, description="Adapter rank r.")
    alpha: float = Field(
        32.0, gt=0, description="Scale numerator: the update is (alpha / r) B A (alpha / sqrt(r) with use_rslora)."
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] | None = Field(
        None,
        description="Names (suffixes) of the linear layers to adapt; None: every linear layer inside the "
        "transformer blocks (the attention and MLP projections).",
    )
    use_rslora: bool = Field(False, description="Rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023).")
    reference_model: Literal["disabled_adapter", "separate"] = Field(
        "disabled_adapter",
        description="The reference of DPO, PPO and GRPO when the policy starts from the reference's weights: the "
        "policy with its adapter disabled (no second model in memory), or a separate frozen copy loaded from the "
        "reference input (twice the weights; the same values).",
    )
    quantize: Literal["4bit"] | None = Field(
        None,
        description="QLoRA: load the frozen base in 4-bit NF4 (bitsandbytes >= 0.48, CUDA or CPU; the single "
        "backend only). The merged commit dequantizes the base: W' = dequant(W_nf4) + scaling B A.",
    )
    merge_on_commit: bool = Field(
        True,
        description="Commit the merged model (a plain HF model). False: commit the adapter in PEFT format "
        "(adapter_config.json, adapter_model.safetensors) over the base model named in it and in the manifest "
        "(extra.adapter.base_model); a base built from config or merged from an upstream adapter is committed "
        "beside it under base/. Downstream stages load either.",
    )
    continue_adapter: bool = Field(
        False,
        description="When the stage's input model was committed as an adapter (merge_on_commit: false upstream): "
        "train that adapter further (its rank, alpha and targets must match this stage's) instead of merging it "
        "into its base and starting a new one. The reference of DPO/PPO/GRPO is then the input model loaded merged "
        "(a second copy: the disabled adapter would be the base, not the input).",
    )


class LoraOverride(override_of(LoraConfig)):  # type: ignore[misc]
    """A stage's ``lora``: the fields of :class:`LoraConfig` it sets over the pipeline-wide
    ``lora`` (e.g. ``{enabled: true, rank: 8}``), unset ones inherited; the merged settings are
    validated as a whole (``PipelineConfig.lora_for``). An unknown key fails at load, named
    ``<stage>.lora.<key>``."""


class LaunchConfig(ConfigBase):
    """How the stage tasks run the trainer processes."""

    retries: int = Field(2, ge=0, description="Prefect retries of a failed stage task (resumes from checkpoint).")
    retry_delay_s: float = Field(2.0, ge=0, description="Seconds between retries.")
    timeout_s: float | None = Field(None, gt=0, description="Kill a stage's trainer after this many seconds.")
    lease_ttl_s: float = Field(
        30.0,
        gt=0,
        description="Lifetime of a stage's writer lease without renewal (renewed every third of it); "
        "a relaunch after a hard kill waits at most this long for the dead writer's lease.",
    )
    max_parallel_stages: int | None = Field(
        None,
        ge=1,
        description="Stages of one run that may run at once (independent branches of the stage graph, e.g. DPO, "
        "PPO and GRPO after SFT). None: no bound of its own when a GPU concurrency limit is set (its slots "
        "bound them), else 1 (one stage at a time, in pipeline order).",
    )
    gpu_concurrency_limit: str | None = Field(
        None,
        description="Prefect global concurrency limit whose slots (one per GPU) a GPU stage holds while it "
        "trains, so pipelines sharing a node queue; default: $POSTTRAIN_GPU_CONCURRENCY_LIMIT, else none.",
    )


class SweepConfig(ConfigBase):
    """A grid of recipes over one pipeline: ``posttrain sweep`` (``flows/sweep.py``) runs one
    pipeline run per point, the stages the points have in common once."""

    grid: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="Config key -> the values swept, e.g. {dpo.beta: [0.1, 0.5]}: one point "
        "per combination of values (the --grid options of posttrain sweep are added to it).",
    )
    metric: str | None = Field(
        None,
        description="The evaluate metric (higher is better) that picks the best point, e.g. grpo/exact_match; "
        "None: <registered stage>/exact_match.",
    )
    max_parallel_points: int | None = Field(
        None,
        ge=1,
        description="Points that run at once. None: every point when a GPU concurrency limit is named "
        "(its slots bound their GPU stages), else 2.",
    )
    register_others: bool = Field(
        False,
        description="Also register every other point's policy, as a candidate (never the champion); False: "
        "only the best point goes through the gates and the registry.",
    )

    @field_validator("grid")
    @classmethod
    def _values(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return check_grid(grid)


def check_grid(grid: dict[str, Any], where: str = "sweep.grid.") -> dict[str, list[Any]]:
    """Return ``grid`` if every axis is sweepable: a list of at least one value, none repeated,
    and a key outside the sweep, the name, storage and tracking (one for every point). The rule of
    ``sweep.grid`` and of ``posttrain sweep --grid`` (and the sweep flow's ``grid``) alike.

    Args:
        grid: config key -> the values swept.
        where: what the messages put before a key (``sweep.grid.``, ``--grid ``).

    Raises:
        ValueError: naming the first bad axis as ``<where><key>``.
    """
    for key, values in grid.items():
        if not isinstance(values, list):
            raise ValueError(f"{where}{key}: give a list of values, not {values!r}")
        if not values:
            raise ValueError(f"{where}{key}: give at least one value (an empty axis makes a sweep of no points)")
        if key == "sweep" or key.startswith(("sweep.", "name", "storage.", "tracking.")):
            raise ValueError(f"{where}{key}: the sweep, its name, storage and tracking are one for every point")
        if len({repr(v) for v in values}) != len(values):
            raise ValueError(f"{where}{key}: a value is repeated in {values}")
    return grid
