"""The distill stage's config, inputs and advantages, without a process (``trainer_core/stages/distill.py``)."""

from __future__ import annotations

import pytest
import torch

from trainer_core.config import load_config
from trainer_core.errors import ConfigError
from trainer_core.registry import STAGE_ORDER, policy_stages, stage_inputs
from trainer_core.training.rl.algorithms import DISTILL_ALGORITHMS
from trainer_core.training.rl.rollout import RolloutBatch


def test_the_advantage_is_the_teachers_log_prob_minus_the_students_on_the_students_tokens():
    cfg = load_config(overrides={"distill.teacher_from": "/models/teacher"}).distill
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    batch = RolloutBatch(
        prompt_ids=torch.zeros(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1),
        completion_ids=torch.zeros(2, 3, dtype=torch.long),
        completion_mask=mask,
        logprobs=torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]]),
        scores=torch.zeros(2),
        prompt_index=torch.arange(2),
        ref_logprobs=torch.tensor([[-1.5, -1.0, -9.0], [-0.5, -3.0, 0.0]]),
    )
    DISTILL_ALGORITHMS[cfg.loss](cfg).prepare(batch, 0.0, lambda t: t)
    torch.testing.assert_close(batch.advantages, torch.tensor([[-0.5, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_the_stage_needs_a_teacher_and_no_other_reference():
    assert STAGE_ORDER.index("distill") < STAGE_ORDER.index("evaluate") and "distill" in policy_stages()
    config = load_config(overrides={"stages": "prepare_data,sft,distill,evaluate"})
    with pytest.raises(ConfigError, match="distill.teacher_from: the distill stage needs a teacher"):
        stage_inputs(config, "distill", {"prepare_data": "/d", "sft": "/s"})
    config = load_config(overrides={"stages": "prepare_data,sft,distill,evaluate", "distill.teacher_from": "/t"})
    assert stage_inputs(config, "distill", {"prepare_data": "/d", "sft": "/s"}) == {
        "data": "/d",
        "model": "/s",
        "reference": "/t",
    }
    for bad, field in (
        ({"distill.reference_from": "/r"}, "reference_from"),
        ({"distill.kl_coef": 0.1}, "kl_coef"),
        ({"distill.adaptive_kl": True}, "adaptive_kl"),
        ({"distill.beta": 0.5}, "distill.beta"),
        ({"distill.loss": "generalized_jsd", "distill.beta": 1.5}, "beta"),
        ({"distill.lmbda": 0.5}, "dataset completions need loss generalized_jsd"),
        (
            {"distill.loss": "generalized_jsd", "distill.lmbda": 0.5, "distill.importance_sampling_cap": 2.0},
            "importance_sampling_cap",
        ),
    ):
        with pytest.raises(ConfigError, match=field):
            load_config(overrides=bad)


def test_the_teacher_stage_trains_its_own_model_and_distill_reads_it():
    """``teacher`` (opt-in, after SFT) starts from the base model; built from config it takes
    ``teacher.model_init``; distill reads its output when ``distill.teacher_from`` is unset (the
    explicit one wins); a model_init for a loaded teacher is refused naming the field."""
    from trainer_core.registry import INIT_SOURCE
    from trainer_core.spec import build_spec
    from trainer_core.stages.context import StageContext
    from trainer_core.stages.teacher import teacher_context

    assert STAGE_ORDER.index("sft") < STAGE_ORDER.index("teacher") < STAGE_ORDER.index("distill")
    wide = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
    config = load_config(overrides={"stages": "prepare_data,sft,teacher,distill,evaluate", "teacher.model_init": wide})
    outputs = {"prepare_data": "/d", "sft": "/s", "teacher": "/t"}
    assert stage_inputs(config, "teacher", outputs) == {"data": "/d", "model": INIT_SOURCE}
    assert stage_inputs(config, "distill", outputs)["reference"] == "/t"
    explicit = load_config(base=config.model_dump(mode="json"), overrides={"distill.teacher_from": "/x"})
    assert stage_inputs(explicit, "distill", outputs)["reference"] == "/x"
    assert stage_inputs(config, "evaluate", outputs)["teacher_model"] == "/t"

    def context(cfg, model):
        spec = build_spec(cfg, "teacher", "run", {"data": "/d", "model": model}, output_uri="/out/teacher")
        return StageContext(spec=spec, backend=None, tokenizer=None, metrics=None)

    wide_ctx = teacher_context(context(config, INIT_SOURCE))
    assert wide_ctx.config.model.init.hidden_size == 128 and wide_ctx.config.teacher == config.teacher
    assert wide_ctx.config.sft == config.sft and wide_ctx.input("model") == INIT_SOURCE
    with pytest.raises(ConfigError, match="teacher.model_init"):
        teacher_context(context(config, "Qwen/Qwen2.5-7B"))
    for loaded in ({"teacher.init_from": "/pretrained"}, {"model.init": None, "model.name_or_path": "/base"}):
        with pytest.raises(
            ConfigError, match="teacher.model_init: the teacher starts from /.*, a model that is loaded"
        ):
            load_config(base=config.model_dump(mode="json"), overrides=loaded)  # at load, for the run's teacher
    load_config(
        overrides={
            "stages": "prepare_data,sft,evaluate",
            "teacher.model_init": wide,
            "teacher.init_from": "/pretrained",
        }
    )  # not trained: not judged
    plain = load_config(overrides={"stages": "prepare_data,sft,teacher,evaluate"})
    assert teacher_context(context(plain, INIT_SOURCE)).config.model.init == plain.model.init
