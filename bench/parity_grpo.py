"""GRPO with sampling: the project's RL loop against TRL 1.16's ``GRPOTrainer``, short runs, several seeds.

The fixed-batch parity of the GRPO loss and gradients is a test (``tests/parity/test_grpo_parity.py``).
With sampling the two sides draw different completions (each its own random streams), so only
their learning curves can be compared, statistically, over seeds. This script runs both sides
once per seed and prints the comparison; it measures, it asserts nothing (exit status 0).

Both sides, for each seed:

* the same initial weights: the suite's tiny Llama (``tests/tiny.py`` ``TINY_MODEL``: 1 layer,
  hidden 32, tied embeddings) over the parity tests' 96-word vocabulary, built once by the
  project's ``load_causal_lm("init", ...)`` (seed 0) and deep-copied (TRL's reference, with the
  KL term, loaded from its saved copy);
* the same 32 prompts (seeded random token rows of 3-8 tokens; TRL reads them as text, checked to
  tokenise back to the same ids) and the same reward: the share of the ``max_new_tokens``
  positions of a completion that hold one of :data:`TARGET` (8 of the 94 ordinary tokens: ~0.08
  for the initial policy, 1 at best; EOS is no target, so whether a side keeps it in the text
  does not matter);
* GRPO on-policy: each step samples 8 completions (temperature 1, no top-p / top-k, at most 8
  tokens, EOS ends one) of each of 4 prompts and takes one optimizer step on the 32 (TRL:
  ``num_generations=8``, ``per_device_train_batch_size=32``, ``steps_per_generation=1``,
  ``num_iterations=1``; the project: ``group_size: 8``, ``prompts_per_rollout: 4``,
  ``ppo_epochs: 1``, ``num_mini_batches: 1``), advantages scaled by the group std
  (``scale_rewards``), the loss aggregation of ``--loss`` (TRL's name; :data:`LOSSES`; default
  DAPO's token mean), the k3 KL term of ``--kl-coef`` (default 0: no reference; TRL with
  ``use_bias_correction_kl=False``, the project's definition: see the parity test), clip 0.2
  (inactive on-policy);
* the same optimisation: AdamW fused, betas (0.9, 0.95), eps 1e-8, no weight decay, LR
  :data:`LEARNING_RATE` with 2 warmup steps then cosine to 0.1 x, clip 1.0, fp32 on the CPU, one
  thread (``tests/parity/trl_oracle.py``'s ``trl_settings``).

What differs, and is meant to: the random streams (TRL seeds its ``RepeatSampler`` and
``transformers.generate`` from ``seed``; the project its prompt order and its engine's
``torch.Generator``), so the same seed does not give the same completions.

The comparison: the per-step mean reward of the sampled completions (TRL's ``reward``, the
project's ``reward_mean``), averaged over each tenth of the run; at each tenth, the two sides'
means over the seeds and the standard error of their difference, ``sqrt(s_ours^2 / n + s_trl^2 /
n)`` (``s``: the sample standard deviation over the ``n`` seeds of that tenth's mean). The curves
"agree" at a tenth when the difference is within 2 standard errors. Also printed: each side's gain
from the first tenth to the last (the reward must clearly rise for the comparison to mean
anything). Writes ``WORK/parity_grpo.json``.

With 3 seeds the standard error is itself estimated from 3 values per side and the 2-s.e. test
misses about one tenth in ten by chance; 40 seeds give a sharper answer. With 6 seeds or more
the script also prints an A/A control (:func:`group_control`): how often comparisons of 3 seeds
(and of half the seeds) agree at all 10 tenths when the project meets TRL, and when each side
meets itself on other seeds. A run of 60 steps takes
~1 s of CPU here (TRL's ~2 s): 3 seeds ~10 s, 40 seeds ~2 min of CPU with the imports.

    .venv/bin/python bench/parity_grpo.py --seeds 0 1 2
    .venv/bin/python bench/parity_grpo.py --seeds $(seq 0 39) --loss grpo --kl-coef 0.04
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the parity tests' shared setup (tests/parity/trl_oracle.py)

import torch  # noqa: E402

from tests.parity.trl_oracle import (  # noqa: E402
    EOS_ID,
    PAD_ID,
    Rows,
    tiny_model_config,
    trl_settings,
    word_tokenizer,
)
from trainer_core.backends import build_backend  # noqa: E402
from trainer_core.checkpoint.session import CheckpointSession, MetricsBuffer  # noqa: E402
from trainer_core.config import BackendConfig, GRPOConfig  # noqa: E402
from trainer_core.modeling.forwards.completion import PolicyAndValue  # noqa: E402
from trainer_core.modeling.models import load_causal_lm  # noqa: E402
from trainer_core.training.rl.algorithms import GRPOAlgorithm  # noqa: E402
from trainer_core.training.rl.rewards import PromptItem  # noqa: E402
from trainer_core.training.rl.trainer import RLTrainer  # noqa: E402

TARGET = frozenset(range(2, 10))
"""The rewarded tokens (``t2`` .. ``t9``)."""
NUM_PROMPTS, PROMPTS_PER_STEP, GROUP_SIZE, MAX_NEW_TOKENS = 32, 4, 8, 8
LEARNING_RATE = 3e-3
MODEL_SEED = 0
LOSSES = {"dapo": "token_mean", "grpo": "sequence_mean", "dr_grpo": "constant"}
"""TRL's ``loss_type`` -> the project's ``loss_aggregation`` (``tests/parity/test_grpo_parity.py``)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (= rollouts) of each run")
    parser.add_argument(
        "--loss",
        choices=sorted(LOSSES),
        default="dapo",
        help=f"TRL's loss_type (the project's loss_aggregation: {LOSSES})",
    )
    parser.add_argument(
        "--kl-coef",
        type=float,
        default=0.0,
        help="beta = kl_coef (k3; TRL without its ratio factor, use_bias_correction_kl=False)",
    )
    parser.add_argument("--work-dir", default=str(REPO / ".bench" / "parity-grpo"))
    return parser.parse_args(argv)


