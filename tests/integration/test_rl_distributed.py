"""Online RL stages at 2 gloo ranks on CPU, launched the way the stage tasks launch them
(``torchrun`` through ``tasks.launch.process``): PPO and GRPO (with the ptx term) on DDP, FSDP2 and
DeepSpeed ZeRO-3 commit an HF policy with finite metrics; the backends train the same policy
(same prompts and samples per rank, the loss normalised by the tokens of every rank); a 2-rank FSDP2 PPO run SIGKILLed after a
checkpoint resumes to the same metrics and weights as an uninterrupted one.

In-process checks, ranks stood in for by threads (no launcher, a second each): a PPO step split
over 2 ranks equals the one-device step (loss normalised by the tokens of both ranks, clipping
by the global norm), also with fewer rows per rank than mini-batches (a rank without rows
forwards a masked row), PPO's whitening over ranks equals whitening the whole batch, lockstep
sampling runs every rank's forwards and returns what each samples alone, and the world-size
checks of the config name the field.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import threading
from dataclasses import dataclass

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tasks.launch.process import launch_stage_process, trainer_command
from tests.tiny import LLAMA_1X16
from trainer_core import storage
from trainer_core.backends.single import SingleDeviceBackend
from trainer_core.checkpoint.manifest import read_manifest
from trainer_core.checkpoint.session import CheckpointSession
from trainer_core.config import GenerationConfig, GRPOConfig, PPOConfig, load_config
from trainer_core.errors import ConfigError
from trainer_core.generation.engines import HFEngine
from trainer_core.modeling.forwards.completion import PolicyAndValue, value_head_for
from trainer_core.objectives.ppo import whiten
from trainer_core.spec import StageSpec, build_spec
from trainer_core.storage import StageLayout, join_uri
from trainer_core.training.rl.algorithms import PPOAlgorithm
from trainer_core.training.rl.rollout import RolloutBatch
from trainer_core.training.rl.trainer import RLTrainer, check_rl_config

from .helpers import (
    RUN_ID,
    StageRun,
    TinyPipeline,
    after_checkpoint,
    assert_same_weights,
    child_env,
    final_weights,
    wider_teacher,
    write_spec,
)
from .rl_runs import RL_OVERRIDES

RL_STEPS = 6
RL_SAVE_EVERY = 2
"""Iterations of each run and checkpoint period: the kill lands between two checkpoints."""

_RL_OVERRIDES = {
    **RL_OVERRIDES,  # the single-process runs' settings, shorter, with checkpoints every 2 steps
    "max_steps": RL_STEPS,
    "save_every": RL_SAVE_EVERY,
    "prompts_per_rollout": 4,  # 2 per rank
    "generation.max_new_tokens": 8,
}
_STAGE_OVERRIDES = {
    # Adaptive KL: the controller is replicated state, fed the KL of every rank's sequences.
    # The ptx term under PPO: DDP needs the value head in its synchronising backward.
    "ppo": {"adaptive_kl": True, "kl_target": 0.5, "kl_horizon": 100, "ptx_coef": 0.5, "ptx_rows_per_step": 2},
    # The learned reward (the tiny policy almost never earns the verifier's): non-zero
    # advantages, and a frozen reward model sharded under FSDP2 / ZeRO-3 besides the reference;
    # the ptx term: one more forward and backward per step on every rank.
    "grpo": {"group_size": 4, "kl_coef": 0.05, "reward.kind": "reward_model", "ptx_coef": 0.5, "ptx_rows_per_step": 2},
    # The generalised JSD over the vocabulary: the teacher (wider, sharded too) forwards in every
    # update step, its head gathered whole once; lmbda 0.5: iterations on the dataset's
    # completions too (the same draw on both ranks: their forwards run in lockstep).
    "distill": {
        "loss": "generalized_jsd",
        "beta": 0.5,
        "lmbda": 0.5,
        "samples_per_prompt": 2,
        "ptx_coef": 0.5,
        "ptx_rows_per_step": 2,
    },
}
SAMPLES_PER_PROMPT = {"grpo": 4, "distill": 2, "ppo": 1}


@dataclass(frozen=True)
class Case:
    """One 2-rank run: the stage and its backend."""

    stage: str
    backend: str
    zero_stage: int | None = None

    @property
    def name(self) -> str:
        return f"{self.stage}-{self.backend}{self.zero_stage or ''}"


CASES = [
    Case("grpo", "fsdp2"),
    Case("grpo", "deepspeed", 3),
    Case("ppo", "ddp"),
    Case("ppo", "fsdp2"),
    Case("distill", "fsdp2"),
    Case("distill", "deepspeed", 3),
]
RESUME_CASE = Case("ppo", "fsdp2")
RESUMED = re.compile(r"resumed from \S*step-(\d+)")


class LineLog:
    """``tasks.launch.process`` line sink; ``stop_when(lines)`` True raises :class:`Killed` (the launcher
    then SIGKILLs every process of the launch, torchrun and both ranks)."""

    def __init__(self, stop_when=None) -> None:
        self.lines: list[str] = []
        self.stop_when = stop_when

    def info(self, msg, *args) -> None:
        self.lines.append(msg % args if args else msg)
        if self.stop_when is not None and self.stop_when(self.lines):
            raise Killed


class Killed(Exception):
    """Raised from the line sink to have the launcher kill the stage."""


def case_spec(pipeline: TinyPipeline, case: Case, name: str) -> tuple[str, str, StageSpec]:
    """Write the spec of ``case`` running as ``name``; returns (spec path, output URI, spec)."""
    overrides = {f"{case.stage}.{k}": v for k, v in {**_RL_OVERRIDES, **_STAGE_OVERRIDES[case.stage]}.items()}
    teacher = None
    if case.stage == "distill":
        teacher = wider_teacher(pipeline, os.path.join(pipeline.root, "rl-dist", "teacher"))
    if teacher is not None:
        overrides["distill.teacher_from"] = teacher
    overrides.update({"backend.name": case.backend, "backend.nproc_per_node": 2, "backend.device": "cpu"})
    if case.zero_stage is not None:
        overrides["backend.zero_stage"] = case.zero_stage
    config = load_config(base=pipeline.config.model_dump(mode="json"), overrides=overrides)
    sft = StageLayout(pipeline.baseline_uris["sft"]).final
    inputs = {
        "data": pipeline.data_uri,
        "model": sft,
        "reference": teacher or sft,
        "reward_model": StageLayout(pipeline.baseline_uris["reward_model"]).final,
    }
    output = os.path.join(pipeline.root, "rl-dist", name)
    spec = build_spec(config, case.stage, RUN_ID, inputs, output_uri=output, writer_id=f"writer-{name}")
    return write_spec(spec, os.path.join(pipeline.root, "specs", f"rl-dist-{name}.json")), output, spec


def launch(spec_path: str, spec: StageSpec, stop_when=None) -> StageRun:
    """Run the stage's ranks under torchrun (``tasks.launch.process``); kill them all once ``stop_when`` holds."""
    log = LineLog(stop_when)
    cmd = trainer_command(spec_path, spec.config.backend_for(spec.stage), f"itest-{spec.stage}")
    try:
        result = launch_stage_process(cmd, env=child_env(), log=log, timeout_s=300)
    except Killed:
        return StageRun(returncode=-9, lines=log.lines, killed=True, wall_s=0.0)
    return StageRun(returncode=result.returncode, lines=log.lines, killed=False, wall_s=result.wall_s)


