"""The fixed GRPO rollout of the TRL parity tests and the project's side of them, shared by
``test_grpo_parity.py`` and ``test_rloo_parity.py``.

The rollout: 3 prompts (left-padded: 3, 5 and 8 tokens), 4 completions of each (1 to 8 tokens,
one cut at ``max_new_tokens`` without its EOS) and their rewards (one group of equal rewards);
the weights (fixture :func:`weights`: the initial model is the reference, "old" and "current"
perturbations of it); the project's :class:`~trainer_core.training.rl.trainer.RLTrainer` built
on them (:func:`project_trainer`: a generation engine that replays the fixed completions, an
optimizer that records the gradients it is given); and the gathering of compared elements. The
tolerances ("module docstring" below) are explained in ``test_grpo_parity.py``'s docstring.

A test module that uses the fixtures imports them (:func:`one_thread`, autouse, and
:func:`weights`), so that each module gets its own module-scoped instances.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from tests.parity.trl_oracle import (
    CPU_FP32_RUN,
    EOS_ID,
    PAD_ID,
    SEED,
    check_close,
    copy_of,
    tiny_model_config,
    word_tokenizer,
)
from trainer_core.backends import build_backend
from trainer_core.checkpoint.session import CheckpointSession
from trainer_core.config import BackendConfig, GRPOConfig
from trainer_core.generation.engines import Generated, GenerationEngine
from trainer_core.modeling.forwards.completion import PolicyAndValue
from trainer_core.modeling.models import load_causal_lm
from trainer_core.training.rl.algorithms import GRPOAlgorithm
from trainer_core.training.rl.rewards import PromptItem
from trainer_core.training.rl.rollout import RolloutBatch
from trainer_core.training.rl.trainer import RLTrainer

RTOL = 1e-5
"""The issue's bar for the fixed-batch GRPO comparisons (see the module docstring)."""
LOGP_SPACING = 2.0**-21
"""fp32's spacing at the log-probs here (|log-prob| in [4, 8)): 4.8e-7."""
FIXED = "fixed batch"
GROUP_SIZE = 4
MAX_NEW_TOKENS = 8
TEMPERATURE = 0.7
CLIP_EPS = 0.2

PROMPTS = [[5, 17, 29], [40, 41, 42, 43, 44], [60, 2, 71, 3, 88, 9, 10, 11]]
"""Three prompts of unequal lengths (both sides left-pad them)."""
COMPLETIONS = [
    [[12, 13, EOS_ID], [14, EOS_ID], [20, 21, 22, 23, 24, EOS_ID], [EOS_ID]],
    [[30, 31, 32, 33, 34, 35, 36, 37], [50, 51, EOS_ID], [52, EOS_ID], [53, 54, 55, 56, EOS_ID]],
    [[70, 72, EOS_ID], [73, 74, 75, EOS_ID], [76, EOS_ID], [77, 78, 79, 80, 81, 82, EOS_ID]],
]
"""Four completions of each prompt, EOS included (one of 8 tokens without it: cut at ``max_new_tokens``)."""
REWARDS = [[1.0, 0.0, 0.5, 0.0], [0.2, 0.9, 0.4, 0.7], [1.0, 1.0, 1.0, 1.0]]
"""The rewards of :data:`COMPLETIONS`; the last group's are all equal (advantages 0, std 0)."""


# -- the fixed rollout ------------------------------------------------------------------------


def padded_completions(rows: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    """[N, T] completion ids (``PAD_ID`` after each row's end) and float mask of ``rows``, each a
    (prompt, completion) index pair."""
    width = max(len(COMPLETIONS[p][j]) for p, j in rows)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, (p, j) in enumerate(rows):
        tokens = COMPLETIONS[p][j]
        ids[i, : len(tokens)] = torch.tensor(tokens)
        mask[i, : len(tokens)] = 1.0
    return ids, mask


def prompt_text(p: int) -> str:
    """Prompt ``p`` as the word tokenizer writes it (``t<id>`` words)."""
    return " ".join(f"t{i}" for i in PROMPTS[p])


class ReplayEngine(GenerationEngine):
    """A generation engine that replays :data:`COMPLETIONS`: the i-th row of a prompt in a
    ``generate`` call gets that prompt's i-th completion. ``rows``: the (prompt, completion) of
    each row it returned, in order."""

    name = "replay"

    def __init__(self) -> None:
        self.rows: list[tuple[int, int]] = []

    def _sample(self, prompt_ids, prompt_mask, gen, eos_id, pad_id, generator, session=None) -> Generated:
        assert gen.max_new_tokens == MAX_NEW_TOKENS and eos_id == EOS_ID and pad_id == PAD_ID
        seen: dict[int, int] = {}
        for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist()):
            p = PROMPTS.index([t for t, m in zip(ids, mask) if m])
            self.rows.append((p, seen.get(p, 0)))
            seen[p] = seen.get(p, 0) + 1
        ids, mask = padded_completions(self.rows)
        return Generated(ids, mask, torch.zeros_like(mask))

    def load_weights(self, model: nn.Module) -> None:
        pass

    def release(self) -> None:
        pass


