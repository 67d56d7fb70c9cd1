"""A seeded, offline task with verifiable answers: multi-step arithmetic word problems.

Problems look like GSM8K (Cobbe et al. 2021) with a deliberately small vocabulary, so a tiny
model trained for minutes can learn the format and some of the arithmetic::

    question: Tom has 3 apples. He buys 5 more. Then he gives away 2. How many apples does Tom have now?
    answer:   Tom has 3+5=<<3+5=8>>8 apples.
              Tom has 8-2=<<8-2=6>>6 apples.
              #### 6

Each problem has 2 or 3 steps: add ``n`` ("buys n more"), subtract ``n`` ("gives away n"),
or add ``k`` groups of ``m`` ("buys k bags of m apples", solved as ``x+k*m``). One solution
line per step keeps answers under about 60 tokens. Everything is drawn from ``random.Random``
seeded by the caller, so a seed gives the same records on every machine. Preference pairs use
their own stream (``random.Random(f"preference:{seed}")``), so they rarely repeat SFT problems.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

NAMES = (("Tom", "He"), ("Anna", "She"), ("Ben", "He"), ("Mia", "She"), ("Sam", "He"), ("Lily", "She"))
"""Problem subjects with their pronoun."""

OBJECTS = (
    ("apples", "bags"),
    ("books", "boxes"),
    ("coins", "bags"),
    ("pens", "boxes"),
    ("cards", "packs"),
    ("eggs", "boxes"),
)
"""Counted objects with the container used by the multiplication step."""

ADD_VERBS = ("buys {n} more", "finds {n} more", "gets {n} more")
SUB_VERBS = ("gives away {n}", "loses {n}", "sells {n}")


@dataclass(frozen=True)
class _Step:
    """One step: ``kind`` in {"add", "sub", "mul"}; mul adds ``groups * size``."""

    kind: str
    clause: str
    n: int = 0
    groups: int = 0
    size: int = 0


def _apply(value: int, step: _Step) -> int:
    """The amount after ``step``."""
    if step.kind == "mul":
        return value + step.groups * step.size
    return value + step.n if step.kind == "add" else value - step.n


def _draw_step(rng: random.Random, value: int, max_operand: int, container: str, obj: str) -> _Step:
    """A random step applicable to the running ``value`` (a subtraction never goes below 1)."""
    kinds = ["add", "mul"] + (["sub", "sub"] if value > 1 else [])
    kind = rng.choice(kinds)
    if kind == "add":
        n = rng.randint(1, max_operand)
        return _Step("add", rng.choice(ADD_VERBS).format(n=n), n=n)
    if kind == "sub":
        n = rng.randint(1, min(value - 1, max_operand))
        return _Step("sub", rng.choice(SUB_VERBS).format(n=n), n=n)
    groups = rng.randint(2, min(5, max_operand))
    size = rng.randint(2, max(2, min(10, max_operand)))
    return _Step("mul", f"buys {groups} {container} of {size} {obj}", groups=groups, size=size)


def _solution_lines(
    name: str,
    obj: str,
    start: int,
    steps: list[_Step],
    error: tuple[int, int] | None,
    annotate: bool | list[bool] = True,
) -> list[str]:
    """Worked solution lines; ``error = (step, delta)`` makes that step's result off by ``delta``
    and carries the wrong value through the later steps. ``annotate``: each step carries GSM8K's
    calculator annotation (``3+5=<<3+5=8>>8``), else the result alone (``3+5=8``); a list says
    it step by step."""
    value, lines = start, []
    annotated = annotate if isinstance(annotate, list) else [annotate] * len(steps)
    for i, step in enumerate(steps):
        delta = error[1] if error is not None and error[0] == i else 0
        if step.kind == "mul":
            expr, result = f"{value}+{step.groups}*{step.size}", value + step.groups * step.size
        elif step.kind == "add":
            expr, result = f"{value}+{step.n}", value + step.n
        else:
            expr, result = f"{value}-{step.n}", value - step.n
        result += delta
        worked = f"<<{expr}={result}>>{result}" if annotated[i] else f"{result}"
        lines.append(f"{name} has {expr}={worked} {obj}.")
        value = result
    lines.append(f"#### {value}")
    return lines


def _draw_problem(rng: random.Random, max_operand: int) -> tuple[str, str, int, list[_Step], str]:
    """(question, name, start, steps, object) of one problem."""
    (name, pronoun), (obj, container) = rng.choice(NAMES), rng.choice(OBJECTS)
    start = rng.randint(2, max_operand)
    value, steps = start, []
    for _ in range(rng.randint(2, 3)):
        step = _draw_step(rng, value, max_operand, container, obj)
        steps.append(step)
        value = _apply(value, step)
    clauses = [f"{pronoun} {steps[0].clause}."] + [f"Then {pronoun.lower()} {s.clause}." for s in steps[1:]]
    question = f"{name} has {start} {obj}. {' '.join(clauses)} How many {obj} does {name} have now?"
    return question, name, start, steps, obj


def _check(num: int, max_operand: int) -> None:
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    if max_operand < 2:
        raise ValueError(f"max_operand must be >= 2, got {max_operand}")


def make_sft_records(num: int, seed: int, max_operand: int) -> list[dict]:
    """``num`` GSM8K-format records ``{"question", "answer"}``: :func:`iter_sft_records` in a list.

    Raises:
        ValueError: ``num < 1`` or ``max_operand < 2``.
    """
    return list(iter_sft_records(num, seed, max_operand))


def iter_sft_records(
    num: int, seed: int, max_operand: int, annotation_fraction: float = 1.0, annotation_unit: str = "solution"
) -> Iterator[dict]:
    """``num`` GSM8K-format records ``{"question", "answer"}``, drawn one at a time.

    Args:
        num: number of problems.
        seed: ``random.Random`` seed; the same seed gives the same records.
        max_operand: largest starting amount or added / removed amount.
        annotation_fraction: the share of solutions (or of steps) written with calculator
            annotations, each draw from its own stream (``random.Random(f"annotation:{seed}")``:
            the problems are those of any other fraction); 1.0: all, as GSM8K.
        annotation_unit: ``"solution"``: a solution is annotated on every step or on none;
            ``"step"``: each step is annotated or not on its own draw, so a policy trained on it
            calls the calculator on about that share of its steps in every answer.

    Raises:
        ValueError: ``num < 1``, ``max_operand < 2``, ``annotation_fraction`` outside [0, 1] or
            another ``annotation_unit`` (at the call, not at the first record).
    """
    _check(num, max_operand)
    if not 0.0 <= annotation_fraction <= 1.0:
        raise ValueError(f"annotation_fraction must be in [0, 1], got {annotation_fraction}")
    if annotation_unit not in ("solution", "step"):
        raise ValueError(f"annotation_unit must be 'solution' or 'step', got {annotation_unit!r}")
    return _sft_stream(
        num,
        random.Random(seed),
        max_operand,
        annotation_fraction,
        random.Random(f"annotation:{seed}"),
        annotation_unit == "step",
    )


def _sft_stream(
    num: int,
    rng: random.Random,
    max_operand: int,
    annotation_fraction: float = 1.0,
    annotation_rng: random.Random | None = None,
    per_step: bool = False,
) -> Iterator[dict]:
    for _ in range(num):
        question, name, start, steps, obj = _draw_problem(rng, max_operand)
        if annotation_fraction >= 1.0:
            annotate: bool | list[bool] = True
        elif per_step:
            annotate = [annotation_rng.random() < annotation_fraction for _ in steps]
        else:
            annotate = annotation_rng.random() < annotation_fraction
        yield {"question": question, "answer": "\n".join(_solution_lines(name, obj, start, steps, None, annotate))}


def _values(start: int, steps: list[_Step]) -> list[int]:
    """The running amount after each step."""
    out, value = [], start
    for step in steps:
        value = _apply(value, step)
        out.append(value)
    return out


def _corrupt(rng: random.Random, name: str, obj: str, start: int, steps: list[_Step]) -> str:
    """A wrong solution: one step's result off by 1-3 (carried through the later steps), or only
    the final number wrong. The sign of the error is flipped where it would make an amount negative."""
    values = _values(start, steps)
    delta = rng.choice([-3, -2, -1, 1, 2, 3])
    if rng.random() < 0.75:
        step = rng.randrange(len(steps))
        if min(values[step:]) + delta < 0:
            delta = -delta
        return "\n".join(_solution_lines(name, obj, start, steps, (step, delta)))
    if values[-1] + delta < 0:
        delta = -delta
    correct = _solution_lines(name, obj, start, steps, None)
    return "\n".join(correct[:-1] + [f"#### {values[-1] + delta}"])


def make_preference_records(num: int, seed: int, max_operand: int) -> list[dict]:
    """``num`` preference records ``{"prompt", "chosen", "rejected"}``: :func:`iter_preference_records`
    in a list.

    Raises:
        ValueError: ``num < 1`` or ``max_operand < 2``.
    """
    return list(iter_preference_records(num, seed, max_operand))


def iter_preference_records(num: int, seed: int, max_operand: int) -> Iterator[dict]:
    """``num`` preference records ``{"prompt", "chosen", "rejected"}``, drawn one at a time.

    chosen is the correct worked solution; rejected is a corrupted one: with probability 3/4 one
    arithmetic step is off by 1-3 and the error is carried through the later steps, otherwise
    the steps are right and only the final ``#### n`` is wrong. The final numbers always differ.

    Args:
        num: number of pairs.
        seed: seed of the pair stream (distinct from :func:`iter_sft_records`'s for the same seed).
        max_operand: as in :func:`iter_sft_records`.

    Raises:
        ValueError: ``num < 1`` or ``max_operand < 2`` (at the call, not at the first record).
    """
    _check(num, max_operand)
    return _preference_stream(num, random.Random(f"preference:{seed}"), max_operand)


def _preference_stream(num: int, rng: random.Random, max_operand: int) -> Iterator[dict]:
    for _ in range(num):
        question, name, start, steps, obj = _draw_problem(rng, max_operand)
        chosen = "\n".join(_solution_lines(name, obj, start, steps, None))
        yield {"prompt": question, "chosen": chosen, "rejected": _corrupt(rng, name, obj, start, steps)}
