"""Teacher stage: SFT of a distillation teacher, a model of its own trained as the SFT stage trains.

On-policy distillation (``trainer_core/stages/distill.py``) needs a teacher that shares the
student's tokenizer. This stage trains one in the same run: the SFT loop, objective and settings
(the ``teacher`` section, a :class:`~trainer_core.config.SupervisedStageConfig`) on the run's SFT
data, starting from ``teacher.init_from`` (a pretrained model sharing the tokenizer) or from the
base model, which, built from config, takes ``teacher.model_init`` (for example twice the
student's width) instead of ``model.init``. Its final directory is an HF model that ``distill``
reads as its teacher and ``evaluate`` scores beside the other policies (``teacher/exact_match``).
"""

from __future__ import annotations

from dataclasses import replace

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.errors import ConfigError
from trainer_core.config.distill import teacher_init_problem
from trainer_core.stages.context import StageContext
from trainer_core.stages.sft import train_causal_lm


def teacher_context(ctx: StageContext) -> StageContext:
    """``ctx`` with ``model.init`` replaced by ``teacher.model_init`` when the teacher is built
    from config and that is set; ``ctx`` itself otherwise.

    Raises:
        ConfigError: ``teacher.model_init`` with a teacher that is loaded, not built (it would
            be ignored).
    """
    cfg, config = ctx.config.teacher, ctx.config
    if cfg.model_init is None:
        return ctx
    problem = teacher_init_problem(cfg, ctx.input("model"))  # refused at load too, for the input the config names
    if problem:
        raise ConfigError(problem)
    model = config.model.model_copy(update={"init": cfg.model_init})
    return replace(ctx, spec=ctx.spec.model_copy(update={"config": config.model_copy(update={"model": model})}))


def run(ctx: StageContext) -> Manifest:
    """Train the teacher on the SFT data and commit it as an HF model directory.

    Raises:
        ConfigError: see :func:`teacher_context`.
    """
    return train_causal_lm(teacher_context(ctx), ctx.config.teacher, "sft")
