"""The GRPO family, pluggable rewards, the generation engines and micro-batched RL forwards, each
as a real GRPO trainer process on the tiny pipeline:

- DAPO (clip-higher, dynamic sampling, overlong shaping) and RLOO / REINFORCE++ run to the end
  and log the sampling rounds and the kept-group fraction;
- a user reward function named by import path scores the rollouts; one that raises fails the
  stage at once (exit 2) with an error naming the function and the sample;
- ``forward_micro_batch_size`` and ``padding_free`` give the same losses and weights as
  whole-batch padded forwards;
- the ``static`` engine (static KV cache, not compiled on CPU) samples the ``hf`` engine's tokens,
  and the step's time split is printed.
"""

from __future__ import annotations

import pytest
import torch

from .helpers import TinyPipeline, final_weights, run_stage
from .rl_runs import rl_config, rl_spec_path

STEPS = 3


def _run(pipeline: TinyPipeline, name: str, **overrides: object):
    config = rl_config(pipeline, "grpo", **{"grpo.max_steps": STEPS, **overrides})
    path, output = rl_spec_path(pipeline, "grpo", name, config=config)
    return run_stage(path), output


def _losses(run) -> list[float]:
    steps = run.step_metrics()
    assert sorted(steps) == list(range(1, STEPS + 1)), run.tail()
    return [float(steps[s]["train/loss"]) for s in sorted(steps)]


@pytest.mark.parametrize(
    "overrides",
    [
        {
            "grpo.clip_eps_high": 0.28,
            "grpo.dynamic_sampling": True,
            "grpo.dynamic_sampling_max_rounds": 3,
            "grpo.overlong_buffer_tokens": 4,
            "grpo.loss_aggregation": "token_mean",
        },
        {"grpo.advantage_estimator": "rloo", "grpo.loss_aggregation": "sequence_mean"},
        {"grpo.advantage_estimator": "reinforce_pp", "grpo.kl_coef": 0.05, "grpo.loss_aggregation": "constant"},
    ],
    ids=["dapo", "rloo", "reinforce_pp"],
)
def test_grpo_family_recipes_run_to_the_end(tiny_pipeline, overrides):
    run, output = _run(tiny_pipeline, "family-" + "-".join(str(v) for v in overrides.values())[:40], **overrides)
    assert run.returncode == 0, run.tail()
    steps = run.step_metrics()
    assert sorted(steps) == list(range(1, STEPS + 1))
    if overrides.get("grpo.dynamic_sampling"):
        for m in steps.values():
            assert 1 <= float(m["rollout/sampling_rounds"]) <= 3
            assert 0.0 <= float(m["rollout/groups_kept_frac"]) <= 1.0
    assert final_weights(output)


def test_custom_reward_function_by_import_path(tiny_pipeline):
    run, _ = _run(
        tiny_pipeline,
        "reward-fn",
        **{"grpo.reward.kind": "function", "grpo.reward.function": "tests.integration.reward_fns:short_and_answered"},
    )
    assert run.returncode == 0, run.tail()
    steps = run.step_metrics()
    # The function's scores, not the verifier's: below 1 and never the verifier's 0 / 0.1 / 1.1 values only.
    rewards = [float(m["reward_mean"]) for m in steps.values()]
    assert all(-1.0 < r < 1.0 for r in rewards), rewards
    assert "verifier_accuracy" in steps[1]  # the prompts still carry answers: accuracy is logged


def test_reward_function_that_raises_fails_the_stage_naming_it(tiny_pipeline):
    path = "tests.integration.reward_fns:explodes_on_answer_lines"
    run, _ = _run(tiny_pipeline, "reward-fn-raises", **{"grpo.reward.kind": "function", "grpo.reward.function": path})
    assert run.returncode == 2, run.tail()
    text = run.tail(60)
    assert path in text and "cannot parse the answer line" in text and "####" in text, text


def test_micro_batched_and_padding_free_forwards_equal_whole_batch(tiny_pipeline):
    """``forward_micro_batch_size`` and ``padding_free`` (with the ptx rows: the update's extra
    forward) give the whole padded batch's losses and final weights."""
    ptx = {"grpo.ptx_coef": 0.5, "grpo.ptx_rows_per_step": 3}
    whole, out_whole = _run(tiny_pipeline, "fmbs-none", **ptx)
    micro, out_micro = _run(tiny_pipeline, "fmbs-3", **ptx, **{"grpo.forward_micro_batch_size": 3})
    packed, out_packed = _run(
        tiny_pipeline, "fmbs-3-padding-free", **ptx, **{"grpo.forward_micro_batch_size": 3, "grpo.padding_free": True}
    )
    assert whole.returncode == micro.returncode == packed.returncode == 0, whole.tail() + micro.tail() + packed.tail()
    want = final_weights(out_whole)
    for run, output in ((micro, out_micro), (packed, out_packed)):
        assert _losses(run) == pytest.approx(_losses(whole), abs=1e-5)
        got = final_weights(output)
        assert sorted(got) == sorted(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_static_engine_samples_what_hf_samples_and_prints_the_time_split(tiny_pipeline):
    hf, _ = _run(tiny_pipeline, "engine-hf")
    static, _ = _run(tiny_pipeline, "engine-static", **{"grpo.generation.engine": "static"})
    assert hf.returncode == 0 and static.returncode == 0, hf.tail() + static.tail()
    a, b = hf.step_metrics(), static.step_metrics()
    for step in a:
        assert a[step]["response_length_tokens"] == b[step]["response_length_tokens"]
        assert float(b[step]["rollout/logprob_diff_max"]) < 1e-4
    timing = [line for line in static.lines if "[grpo] step 1 time:" in line]
    assert timing, static.tail()
    for key in ("time/generation_s", "time/reward_s", "time/logprobs_s", "time/update_s", "rollout/tokens_per_s"):
        assert key in timing[0], timing[0]
