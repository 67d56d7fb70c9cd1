"""lm-evaluation-harness over the project's models (``trainer_core/generation/harness.py``): the
harness's requests answered by the project's engine give the completions evaluate generates for the
same chat prompts, and the built-in held-out task scores them as evaluate's exact match does."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import tiny_llama
from trainer_core.config import GenerationConfig
from trainer_core.config.sections import DataConfig
from trainer_core.data.formats import answers_match, extract_generated_answer
from trainer_core.data.tokenizer import train_tokenizer
from trainer_core.errors import ConfigError
from trainer_core.generation.completions import generate_completions, prompt_ids

harness = pytest.importorskip("trainer_core.generation.harness", reason="lm_eval (the eval extra) is not installed")

TEXTS = ["Tom has 3+5=8 apples. #### 8", "Ann has 9-2=7 pears. #### 7", "What is 4+1? 4+1=5 #### 5"]
QUESTIONS = [f"What is {i}+{j}?" for i in range(3) for j in range(2)]


@pytest.fixture(scope="module")
def tiny():
    tokenizer = train_tokenizer(TEXTS * 20, 128, 1)
    model = tiny_llama(tokenizer)
    digits = [i for token, i in tokenizer.get_vocab().items() if token.lstrip("\u0120").isdigit()]
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id].zero_()  # EOS rare: every answer runs to max_new_tokens
        model.lm_head.weight[digits] *= 4  # numbers in the answers, so that exact match has something to read
    return model, tokenizer


def test_the_heldout_task_agrees_with_evaluates_exact_match(tiny, tmp_path):
    model, tokenizer = tiny
    gen = GenerationConfig(max_new_tokens=16, batch_size=4)
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}], DataConfig()) for q in QUESTIONS]
    completions = generate_completions(model, tokenizer, prompts, gen, torch.device("cpu"), 0)
    # Half the reference answers are the number each completion ends with (a hit), half are not.
    answers = [extract_generated_answer(c) or "1" if i % 2 == 0 else "987654" for i, c in enumerate(completions)]
    ours = [answers_match(extract_generated_answer(c), a) for c, a in zip(completions, answers)]
    task = harness.write_heldout_task(
        str(tmp_path), [{"question": q, "answer": a} for q, a in zip(QUESTIONS, answers)], 16
    )
    lm = harness.HarnessLM(model, tokenizer, gen, torch.device("cpu"), 0)
    results = harness.run_harness(lm, [task], str(tmp_path), None, None, True, 0, log_samples=True)
    # The same chat prompts, the same greedy completions (the harness's context re-tokenised from text).
    responses = {s["doc"]["question"]: s["resps"][0][0] for s in results["samples"][task]}
    assert [responses[q] for q in QUESTIONS] == completions
    metrics = harness.harness_metrics(results, "sft")
    assert metrics["sft/lm_eval/posttrain_heldout/exact_match_flexible_extract"] == pytest.approx(sum(ours) / len(ours))
    assert 0 < sum(ours) < len(ours)  # the comparison can tell a hit from a miss
    strict = [("####" in c) and o for c, o in zip(completions, ours)]  # strict-match reads "#### n" lines alone
    assert metrics["sft/lm_eval/posttrain_heldout/exact_match_strict_match"] == pytest.approx(sum(strict) / len(strict))
    assert "sft/lm_eval/posttrain_heldout/exact_match_stderr_flexible_extract" in metrics
    # Each example's score, keyed by the example, under the names of the task's means.
    scores = harness.example_scores(results)
    assert set(scores) == {f"lm_eval/{task}/exact_match_{f}" for f in ("strict_match", "flexible_extract")}
    flexible = scores[f"lm_eval/{task}/exact_match_flexible_extract"]
    by_doc = {int(key.split("/")[2]): value for key, value in flexible.items()}
    assert [by_doc[i] for i in range(len(QUESTIONS))] == [float(o) for o in ours]
    assert all(key.startswith(f"lm_eval/{task}/") and len(key.split("/")[3]) == 64 for key in flexible)


def test_loglikelihood_is_the_continuations_log_probability(tiny):
    from lm_eval.api.instance import Instance

    model, tokenizer = tiny
    lm = harness.HarnessLM(model, tokenizer, GenerationConfig(), torch.device("cpu"), 0)
    request = Instance("loglikelihood", {}, ("Tom has 3+5=", "8 apples"), 0)
    [(logprob, greedy)] = lm.loglikelihood([request])
    context, continuation = tokenizer("Tom has 3+5=")["input_ids"], tokenizer("8 apples")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([context + continuation])).logits[0].log_softmax(-1)
    expected = sum(logits[len(context) - 1 + i, t].item() for i, t in enumerate(continuation))
    assert logprob == pytest.approx(expected, abs=1e-5) and isinstance(greedy, bool)
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("Tom has 3+5=8 apples",), 0)])
    assert rolling < 0


def test_an_unknown_task_is_named(tiny, tmp_path):
    model, tokenizer = tiny
    lm = harness.HarnessLM(model, tokenizer, GenerationConfig(), torch.device("cpu"), 0)
    with pytest.raises(ConfigError, match=r"unknown task\(s\) \['no_such_task'\]"):
        harness.run_harness(lm, ["no_such_task"], str(tmp_path), None, None, True, 0)


def test_a_task_folder_and_its_data_on_object_storage(tiny, s3_server, tmp_path):
    """``include_path`` on S3 (moto): the task YAML is copied to a local folder, and its data file,
    an ``s3://`` URI too, is read by datasets through fsspec with the process's S3 settings."""
    from tests.conftest import make_bucket
    from trainer_core import storage

    model, tokenizer = tiny
    local = tmp_path / "task"
    harness.write_heldout_task(str(local), [{"question": q, "answer": "5"} for q in QUESTIONS], 8)
    root = f"s3://{make_bucket(s3_server)}/tasks"
    data = f"{root}/{harness.HELDOUT_TASK}.jsonl"
    storage.write_bytes(data, (local / f"{harness.HELDOUT_TASK}.jsonl").read_bytes())
    yaml = (
        (local / f"{harness.HELDOUT_TASK}.yaml").read_text().replace(str(local / f"{harness.HELDOUT_TASK}.jsonl"), data)
    )
    storage.write_bytes(
        f"{root}/{harness.HELDOUT_TASK}.yaml",
        yaml.replace(f"task: {harness.HELDOUT_TASK}", "task: remote_task").encode(),
    )
    lm = harness.HarnessLM(model, tokenizer, GenerationConfig(max_new_tokens=8, batch_size=8), torch.device("cpu"), 0)
    results = harness.run_harness(lm, ["remote_task"], root, 3, None, True, 0)
    assert results["results"]["remote_task"]["sample_len"] == 3