@pytest.fixture(scope="module")
def runs(tiny_pipeline: TinyPipeline) -> dict[Case, tuple[str, StageRun]]:
    """Every case run once to the end: case -> (output URI, run)."""
    out = {}
    for case in CASES:
        path, output, spec = case_spec(tiny_pipeline, case, case.name)
        run = launch(path, spec)
        assert run.returncode == 0, f"{case.name}:\n{run.tail(60)}"
        out[case] = (output, run)
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_two_ranks_commit_an_hf_policy_with_finite_metrics(tiny_pipeline, runs, case):
    output, run = runs[case]
    steps = run.step_metrics()  # rank 0's lines only: one line per step
    assert sorted(steps) == list(range(1, RL_STEPS + 1)), run.tail()
    assert sum(f"[{case.stage}] step 1:" in line for line in run.lines) == 1
    for step, metrics in steps.items():
        # distill's dataset iterations: no reward, and no KL estimate (it holds over samples only)
        sampled = float(metrics.get("rollout/on_policy", 1.0)) == 1.0
        assert {"loss/policy_avg", "train/grad_norm", "train/loss"} <= set(metrics)
        assert ("reward_mean" in metrics) == sampled and ("objective/kl" in metrics) == sampled
        bad = {k: v for k, v in metrics.items() if not math.isfinite(float(v))}
        assert not bad, f"step {step}: {bad}"
        assert float(metrics["train/consumed_samples"]) == step * 4 * SAMPLES_PER_PROMPT[case.stage]
        assert "train/ptx_loss" in metrics  # both stages take the ptx term here
    manifest = read_manifest(StageLayout(output).final)
    assert (manifest.global_step, manifest.world_size, manifest.backend) == (RL_STEPS, 2, case.backend)
    policy, sft = final_weights(output), final_weights(tiny_pipeline.baseline_uris["sft"])
    assert sorted(policy) == sorted(sft)  # HF names of the policy only: no value head, no wrapper prefix
    assert all(torch.isfinite(t).all() for t in policy.values())
    assert any(not torch.equal(policy[k], sft[k]) for k in sft)  # trained
    files = storage.list_files(StageLayout(output).final)
    if case.stage == "ppo":
        head = safetensors.torch.load(storage.read_bytes(join_uri(StageLayout(output).final, "value_head.safetensors")))
        assert head["weight"].shape == (1, tiny_pipeline.config.model.init.hidden_size)
        assert head["weight"].abs().sum() > 0  # trained away from its zero init
        assert len({m["objective/kl_coef"] for m in steps.values()}) > 1  # the adaptive controller moved
    else:
        assert "value_head.safetensors" not in files
    if case.stage == "distill":
        assert all(float(m["distill/jsd_avg"]) > 0 for m in steps.values())
        assert {float(m["rollout/on_policy"]) for m in steps.values()} == {0.0, 1.0}