def reward_of_ids(ids: list[int]) -> float:
    """The share of the ``MAX_NEW_TOKENS`` positions holding a :data:`TARGET` token."""
    return sum(t in TARGET for t in ids) / MAX_NEW_TOKENS


def prompt_text(ids: list[int]) -> str:
    """A prompt as TRL's dataset holds it: the word tokenizer's words (``t<id>``)."""
    return " ".join(f"t{i}" for i in ids)


def stage_config(steps: int, loss: str = "dapo", kl_coef: float = 0.0) -> GRPOConfig:
    """The project's GRPO config of a run (module docstring); ``loss``: TRL's name of the aggregation."""
    return GRPOConfig(
        max_steps=steps,
        learning_rate=LEARNING_RATE,
        warmup_steps=2,
        min_lr_ratio=0.1,
        weight_decay=0.0,
        group_size=GROUP_SIZE,
        prompts_per_rollout=PROMPTS_PER_STEP,
        ppo_epochs=1,
        num_mini_batches=1,
        advantage_estimator="grpo",
        scale_rewards=True,
        loss_aggregation=LOSSES[loss],
        kl_coef=kl_coef,
        kl_estimator="k3",
        clip_eps=0.2,
        save_every=10 * steps,
        async_save=False,
        generation={"temperature": 1.0, "top_p": 1.0, "max_new_tokens": MAX_NEW_TOKENS},
    )


@dataclass
class Setup:
    """What every run shares: the initial model (also saved in ``initial_dir``, where TRL builds its
    reference from when the KL term is on), the prompts, the project's config, TRL's ``loss_type``."""

    initial: torch.nn.Module
    initial_dir: Path
    prompts: list[list[int]]
    cfg: GRPOConfig
    loss: str
    work: Path


def run_project(setup: Setup, seed: int) -> list[float]:
    """The project's ``RLTrainer`` with ``GRPOAlgorithm`` (as ``stages/rl_common.py`` builds it, on the
    single-device backend; the reference a copy of the initial model when ``kl_coef`` > 0); the
    per-iteration ``reward_mean``."""
    cfg = setup.cfg
    backend = build_backend(BackendConfig(name="single", device="cpu", precision="fp32"))
    logged: dict[int, dict[str, float]] = {}
    session = CheckpointSession(
        str(setup.work / f"project-{seed}"),
        backend,
        asynchronous=False,
        metrics=MetricsBuffer(printer=lambda m, step: logged.setdefault(step, {}).update(m)),
    )

    def reward(items, texts):
        return torch.tensor([reward_of_ids([int(w[1:]) for w in t.split()]) for t in texts])

    items = [PromptItem([{"role": "user", "content": prompt_text(p)}], p, None) for p in setup.prompts]
    reference = copy.deepcopy(setup.initial).eval() if cfg.kl_coef > 0 else None
    torch.manual_seed(seed)
    trainer = RLTrainer(
        backend=backend,
        tokenizer=word_tokenizer(),
        cfg=cfg,
        algo=GRPOAlgorithm(cfg),
        model=backend.wrap(PolicyAndValue(copy.deepcopy(setup.initial))),
        reference=reference,
        reward_fn=reward,
        prompts=items,
        seed=seed,
        session=session,
    )
    trainer.run()
    return [float(logged[s]["reward_mean"]) for s in range(1, cfg.max_steps + 1)]


