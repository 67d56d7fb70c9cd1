"""The ``distill`` section: on-policy distillation from a teacher model (``trainer_core/stages/distill.py``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from trainer_core.config.stages import RLStageConfig


class DistillConfig(RLStageConfig):
    """On-policy distillation: the student (the SFT output by default) samples completions of the
    RL prompts, the teacher scores the same tokens, and the student follows the per-token reverse
    KL to the teacher (Thinking Machines' on-policy distillation; prime-rl's ``opd``). The rollout,
    update, checkpoint and resume machinery is the RL stages'; ``reward`` is only logged (the
    verifier's accuracy of the student's samples by default), never optimised.
    """

    teacher_from: str | None = Field(
        None, description="The teacher: an HF causal-LM directory or fsspec URI (e.g. another run's "
        "stages/sft/final) that shares the student's tokenizer; required when the stage runs."
    )
    samples_per_prompt: int = Field(1, ge=1, description="Completions sampled per prompt.")
    kl_coef: float = Field(0.0, ge=0, le=0, description="Must stay 0: the teacher takes the reference's place, and "
                           "the distillation signal is the KL to it.")

    @model_validator(mode="after")
    def _teacher_is_the_reference(self) -> DistillConfig:
        if self.reference_from is not None:
            raise ValueError("distill.reference_from: the teacher (distill.teacher_from) is the reference of the "
                             "distillation; leave reference_from unset")
        if self.adaptive_kl:
            raise ValueError("distill.adaptive_kl: no KL penalty in distillation (the KL to the teacher is the loss)")
        return self
