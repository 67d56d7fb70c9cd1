"""What the TRL parity tests share: one tiny model, synthetic token rows, the project's training
loop on one side and a TRL 1.16 trainer on the other, and the comparison that fills the table of
``bench/README.md`` ("Parity with TRL").

Both sides start from the same weights (one model built by the project's ``load_causal_lm`` /
``load_reward_model`` from :data:`tests.tiny.TINY_MODEL`, deep-copied for each run), read the same
token ids with the same loss masks, in the same micro-batches, in the same order, and optimise
with the same AdamW (fused, betas (0.9, 0.95), eps 1e-8, weight decay on matrices only), the
same schedule (linear warmup, then cosine down to ``min_lr_ratio``: transformers'
``cosine_with_min_lr``, which ``trainer_core/training/schedule.py`` restates) and the same
clipping, in fp32 on the CPU, one process each, no gradient accumulation.

* The project's side is its real loop: :class:`~trainer_core.training.loop.TrainLoop` on the
  single-device backend, the stage's objective from ``trainer_core/training/supervised.py``, its
  batch source (``causal_source`` / ``pair_source`` / ``kto_source``: the length-bucketed,
  seeded :class:`~trainer_core.data.samplers.BucketedBatchSampler`) and, for DPO and KTO, the
  reference log-probs precomputed by ``reference_logprobs`` as ``stages/reference.py`` does.
* TRL's side reads a dataset written in the order the project's sampler draws its micro-batches
  (:func:`drawn_order`) with ``train_sampling_strategy="sequential"`` (transformers'
  ``Trainer._get_train_sampler``), so its i-th batch holds the rows of the project's i-th
  micro-batch. SFTTrainer and RewardTrainer take pre-tokenised rows as they are (``input_ids`` +
  ``completion_mask``; ``chosen_ids`` / ``rejected_ids``); DPOTrainer and KTOTrainer tokenise text
  in ``_prepare_dataset``, which :func:`pretokenised` skips (the rows already have the columns
  their collators read: ``prompt_ids``, ``chosen_ids``, ``rejected_ids``, ``completion_ids``,
  ``KL_completion_ids``, ``label``). TRL's reference model is a copy of the initial weights,
  run live in every step (``precompute_ref_log_probs=False``).

Tolerance (:func:`check_close`): ``|ours - trl| <= RTOL |trl| + atol``. The two sides do the same
arithmetic in another order: the project's LM head runs on completion positions only, in chunks
(``trainer_core/modeling/forwards/token.py``), TRL's fused head (``trl/trainer/utils.py``,
``add_fused_lm_head``) on every position, then masks; the log-softmax is ``cross_entropy`` here,
TRL's chunked kernel there; the project's reference log-probs come from length-sorted batches
(other padding), TRL's from the training batch. Each differs by a few fp32 ulps (~1e-7
relative); AdamW's update ``m / sqrt(v)`` is scale-free, so the differences reach the weights at
about that relative size, and 20 steps at these learning rates do not amplify them: the worst
relative difference measured in a loss or gradient norm is 3e-7 (bench/README.md). ``RTOL =
1e-4``, the issue's bar, leaves a factor of ~300. An absolute floor is added only where a
quantity is a difference of two nearly equal summed log-probs (the rewards ``beta (pi - ref)``,
their margins, KTO's KL estimate), whose relative error is unbounded as it nears 0 (at the first
steps the policy is still the reference): each sum carries a rounding error of its own fp32
spacing whatever the difference, so the floor is :data:`LOGP_ATOL`, 8 spacings of the largest
sums here (times beta where the quantity is scaled by beta).
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tests.tiny import TINY_MODEL
from trainer_core.backends import build_backend
from trainer_core.checkpoint.session import CheckpointSession, MetricsBuffer
from trainer_core.config import BackendConfig, TrainStageConfig, load_config
from trainer_core.data.samplers import DataPosition, iterate_batches
from trainer_core.training.loop import BatchSource, Objective, TrainLoop

VOCAB = 96
"""Word-level vocabulary: ``<pad>`` 0, ``<eos>`` 1, ``t2`` .. ``t95``."""
PAD_ID, EOS_ID = 0, 1
SEED = 0
STEPS = 20
"""Optimizer steps compared, one micro-batch each."""
MICRO_BATCH = 4
CPU = torch.device("cpu")
CPU_FP32_RUN = dict(
    use_cpu=True,
    bf16=False,
    fp16=False,
    activation_checkpointing=False,
    report_to="none",
    disable_tqdm=True,
    seed=SEED,
)
"""The arguments of every TRL config here (a ``transformers.TrainingArguments``) that make its run a
plain seeded fp32 one on the CPU: TRL's ``bf16=True`` and ``gradient_checkpointing=True`` (named
``activation_checkpointing`` in current transformers) off, no reporting, no progress bar."""

RTOL = 1e-4
"""Relative tolerance of every compared quantity (see the module docstring)."""
LOGP_ATOL = 3e-5
"""Absolute floor of a difference of two summed log-probs (KTO's KL; the rewards once multiplied by
beta): a completion here is at most 9 tokens at about -ln 96 = -4.6 each (a barely trained tiny
model), so its summed log-probs lie in (-64, 0), where fp32's spacing is at most 2**-18 = 3.8e-6;
the floor is 8 spacings (the measured worst is under 1, bench/README.md)."""


@dataclass
class Result:
    """One row of the parity table: a comparison (``|ours - trl| <= rtol |trl| + atol``), or, with
    ``departure``, the size of a pinned departure (its two definitions must differ by more than
    ``rtol`` relative)."""

    objective: str
    quantity: str
    steps: str
    max_rel: float
    max_abs: float
    rtol: float
    atol: float
    departure: bool = False
    tolerance: str | None = None
    """The tolerance as the table states it, where ``atol`` alone does not (a per-element floor)."""


RESULTS: list[Result] = []
"""Every comparison made in this process, in order; ``tests/parity/conftest.py`` prints them as
the table of bench/README.md at the end of the session."""


def word_tokenizer():
    """A word-level tokenizer over :data:`VOCAB` ids (``t<i>`` is id i; words split on whitespace,
    so ``"t5 t17"`` encodes to ``[5, 17]`` and decodes back): TRL's trainers need a
    ``processing_class`` with a pad token; the supervised and preference rows are token ids
    already (only its pad / eos ids and its length, the model's vocabulary, matter there), while
    GRPOTrainer tokenises its text prompts and the project's RL loop decodes completions."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID, **{f"t{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def tiny_model_config():
    """The suite's tiny model (:data:`tests.tiny.TINY_MODEL`: 1 layer, 32 wide, tied embeddings)."""
    return load_config(overrides=TINY_MODEL).model


# -- synthetic rows ---------------------------------------------------------------------------


class Rows:
    """Seeded random token rows: prompts of 3-8 tokens, completions of 2-8 tokens ending in EOS
    (no padding id inside a row, so the reward model's last-token pooling sees the real end)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def _ids(self, low: int, high: int, ids: range = range(2, VOCAB)) -> list[int]:
        return [self.rng.choice(ids) for _ in range(self.rng.randint(low, high))]

    def prompt(self) -> list[int]:
        return self._ids(3, 8)

    def completion(self, ids: range = range(2, VOCAB), low: int = 2, high: int = 8) -> list[int]:
        return self._ids(low, high, ids) + [EOS_ID]

    def sft(self, n: int, ids: range = range(2, VOCAB), low: int = 2, high: int = 8) -> list[dict]:
        """``input_ids`` / ``loss_mask`` (the prepared ``sft/*`` columns) and their parts; the
        completions' tokens from ``ids``, ``low`` to ``high`` of them before the EOS."""
        rows = []
        for _ in range(n):
            prompt, completion = self.prompt(), self.completion(ids, low, high)
            rows.append(
                {
                    "input_ids": prompt + completion,
                    "loss_mask": [0] * len(prompt) + [1] * len(completion),
                    "prompt": prompt,
                    "completion": completion,
                }
            )
        return rows

    def pairs(self, n: int) -> list[dict]:
        """``chosen_*`` / ``rejected_*`` (the prepared ``preference/*`` columns) and their parts."""
        rows = []
        for _ in range(n):
            prompt, chosen, rejected = self.prompt(), self.completion(), self.completion()
            rows.append(
                {
                    "chosen_input_ids": prompt + chosen,
                    "chosen_loss_mask": [0] * len(prompt) + [1] * len(chosen),
                    "rejected_input_ids": prompt + rejected,
                    "rejected_loss_mask": [0] * len(prompt) + [1] * len(rejected),
                    "prompt": prompt,
                    "chosen": chosen,
                    "rejected": rejected,
                }
            )
        return rows

    def unpaired(self, n: int, completion_tokens: int) -> list[dict]:
        """KTO's prompt, completion and label (True = desirable, drawn with probability 1/2), every
        completion ``completion_tokens`` long with its EOS: a row's KL sequence (its prompt with
        another row's completion) is then as long as the row itself, whichever completion it gets,
        so the length-bucketed sampler's batches do not depend on the KL pairing
        (:func:`set_kl_completions` adds it afterwards, from those batches)."""
        rows = []
        for _ in range(n):
            completion = self.completion(low=completion_tokens - 1, high=completion_tokens - 1)
            rows.append({"prompt": self.prompt(), "completion": completion, "label": self.rng.random() < 0.5})
        return rows


def set_kl_completions(rows: list[dict], batches: Sequence[Sequence[int]]) -> None:
    """Give KTO rows (in place) the prepared ``kto/*`` columns (``input_ids``, ``loss_mask``,
    ``kl_input_ids``, ``kl_loss_mask``) with their mismatched KL sequences as TRL builds them: within
    each batch of ``batches`` (row indices) the completions rotate by one, ``(x_1, y_n), (x_2, y_1),
    ..., (x_n, y_{n-1})`` (``KTOTrainer._prepare_dataset``, ``add_kl_completion_ids``), so a batch's
    KL completions are its own completions paired with other prompts. A row in several batches
    keeps the last one's."""
    for batch in batches:
        members = [rows[i] for i in batch]
        rotated = [members[-1]["completion"]] + [m["completion"] for m in members[:-1]]
        for row, kl in zip(members, rotated):
            prompt, completion = row["prompt"], row["completion"]
            row.update(
                {
                    "kl_completion": kl,
                    "input_ids": prompt + completion,
                    "loss_mask": [0] * len(prompt) + [1] * len(completion),
                    "kl_input_ids": prompt + kl,
                    "kl_loss_mask": [0] * len(prompt) + [1] * len(kl),
                }
            )


def drawn_batches(source: BatchSource, num_batches: int) -> list[list[int]]:
    """The row indices of the first ``num_batches`` micro-batches ``source`` yields from the start
    (its sampler's epochs one after another)."""
    stream = iterate_batches(source.sampler, DataPosition(0, 0))
    return [indices for indices, _ in itertools.islice(stream, num_batches)]


def drawn_order(source: BatchSource, num_batches: int) -> list[int]:
    """:func:`drawn_batches` flattened: the order TRL's sequential sampler must read its rows in."""
    return [i for batch in drawn_batches(source, num_batches) for i in batch]


# -- the project's side -----------------------------------------------------------------------


@dataclass
class ProjectRun:
    """The project's loop after training.

    Attributes:
        logged: global step -> every metric the loop emitted at that step (``train/*``; ``eval/*``
            at step 0 and at the last step).
        model: the trained model.
        optimizer: its optimizer.
    """

    logged: dict[int, dict[str, float]]
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def series(self, key: str, steps: int = STEPS) -> list[float]:
        """``train/<key>`` of steps 1 .. ``steps``."""
        return [float(self.logged[s][f"train/{key}"]) for s in range(1, steps + 1)]

    def final_eval(self) -> dict[str, float]:
        """``eval/*`` of the last step, without the prefix."""
        last = max(self.logged)
        return {k.removeprefix("eval/"): float(v) for k, v in self.logged[last].items() if k.startswith("eval/")}


def train_project(
    model: nn.Module, objective: Objective, source: BatchSource, cfg: TrainStageConfig, workdir: Path
) -> ProjectRun:
    """Train ``model`` with :class:`TrainLoop` on the single-device CPU backend in fp32; no checkpoint
    is written (``cfg.save_every`` beyond ``cfg.max_steps``)."""
    assert cfg.save_every > cfg.max_steps and cfg.grad_accum_steps == 1
    backend = build_backend(BackendConfig(name="single", device="cpu", precision="fp32"))
    logged: dict[int, dict[str, float]] = {}
    session = CheckpointSession(
        str(workdir / "checkpoints"),
        backend,
        asynchronous=False,
        metrics=MetricsBuffer(printer=lambda metrics, step: logged.setdefault(step, {}).update(metrics)),
    )
    loop = TrainLoop(
        model=backend.wrap(model), backend=backend, objective=objective, batches=source, cfg=cfg, session=session
    )
    loop.run()
    return ProjectRun(logged, loop.model, loop.optimizer)


def stage_config(config_class: type[TrainStageConfig], **overrides) -> TrainStageConfig:
    """The stage config both sides train with: :data:`STEPS` steps of :data:`MICRO_BATCH` rows, no
    accumulation, 2 warmup steps then cosine to 0.1 x peak, weight decay 0.01 (on matrices), the
    default clipping (1.0) and betas (0.9, 0.95); evaluated after the last step (and, as the loop
    always does, before the first), never checkpointed."""
    settings = {
        "max_steps": STEPS,
        "micro_batch_size": MICRO_BATCH,
        "grad_accum_steps": 1,
        "warmup_steps": 2,
        "min_lr_ratio": 0.1,
        "weight_decay": 0.01,
        "eval_every": STEPS,
        "eval_max_batches": 8,
        "save_every": 10 * STEPS,
        "async_save": False,
        **overrides,
    }
    return config_class(**settings)


# -- TRL's side -------------------------------------------------------------------------------


def trl_settings(cfg: TrainStageConfig, workdir: Path, *, eval_batch_size: int = MICRO_BATCH) -> dict:
    """The arguments of TRL's config (a ``transformers.TrainingArguments``) for the optimisation
    ``cfg`` describes, every trainer's alike; each test adds its objective's own.

    The project's AdamW (``loop.build_optimizer``: fused, ``cfg.adam_betas``, torch's eps 1e-8,
    ``cfg.weight_decay`` on parameters of 2 or more dimensions) is transformers' ``adamw_torch_fused``
    with its decay groups (``Trainer.get_decay_parameter_names``: no bias, no norm); the schedule
    (``training/schedule.py``) is ``cosine_with_min_lr`` with ``min_lr_rate``; TRL's defaults that
    differ from a plain fp32 run (``bf16=True``, ``gradient_checkpointing=True``, whose current name in
    transformers is ``activation_checkpointing``) are turned off.
    """
    beta1, beta2 = cfg.adam_betas
    return dict(
        output_dir=str(workdir / "trl"),
        max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.micro_batch_size,
        per_device_eval_batch_size=eval_batch_size,
        gradient_accumulation_steps=cfg.grad_accum_steps,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        adam_beta1=beta1,
        adam_beta2=beta2,
        adam_epsilon=1e-8,
        optim="adamw_torch_fused",
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": cfg.min_lr_ratio},
        warmup_steps=cfg.warmup_steps,
        max_grad_norm=cfg.max_grad_norm,
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        **CPU_FP32_RUN,
    )


def pretokenised(trainer_class):
    """``trainer_class`` (DPOTrainer, KTOTrainer) whose ``_prepare_dataset`` returns the dataset as
    given: TRL's preparation extracts the prompt from text, appends EOS and tokenises; these rows
    are token ids already, in the columns TRL's collators read (``DataCollatorForPreference``,
    ``DataCollatorForUnpairedPreference``)."""

    class Pretokenised(trainer_class):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset

    Pretokenised.__name__ = f"Pretokenised{trainer_class.__name__}"
    return Pretokenised


@dataclass
class TRLRun:
    """A TRL trainer after ``train()`` and ``evaluate()``.

    Attributes:
        steps: global step -> the trainer's log of that step (``loss``, ``grad_norm``,
            ``learning_rate`` and the trainer's own metrics, as in ``state.log_history``).
        eval: ``evaluate()``'s metrics, without the ``eval_`` prefix.
        trainer: the trainer.
    """

    steps: dict[int, dict[str, float]]
    eval: dict[str, float]
    trainer: object = field(repr=False)

    def series(self, key: str, steps: int = STEPS) -> list[float]:
        """``key`` of steps 1 .. ``steps``."""
        return [float(self.steps[s][key]) for s in range(1, steps + 1)]


def train_trl(trainer) -> TRLRun:
    """Train and evaluate ``trainer``; its per-step logs come from ``state.log_history`` (one entry a
    step with ``logging_steps=1``; the loss is the step's, unrounded)."""
    assert not (trainer.args.bf16 or trainer.args.fp16 or trainer.args.gradient_checkpointing)
    trainer.train()
    steps = {int(h["step"]): h for h in trainer.state.log_history if "loss" in h}
    metrics = trainer.evaluate()
    return TRLRun(steps, {k.removeprefix("eval_"): float(v) for k, v in metrics.items()}, trainer)


# -- comparison -------------------------------------------------------------------------------


def check_close(
    objective: str,
    quantity: str,
    ours: Sequence[float],
    theirs: Sequence[float],
    *,
    steps: str,
    atol: float | Sequence[float] = 0.0,
    rtol: float = RTOL,
    tolerance: str | None = None,
    labels: Sequence[str] | None = None,
) -> None:
    """Assert ``|ours - theirs| <= rtol |theirs| + atol`` elementwise and record the row in
    :data:`RESULTS` (before asserting, so a failing row is in the table too).

    The recorded relative difference of an element is ``|ours - theirs| / max(|ours|, |theirs|)``
    (0 where both are 0); ``steps`` says which steps (or ``eval``) the elements are. ``atol`` may
    be one floor per element (several cases compared in one row), ``tolerance`` then says in words
    what it is, for the table; ``labels`` names each element's case in a failure's message.
    """
    assert len(ours) == len(theirs) and len(ours) > 0, (objective, quantity, len(ours), len(theirs))
    floors = [float(atol)] * len(ours) if isinstance(atol, (int, float)) else [float(a) for a in atol]
    assert len(floors) == len(ours) and (tolerance is not None or len(set(floors)) == 1), (objective, quantity)
    diffs = [abs(a - b) for a, b in zip(ours, theirs)]
    rels = [d / max(abs(a), abs(b)) if d else 0.0 for d, a, b in zip(diffs, ours, theirs)]
    RESULTS.append(Result(objective, quantity, steps, max(rels), max(diffs), rtol, max(floors), tolerance=tolerance))
    bad = [i for i, (d, b, f) in enumerate(zip(diffs, theirs, floors)) if not d <= rtol * abs(b) + f]
    shown = bad[:10]
    where = [labels[i] for i in shown] if labels is not None else shown
    assert not bad, (
        f"{objective} {quantity} ({steps}): {len(bad)} element(s) differ beyond tolerance, e.g. project "
        f"{[ours[i] for i in shown]} vs TRL {[theirs[i] for i in shown]} at {where} "
        f"(rtol {rtol}, atol {[floors[i] for i in shown]})"
    )


def check_departure(
    objective: str, quantity: str, one: float, other: float, *, steps: str, minimum: float = 10 * RTOL
) -> None:
    """Assert that the two definitions of a pinned departure differ by more than ``minimum``
    relative here, an order of magnitude above the comparisons' :data:`RTOL` (so the checks of each
    definition could not pass with the other), and record the size in :data:`RESULTS`."""
    diff = abs(one - other)
    rel = diff / max(abs(one), abs(other))
    RESULTS.append(Result(objective, quantity, steps, rel, diff, minimum, 0.0, departure=True))
    assert rel > minimum, f"{objective} {quantity}: {one} and {other} differ by only {rel:.2g} relative"


def check_departure_vectors(
    objective: str, quantity: str, one: torch.Tensor, other: torch.Tensor, *, steps: str, minimum: float = 10 * RTOL
) -> None:
    """:func:`check_departure` of two vectors (a gradient under two definitions): their difference's
    L2 norm relative to the larger of their norms must exceed ``minimum``; records it (the max.
    abs. diff column: the largest element difference)."""
    diff = (one - other).float()
    rel = float(diff.norm()) / max(float(one.norm()), float(other.norm()))
    RESULTS.append(Result(objective, quantity, steps, rel, float(diff.abs().max()), minimum, 0.0, departure=True))
    assert rel > minimum, f"{objective} {quantity}: the two differ by only {rel:.2g} relative (L2)"


def check_weights(objective: str, ours: nn.Module, theirs: nn.Module, atol: float) -> None:
    """The final weights, tensor by tensor: ``|ours - theirs| <= RTOL |theirs| + atol`` elementwise;
    records the largest element differences. ``atol``: the caller's floor for weights near 0."""
    theirs_state = theirs.state_dict()
    max_rel, max_abs, bad = 0.0, 0.0, []
    for name, tensor in ours.state_dict().items():
        other = theirs_state[name]
        diff = (tensor - other).abs()
        scale = torch.maximum(tensor.abs(), other.abs())
        rel = torch.where(diff > 0, diff / scale.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(diff))
        max_rel, max_abs = max(max_rel, float(rel.max())), max(max_abs, float(diff.max()))
        if not bool((diff <= RTOL * other.abs() + atol).all()):
            bad.append(name)
    RESULTS.append(Result(objective, "final weights (every element)", "after last", max_rel, max_abs, RTOL, atol))
    assert not bad, f"{objective}: final weights differ beyond tolerance in {bad}"


def check_same_optimizer(run: ProjectRun, trainer) -> None:
    """The two optimizers are configured alike: the same AdamW hyperparameters, and each parameter
    (by name) in a group of the same weight decay and peak learning rate. Structural: it fails
    where a transformers or project default moves (fused, eps, the decay groups) before any number
    is compared."""

    def groups(optimizer, model) -> dict[tuple[float, float], set[str]]:
        names = {id(p): n for n, p in model.named_parameters()}
        out: dict[tuple[float, float], set[str]] = {}
        for group in optimizer.param_groups:
            key = (group["weight_decay"], group["initial_lr"])
            out.setdefault(key, set()).update(names[id(p)] for p in group["params"])
        return {key: members for key, members in out.items() if members}

    ours = run.optimizer
    theirs = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's AcceleratedOptimizer
    keys = ("betas", "eps", "amsgrad", "maximize", "fused")
    assert type(theirs) is type(ours)
    assert {k: theirs.defaults[k] for k in keys} == {k: ours.defaults[k] for k in keys}
    assert groups(theirs, trainer.model) == groups(ours, run.model)


def lr_zero_steps(run: ProjectRun, steps: int = STEPS) -> int:
    """How many first steps run on the initial weights: step s forwards the weights after steps
    1 .. s-1, unchanged while their learning rates were all 0 (the warmup's first step)."""
    lrs = run.series("lr", steps)
    count = 1
    while count < steps and lrs[count - 1] == 0.0:
        count += 1
    return count


def copy_of(model: nn.Module) -> nn.Module:
    """An independent copy (TRL patches its models' ``forward`` in place: ``add_fused_lm_head``)."""
    return copy.deepcopy(model)
