"""The per-stage config sections: optimisation and each stage's own (the RL stages' rewards: rewards.py; sampling and
tools: generation.py; score, evaluate and the quality gates: evaluation.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from trainer_core.config.backend import BackendOverride
from trainer_core.config.base import ConfigBase, Neutral
from trainer_core.config.generation import EnvironmentConfig, RolloutGenerationConfig
from trainer_core.config.rewards import RewardConfig
from trainer_core.config.sections import LoraOverride
from trainer_core.errors import ConfigError


class RouterTemperatureConfig(ConfigBase):
    """A router temperature schedule: the routers' logits divided by a temperature that moves
    linearly from ``start`` (the first optimizer step) to ``end`` (reached after ``steps`` steps,
    then kept), in the training forwards only."""

    start: float = Field(gt=0, description="Temperature of the first optimizer step (> 1 spreads the routing).")
    end: float = Field(1.0, gt=0, description="Temperature from step `steps` on (1: the model as it is committed).")
    steps: int = Field(ge=1, description="Optimizer steps over which the temperature moves from start to end.")


class MoEConfig(ConfigBase):
    """Mixture-of-experts training of a model with routers (Mixtral, Qwen2-MoE, OLMoE, ...)."""

    aux_loss_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the routers' load-balancing loss (Switch Transformer eqs. 4-6, transformers' "
        "load_balancing_loss_func) added to the training loss. 0: none, which is transformers' own default "
        "(output_router_logits off); Mixtral's published coefficient is 0.02.",
    )
    router_temperature: Annotated[RouterTemperatureConfig | None, Neutral(None)] = Field(
        None,
        description="Router temperature schedule {start, end, steps}: the router logits of the training "
        "forwards divided by a temperature moved linearly from start to end over `steps` optimizer steps; None: "
        "the routers as they are (temperature 1).",
    )


class OptimizerStageConfig(ConfigBase):
    """What every training stage reads, the supervised loop's and the online RL loop's alike: the
    model it starts from, its backend and LoRA overrides, its optimizer steps, AdamW and its
    schedule, clipping, non-finite steps and checkpoints."""

    init_from: str | None = Field(
        None, description="Model URI to start from; None: the previous stage's output (or model config)."
    )
    backend: BackendOverride = Field(
        default_factory=BackendOverride,
        description="Override of the pipeline-wide backend for this stage (e.g. {name: ddp}): the fields set here "
        "replace `backend`'s, the merged backend is validated as a whole.",
    )
    lora: LoraOverride = Field(
        default_factory=LoraOverride,
        description="Override of the pipeline-wide `lora` for this stage (e.g. {enabled: true, rank: 8}): the fields "
        "set here replace `lora`'s, the merged settings are validated as a whole.",
    )
    max_steps: int = Field(100, ge=1, description="Optimizer steps (global_step at the end).")
    learning_rate: float = Field(1e-3, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps, then cosine decay.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of the peak.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global grad norm (None: no clipping).")
    save_every: int = Field(50, ge=1, description="Write a checkpoint every N optimizer steps.")
    keep_last_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept; older ones are purged.")
    async_save: bool = Field(
        True, description="Upload checkpoints in a background thread (at most one save in flight)."
    )
    max_nonfinite_steps: Annotated[int, Neutral(0)] = Field(
        0,
        ge=0,
        description="Optimizer steps with a NaN/inf loss or gradient norm that are skipped (weights and optimizer "
        "state left as they were) before the stage fails; 0: the first one fails it. Not with deepspeed.",
    )


class TrainStageConfig(OptimizerStageConfig):
    """A stage of the supervised loop (``trainer_core.training.loop``: SFT, reward model, DPO, KTO,
    pretrain, the distillation teacher): micro-batches of a fixed dataset, held-out evaluation,
    the best checkpoint and early stopping, logging every N steps, the routers' losses."""

    moe: Annotated[MoEConfig, Neutral(MoEConfig())] = Field(
        default_factory=MoEConfig,
        description="Router load-balancing loss of a mixture-of-experts model (expert usage "
        "is logged whenever the model has routers).",
    )
    micro_batch_size: int = Field(8, ge=1, description="Examples per forward/backward.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches per rank per optimizer step.")
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Examples per optimizer step over all ranks. When set, grad_accum_steps is ignored and "
        "derived as global_batch_size / (micro_batch_size x world size), so a run resumed at another world "
        "size (elastic) keeps the same batch.",
    )
    eval_every: int = Field(25, ge=1, description="Evaluate every N optimizer steps (and at the end).")
    eval_max_batches: int = Field(8, ge=1, description="Max eval micro-batches per evaluation.")
    keep_best_metric: str | None = Field(
        "eval/loss", description="Also keep the checkpoint with the lowest value of this metric (None: off)."
    )
    early_stopping_patience: int | None = Field(
        None, ge=1, description="Stop after this many evaluations without a better eval loss (None: off)."
    )
    log_every: int = Field(1, ge=1, description="Log metrics every N optimizer steps.")

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


