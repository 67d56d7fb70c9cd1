"""Distill stage: on-policy distillation of a teacher into the student with the per-token reverse KL.

Each iteration the student (the SFT output by default) samples completions of the RL prompts
with the generation engine; the teacher (``distill.teacher_from``, loaded as the RL loop's
frozen reference) scores the same tokens; each completion token's advantage is the teacher's
log-probability of it minus the student's (at sampling time), the negative of a one-sample
estimate of the reverse KL ``KL(student || teacher)`` at that position, with no discounting over
later tokens; the student follows it with the clipped policy-gradient loss, token mean. Minimising
the reverse KL on the student's own samples is mode-seeking and needs no reward (Agarwal et al.
2024, GKD, with beta 1 on on-policy data; Thinking Machines, "On-Policy Distillation", 2025;
prime-rl's ``opd`` loss). Rollouts, mini-batch updates, the ptx term, tools, checkpoints and exact
resume are the RL loop's (:mod:`trainer_core.training.rl.trainer`); ``distill.reward`` is logged,
never optimised.

With ``distill.loss: generalized_jsd`` the student instead minimises, at each sampled position,
the generalised Jensen-Shannon divergence between its next-token distribution and the teacher's
over the whole vocabulary (GKD, Agarwal et al. 2024, eq. 1, with ``beta``; TRL's
``GKDTrainer``): in each update step the teacher forwards the mini-batch again (no gradient) for
its final hidden states, and the divergence is computed from both models' hidden states and
heads a chunk of tokens at a time inside the student's forward
(:func:`~trainer_core.modeling.forwards.kernels.chunked_generalized_jsd`: no [N, T, V] tensor of either
model), token mean over the student's tokens (tool observations excluded).

With ``distill.lmbda`` below 1 (GKD's lambda, generalized_jsd only) an iteration trains, with
probability ``1 - lmbda`` drawn from the seed and ``global_step``, on the dataset's completions of
its prompts instead of the student's samples
(:mod:`trainer_core.training.rl.dataset_completions`).

The teacher must share the student's tokenizer (checked before anything is trained, naming both
models); its architecture and width may differ.

The two losses are :data:`~trainer_core.training.rl.algorithms.distill.DISTILL_ALGORITHMS`' entries.
"""

from __future__ import annotations

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.errors import ConfigError
from trainer_core.stages.commit import commit_final
from trainer_core.stages.context import StageContext
from trainer_core.stages.rl_common import run_rl_stage
from trainer_core.training.rl.algorithms import DISTILL_ALGORITHMS


def check_teacher_tokenizer(ctx: StageContext) -> None:
    """Refuse a teacher whose tokenizer is not the student's (the same words for the same ids).

    Raises:
        ConfigError: the teacher has no tokenizer, or another one (naming both models).
    """
    from transformers import AutoTokenizer

    from trainer_core.storage import materialize, names_a_path

    teacher, student = ctx.input("reference"), ctx.input("model")
    try:
        local = materialize(teacher) if names_a_path(teacher) else teacher
        theirs = AutoTokenizer.from_pretrained(local)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"distill.teacher_from: no tokenizer could be loaded from the teacher {teacher}: {e}"
        ) from None
    ours = ctx.tokenizer
    their_vocab, our_vocab = theirs.get_vocab(), ours.get_vocab()
    if their_vocab != our_vocab or theirs.all_special_tokens != ours.all_special_tokens:
        differ = sorted(set(their_vocab.items()) ^ set(our_vocab.items()))[:3]
        raise ConfigError(
            f"distill.teacher_from: the teacher {teacher} and the student {student} have different "
            f"tokenizers ({len(their_vocab)} and {len(our_vocab)} words; e.g. {differ}); distillation "
            "compares their log-probs of the same token ids, so they must share one"
        )


def run(ctx: StageContext) -> Manifest:
    """Distil the teacher into the student and commit the student as an HF model directory
    (collective when distributed).

    Raises:
        ConfigError: the teacher's tokenizer is not the student's (before anything is trained).
    """
    cfg = ctx.config.distill
    check_teacher_tokenizer(ctx)
    trainer, metrics = run_rl_stage(ctx, cfg, DISTILL_ALGORITHMS[cfg.loss](cfg), uses_reference=True)
    return commit_final(ctx, metrics, model=trainer.policy)
