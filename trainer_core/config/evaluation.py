"""The sections of the stages that evaluate policies: ``score``, ``evaluate`` and its quality gates."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from trainer_core.config.base import ConfigBase, Neutral
from trainer_core.config.generation import (
    EnvironmentConfig,
    GenerationConfig,
    LmEvalConfig,
    PassAtKConfig,
    SampledGenerationConfig,
    per_problem_metric,
)


class ScoreConfig(ConfigBase):
    """Sample completions from the SFT policy for held-out prompts and score them."""

    policy_from: str | None = Field(None, description="Policy URI; None: the SFT output.")
    reward_model_from: str | None = Field(None, description="Reward model URI; None: the reward_model output.")
    num_prompts: Annotated[int, Neutral(None)] = Field(
        64, ge=1, description="Held-out prompts scored from each set (GSM8K-style problems and preference prompts)."
    )
    generation: SampledGenerationConfig = Field(
        default_factory=SampledGenerationConfig, description="Sampling settings."
    )


class QualityGate(ConfigBase):
    """A condition on one evaluate metric that a run's final policy must meet to become the champion.

    The metric is compared with ``threshold``, with the registered model's current champion's value
    of the same metric (``vs_champion``: at least the champion's value minus ``tolerance`` for
    ``>=``/``>``, at most the champion's value plus ``tolerance`` for ``<=``/``<``), or with both.
    ``min_gain_se`` k asks more of an exact match, a pass@k, an avg@n or a harness metric: a paired gain over the
    baseline larger than k standard errors on the same problems (a gain inside the noise of these
    problems does not pass).
    """

    metric: str = Field(description="An evaluate metric, e.g. dpo/exact_match or dpo_vs_sft/win_rate.")
    op: Literal[">=", ">", "<=", "<"] = Field(">=", description="How the run's value must compare.")
    threshold: float | None = Field(None, description="A fixed bound; None: no fixed bound.")
    vs_champion: bool = Field(
        False, description="Also compare with the champion's value of the metric (passes when there is no champion)."
    )
    tolerance: float = Field(0.0, ge=0, description="Slack allowed against the champion's value.")
    min_gain_se: float | None = Field(
        None,
        ge=0,
        description="On <policy>/exact_match, <policy>/pass_at_<k>, <policy>/avg_at_<n> or a harness "
        "metric <policy>/lm_eval/<task>/<metric>: also require the policy's paired "
        "gain over a baseline on the same held-out problems to exceed this many standard errors (evaluate's "
        "paired_gain). The baseline is the champion's policy with vs_champion (its run's per-problem verdicts), "
        "else, and while there is no champion, this run's SFT policy. None: no such requirement.",
    )

    @model_validator(mode="after")
    def _one_bound(self) -> QualityGate:
        if self.threshold is None and not self.vs_champion and self.min_gain_se is None:
            raise ValueError(f"gate on {self.metric!r}: set threshold, vs_champion, min_gain_se, or several")
        policy, _, metric = self.metric.partition("/")  # paired by problem: the sample table holds their values
        paired = bool(policy) and per_problem_metric(metric)
        if self.min_gain_se is not None and (not paired or self.op not in (">=", ">")):
            raise ValueError(
                f"gate on {self.metric!r} (op {self.op!r}): min_gain_se needs a <policy>/exact_match, "
                "<policy>/pass_at_<k>, <policy>/avg_at_<n> or <policy>/lm_eval/<task>/<metric> metric "
                "that must rise (op >= or >)"
            )
        return self


class EvaluateConfig(ConfigBase):
    """Held-out evaluation of every trained stage."""

    num_problems: int = Field(64, ge=1, description="Held-out problems for generation exact-match.")
    num_winrate_prompts: int = Field(64, ge=1, description="Held-out prompts for the reward-model win rate.")
    eval_max_batches: int = Field(16, ge=1, description="Max micro-batches per loss/accuracy evaluation.")
    micro_batch_size: int = Field(16, ge=1, description="Examples per forward in loss/accuracy evaluation.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Generation settings.")
    environment: Annotated[EnvironmentConfig | None, Neutral(None)] = Field(
        None,
        description="A tool environment every policy's exact-match answers are generated with (as the RL "
        "stage's, e.g. the calculator); None: without tools.",
    )
    pass_at_k: Annotated[PassAtKConfig | None, Neutral(None)] = Field(
        None,
        description="Sample n answers to held-out problems per policy: <policy>/pass_at_<k>, "
        "<policy>/avg_at_<n> and their standard errors (Chen et al. 2021's unbiased estimator); None: off.",
    )
    lm_eval: Annotated[LmEvalConfig | None, Neutral(None)] = Field(
        None,
        description="lm-evaluation-harness tasks for every policy: <policy>/lm_eval/<task>/<metric> and its "
        "results JSON (the 'eval' extra installs the harness); None: off.",
    )
    gates: list[QualityGate] = Field(
        default_factory=list,
        description="Quality gates the final policy must pass to get the registered model's 'champion' alias; "
        "a failed gate ends the flow run Failed, naming it. They do not change evaluate's own result.",
    )