def run_trl(setup: Setup, seed: int) -> list[float]:
    """TRL's ``GRPOTrainer`` with the equivalent settings (module docstring); the per-step ``reward``."""
    import datasets
    import trl
    from transformers.trainer_callback import PrinterCallback

    cfg = setup.cfg

    def reward(prompts, completions, completion_ids, **kwargs):
        return [reward_of_ids(ids) for ids in completion_ids]

    settings = {
        **trl_settings(cfg, setup.work / f"trl-{seed}"),
        "seed": seed,
        "per_device_train_batch_size": PROMPTS_PER_STEP * GROUP_SIZE,
        "max_grad_norm": cfg.max_grad_norm,
    }
    args = trl.GRPOConfig(
        **settings,
        num_generations=GROUP_SIZE,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=cfg.kl_coef,
        use_bias_correction_kl=False,
        loss_type=setup.loss,
        scale_rewards="group",
        epsilon=cfg.clip_eps,
    )
    model = copy.deepcopy(setup.initial)
    model.config._name_or_path = str(setup.initial_dir)  # TRL's reference (beta > 0) is loaded from here
    dataset = datasets.Dataset.from_list([{"prompt": prompt_text(p)} for p in setup.prompts])
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=word_tokenizer()
    )
    trainer.remove_callback(PrinterCallback)  # the per-step log lines (disable_tqdm's printer)
    trainer.train()
    by_step = {int(h["step"]): h for h in trainer.state.log_history if "reward" in h}
    return [float(by_step[s]["reward"]) for s in range(1, cfg.max_steps + 1)]


