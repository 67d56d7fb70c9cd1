"""Online RL stages as real trainer processes: PPO with the learned reward model and GRPO with the
verifier (and the ptx term) run end to end and log TRL's metrics; SIGKILL mid-run then resume gives the same later
metrics and the same final weights (policy and value head) as an uninterrupted run; GRPO raises
the verifier reward and PPO the reward model's score on the synthetic task.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import safetensors.torch

from trainer_core import storage
from trainer_core.checkpoint.manifest import read_manifest
from trainer_core.config import load_config
from trainer_core.spec import build_spec
from trainer_core.storage import StageLayout, join_uri

from .helpers import (
    DEMO_CONFIG,
    RUN_ID,
    SAVE_EVERY,
    StageRun,
    TinyPipeline,
    after_checkpoint_line,
    assert_same_weights,
    final_weights,
    run_stage,
    wider_teacher,
    write_spec,
)
from .rl_runs import RL_OVERRIDES, RL_STEPS, rl_config, rl_spec_path


def _load_rl_learning():
    """``bench/rl_learning.py`` (its :func:`window_gain`: the demo's learning criterion)."""
    path = Path(__file__).resolve().parents[2] / "bench" / "rl_learning.py"
    spec = importlib.util.spec_from_file_location("rl_learning", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


window_gain = _load_rl_learning().window_gain

PPO_METRICS = (
    "objective/kl",
    "objective/entropy",
    "objective/scores",
    "objective/rlhf_reward",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/ratio",
    "reward_mean",
    "reward_std",
    "response_length_tokens",
    "verifier_accuracy",
)
TIMED = (
    "time/generation_s",
    "time/reward_s",
    "time/logprobs_s",
    "time/reference_s",
    "time/update_s",
    "rollout/tokens_per_s",
)


TOOL = {"name": "tests.integration.tool_envs:Counter", "kwargs": {"every": 12}}
"""A user's deterministic tool, by import path: the RL stages' multi-turn rollouts."""


def _config(pipeline: TinyPipeline, run: str):
    """The config of ``run``: ``ppo``, ``grpo``, or either with ``-tools`` (with :data:`TOOL`)."""
    stage = run.split("-")[0]
    return rl_config(pipeline, stage, **({f"{stage}.environment": TOOL} if run.endswith("-tools") else {}))


@pytest.fixture(scope="module")
def rl_baselines(tiny_pipeline: TinyPipeline) -> dict[str, tuple[str, StageRun]]:
    """One uninterrupted PPO, GRPO, and each with a tool: run name -> (output URI, run)."""
    out = {}
    for name in ("ppo", "grpo", "grpo-tools", "ppo-tools"):
        path, output = rl_spec_path(
            tiny_pipeline, name.split("-")[0], f"{name}-baseline", config=_config(tiny_pipeline, name)
        )
        run = run_stage(path)
        assert run.returncode == 0, run.tail()
        out[name] = (output, run)
    return out


def test_ppo_runs_end_to_end_and_logs_trl_metrics(rl_baselines):
    output, run = rl_baselines["ppo"]
    steps = run.step_metrics()
    assert sorted(steps) == list(range(1, RL_STEPS + 1))
    for step, metrics in steps.items():
        missing = [k for k in PPO_METRICS if k not in metrics]
        assert not missing, f"step {step} lacks {missing}"
    manifest = read_manifest(StageLayout(output).final)
    assert {"first/reward_mean", "reward_mean", "global_step"} <= set(manifest.metrics)
    assert manifest.metrics["global_step"] == RL_STEPS
    assert all(k in manifest.metrics for k in TIMED)
    head = safetensors.torch.load(storage.read_bytes(join_uri(StageLayout(output).final, "value_head.safetensors")))
    assert head["weight"].shape[0] == 1 and head["weight"].abs().sum() > 0  # trained away from its zero init
    kl_coefs = {float(m["objective/kl_coef"]) for m in steps.values()}
    assert len(kl_coefs) > 1  # the adaptive controller moved


def test_grpo_runs_and_logs_group_metrics(rl_baselines):
    output, run = rl_baselines["grpo"]
    steps = run.step_metrics()
    assert sorted(steps) == list(range(1, RL_STEPS + 1))
    for metrics in steps.values():
        assert {"objective/kl", "policy/clipfrac_avg", "loss/policy_avg", "val/ratio", "reward_mean"} <= set(metrics)
        assert 0 < float(metrics["train/ptx_loss"]) < 20  # a mean NLL over the demonstrations' completion tokens
    assert "value_head.safetensors" not in storage.list_files(StageLayout(output).final)


@pytest.mark.parametrize("name", ["grpo-tools", "ppo-tools"])
def test_rl_with_a_users_tool_calls_it_and_logs_the_episodes(rl_baselines, name):
    """The tool (by import path) is called in most episodes of every iteration; its tokens are
    observations, its reward (0.25 a call) is in the scores: GRPO's verifier reward (>= 0) plus
    it, PPO's reward model and verifier (each logged) plus it."""
    _, run = rl_baselines[name]
    for m in ({k: float(v) for k, v in metrics.items()} for metrics in run.step_metrics().values()):
        calls = m["env/tool_calls"]
        assert calls > 0.5 and m["env/observation_tokens"] >= 2 * calls and m["env/tool_errors"] == 0
        if name == "grpo-tools":
            assert m["reward_mean"] >= 0.25 * calls
        else:
            assert m["reward_mean"] == pytest.approx(
                m["reward/reward_model"] + m["reward/verifier"] + 0.25 * calls, abs=1e-4
            )


@pytest.mark.parametrize("name", ["ppo", "grpo", "grpo-tools"])
def test_sigkill_mid_run_then_resume_matches_uninterrupted(tiny_pipeline, rl_baselines, name):
    """Killed at the line that says its step-4 checkpoint is committed (the stage stops itself
    there, so it cannot run on to its end before the kill, as it could on a fast machine); the
    relaunch resumes from step 4 and prints the same metrics for steps 5-8 and writes the same
    final weights as the baseline (with a deterministic tool too: multi-turn rollouts resume
    bit-identically)."""
    stage = name.split("-")[0]
    path, output = rl_spec_path(tiny_pipeline, stage, f"{name}-killed", config=_config(tiny_pipeline, name))
    killed = run_stage(path, kill_when=after_checkpoint_line(SAVE_EVERY))
    assert killed.killed
    resumed = run_stage(path)
    assert resumed.returncode == 0, resumed.tail()
    assert any("resumed from" in line and "step-00000004" in line for line in resumed.lines), resumed.tail()
    base_output, base_run = rl_baselines[name]
    want = {s: m for s, m in base_run.step_metrics().items() if s > SAVE_EVERY}
    assert resumed.step_metrics() == want
    assert_same_weights(final_weights(output), final_weights(base_output))
    if stage == "ppo":
        heads = [
            storage.read_bytes(join_uri(StageLayout(o).final, "value_head.safetensors")) for o in (output, base_output)
        ]
        assert heads[0] == heads[1]


GRPO_TREND_UPDATES = 30
PPO_TREND_UPDATES = 20
_TREND_OVERRIDES = {
    # small model trained for only 100 SFT steps: it writes the '#### n' line about a quarter of
    # the time and is rarely right, so both parts of the verifier reward have room to grow.
    "data.synthetic.num_problems": 600,
    "data.synthetic.num_pairs": 10,
    # Pinned (the demo takes 10): the task these trends were measured on.
    "data.synthetic.max_operand": 20,
    # Pinned off (the demo's GRPO takes 1.0): with it, after this 100-step SFT, the reward of
    # updates 1-10 vs 21-30 went 0.060 -> 0.066 (measured 2026-11-26): the supervised term holds
    # the policy near SFT's demonstrations. These trends measure the RL alone.
    "grpo.ptx_coef": 0.0,
    # Likewise PPO's anchor (the demo's ptx_coef 2.0 and kl_coef 0.05, 2026-11-28, which hold its
    # exact match to SFT's against a weak reward model): with it this trend was 0.547 -> 0.884
    # (2 SE 0.364). The recipe the trend was measured with: no ptx term, kl_coef 0.01.
    "ppo.ptx_coef": 0.0,
    "ppo.kl_coef": 0.01,
    "data.eval_fraction": 0.1,
    "data.max_eval_rows": 16,
    "model.init.hidden_size": 64,
    "model.init.intermediate_size": 172,
    "model.init.num_hidden_layers": 2,
    "sft.max_steps": 100,
    "sft.micro_batch_size": 16,
    "sft.learning_rate": 3.0e-3,
    "sft.warmup_steps": 10,
    "sft.save_every": 1000,
    "sft.eval_every": 1000,
    "grpo.max_steps": GRPO_TREND_UPDATES,
    "grpo.save_every": 1000,
    "grpo.prompts_per_rollout": 8,
    "grpo.group_size": 4,
    "grpo.learning_rate": 1.0e-3,
    "grpo.generation.max_new_tokens": 64,
    "grpo.generation.temperature": 1.0,
    # Pinned: the demo's own GRPO recipe (a 512-prompt pool, 4 mini-batches after a warmup, the
    # ptx term) is measured by the demo.
    "grpo.kl_coef": 0.0,
    "grpo.num_prompts": None,
    "grpo.num_mini_batches": 1,
    "grpo.warmup_steps": 0,
    # A reward model trained briefly (a fixed scorer of the text is all PPO needs here), then the
    # demo's PPO recipe on a fixed pool of 16 prompts: 4 epochs, value loss 0.5, a light KL.
    # Pinned: the scalar head this trend was measured with (the demo's implicit reward, the SFT
    # model's own likelihood, is highest on SFT's answers: PPO without the ptx term lowers it;
    # ``bench/README.md``, "The demo's RL, 2026-11-26 to 2026-11-29").
    "reward_model.parameterization": "scalar_head",
    # Pinned: the reward model's score alone (the demo's PPO adds the verifier's since 2026-11-29).
    "ppo.reward.kind": "reward_model",
    "reward_model.learning_rate": 5.0e-4,
    "reward_model.max_steps": 30,
    "reward_model.micro_batch_size": 16,
    "reward_model.save_every": 1000,
    "reward_model.eval_every": 1000,
    "ppo.max_steps": PPO_TREND_UPDATES,
    "ppo.save_every": 1000,
    "ppo.num_prompts": 16,
    "ppo.prompts_per_rollout": 16,
    "ppo.ppo_epochs": 4,
    "ppo.num_mini_batches": 2,
    "ppo.learning_rate": 3.0e-4,
    "ppo.vf_coef": 0.5,
    "ppo.adaptive_kl": False,
    # Pinned (the demo's PPO takes 1.0 since 2026-11-27): the cosine decay to a tenth that this
    # trend was measured with.
    "ppo.min_lr_ratio": 0.1,
    "ppo.generation.max_new_tokens": 64,
    "ppo.generation.temperature": 0.7,
}


@pytest.fixture(scope="module")
def trend_runs(tmp_path_factory) -> dict[str, StageRun]:
    """prepare_data -> SFT -> reward model -> GRPO (verifier reward) and PPO (the reward model's
    score) under one root: each stage's trainer run."""
    root = str(tmp_path_factory.mktemp("rl-trend"))
    config = load_config(str(DEMO_CONFIG), overrides={**_TREND_OVERRIDES, "storage.root": root})
    layout = lambda stage: StageLayout(os.path.join(root, stage)).final
    data, sft = layout("data"), layout("sft")
    inputs = {
        "prepare_data": {},
        "sft": {"data": data, "model": "init"},
        "reward_model": {"data": data, "model": sft},
        "grpo": {"data": data, "model": sft},
        "ppo": {"data": data, "model": sft, "reference": sft, "reward_model": layout("reward_model")},
    }
    runs = {}
    for stage, stage_inputs in inputs.items():
        output = os.path.join(root, "data" if stage == "prepare_data" else stage)
        spec = build_spec(config, stage, RUN_ID, stage_inputs, output_uri=output)
        runs[stage] = run_stage(write_spec(spec, os.path.join(root, "specs", f"{stage}.json")), timeout_s=600)
        assert runs[stage].returncode == 0, runs[stage].tail()
    return runs


def _per_update(run: StageRun, updates: int, key: str) -> list[float]:
    steps = run.step_metrics()
    assert sorted(steps) == list(range(1, updates + 1))
    return [float(steps[s][key]) for s in sorted(steps)]


def test_grpo_raises_verifier_reward_on_synthetic_task(trend_runs):
    """Mean verifier reward of updates 21-30 beats updates 1-10 by at least 0.04 (fixed seed, one
    thread: deterministic on a machine). Measured when written: 0.034 -> 0.098 (the '#### n' format
    rate goes from about a quarter to most completions; accuracy moves little in 30 updates)."""
    rewards = _per_update(trend_runs["grpo"], GRPO_TREND_UPDATES, "reward_mean")
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"GRPO verifier reward, updates 1-10 {first:.4f}, 21-30 {last:.4f}")
    assert last > first + 0.04, f"mean reward updates 1-10 {first:.4f}, 21-30 {last:.4f}: {rewards}"


def test_ppo_raises_reward_model_score_on_synthetic_task(trend_runs):
    """The reward model's mean score (``objective/scores``) of the last 5 of 20 updates beats the
    first 5 by more than twice the difference's standard error (as the demo's acceptance).
    Measured when written: 0.779 -> 1.405, twice the standard error 0.383."""
    scores = _per_update(trend_runs["ppo"], PPO_TREND_UPDATES, "objective/scores")
    gain = window_gain(scores, 5)
    print(
        f"PPO reward-model score, updates 1-5 {gain['first']:.4f}, 16-20 {gain['last']:.4f}, 2 SE {2 * gain['se']:.4f}"
    )
    assert gain["learns"], f"PPO reward-model score: {gain} over updates {scores}"


# --------------------------------------------------------------------------- distillation


@pytest.fixture(scope="module")
def distill_teacher(tiny_pipeline: TinyPipeline, tmp_path_factory) -> str:
    """A teacher twice as wide as the student (64 against 32 hidden), with the student's tokenizer
    (random weights: the stage only needs a distribution to follow)."""
    return wider_teacher(tiny_pipeline, str(tmp_path_factory.mktemp("teacher")))


def distill_spec_path(pipeline: TinyPipeline, name: str, teacher: str, **extra: object) -> tuple[str, str]:
    """Write the spec of a distill run ``name`` (the SFT baseline the student, ``teacher`` the
    teacher, ``extra`` more ``distill.*`` settings); returns (spec path, output URI)."""
    overrides = {f"distill.{k}": v for k, v in {**RL_OVERRIDES, **extra}.items()}
    config = load_config(
        base=pipeline.config.model_dump(mode="json"),
        overrides={**overrides, "distill.teacher_from": teacher, "distill.samples_per_prompt": 2},
    )
    sft = StageLayout(pipeline.baseline_uris["sft"]).final
    output = os.path.join(pipeline.root, "rl", name)
    spec = build_spec(
        config,
        "distill",
        RUN_ID,
        {"data": pipeline.data_uri, "model": sft, "reference": teacher},
        output_uri=output,
        writer_id=f"writer-{name}",
    )
    return write_spec(spec, os.path.join(pipeline.root, "specs", f"distill-{name}.json")), output


@pytest.fixture(scope="module")
def distill_baseline(tiny_pipeline, distill_teacher) -> tuple[str, StageRun]:
    path, output = distill_spec_path(tiny_pipeline, "distill-baseline", distill_teacher)
    run = run_stage(path)
    assert run.returncode == 0, run.tail()
    return output, run


def test_distillation_lowers_the_reverse_kl_to_a_wider_teacher(distill_baseline):
    output, run = distill_baseline
    steps = run.step_metrics()
    assert sorted(steps) == list(range(1, RL_STEPS + 1))
    kl = [float(steps[s]["distill/reverse_kl_avg"]) for s in sorted(steps)]
    assert all(k > 0 for k in kl[:2])  # the SFT student starts far from a random teacher
    assert sum(kl[-3:]) / 3 < 0.8 * sum(kl[:3]) / 3, kl
    manifest = read_manifest(StageLayout(output).final)
    assert manifest.metrics["global_step"] == RL_STEPS and "reward_mean" in manifest.metrics  # the reward is logged


JSD_SETTINGS = {"loss": "generalized_jsd", "beta": 0.5, "lmbda": 0.5}
"""The generalised JSD with GKD's mixture (at the pipeline's seed the draw gives iterations 4-6 to
the dataset's completions, the others to the student's samples)."""


@pytest.fixture(scope="module")
def distill_jsd(tiny_pipeline, distill_teacher) -> tuple[str, StageRun]:
    path, output = distill_spec_path(tiny_pipeline, "distill-jsd", distill_teacher, **JSD_SETTINGS)
    run = run_stage(path)
    assert run.returncode == 0, run.tail()
    return output, run


def test_the_generalised_jsd_over_the_vocabulary_falls(tiny_pipeline, distill_jsd):
    """``distill.loss: generalized_jsd`` (beta 0.5): the divergence the update minimises, over the
    whole vocabulary at the student's sampled tokens, falls below 0.8 of its start (the teacher
    twice as wide); the sampling-time reverse KL is logged beside it. With ``lmbda`` 0.5 the
    iterations the draw gives to the dataset train on its completions: the divergence logged, no
    reward (nothing sampled) and no KL or entropy estimate (they hold over the student's own
    samples only)."""
    from trainer_core.training.rl.dataset_completions import on_policy_iteration

    output, run = distill_jsd
    steps = run.step_metrics()
    on_policy = {s: float(m["rollout/on_policy"]) == 1.0 for s, m in steps.items()}
    seed = tiny_pipeline.config.seed
    assert on_policy == {s: on_policy_iteration(0.5, seed, s - 1) for s in range(1, RL_STEPS + 1)}
    assert 2 <= sum(on_policy.values()) <= RL_STEPS - 2, on_policy  # both kinds of iteration ran
    jsd = [float(steps[s]["distill/jsd_avg"]) for s in sorted(steps) if on_policy[s]]
    print(f"distill generalized_jsd per on-policy step: {[round(x, 4) for x in jsd]}; on-policy {on_policy}")
    assert all("distill/jsd_avg" in m for m in steps.values())
    sampled_only = ("reward_mean", "objective/kl", "objective/entropy", "distill/reverse_kl_avg")
    assert all((k in m) == on_policy[s] for s, m in steps.items() for k in sampled_only)
    assert sum(jsd[-2:]) / 2 < 0.8 * sum(jsd[:2]) / 2, jsd
    assert read_manifest(StageLayout(output).final).metrics["global_step"] == RL_STEPS


def test_the_teacher_stage_trains_a_wider_model_that_distill_reads(tiny_pipeline):
    """``teacher`` with ``model_init`` twice the student's width: an HF model of that width with
    the run's tokenizer, its loss falling; distill, wired by the registry (no ``teacher_from``),
    takes it as its teacher and runs two iterations from it."""
    import json

    from transformers import AutoTokenizer

    from trainer_core.data.prepared import load_tokenizer_from
    from trainer_core.registry import stage_inputs as registry_inputs

    init = tiny_pipeline.config.model.init.model_dump()
    config = load_config(
        base=tiny_pipeline.config.model_dump(mode="json"),
        overrides={
            "stages": "prepare_data,sft,teacher,distill,evaluate",
            "teacher.max_steps": 8,
            "teacher.model_init": {**init, "hidden_size": 2 * init["hidden_size"]},
            **{f"distill.{k}": v for k, v in {**RL_OVERRIDES, "max_steps": 2}.items()},
        },
    )
    outputs = {"prepare_data": tiny_pipeline.data_uri, "sft": StageLayout(tiny_pipeline.baseline_uris["sft"]).final}
    teacher_out = os.path.join(tiny_pipeline.root, "rl", "teacher")
    spec = build_spec(config, "teacher", RUN_ID, registry_inputs(config, "teacher", outputs), output_uri=teacher_out)
    run = run_stage(write_spec(spec, os.path.join(tiny_pipeline.root, "specs", "teacher.json")))
    assert run.returncode == 0, run.tail()
    final = StageLayout(teacher_out).final
    assert json.loads(storage.read_bytes(join_uri(final, "config.json")))["hidden_size"] == 2 * init["hidden_size"]
    assert AutoTokenizer.from_pretrained(final).get_vocab() == load_tokenizer_from(tiny_pipeline.data_uri).get_vocab()
    losses = [float(m["train/loss"]) for _, m in sorted(run.step_metrics().items()) if "train/loss" in m]
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    inputs = registry_inputs(config, "distill", {**outputs, "teacher": final})
    assert inputs["reference"] == final
    output = os.path.join(tiny_pipeline.root, "rl", "distill-from-teacher")
    spec = build_spec(config, "distill", RUN_ID, inputs, output_uri=output)
    run = run_stage(write_spec(spec, os.path.join(tiny_pipeline.root, "specs", "distill-from-teacher.json")))
    assert run.returncode == 0, run.tail()
    assert sorted(run.step_metrics()) == [1, 2]


def test_a_killed_distillation_resumes_bit_identically(tiny_pipeline, distill_teacher, distill_jsd):
    """The generalised JSD with dataset completions (``lmbda`` 0.5) killed at the line that says
    its step-4 checkpoint is committed: the resumed run logs the uninterrupted one's lines, its
    on-policy and dataset iterations alike, and ends with its weights. (Killed at the step-6 line
    instead, the 2-second stage could commit its final output before the kill landed: the fresh
    clone's CI of fbaf3ac resumed nothing.)"""
    path, output = distill_spec_path(tiny_pipeline, "distill-killed", distill_teacher, **JSD_SETTINGS)
    killed = run_stage(path, kill_when=after_checkpoint_line(SAVE_EVERY))
    assert killed.killed
    resumed = run_stage(path)
    assert resumed.returncode == 0, resumed.tail()
    base_output, base_run = distill_jsd
    assert resumed.step_metrics() == {s: m for s, m in base_run.step_metrics().items() if s > SAVE_EVERY}
    assert_same_weights(final_weights(output), final_weights(base_output))


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tiny_pipeline, distill_teacher, tmp_path):
    import shutil

    from trainer_core.data.tokenizer import train_tokenizer

    teacher = tmp_path / "other-teacher"
    shutil.copytree(distill_teacher, teacher)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (teacher / name).unlink(missing_ok=True)
    train_tokenizer(["another corpus altogether, 12 + 30 = 42"] * 50, 120, 1).save_pretrained(str(teacher))
    path, output = distill_spec_path(tiny_pipeline, "distill-other-tokenizer", str(teacher))
    run = run_stage(path)
    assert run.returncode == 2, run.tail()
    text = "\n".join(run.lines)
    assert f"the teacher {teacher} and the student" in text and "different tokenizers" in text
    assert StageLayout(tiny_pipeline.baseline_uris["sft"]).final in text
    assert not storage.exists(join_uri(StageLayout(output).final, "manifest.json"))