@pytest.mark.parametrize("stage", ["ppo", "grpo", "distill"])
def test_backends_train_the_same_policy(runs, stage):
    """Each rank samples the same prompts with the same generator whatever the backend, and the
    step's loss is normalised by the tokens of both ranks on each: the final policies differ only
    by float reduction order (measured: <= 3e-7)."""
    weights = {c: final_weights(output) for c, (output, _) in runs.items() if c.stage == stage}
    (first, reference), *others = weights.items()
    for case, got in others:
        worst = max((got[k] - reference[k]).abs().max().item() for k in reference)
        assert worst < 1e-5, f"{case.name} vs {first.name}: max |diff| {worst}"


def test_fsdp2_sigkill_after_checkpoint_then_resume_matches_uninterrupted(tiny_pipeline, runs):
    """Both ranks are SIGKILLed once the step-2 checkpoint (DCP shards, per-rank RNG, the sampler
    generators of both ranks, the KL controller) is committed and step 3 ran; the relaunch
    resumes from it and prints the uninterrupted run's metrics for the later steps, and commits
    the same weights."""
    path, output, spec = case_spec(tiny_pipeline, RESUME_CASE, f"{RESUME_CASE.name}-killed")
    committed = after_checkpoint(output, RL_SAVE_EVERY)
    killed = launch(
        path, spec, stop_when=lambda lines: f"[ppo] step {RL_SAVE_EVERY + 1}:" in lines[-1] and committed(lines)
    )
    assert killed.killed, killed.tail()
    resumed = launch(path, spec)
    assert resumed.returncode == 0, resumed.tail(60)
    found = [m for x in resumed.lines if (m := RESUMED.search(x))]
    assert found, resumed.tail()
    start = int(found[0][1])
    assert RL_SAVE_EVERY <= start < RL_STEPS
    base_output, base_run = runs[RESUME_CASE]
    want = {s: m for s, m in base_run.step_metrics().items() if s > start}
    assert resumed.step_metrics() == want
    assert_same_weights(final_weights(output), final_weights(base_output))
    heads = [
        storage.read_bytes(join_uri(StageLayout(o).final, "value_head.safetensors")) for o in (output, base_output)
    ]
    assert heads[0] == heads[1]


# ----- in-process checks of what the ranks share ------------------------------------------