class SupervisedStageConfig(TrainStageConfig):
    """A stage trained on a fixed dataset (SFT, reward model, DPO): its micro-batches may be packed."""

    max_tokens_per_micro_batch: Annotated[int | None, Neutral(None)] = Field(
        None,
        ge=1,
        description="Pack rows end to end, padding-free, into micro-batches of at most this many tokens (a "
        "preference pair's chosen and rejected together); each micro-batch then holds a varying number of rows and "
        "micro_batch_size only sizes evaluation and the reference pass. No token attends across rows: transformers "
        "masks by the restarting position ids (block-diagonal on sdpa/eager, document masks with "
        "model.attn_implementation=flex_attention, varlen with flash_attention_2); refused at start for a model "
        "whose attention mask ignores position ids (OPT, BLOOM). None: padded micro-batches of micro_batch_size rows.",
    )

    @model_validator(mode="after")
    def _packing_counts_micro_batches(self) -> SupervisedStageConfig:
        if self.max_tokens_per_micro_batch is not None and self.global_batch_size is not None:
            raise ValueError(
                "global_batch_size counts examples, but a packed micro-batch (max_tokens_per_micro_batch) holds a "
                "varying number: set grad_accum_steps (micro-batches per rank per optimizer step) instead"
            )
        return self


class ReferenceModelConfig(ConfigBase):
    """Mixed into the stages that score the policy against a frozen reference model (DPO, KTO, PPO, GRPO)."""

    reference_from: str | None = Field(
        None, description="Reference model URI; None: the policy's starting model (the SFT output by default)."
    )


class SFTConfig(SupervisedStageConfig):
    """Supervised fine-tuning: causal-LM loss on completion tokens only."""


class RewardModelConfig(SupervisedStageConfig):
    """Bradley-Terry reward model on preference pairs, in one of two parameterisations."""

    learning_rate: float = Field(5e-4, gt=0, description="Peak learning rate (AdamW).")
    parameterization: Annotated[Literal["scalar_head", "implicit"], Neutral("scalar_head")] = Field(
        "scalar_head",
        description="scalar_head: a sequence classifier with one output read at the last token (InstructGPT; TRL's "
        "RewardTrainer), its head new; implicit: the causal LM itself, reward implicit_beta / |y| * log pi(y | x), "
        "the mean log-probability of the completion (SimPO's reference-free implicit reward, Meng et al. 2024, "
        "eq. 4), committed as a causal LM whose config.json says so. Both train with the Bradley-Terry loss.",
    )
    implicit_beta: Annotated[float, Neutral(2.0)] = Field(
        2.0, gt=0, description="The implicit reward's scale beta (SimPO's default 2.0); unused by scalar_head."
    )


def implicit_reward_problem(cfg: RewardModelConfig, lora_enabled: bool) -> str | None:
    """Why the reward model stage cannot train ``cfg`` with LoRA on (``lora_enabled``), or None:
    the implicit reward is committed as a causal LM marked in its config.json, which an adapter's
    directory would not carry."""
    if cfg.parameterization == "implicit" and lora_enabled:
        return "reward_model.parameterization='implicit' does not take LoRA (reward_model.lora / lora)"
    return None