def fixed_rewards(rows: list[tuple[int, int]], texts: list[str]) -> Tensor:
    """:data:`REWARDS` of ``rows``, after checking that ``texts`` are their completions decoded."""
    expected = [" ".join(f"t{t}" for t in COMPLETIONS[p][j] if t != EOS_ID) for p, j in rows]
    assert texts == expected, (texts, expected)
    return torch.tensor([REWARDS[p][j] for p, j in rows])


# -- the weights ------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One compute thread for the module (restored after), as in ``test_trl_parity.py``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Weights:
    """The initial model (the reference; saved in ``directory``, where TRL builds its reference
    from) and the parameters of the policy when the rollout is scored (``old``) and at the update
    (``current``), by name (the tied LM head once, as ``model.embed_tokens.weight``)."""

    initial: nn.Module
    directory: Path
    old: dict[str, Tensor]
    current: dict[str, Tensor]


def perturbed(params: dict[str, Tensor], std: float, generator: torch.Generator) -> dict[str, Tensor]:
    """``params`` plus Gaussian noise of ``std`` times each matrix's own std (1-D norm weights kept)."""
    return {
        k: v + std * float(v.std()) * torch.randn(v.shape, generator=generator) if v.ndim > 1 else v.clone()
        for k, v in params.items()
    }