def tenths(values: list[float]) -> list[float]:
    """The mean of each tenth of ``values`` (consecutive, as equal as the length allows)."""
    n = len(values)
    return [statistics.fmean(values[n * k // 10 : n * (k + 1) // 10]) for k in range(10)]


def compare(ours: list[list[float]], theirs: list[list[float]]) -> list[dict[str, float | bool]]:
    """Per tenth: each side's mean over the seeds, the difference, its standard error, agreement."""
    rows = []
    for k, (a, b) in enumerate(zip(zip(*map(tenths, ours)), zip(*map(tenths, theirs)))):
        se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
        diff = statistics.fmean(a) - statistics.fmean(b)
        rows.append(
            {
                "tenth": k + 1,
                "project": statistics.fmean(a),
                "trl": statistics.fmean(b),
                "diff": diff,
                "se": se,
                "agree": abs(diff) <= 2 * se,
            }
        )
    return rows


def agreements(ours: list[list[float]], theirs: list[list[float]]) -> int:
    """How many of the 10 tenths agree (:func:`compare`) between two sets of curves."""
    return sum(bool(r["agree"]) for r in compare(ours, theirs))


def group_control(
    curves: dict[str, list[list[float]]], size: int = 3, draws: int = 2000, seed: int = 0
) -> dict[str, float]:
    """The ``size``-seed criterion's own false-alarm rate, from an A/A control.

    Each draw takes ``2 x size`` distinct seeds, the first ``size`` for one set of curves and the
    rest for the other, and compares the two sets by :func:`compare`: the project against TRL,
    and (the control) the project against itself and TRL against itself, each on disjoint seeds.
    Returns, per pairing, the share of draws in which all 10 tenths agree (``<pair>/all_10``) and
    the mean number that agree (``<pair>/mean``). When the project against TRL agrees about as
    often as either side against itself, a tenth that disagrees in one comparison is the
    criterion's noise (with 3 seeds its standard error is estimated from 3 values a side; and 10
    tenths are 10 chances), not a departure.

    Raises:
        ValueError: fewer than ``2 x size`` seeds a side.
    """
    ours, theirs = curves["project"], curves["trl"]
    n = min(len(ours), len(theirs))
    if n < 2 * size:
        raise ValueError(f"the control draws {2 * size} distinct seeds; got {len(ours)} and {len(theirs)}")
    pairs = {"project_vs_trl": (ours, theirs), "project_vs_project": (ours, ours), "trl_vs_trl": (theirs, theirs)}
    counts: dict[str, list[int]] = {name: [] for name in pairs}
    rng = random.Random(seed)
    for _ in range(draws):
        idx = rng.sample(range(n), 2 * size)
        for name, (a, b) in pairs.items():
            counts[name].append(agreements([a[i] for i in idx[:size]], [b[i] for i in idx[size:]]))
    out: dict[str, float] = {}
    for name, values in counts.items():
        out[f"{name}/all_10"] = sum(v == 10 for v in values) / draws
        out[f"{name}/mean"] = statistics.fmean(values)
    return out


def setup_of(args: argparse.Namespace) -> Setup:
    """The shared model (saved under the work directory), prompts and config of every run."""
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    initial = load_causal_lm("init", tiny_model_config(), word_tokenizer(), MODEL_SEED)
    initial.save_pretrained(work / "initial")
    builder = Rows(MODEL_SEED)
    prompts = [builder.prompt() for _ in range(NUM_PROMPTS)]
    assert all(EOS_ID not in p and PAD_ID not in p for p in prompts)
    tokenizer = word_tokenizer()  # TRL reads the prompts as text: it must tokenise them back to these ids
    assert [tokenizer(prompt_text(p)).input_ids for p in prompts] == prompts
    return Setup(initial, work / "initial", prompts, stage_config(args.steps, args.loss, args.kl_coef), args.loss, work)


def report(curves: dict[str, list[list[float]]], seconds: dict[str, float]) -> dict[str, object]:
    """Print the comparison table, the gains, the CPU time and (6 seeds or more) the A/A control;
    the table's rows (``tenths``) and the control (``control``: :func:`group_control`'s answer by
    group size, 3 and half the seeds; empty under 6 seeds)."""
    rows = compare(curves["project"], curves["trl"])
    print("\n| tenth | project mean reward | TRL mean reward | difference | 2 x s.e. | agree |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(
            f"| {r['tenth']} | {r['project']:.3f} | {r['trl']:.3f} | {r['diff']:+.3f} | {2 * r['se']:.3f} | "
            f"{'yes' if r['agree'] else 'NO'} |"
        )
    for side, side_curves in curves.items():
        gains = [tenths(c)[-1] - tenths(c)[0] for c in side_curves]
        print(
            f"{side}: gain first -> last tenth, mean over seeds {statistics.fmean(gains):+.3f} (min {min(gains):+.3f})"
        )
    print(
        f"agree at {sum(r['agree'] for r in rows)} of 10 tenths; CPU seconds: "
        + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items())
    )
    control: dict[str, dict[str, float]] = {}
    n = min(len(c) for c in curves.values())
    for size in sorted({3, n // 2}):
        if size < 3 or n < 2 * size:
            continue
        control[str(size)] = judged = group_control(curves, size)
        print(
            f"A/A control, {size}-seed comparisons on disjoint seeds (2000 draws): share agreeing at all 10 "
            "tenths, mean tenths agreeing"
        )
        for name in ("project_vs_trl", "project_vs_project", "trl_vs_trl"):
            print(f"  {name}: {judged[name + '/all_10']:.3f}, {judged[name + '/mean']:.2f}")
    return {"tenths": rows, "control": control}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    setup = setup_of(args)
    curves: dict[str, list[list[float]]] = {"project": [], "trl": []}
    seconds: dict[str, float] = {"project": 0.0, "trl": 0.0}
    for seed in args.seeds:
        for side, run in (("project", run_project), ("trl", run_trl)):
            random.seed(seed)
            start = time.process_time()
            curves[side].append(run(setup, seed))
            seconds[side] += time.process_time() - start
            print(
                f"seed {seed} {side}: {time.process_time() - start:.0f} s CPU; reward by tenth "
                + " ".join(f"{v:.3f}" for v in tenths(curves[side][-1])),
                flush=True,
            )
    judged = report(curves, seconds)
    (setup.work / "parity_grpo.json").write_text(
        json.dumps(
            {
                "seeds": args.seeds,
                "steps": args.steps,
                "loss": args.loss,
                "kl_coef": args.kl_coef,
                "curves": curves,
                **judged,
                "cpu_seconds": seconds,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
