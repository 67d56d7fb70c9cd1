"""The synthetic arithmetic task: determinism, correct worked solutions, corrupted rejections."""

from __future__ import annotations

import re

import pytest

from trainer_core.data.formats import detect_format, final_answer, to_preference_example, to_sft_example
from trainer_core.data.synthetic import iter_sft_records, make_preference_records, make_sft_records

_ANNOTATION = re.compile(r"<<([0-9+\-*]+)=(-?\d+)>>(-?\d+)")


def _annotations(answer: str) -> list[tuple[int, int, int]]:
    """(value of the expression, written result, result after >>) of every ``<<expr=r>>r``."""
    out = []
    for expr, written, after in _ANNOTATION.findall(answer):
        assert re.fullmatch(r"\d+([+\-*]\d+)+", expr), expr
        out.append((eval(expr), int(written), int(after)))  # noqa: S307 - digits and + - * only (checked)
    return out


def _is_correct(answer: str) -> bool:
    """Every annotation computes right, each step starts from the previous result, and #### is the last."""
    steps = _annotations(answer)
    lines = answer.split("\n")
    starts = [int(re.search(r"has (-?\d+)", line).group(1)) for line in lines[:-1]]
    chained = all(starts[i + 1] == steps[i][1] for i in range(len(steps) - 1))
    return all(v == w == a for v, w, a in steps) and chained and final_answer(answer) == str(steps[-1][1])


def test_same_seed_same_records_other_seed_different():
    assert make_sft_records(50, 3, 20) == make_sft_records(50, 3, 20)
    assert make_sft_records(50, 3, 20) != make_sft_records(50, 4, 20)
    assert make_preference_records(50, 3, 20) == make_preference_records(50, 3, 20)
    assert make_preference_records(50, 3, 20) != make_preference_records(50, 4, 20)


def test_sft_records_are_gsm8k_with_correct_worked_solutions():
    records = make_sft_records(300, 0, 20)
    assert len(records) == 300
    for r in records:
        assert set(r) == {"question", "answer"} and detect_format(r) == "gsm8k"
        assert _is_correct(r["answer"]), r["answer"]
        num_steps = len(_annotations(r["answer"]))
        assert 2 <= num_steps <= 3 and r["question"].count(".") == num_steps + 1
        start = int(re.match(r"\w+ has (\d+) ", r["question"]).group(1))
        assert r["answer"].split("\n")[0].split(" has ")[1].startswith(f"{start}")
        assert int(final_answer(r["answer"])) >= 1
        assert to_sft_example(r)["answer"] == final_answer(r["answer"])
    assert {len(_annotations(r["answer"])) for r in records} == {2, 3}
    assert len({r["question"].split()[0] for r in records}) > 3  # several names


def test_operands_respect_max_operand():
    for r in make_sft_records(200, 1, 5):
        added = [int(n) for n in re.findall(r"(?:buys|finds|gets|away|loses|sells) (\d+)", r["question"])]
        start = int(re.match(r"\w+ has (\d+) ", r["question"]).group(1))
        assert 2 <= start <= 5 and all(1 <= n <= 5 for n in added)


def test_example_from_docstring_shape():
    r = make_sft_records(1, 0, 20)[0]
    assert r["question"].endswith("now?") and r["answer"].split("\n")[-1].startswith("#### ")


def test_preference_records_chosen_correct_rejected_wrong():
    records = make_preference_records(300, 0, 20)
    kinds = set()
    for r in records:
        assert set(r) == {"prompt", "chosen", "rejected"} and detect_format(r) == "prompt_completion"
        assert _is_correct(r["chosen"]) and not _is_correct(r["rejected"])
        assert final_answer(r["rejected"]) != final_answer(r["chosen"])
        wrong_steps = [s for s in _annotations(r["rejected"]) if s[0] != s[1]]
        kinds.add("step" if wrong_steps else "final")
        if wrong_steps:
            assert len(wrong_steps) == 1  # one wrong step, later steps carry the wrong value correctly
        assert to_preference_example(r)["messages"] == [{"role": "user", "content": r["prompt"]}]
    assert kinds == {"step", "final"}


def test_preference_prompts_differ_from_sft_prompts_for_same_seed():
    sft = {r["question"] for r in make_sft_records(200, 0, 20)}
    pref = {r["prompt"] for r in make_preference_records(200, 0, 20)}
    assert len(sft & pref) < 5


@pytest.mark.parametrize(("num", "max_operand"), [(0, 20), (5, 1)])
def test_bad_arguments(num, max_operand):
    with pytest.raises(ValueError):
        make_sft_records(num, 0, max_operand)
    with pytest.raises(ValueError):
        make_preference_records(num, 0, max_operand)


def test_a_share_of_solutions_carries_calculator_annotations():
    """``annotation_fraction``: the same problems and answers; about that share annotated
    (``<<3+5=8>>8``), the rest worked without (``3+5=8``); 1.0 is the default stream exactly."""
    full = list(iter_sft_records(400, 3, 10))
    assert list(iter_sft_records(400, 3, 10, 1.0)) == full
    half = list(iter_sft_records(400, 3, 10, 0.5))
    assert [r["question"] for r in half] == [r["question"] for r in full]
    annotated = [r for r in half if "<<" in r["answer"]]
    assert 160 < len(annotated) < 240 and all(r in full for r in annotated)
    for plain, ref in ((p, f) for p, f in zip(half, full) if "<<" not in p["answer"]):
        assert plain["answer"] == re.sub(r"<<[^>]*>>", "", ref["answer"])
    assert not any("<<" in r["answer"] for r in iter_sft_records(50, 3, 10, 0.0))
    with pytest.raises(ValueError, match="annotation_fraction"):
        iter_sft_records(5, 3, 10, 1.5)


def test_annotation_by_step_mixes_calls_and_plain_sums_in_one_answer():
    """``annotation_unit="step"``: the same problems and answers; each step annotated on its own
    draw (about that share of all steps, answers with both kinds), the plain steps worked as
    ``3+5=8``; an unknown unit refused."""
    full = list(iter_sft_records(400, 3, 10))
    mixed = list(iter_sft_records(400, 3, 10, 0.5, "step"))
    assert [r["question"] for r in mixed] == [r["question"] for r in full]
    steps = [line for r in mixed for line in r["answer"].split("\n")[:-1]]
    share = sum("<<" in line for line in steps) / len(steps)
    assert 0.43 < share < 0.57
    assert sum(0 < r["answer"].count("<<") < len(r["answer"].split("\n")) - 1 for r in mixed) > 150
    for r, ref in zip(mixed, full):
        assert re.sub(r"<<[^>]*>>", "", r["answer"]) == re.sub(r"<<[^>]*>>", "", ref["answer"])
        assert all(line in ref["answer"].split("\n") for line in r["answer"].split("\n") if "<<" in line)
    with pytest.raises(ValueError, match="annotation_unit"):
        iter_sft_records(5, 3, 10, 0.5, "token")