class DPOConfig(SupervisedStageConfig, ReferenceModelConfig):
    """Preference optimisation on chosen/rejected pairs: DPO (sigmoid loss) against a frozen
    reference, or another loss of the family (``loss_type``; see ``trainer_core.objectives.dpo``)."""

    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate (AdamW).")
    beta: Annotated[float, Neutral(None)] = Field(
        0.1,
        gt=0,
        description="DPO beta: strength of the implicit KL constraint (IPO's tau, "
        "SimPO's reward scale, ORPO's lambda).",
    )
    loss_type: Annotated[Literal["sigmoid", "robust", "hinge", "ipo", "simpo", "orpo"], Neutral("sigmoid")] = Field(
        "sigmoid",
        description="sigmoid: DPO (with label_smoothing > 0: conservative DPO); robust: rDPO; hinge: SLiC; ipo: IPO "
        "(length-averaged log-ratios); simpo: SimPO (reference-free, length-normalised, margin simpo_gamma); "
        "orpo: ORPO (NLL of the chosen plus the odds-ratio term, reference-free). The reference-free ones load no "
        "reference model.",
    )
    label_smoothing: Annotated[float, Neutral(0.0)] = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="Probability that a preference label is flipped: cDPO (sigmoid), rDPO "
        "(robust) and SimPO; 0 elsewhere.",
    )
    simpo_gamma: Annotated[float, Neutral(0.5)] = Field(0.5, ge=0, description="SimPO's target reward margin gamma.")
    rpo_alpha: Annotated[float, Neutral(0.0)] = Field(
        0.0,
        ge=0,
        description="Weight of the chosen completions' negative log-likelihood (per token) added to "
        "the preference loss: RPO (Pang et al. 2024, eq. 1; TRL 1.x: loss_type ['sigmoid', 'sft'] with "
        "loss_weights [1, rpo_alpha]); keeps the chosen solutions likely where DPO alone lowers both sides. "
        "0: off (ORPO has its own NLL term).",
    )

    @model_validator(mode="after")
    def _smoothing_applies(self) -> DPOConfig:
        if self.rpo_alpha and self.loss_type == "orpo":
            raise ValueError(f"rpo_alpha={self.rpo_alpha}: loss_type 'orpo' already adds the chosen NLL")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust", "simpo"):
            raise ValueError(
                f"label_smoothing={self.label_smoothing}: loss_type {self.loss_type!r} has no label "
                "smoothing (sigmoid, robust and simpo have)"
            )
        return self


class KTOConfig(TrainStageConfig, ReferenceModelConfig):
    """Kahneman-Tversky optimisation on unpaired desirable / undesirable examples (``data.kto``)
    against a frozen reference (Ethayarajh et al. 2024; ``trainer_core.objectives.kto``)."""

    learning_rate: float = Field(
        1e-4,
        gt=0,
        description="Peak learning rate (AdamW); lower than DPO's: an unpaired loss has no pair to cancel "
        "the shift common to every completion.",
    )
    beta: Annotated[float, Neutral(None)] = Field(
        0.1, gt=0, description="KTO beta: scale of the implied reward (as DPO's)."
    )
    desirable_weight: float = Field(
        1.0,
        gt=0,
        description="lambda_D, the weight of a desirable example's loss. The paper advises "
        "desirable_weight x #desirable / (undesirable_weight x #undesirable) in [1, 4/3].",
    )
    undesirable_weight: float = Field(1.0, gt=0, description="lambda_U, the weight of an undesirable example's loss.")

    @model_validator(mode="after")
    def _kl_needs_a_batch(self) -> KTOConfig:
        if self.micro_batch_size < 2:
            raise ValueError(
                "kto.micro_batch_size must be at least 2: the KL reference point is estimated from the "
                "micro-batch's mismatched pairs (with 1 it is the example's own implied reward; TRL refuses "
                "it too)"
            )
        return self


class PretrainConfig(SupervisedStageConfig):
    """Continued pretraining: next-token loss on every token of packed raw text (``data.pretrain``)."""


SUPERVISED_LOOP_FIELDS: tuple[str, ...] = tuple(
    name for name in TrainStageConfig.model_fields if name not in OptimizerStageConfig.model_fields
)
"""The supervised loop's fields (:class:`TrainStageConfig`'s own), which the online RL loop does
not read and its sections do not have."""


