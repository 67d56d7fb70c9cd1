"""The ``distill`` section: on-policy distillation from a teacher model (``trainer_core/stages/distill.py``);
the ``teacher`` section: SFT of that teacher in the same run (``trainer_core/stages/teacher.py``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from trainer_core.config.base import Neutral
from trainer_core.config.sections import ModelInit
from trainer_core.config.stages import RLStageConfig, SupervisedStageConfig
from trainer_core.registry import INIT_SOURCE


class TeacherConfig(SupervisedStageConfig):
    """SFT of a distillation teacher on the run's SFT data, the SFT stage's loop and settings, with
    a model of its own: built from ``model_init`` (a wider or deeper model than the student's
    ``model.init``, with the run's tokenizer), or loaded from ``init_from`` (a pretrained model
    that shares the student's tokenizer). ``distill`` reads it as its teacher when
    ``distill.teacher_from`` is unset.
    """

    model_init: ModelInit | None = Field(
        None,
        description="The teacher's architecture and sizes when it is built from config (the fields of "
        "model.init); None: model.init, the student's. Only for a teacher built from config (not with init_from or "
        "model.name_or_path).",
    )


class DistillConfig(RLStageConfig):
    """On-policy distillation: the student (the SFT output by default) samples completions of the
    RL prompts, the teacher scores the same tokens, and the student follows the per-token reverse
    KL to the teacher (``loss: token_reverse_kl``: Thinking Machines' on-policy distillation;
    prime-rl's ``opd``) or minimises the generalised JSD over the whole vocabulary at each of
    those tokens (``loss: generalized_jsd``, GKD). The rollout, update, checkpoint and resume
    machinery is the RL stages'; ``reward`` is only logged (the verifier's accuracy of the
    student's samples by default), never optimised.
    """

    teacher_from: str | None = Field(
        None,
        description="The teacher: an HF causal-LM directory or fsspec URI (e.g. another run's "
        "stages/sft/final) that shares the student's tokenizer; required when the stage runs.",
    )
    samples_per_prompt: int = Field(1, ge=1, description="Completions sampled per prompt.")
    loss: Annotated[Literal["token_reverse_kl", "generalized_jsd"], Neutral("token_reverse_kl")] = Field(
        "token_reverse_kl",
        description="token_reverse_kl: a policy gradient whose per-token advantage is the "
        "teacher's log-prob of the sampled token minus the student's (a one-sample reverse KL; no [B, T, V] "
        "tensor, no teacher forward in the update); generalized_jsd: the generalised Jensen-Shannon divergence "
        "between the two next-token distributions over the whole vocabulary at every sampled position (Agarwal "
        "et al. 2024, GKD, eq. 1; TRL's generalized_jsd_loss), from both models' hidden states and heads in "
        "chunks, the teacher forwarded again in each update step.",
    )
    beta: Annotated[float | None, Neutral(None)] = Field(
        None,
        ge=0,
        le=1,
        description="generalized_jsd's mixing coefficient (TRL's convention: 0 the forward KL "
        "KL(teacher || student), 1 the reverse KL KL(student || teacher)); None: 0.5, GKD's default. Only "
        "with loss generalized_jsd.",
    )
    lmbda: Annotated[float, Neutral(1.0)] = Field(
        1.0,
        ge=0,
        le=1,
        description="GKD's lambda (TRL's GKDConfig.lmbda): the probability that an iteration "
        "trains on the student's own samples; otherwise it trains on the dataset's completions (the prepared "
        "sft/train rows of the same prompts: supervised KD with the teacher's distribution as the target). 1: "
        "on-policy only. Drawn per iteration from (seed, global_step) alone, the same on every rank and after "
        "a resume. Below 1 only with loss generalized_jsd (token_reverse_kl is a policy gradient on the "
        "student's own samples).",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        le=0,
        description="Must stay 0: the teacher takes the reference's place, and "
        "the distillation signal is the KL to it.",
    )

    @property
    def samples_per_prompt_of_rollout(self) -> int:
        """Completions sampled per prompt: ``samples_per_prompt``."""
        return self.samples_per_prompt

    @model_validator(mode="after")
    def _teacher_is_the_reference(self) -> DistillConfig:
        if self.reference_from is not None:
            raise ValueError(
                "distill.reference_from: the teacher (distill.teacher_from) is the reference of the "
                "distillation; leave reference_from unset"
            )
        if self.beta is not None and self.loss != "generalized_jsd":
            raise ValueError(f"distill.beta: the mixing coefficient of loss generalized_jsd; the loss is {self.loss}")
        if self.lmbda < 1 and self.loss != "generalized_jsd":
            raise ValueError(
                f"distill.lmbda={self.lmbda}: dataset completions need loss generalized_jsd; the loss "
                f"{self.loss} is a policy gradient on the student's own samples (lmbda 1)"
            )
        if self.lmbda < 1 and self.importance_sampling_cap is not None:
            raise ValueError(
                f"distill.lmbda={self.lmbda}: importance_sampling_cap corrects sampled tokens; the "
                "dataset's completions were not sampled by the engine"
            )
        if self.adaptive_kl:
            raise ValueError("distill.adaptive_kl: no KL penalty in distillation (the KL to the teacher is the loss)")
        return self


def teacher_init_problem(cfg: TeacherConfig, start: str) -> str | None:
    """Why ``teacher.model_init`` cannot apply to a teacher that starts from ``start`` (its input
    model), or None: only a teacher built from config (:data:`~trainer_core.registry.INIT_SOURCE`)
    takes it; a loaded one would ignore it."""
    if cfg.model_init is not None and start != INIT_SOURCE:
        return (
            f"teacher.model_init: the teacher starts from {start}, a model that is loaded, not built from config; "
            "unset teacher.model_init or teacher.init_from / model.name_or_path"
        )
    return None
