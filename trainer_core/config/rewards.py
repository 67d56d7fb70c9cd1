"""How an online RL stage scores its completions (``<stage>.reward``): a learned reward model, a
verifier, a user function, or a weighted sum of them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from trainer_core.config.base import ConfigBase, Neutral


RewardKind = Literal["reward_model", "verifier", "math_verify", "function"]


class RewardConfig(ConfigBase):
    """How an online RL stage scores a completion: learned, verifiable, a user function, or a weighted sum."""

    kind: Literal["reward_model", "verifier", "math_verify", "function", "weighted"] = Field(
        "verifier",
        description="'reward_model': the trained RM's score; 'verifier': exact match of the final "
        "number (1/0) plus format bonus; 'math_verify': 1/0 by math-verify's equivalence of the final answer; "
        "'function': the user function at 'function'; 'weighted': the weighted sum of 'weights' (by default "
        "reward_model_weight * RM + verifier_weight * verifier).",
    )
    reward_model_from: str | None = Field(None, description="Reward model URI; None: the reward_model output.")
    reward_model_weight: float = Field(1.0, description="Weight of the RM score in 'weighted' (without 'weights').")
    verifier_weight: float = Field(1.0, description="Weight of the verifier score in 'weighted' (without 'weights').")
    function: Annotated[str | None, Neutral(None)] = Field(
        None,
        description="'function' (or a 'weighted' part): import path 'package.module:function' of a reward "
        "function (see trainer_core.training.rl.rewards.FunctionReward for its signature).",
    )
    weights: Annotated[dict[RewardKind, float] | None, Neutral(None)] = Field(
        None,
        description="'weighted': kind -> weight, e.g. {verifier: 1.0, function: 0.5}; None: "
        "reward_model_weight and verifier_weight.",
    )

    @model_validator(mode="after")
    def _function_named(self) -> RewardConfig:
        uses_function = self.kind == "function" or (self.kind == "weighted" and "function" in (self.weights or {}))
        if uses_function and not self.function:
            raise ValueError("reward.function must name 'package.module:function' when the reward uses a function")
        if self.function is not None and ":" not in self.function:
            raise ValueError(f"reward.function={self.function!r} must be 'package.module:function'")
        if self.weights is not None and self.kind != "weighted":
            raise ValueError(f"reward.weights is for kind 'weighted', not {self.kind!r}")
        if self.kind == "weighted" and self.weights is not None and not self.weights:
            raise ValueError("reward.weights must name at least one reward kind")
        return self

    format_bonus: float = Field(
        0.1,
        ge=0,
        description="'verifier' and 'math_verify': added when the completion has a '#### <number>' final line.",
    )

    def kind_weights(self) -> dict[str, float]:
        """The reward kinds summed, with their weights: ``{kind: 1.0}`` for a single kind; for
        'weighted', ``weights``, or by default ``reward_model_weight`` x RM + ``verifier_weight`` x
        verifier. What the plan checks a stage's inputs against (``tasks/plan.py``); the same table as
        ``trainer_core.training.rl.rewards.reward_weights``, which builds the reward."""
        if self.kind != "weighted":
            return {self.kind: 1.0}
        if self.weights is not None:
            return dict(self.weights)
        return {"reward_model": self.reward_model_weight, "verifier": self.verifier_weight}

    @property
    def reads_reward_model(self) -> bool:
        """Whether the reward reads a trained reward model ('reward_model', or a weighted sum with it)."""
        return "reward_model" in self.kind_weights()
