"""Reward-model stage: Bradley-Terry loss on preference pairs, from the SFT model.

``reward_model.parameterization`` picks the reward: a new scalar head on the SFT backbone
(committed as an HF sequence classifier), or the implicit reward ``beta / |y| * log pi(y | x)`` of
the SFT causal LM itself (committed as a causal LM marked as a reward model; see
:func:`~trainer_core.modeling.forwards.rewards.sequence_rewards`). The objective is
:class:`~trainer_core.training.supervised.RewardObjective` for both.
"""

from __future__ import annotations

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config.stages import implicit_reward_problem
from trainer_core.errors import ConfigError
from trainer_core.modeling.forwards.rewards import mark_implicit_reward
from trainer_core.stages.commit import commit_final
from trainer_core.stages.context import StageContext, train_stage
from trainer_core.training.supervised import RewardObjective, pair_source


def run(ctx: StageContext) -> Manifest:
    """Train the reward model and commit it as an HF sequence-classification directory (scalar
    head) or causal-LM directory (implicit).

    Raises:
        ConfigError: ``parameterization: implicit`` with LoRA (not built: the adapter's
            directory would not carry the reward's marker).
    """
    cfg, seed = ctx.config.reward_model, ctx.config.seed
    pad_id, device = ctx.tokenizer.pad_token_id, ctx.backend.device
    train = pair_source(
        ctx.load_rows("preference/train"),
        pad_id,
        cfg.micro_batch_size,
        seed,
        device,
        max_tokens=cfg.max_tokens_per_micro_batch,
    )
    held_out = pair_source(ctx.load_rows("preference/eval"), pad_id, cfg.micro_batch_size, seed, device, shuffle=False)
    if cfg.parameterization == "implicit":
        problem = implicit_reward_problem(cfg, ctx.models.lora.enabled)  # refused at load too
        if problem:
            raise ConfigError(problem)
        model = ctx.models.causal_lm("model")
        mark_implicit_reward(model, cfg.implicit_beta)
    else:
        model = ctx.models.reward_model("model")
    model = ctx.backend.wrap(model)
    metrics = train_stage(ctx, model, RewardObjective(held_out, cfg.eval_max_batches), train, cfg)
    return commit_final(ctx, metrics, model=model)