def load(model: nn.Module, params: dict[str, Tensor]) -> None:
    """Set ``model``'s parameters (a causal LM, or its :class:`PolicyAndValue`'s policy) to ``params``."""
    missing, unexpected = model.load_state_dict(params, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Weights:
    """The suite's tiny model (``load_causal_lm("init", ...)``, seeded) is the reference; the old
    policy is it with every matrix perturbed by its own std, the current one the old perturbed by
    3/4 of it more: ratios from 0.53 to 1.61, 37% of the tokens outside [0.8, 1.2] (11% of the
    tokens clipped in the loss with the symmetric range, 9% with clip-higher: 0.28 makes a
    difference), a mean k3 KL to the reference of 0.056."""
    initial = load_causal_lm("init", tiny_model_config(), word_tokenizer(), SEED).eval()
    directory = tmp_path_factory.mktemp("grpo-initial")
    initial.save_pretrained(directory)
    generator = torch.Generator().manual_seed(SEED)
    old = perturbed({k: v.detach() for k, v in initial.named_parameters()}, 1.0, generator)
    return Weights(initial, directory, old, perturbed(old, 0.75, generator))


# -- the project's side -----------------------------------------------------------------------


class GradientRecorder(torch.optim.Optimizer):
    """An optimizer that changes nothing: its ``step`` keeps a copy of every gradient (by parameter
    name, ``policy.`` dropped), as the loop's optimizer step is given them."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__([p for _, p in named], {})
        self.names = {id(p): n.removeprefix("policy.") for n, p in named}
        self.grads: dict[str, Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.grads[self.names[id(p)]] = p.grad.detach().clone()


@dataclass
class Side:
    """What one side computed on the fixed batch.

    Attributes:
        rows: (prompt, completion) of each row, in the side's order.
        mask: [N, T] completion mask.
        advantages: [N] per completion.
        old_logprobs, ref_logprobs: [N, T], 0 on padding (ref None without the KL term).
        loss: the loss.
        grads: parameter name -> gradient.
        metrics: ``kl`` (with the KL term), ``clip_ratio``, ``entropy``: means over the tokens.
    """

    rows: list[tuple[int, int]]
    mask: Tensor
    advantages: Tensor
    old_logprobs: Tensor
    ref_logprobs: Tensor | None
    loss: float
    grads: dict[str, Tensor]
    metrics: dict[str, float]


def project_trainer(cfg: GRPOConfig, weights: Weights) -> tuple[RLTrainer, ReplayEngine]:
    """The project's RL trainer as ``stages/rl_common.py`` builds it (single-device backend, fp32; a
    reference only with the KL term), the policy at the old weights, the engine a
    :class:`ReplayEngine`, the reward the fixed rewards, the optimizer a :class:`GradientRecorder`."""
    backend = build_backend(BackendConfig(name="single", device="cpu", precision="fp32"))
    policy = copy_of(weights.initial)
    load(policy, weights.old)
    reference = copy_of(weights.initial).eval() if cfg.kl_coef > 0 else None
    items = [PromptItem([{"role": "user", "content": prompt_text(p)}], PROMPTS[p], None) for p in range(len(PROMPTS))]
    engine = ReplayEngine()
    trainer = RLTrainer(
        backend=backend,
        tokenizer=word_tokenizer(),
        cfg=cfg,
        algo=GRPOAlgorithm(cfg),
        model=backend.wrap(PolicyAndValue(policy)),
        reference=reference,
        reward_fn=lambda prompts, texts: fixed_rewards(engine.rows[-len(texts) :], texts),
        prompts=items,
        seed=SEED,
        session=CheckpointSession("memory://grpo-parity", backend),
    )
    trainer.engine = engine
    trainer.optimizer = GradientRecorder(list(trainer.model.named_parameters()))
    return trainer, engine


def project_side(
    trainer: RLTrainer, engine: ReplayEngine, batch: RolloutBatch, metrics: dict[str, Tensor], kl: bool
) -> Side:
    """The project's :class:`Side` of ``batch`` (a rollout of :func:`project_trainer`'s ``trainer``,
    whose ``engine`` replayed it) and of ``metrics``, what ``RLTrainer.train_step`` on it returned;
    the ``kl`` mean only with the KL term (``kl``). The advantages are the first token's of each row
    (the caller checks that each completion's are one value)."""
    side = Side(
        engine.rows,
        batch.completion_mask,
        batch.advantages[:, 0],
        batch.logprobs,
        batch.ref_logprobs,
        float(metrics["train/loss"]),
        trainer.optimizer.grads,
        {"clip_ratio": float(metrics["policy/clipfrac_avg"]), "entropy": float(metrics["policy/entropy_avg"])},
    )
    if kl:
        side.metrics["kl"] = float(metrics["policy/kl_avg"])
    return side


# -- TRL's side -------------------------------------------------------------------------------


def trl_model(weights: Weights) -> nn.Module:
    """The policy TRL's trainers start from: a copy of the initial model whose config names
    ``weights.directory`` (TRL builds its reference from there)."""
    model = copy_of(weights.initial)
    model.config._name_or_path = str(weights.directory)
    return model


def trl_reward(rows: list[tuple[int, int]]):
    """TRL's reward function of ``rows``: their :data:`REWARDS`, after checking that the completion
    ids it is given are theirs."""

    def reward(prompts, completions, completion_ids, **kwargs):
        assert completion_ids == [COMPLETIONS[p][j] for p, j in rows]
        return [REWARDS[p][j] for p, j in rows]

    return reward


def trl_rollout_settings(rows: list[tuple[int, int]], workdir: Path) -> dict:
    """The arguments of TRL's GRPO and RLOO configs both tests share: the rows one generation of
    groups of :data:`GROUP_SIZE` and one optimizer step, the fixed batch's sampling settings, the
    symmetric clip :data:`CLIP_EPS` (``epsilon``), fp32 on the CPU; each test adds its estimator's."""
    return dict(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=len(rows),
        steps_per_generation=1,
        num_generations=GROUP_SIZE,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
        epsilon=CLIP_EPS,
        max_steps=1,
        **CPU_FP32_RUN,
    )


def trl_logged(trainer) -> dict[str, float]:
    """The per-token means TRL's last ``compute_loss`` logged: ``clip_ratio``
    (``clip_ratio/region_mean``), ``entropy`` and, with ``beta``, ``kl``."""
    logged = trainer._metrics["train"]
    metrics = {"clip_ratio": logged["clip_ratio/region_mean"][-1], "entropy": logged["entropy"][-1]}
    if trainer.beta:
        metrics["kl"] = logged["kl"][-1]
    return metrics


def trl_grads(trainer) -> dict[str, Tensor]:
    """A copy of every gradient of TRL's model, by parameter name (those without one left out)."""
    return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


# -- the comparison ---------------------------------------------------------------------------


def flat(grads: dict[str, Tensor]) -> Tensor:
    """Every gradient element, the parameters in name order."""
    return torch.cat([grads[n].flatten() for n in sorted(grads)])


SCALED = "rel 1e-05 + abs 1e-05 x max abs(A)"
"""The tolerance of the advantages and the loss (module docstring)."""
GRAD_SCALED = "rel 1e-05 + abs 1e-05 x max abs(grad)"
"""The tolerance of a gradient element (module docstring)."""


@dataclass
class Gathered:
    """The elements of one table row gathered over several cases: project, TRL, per-element floor,
    the case of each element."""

    ours: list[float] = field(default_factory=list)
    theirs: list[float] = field(default_factory=list)
    floors: list[float] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)

    def add(self, label: str, ours: Tensor | list[float], theirs: Tensor | list[float], floor: float) -> None:
        ours, theirs = torch.as_tensor(ours).flatten().tolist(), torch.as_tensor(theirs).flatten().tolist()
        self.ours += ours
        self.theirs += theirs
        self.floors += [floor] * len(ours)
        self.labels += [label] * len(ours)

    def check(self, objective: str, quantity: str, tolerance: str, steps: str = FIXED) -> None:
        """One table row: ``check_close`` of the gathered elements to :data:`RTOL` relative plus each
        one's floor (``tolerance`` names it); nothing when none were gathered."""
        if self.ours:
            check_close(
                objective,
                quantity,
                self.ours,
                self.theirs,
                steps=steps,
                rtol=RTOL,
                atol=self.floors,
                tolerance=tolerance,
                labels=self.labels,
            )
