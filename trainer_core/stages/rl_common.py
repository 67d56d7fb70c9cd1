"""What the PPO and GRPO stages share around the RL loop (:mod:`trainer_core.training.rl.trainer`): the
prompt set, the reward function, and building, resuming and running the trainer.
"""

from __future__ import annotations

import json
import logging
import random

import safetensors.torch
import torch
from torch import Tensor, nn

from trainer_core.config import RLStageConfig
from trainer_core.data.prepared import PreparedRows
from trainer_core.errors import ConfigError
from trainer_core.generation.completions import messages_of, prompt_ids
from trainer_core.modeling.forwards.completion import PolicyAndValue, value_head_for
from trainer_core.modeling.forwards.padding_free import check_packed_rows_apart
from trainer_core.stages.context import StageContext
from trainer_core.training.loop import summarize
from trainer_core.training.rl.algorithms import Algorithm
from trainer_core.training.rl.environments import Environment, load_environment
from trainer_core.training.rl.rewards import (
    PromptItem,
    RewardFunction,
    RewardModelReward,
    build_reward,
    needs_answers,
    needs_reward_model,
)
from trainer_core.training.rl.trainer import RL_CHECKPOINT_LAYOUT, RLTrainer, check_rl_config

log = logging.getLogger(__name__)


def load_prompts(ctx: StageContext, cfg: RLStageConfig, split: PreparedRows | None = None) -> list[PromptItem]:
    """RL prompts: the prepared ``sft/train`` rows (only those with an answer when the reward needs
    one), each with the tools its conversation declared (``tools_json``) rendered in its prompt.

    Args:
        split: the ``sft/train`` split when the caller has it open already (``ctx.load_rows``'s
            result); read from the prepared data when None.

    Raises:
        ConfigError: no usable prompt.
    """
    split = ctx.load_rows("sft/train") if split is None else split
    usable = split.nonnull_indices("answer").tolist() if needs_answers(cfg.reward) else range(len(split))
    if not usable:
        raise ConfigError("no RL prompts: sft/train has no rows (with a final answer, for the verifier reward)")
    if cfg.num_prompts is not None and cfg.num_prompts < len(usable):
        keep = sorted(random.Random(f"rl-prompts:{ctx.config.seed}").sample(range(len(usable)), cfg.num_prompts))
        usable = [usable[i] for i in keep]
    rows = [split[i] for i in usable]  # only the prompts used become Python objects
    data = ctx.config.data
    tools = [json.loads(r["tools_json"]) if r.get("tools_json") else None for r in rows]
    return [
        PromptItem(messages_of(r), prompt_ids(ctx.tokenizer, messages_of(r), data, t), r["answer"], row=int(i))
        for i, r, t in zip(usable, rows, tools, strict=True)
    ]


def _reward_fn(ctx: StageContext, cfg: RLStageConfig) -> RewardFunction:
    def load() -> RewardFunction:
        rm = ctx.models.reward_model()
        rm = ctx.backend.prepare_frozen(rm)
        batch_size = cfg.forward_micro_batch_size or cfg.generation.batch_size
        return RewardModelReward(rm, ctx.tokenizer, ctx.config.data, batch_size, ctx.backend.device)

    return build_reward(cfg.reward, load if needs_reward_model(cfg.reward) else None)


def _environment(stage: str, cfg: RLStageConfig) -> Environment | None:
    """The stage's tool environment (``<stage>.environment``), or None."""
    env_cfg = getattr(cfg, "environment", None)
    if env_cfg is None:
        return None
    return load_environment(env_cfg.name, env_cfg.kwargs, where=f"{stage}.environment.name")


def value_head_bytes(state: dict[str, Tensor]) -> bytes:
    """A value head's weights (its full state dict: ``weight`` [1, H], ``bias`` [1]) as safetensors bytes."""
    return safetensors.torch.save({k: v.detach().cpu().contiguous() for k, v in state.items()})


def _reference(ctx: StageContext, uses_reference: bool) -> tuple[nn.Module | None, bool]:
    """The frozen reference model, prepared by the backend (None when the algorithm uses none, or
    when the reference is the policy with its LoRA adapter disabled), and whether it is the latter."""
    disabled_adapter = uses_reference and ctx.models.reference_is_disabled_adapter
    if disabled_adapter:
        log.info("reference: the policy with its LoRA adapter disabled (no reference model loaded)")
    if not uses_reference or disabled_adapter:
        return None, disabled_adapter
    return ctx.backend.prepare_frozen(ctx.models.causal_lm("reference")), False


def run_rl_stage(
    ctx: StageContext, cfg: RLStageConfig, algo: Algorithm, uses_reference: bool
) -> tuple[RLTrainer, dict[str, float]]:
    """Build the trainer, resume if a checkpoint exists, train; returns it and the final metrics.

    Raises:
        ConfigError: see :func:`check_rl_config`.
    """
    backend = ctx.backend
    check_rl_config(ctx.spec.stage, cfg, algo.samples_per_prompt, backend.world_size)
    seed = ctx.config.seed
    split = ctx.load_rows("sft/train")  # the prompts, the ptx term's demonstrations, distill's dataset completions
    prompts = load_prompts(ctx, cfg, split)
    reward_fn = _reward_fn(ctx, cfg)
    reference, disabled_adapter = _reference(ctx, uses_reference)
    policy = ctx.models.causal_lm("model")
    torch.manual_seed(seed)
    value_head = value_head_for(policy) if algo.uses_values else None
    model = backend.wrap(PolicyAndValue(policy, value_head))
    if cfg.padding_free:
        for name, packed in (("model", model), ("reference", reference)):
            if packed is not None:
                check_packed_rows_apart(packed, f"{ctx.spec.stage}.padding_free (the {name})")
    trainer = RLTrainer(
        backend=backend,
        tokenizer=ctx.tokenizer,
        cfg=cfg,
        algo=algo,
        model=model,
        reference=reference,
        reward_fn=reward_fn,
        prompts=prompts,
        seed=seed,
        session=ctx.checkpoint_session(cfg, extra={"rl_checkpoint": RL_CHECKPOINT_LAYOUT}),
        reference_is_disabled_adapter=disabled_adapter,
        demonstrations=split,
        environment=_environment(ctx.spec.stage, cfg),
    )
    try:
        return trainer, _resume_and_train(ctx, trainer, prompts)
    finally:
        trainer.engine.close()


def _resume_and_train(ctx: StageContext, trainer: RLTrainer, prompts: list[PromptItem]) -> dict[str, float]:
    """Resume ``trainer`` from its last checkpoint if there is one, train; the final metrics."""
    backend = ctx.backend
    resumed = trainer.resume()
    log.info(
        "%s: %d prompts, %s x %d rank(s) on %s, resumed=%s",
        ctx.spec.stage,
        len(prompts),
        backend.name,
        backend.world_size,
        backend.device,
        resumed,
    )
    progress = trainer.run()
    metrics = summarize(progress)
    metrics["resumed"] = float(resumed)
    return metrics