def without_supervised_loop_fields(section: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """An RL section of a config saved before the RL sections lost the supervised loop's fields
    (a run's ``config.json`` holds every field), without them, and their names: the RL loop never
    read them, so the section configures the same run (CHANGELOG.md)."""
    dropped = [name for name in SUPERVISED_LOOP_FIELDS if name in section]
    return {k: v for k, v in section.items() if k not in dropped}, dropped


class RLStageConfig(OptimizerStageConfig, ReferenceModelConfig):
    """Settings shared by online RL stages (PPO, GRPO, distill). ``max_steps`` counts rollout-update
    iterations. The supervised loop's own fields (:data:`SUPERVISED_LOOP_FIELDS`) are refused: an
    iteration's batches are ``prompts_per_rollout``, ``num_mini_batches`` and
    ``forward_micro_batch_size``, it logs every iteration, held-out evaluation is ``evaluate``'s,
    and it adds no router loss."""

    learning_rate: float = Field(1e-4, gt=0, description="Peak policy learning rate (AdamW).")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps, then cosine decay.")
    prompts_per_rollout: int = Field(8, ge=1, description="Prompts sampled per rollout-update iteration.")
    num_prompts: Annotated[int | None, Neutral(None)] = Field(
        None,
        ge=1,
        description="RL prompt pool: this many prompts of the prepared train split, drawn with the "
        "pipeline seed (iterations go through the pool in epochs); None: all of them.",
    )
    ppo_epochs: int = Field(1, ge=1, description="Optimisation passes over each rollout batch.")
    num_mini_batches: int = Field(1, ge=1, description="Mini-batches (optimizer steps) per epoch of a rollout batch.")
    clip_eps: float = Field(0.2, gt=0, description="Policy ratio clip range epsilon.")
    kl_coef: float = Field(0.05, ge=0, description="KL penalty coefficient (initial value when adaptive).")
    kl_estimator: Literal["k1", "k3"] = Field("k1", description="Per-token KL estimator (Schulman's k1 or k3).")
    adaptive_kl: bool = Field(False, description="Adapt kl_coef towards kl_target (Ziegler et al. 2019).")
    kl_target: float = Field(6.0, gt=0, description="Target KL for the adaptive controller.")
    kl_horizon: int = Field(10000, ge=1, description="Horizon of the adaptive KL controller.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward function.")
    environment: Annotated[EnvironmentConfig | None, Neutral(None)] = Field(
        None,
        description="A tool environment for multi-turn rollouts (its tokens masked from every loss term; "
        "PPO's GAE steps over the policy's tokens alone); None: single-turn.",
    )
    generation: RolloutGenerationConfig = Field(
        default_factory=RolloutGenerationConfig, description="Rollout sampling settings."
    )
    forward_micro_batch_size: Annotated[int | None, Neutral(None)] = Field(
        None,
        ge=1,
        description="Sequences per forward over a rollout batch (policy, reference, value head, "
        "reward model) and per backward in a mini-batch (gradients accumulated); None: all at once.",
    )
    padding_free: Annotated[bool, Neutral(False)] = Field(
        False,
        description="Run the policy's, the reference's and the teacher's forwards over a rollout (log-probs, "
        "values and the update, the ptx rows too) on the real tokens only: each forward's rows end to end in one "
        "row, position ids restarting per row, instead of [rows, longest prompt + longest completion] with padding "
        "(TRL's padding_free, verl's use_remove_padding). No token attends across rows (block-diagonal on "
        "sdpa/eager, document masks with model.attn_implementation=flex_attention, varlen with flash_attention_2); "
        "on sdpa/eager the mask is as long as all the rows together, so it pays where padding is a large share. "
        "Refused at start for a model whose attention mask ignores position ids (OPT, BLOOM), and when the config "
        "loads with backend.name=deepspeed.",
    )
    ptx_coef: Annotated[float, Neutral(0.0)] = Field(
        0.0,
        ge=0,
        description="Weight of a supervised loss on the prepared sft/train demonstrations added to "
        "every optimizer step (InstructGPT's PPO-ptx, eq. 2; OpenRLHF's ptx_coef): keeps what the policy "
        "learnt outside the RL prompts; 0: off. See trainer_core.training.rl.ptx.",
    )
    ptx_rows_per_step: Annotated[int, Neutral(16)] = Field(
        16, ge=1, description="Demonstrations per rank in each optimizer step's ptx loss."
    )
    importance_sampling_cap: Annotated[float | None, Neutral(None)] = Field(
        None,
        gt=0,
        description="Truncated importance sampling: weight each token's loss by "
        "min(exp(trainer logprob - engine logprob), cap) where the engine's numerics differ from the "
        "trainer's (e.g. 2.0 with engine 'static'); None: off.",
    )

    @property
    def samples_per_prompt_of_rollout(self) -> int:
        """Completions sampled per prompt (GRPO's group size, distillation's ``samples_per_prompt``; 1 here)."""
        return 1

    @model_validator(mode="before")
    @classmethod
    def _no_supervised_loop_fields(cls, data: Any) -> Any:
        found = [name for name in SUPERVISED_LOOP_FIELDS if isinstance(data, dict) and name in data]
        if found:
            raise ValueError(
                f"{', '.join(found)}: a setting of the supervised loop, which the online RL stages do not read (their "
                "batches are prompts_per_rollout, num_mini_batches and forward_micro_batch_size; they log every "
                "iteration; held-out evaluation is the evaluate stage's; they add no router loss): remove it"
            )
        return data

    @model_validator(mode="after")
    def _engine_serves_the_rollout(self) -> RLStageConfig:
        if self.environment is not None and self.generation.engine == "vllm":
            raise ValueError(
                "generation.engine='vllm' with an environment: the vllm engine samples single-turn rollouts "
                "(a tool session's observations are fed by the 'hf' and 'static' engines); use one of those"
            )
        return self


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

    @property
    def samples_per_prompt_of_rollout(self) -> int:
        """Completions sampled per prompt: the group size G."""
        return self.group_size

    scale_rewards: bool = Field(
        True, description="'grpo' estimator: divide group advantages by the group std (False: as 'dr_grpo')."
    )
    advantage_estimator: Annotated[Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"], Neutral("grpo")] = Field(
        "grpo",
        description="'grpo' (group mean and std), 'dr_grpo' (group mean only), 'rloo' (leave-one-out "
        "mean), 'reinforce_pp' (REINFORCE++: token-level KL in the reward, whitened over the batch); see "
        "trainer_core.objectives.grpo_family.",
    )
    loss_aggregation: Annotated[Literal["token_mean", "sequence_mean", "constant"], Neutral("token_mean")] = Field(
        "token_mean",
        description="How per-token losses become the loss: 'token_mean' over the mini-batch's "
        "tokens (DAPO), 'sequence_mean' each sequence's token mean then the mean over sequences (GRPO), "
        "'constant' the sum over sequences x max_new_tokens (Dr. GRPO).",
    )
    clip_eps_high: Annotated[float | None, Neutral(None)] = Field(
        None,
        gt=0,
        description="Upper clip range (DAPO's clip-higher: ratio clipped to "
        "[1 - clip_eps, 1 + clip_eps_high]); None: clip_eps.",
    )
    dynamic_sampling: Annotated[bool, Neutral(False)] = Field(
        False,
        description="DAPO's dynamic sampling: drop groups whose rewards are all equal and sample more "
        "prompts until prompts_per_rollout groups remain or dynamic_sampling_max_rounds is reached.",
    )
    dynamic_sampling_max_rounds: Annotated[int, Neutral(4)] = Field(
        4, ge=1, description="Sampling rounds per rollout at most with dynamic_sampling (1: filter only)."
    )
    overlong_buffer_tokens: Annotated[int | None, Neutral(None)] = Field(
        None,
        ge=1,
        description="DAPO's soft overlong punishment: completions longer than max_new_tokens minus "
        "this many tokens lose up to overlong_penalty linearly; None: off.",
    )
    overlong_penalty: Annotated[float, Neutral(1.0)] = Field(
        1.0, ge=0, description="Largest overlong punishment (DAPO: 1)."
    )

    @model_validator(mode="after")
    def _overlong_fits(self) -> GRPOConfig:
        buffer, longest = self.overlong_buffer_tokens, self.generation.max_new_tokens
        if buffer is not None and buffer > longest:
            raise ValueError(f"grpo.overlong_buffer_tokens={buffer} exceeds generation.max_new_tokens={longest}")
        return self

    kl_coef: float = Field(0.0, ge=0, description="KL-to-reference coefficient (0: no KL term, no reference).")
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="Per-token KL estimator (k3 as in DeepSeekMath).")