class ThreadAllReduce:
    """A sum over ``n`` threads standing in for ranks (each calls its own :meth:`rank` function)."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n)
        self.slots: list[torch.Tensor | None] = [None] * n
        self.calls = [0] * n

    def rank(self, r: int):
        def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
            self.calls[r] += 1
            self.slots[r] = tensor.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())
            self.barrier.wait()
            return total

        return all_reduce_sum


def on_threads(fn, n: int) -> list:
    """``fn(rank)`` on ``n`` threads at once; their results in rank order."""
    results: list = [None] * n
    errors: list[BaseException] = []

    def target(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


class ThreadDDP:
    """The parts of a DDP backend ``RLTrainer.train_step`` uses, over threads: the loss scaled by
    the world size, gradients averaged over ranks before clipping and the step."""

    name, checkpoint_format, sharded_forward = "thread-ddp", "full", False
    process_group, validate_replicas = True, True

    def __init__(self, rank: int, world_size: int, all_reduce_sum) -> None:
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")
        self.all_reduce_sum = all_reduce_sum

    def setup_optimizer(self, model, optimizer, cfg):
        return model, optimizer

    def unwrap(self, model):
        return model

    def grad_sync(self, model, is_last_micro_batch: bool):
        return contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, model, loss) -> None:
        (loss * self.world_size).backward()

    def optimizer_step(self, model, optimizer, max_grad_norm, skip_nonfinite=False):
        for param in model.parameters():
            param.grad = self.all_reduce_sum(param.grad) / self.world_size
        grad_norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm


def tiny_policy(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=12,
        **LLAMA_1X16,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
    )
    return AutoModelForCausalLM.from_config(config)


def ppo_batch(lengths: list[int], prompt_tokens: int = 3, seed: int = 1) -> RolloutBatch:
    """A PPO rollout batch of random tokens, values and advantages; row i has ``lengths[i]`` real tokens."""
    torch.manual_seed(seed)
    n, t = len(lengths), max(lengths)
    c_mask = (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).float()
    return RolloutBatch(
        prompt_ids=torch.randint(2, 12, (n, prompt_tokens)),
        prompt_mask=torch.ones(n, prompt_tokens),
        completion_ids=torch.randint(2, 12, (n, t)) * c_mask.long(),
        completion_mask=c_mask,
        logprobs=(-2.5 + 0.3 * torch.randn(n, t)) * c_mask,
        scores=torch.randn(n),
        prompt_index=torch.arange(n),
        values=0.1 * torch.randn(n, t) * c_mask,
        advantages=torch.randn(n, t) * c_mask,
        returns=torch.randn(n, t) * c_mask,
    )


def ppo_trainers(cfg: PPOConfig):
    """A function ``backend -> RLTrainer`` whose trainers all start from the same tiny policy and
    value head (built here, before any thread: threads share torch's global RNG), with SGD (the
    update is the gradient, so weights compare as gradients do)."""
    policy = tiny_policy()
    initial = PolicyAndValue(policy, value_head_for(policy))
    torch.nn.init.normal_(initial.value_head.weight, std=0.1)

    def make(backend) -> RLTrainer:
        model = copy.deepcopy(initial)
        trainer = RLTrainer(
            backend=backend,
            tokenizer=None,
            cfg=cfg,
            algo=PPOAlgorithm(cfg),
            model=model,
            reference=None,
            reward_fn=None,
            prompts=[],
            seed=0,
            session=CheckpointSession("memory://rl-step", backend),
        )
        trainer.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return trainer

    return make


def weights_of(trainer: RLTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_same_step(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    """(metrics, weights) equal up to float reduction order."""
    (metrics, weights), (want_metrics, want_weights) = got, want
    assert metrics.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        assert float(metrics[k]) == pytest.approx(float(v), rel=1e-5, abs=1e-7), k
    for k, v in want_weights.items():
        torch.testing.assert_close(weights[k], v, rtol=0, atol=1e-6)


def test_two_rank_ppo_step_equals_the_one_device_step():
    """One PPO mini-batch step over 4 sequences (19 real tokens) on one device, and split 2 + 2
    over two thread ranks (12 and 7 tokens: a per-rank mean would weigh them wrongly): the same
    loss, metrics, gradient norm and updated weights."""
    batch = ppo_batch([6, 6, 5, 2])
    cfg = PPOConfig(max_grad_norm=0.5)  # the clip is active: it must see the global norm
    make = ppo_trainers(cfg)
    one = make(SingleDeviceBackend("cpu"))
    want = (one.train_step(batch), weights_of(one))
    assert float(want[0]["train/grad_norm"]) > cfg.max_grad_norm
    reduce = ThreadAllReduce(2)

    def rank(r: int):
        trainer = make(ThreadDDP(r, 2, reduce.rank(r)))
        return trainer.train_step(batch.select(torch.arange(2 * r, 2 * r + 2))), weights_of(trainer)

    for got in on_threads(rank, 2):
        assert_same_step(got, want)


def test_fewer_rows_per_rank_than_mini_batches():
    """2 sequences, 2 mini-batches, 2 ranks of 1 row each: rank 1's parts are rotated, so the
    first mini-batch is rank 0's row and the second rank 1's, the other rank forwarding a masked
    row each time; the two steps equal the one-device steps on row 0, then row 1."""
    batch = ppo_batch([6, 3])
    cfg = PPOConfig(max_grad_norm=0.5, ppo_epochs=1, num_mini_batches=2)
    make = ppo_trainers(cfg)
    one = make(SingleDeviceBackend("cpu"))
    steps = [one.train_step(batch.select(torch.tensor([i]))) for i in range(2)]
    want = ({k: sum(float(s[k]) for s in steps) / 2 for k in steps[0]}, weights_of(one))
    reduce = ThreadAllReduce(2)

    def rank(r: int):
        trainer = make(ThreadDDP(r, 2, reduce.rank(r)))
        return trainer.update(batch.select(torch.tensor([r]))), weights_of(trainer)

    for got in on_threads(rank, 2):
        assert_same_step(got, want)


def test_whitening_over_ranks_equals_whitening_the_whole_batch():
    """One rank: bit-identical to TRL's ``masked_whiten`` written out (masked mean, masked mean of
    squares times n / (n - 1)), the formula ``whiten`` had before it took ``all_reduce_sum``. Two
    ranks holding rows 0-2 and 3-5: the concatenation equals ``whiten`` of all six rows."""
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1.0
    count = mask.sum()
    mean = (x * mask).sum() / count.clamp(min=1.0)
    var = ((x - mean) ** 2 * mask).sum() / count.clamp(min=1.0) * count / (count - 1).clamp(min=1.0)
    masked_whiten = (x - mean) * torch.rsqrt(var + 1e-8) * mask
    assert torch.equal(whiten(x, mask), masked_whiten)
    assert torch.equal(whiten(x, mask, all_reduce_sum=lambda t: t), masked_whiten)
    reduce = ThreadAllReduce(2)
    halves = on_threads(
        lambda r: whiten(x[3 * r : 3 * r + 3], mask[3 * r : 3 * r + 3], all_reduce_sum=reduce.rank(r)), 2
    )
    torch.testing.assert_close(torch.cat(halves), whiten(x, mask), rtol=0, atol=1e-6)


def test_synced_sampling_runs_ranks_in_lockstep_and_returns_the_unsynced_tokens():
    """Rank 0's rows end at their first token (EOS made near-certain), rank 1's never end (EOS
    made near-impossible): alone, rank 0 runs 1 forward and rank 1 ``max_new_tokens``; with
    ``sync`` both run ``max_new_tokens``, and each returns exactly what it samples alone."""
    policy = tiny_policy().eval()
    gen = GenerationConfig(max_new_tokens=6, temperature=1.0, top_p=1.0)
    prompts = torch.tensor([[5, 6], [7, 8]])

    class Biased(torch.nn.Module):
        """The policy with the EOS logit shifted by ``eos_bias``; counts its forwards."""

        def __init__(self, eos_bias: float) -> None:
            super().__init__()
            self.eos_bias, self.calls = eos_bias, 0

        def forward(self, **kwargs):
            self.calls += 1
            out = policy(**kwargs)
            out.logits[..., 1] += self.eos_bias
            return out

    def sample(rank: int, sync) -> tuple[torch.Tensor, torch.Tensor, int]:
        model = Biased(50.0 if rank == 0 else -50.0)
        out = HFEngine(model, sync=sync).generate(
            prompts, torch.ones(2, 2), gen, eos_id=1, pad_id=0, generator=torch.Generator().manual_seed(rank)
        )
        return out.completion_ids, out.completion_mask, model.calls

    alone = [sample(r, None) for r in range(2)]
    reduce = ThreadAllReduce(2)
    synced = on_threads(lambda r: sample(r, reduce.rank(r)), 2)
    assert [calls for _, _, calls in alone] == [1, gen.max_new_tokens]
    assert [calls for _, _, calls in synced] == [gen.max_new_tokens] * 2
    assert reduce.calls == [gen.max_new_tokens - 1] * 2
    for (a_tokens, a_mask, _), (s_tokens, s_mask, _) in zip(alone, synced):
        assert torch.equal(a_tokens, s_tokens) and torch.equal(a_mask, s_mask)
    assert alone[0][0].shape == (2, 1) and alone[1][0].shape == (2, gen.max_new_tokens)


def test_world_size_checks_name_the_field():
    grpo = GRPOConfig(prompts_per_rollout=6, num_mini_batches=2)
    check_rl_config("grpo", grpo, 4, 2)
    with pytest.raises(ConfigError, match=r"grpo\.prompts_per_rollout=6 must be a multiple of the world size \(4\)"):
        check_rl_config("grpo", grpo, 4, 4)
    ppo = PPOConfig(prompts_per_rollout=2, num_mini_batches=2)
    check_rl_config("ppo", ppo, 1, 2)  # one row per rank: fine (see test_fewer_rows_per_rank_than_mini_batches)
    with pytest.raises(ConfigError, match=r"ppo\.num_mini_batches=3 exceeds the rollout batch's number of sequences"):
        check_rl_config("ppo", ppo.model_copy(update={"num_mini_batches": 3}), 1, 2)
