"""TrainLoop on a toy regression: async save, metric commit order, best-checkpoint retention, resume."""

from __future__ import annotations

import uuid

import pytest
import safetensors.torch
import torch
from torch import nn

from tests.unit.toy_session import toy_session
from trainer_core.backends.single import SingleDeviceBackend
from trainer_core import storage
from trainer_core.checkpoint.manifest import find_latest, read_manifest
from trainer_core.config import TrainStageConfig
from trainer_core.data.batching import BucketedBatchSampler
from trainer_core.checkpoint.session import MetricsBuffer
from trainer_core.storage import join_uri
from trainer_core.training.loop import BatchSource, Objective, StepOutput, TrainLoop

DEVICE = torch.device("cpu")


def _rows(n: int = 24) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    return [{"x": x[i], "y": y[i]} for i in range(n)]


def _collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {"x": torch.stack([r["x"] for r in rows]), "y": torch.stack([r["y"] for r in rows])}


class Regression(Objective):
    """Squared error per example; eval returns scripted losses when given, else the real one."""

    def __init__(self, eval_losses: list[float] | None = None) -> None:
        self.eval_losses = list(eval_losses or [])
        self.eval_rows = _collate(_rows(8))

    def count(self, batch):
        return batch["x"].shape[0]

    @staticmethod
    def _loss_sum(model, batch):
        return ((model(batch["x"]).squeeze(-1) - batch["y"]) ** 2).sum()

    def step(self, model, batch):
        return StepOutput(loss_sum=self._loss_sum(model, batch), num_tokens=batch["x"].shape[0])

    def evaluate(self, model):
        if self.eval_losses:
            return {"loss": self.eval_losses.pop(0)}
        return {"loss": float(self._loss_sum(model, self.eval_rows)) / 8}


class RecordingBuffer(MetricsBuffer):
    """A metrics buffer that records each batch handed to the tracker, and each re-commit."""

    def __init__(self) -> None:
        super().__init__(sink=None, printer=lambda metrics, step: None)
        self.committed: list = []
        self.recommitted: list = []

    def commit(self, batch):
        self.committed.append(batch)

    def recommit(self, batch):
        self.recommitted.extend(batch)
        return len(batch)


def _loop(root: str, objective=None, **cfg) -> TrainLoop:
    torch.manual_seed(0)
    rows = _rows()
    sampler = BucketedBatchSampler([1] * len(rows), micro_batch_size=4, seed=0)
    settings = dict(max_steps=6, save_every=3, eval_every=3, warmup_steps=1, learning_rate=0.05, log_every=1)
    settings.update(cfg)
    stage_cfg = TrainStageConfig(**settings)
    backend = SingleDeviceBackend("cpu")
    session = toy_session(
        root, backend, RecordingBuffer(), keep_last=stage_cfg.keep_last_checkpoints, asynchronous=stage_cfg.async_save
    )
    return TrainLoop(
        model=nn.Linear(4, 1),
        backend=backend,
        objective=objective or Regression(),
        batches=BatchSource(rows=rows, sampler=sampler, collate=_collate, device=DEVICE),
        cfg=stage_cfg,
        session=session,
    )


@pytest.fixture
def root():
    return f"memory://loop-{uuid.uuid4().hex}"


def _weights(loop: TrainLoop) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in loop.model.state_dict().items()}


def test_async_and_sync_save_write_identical_checkpoints(root):
    sync = _loop(join_uri(root, "sync"), async_save=False)
    sync.run()
    asyn = _loop(join_uri(root, "async"), async_save=True)
    asyn.run()
    for k, v in _weights(sync).items():
        assert torch.equal(v, _weights(asyn)[k])
    a = storage.read_bytes(join_uri(root, "sync/checkpoints/step-00000006/model.safetensors"))
    b = storage.read_bytes(join_uri(root, "async/checkpoints/step-00000006/model.safetensors"))
    assert a == b


def test_metrics_are_committed_only_with_their_checkpoint(root):
    """Steps 0-3 go to the tracker when step-3 commits, 4-6 with step-6; nothing twice."""
    loop = _loop(root, max_steps=7)
    loop.run()
    committed = loop.metrics.committed
    batches = [sorted({step for _, step in batch}) for batch in committed]
    assert batches[0] == [0, 1, 2, 3]
    assert batches[1] == [4, 5, 6]
    assert batches[-1] == [7]  # the tail after the last checkpoint, flushed at the end
    steps = [(step, tuple(sorted(m))) for batch in committed for m, step in batch]
    assert len(steps) == len(set(steps))


def test_best_checkpoint_survives_retention(root):
    """keep_last=1, eval loss lowest at step 3: step-3 is kept beside the newest, step-6 purged."""
    scripted = Regression(eval_losses=[5.0, 1.0, 3.0, 4.0])  # steps 0, 3, 6, 9
    loop = _loop(root, objective=scripted, max_steps=9, keep_last_checkpoints=1, async_save=False)
    loop.run()
    names = storage.list_dirs(join_uri(root, "checkpoints"))
    assert names == ["step-00000003", "step-00000009"]
    assert read_manifest(join_uri(root, "checkpoints/step-00000003")).metrics["eval/loss"] == 1.0


def test_resume_continues_bit_identically(root):
    """6 steps straight == 3 steps, a fresh process state, resume, 3 more."""
    full = _loop(join_uri(root, "full"))
    full.run()
    part = _loop(join_uri(root, "part"))
    calls = {"n": 0}
    step = part.objective.step

    def crash_after_checkpoint(model, batch):
        """Micro-batches 1-3 train (steps 1-3, checkpoint at 3); the 4th crashes."""
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return step(model, batch)

    part.objective.step = crash_after_checkpoint
    with pytest.raises(KeyboardInterrupt):
        part.run()
    assert find_latest(join_uri(root, "part/checkpoints"))[1].global_step == 3
    resumed = _loop(join_uri(root, "part"))
    assert resumed.resume()
    assert resumed.progress.global_step == 3
    resumed.run()
    for k, v in _weights(full).items():
        assert torch.equal(v, _weights(resumed)[k])
    a = safetensors.torch.load(storage.read_bytes(join_uri(root, "full/checkpoints/step-00000006/model.safetensors")))
    b = safetensors.torch.load(storage.read_bytes(join_uri(root, "part/checkpoints/step-00000006/model.safetensors")))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_hands_the_checkpoints_metrics_to_recommit(root):
    """A process killed after committing step-3 but before logging its metrics: the resume logs them."""
    first = _loop(root, max_steps=3)
    first.run()
    resumed = _loop(root, max_steps=3)
    assert resumed.resume()
    recommitted = resumed.metrics.recommitted
    assert sorted({step for _, step in recommitted}) == [0, 1, 2, 3]
    assert any("train/loss" in metrics for metrics, step in recommitted if step == 3)


class PoisonedAt(Regression):
    """The regression loss, but NaN for every micro-batch of the given (1-based) optimizer steps."""

    def __init__(self, steps: set[int]) -> None:
        super().__init__()
        self.steps, self.calls = steps, 0

    def step(self, model, batch):
        self.calls += 1
        out = super().step(model, batch)
        if self.calls in self.steps:  # one micro-batch per step here
            out.loss_sum = out.loss_sum * float("nan")
        return out


def test_a_nonfinite_step_fails_the_stage_before_its_checkpoint(root):
    """NaN at step 3 (a checkpoint step): NonFiniteError names step 3; step-3 is never written."""
    from trainer_core.errors import NonFiniteError

    loop = _loop(root, objective=PoisonedAt({3}), async_save=False)
    with pytest.raises(
        NonFiniteError, match="stage toy: non-finite train/grad_norm=nan, train/loss=nan at global_step 3"
    ):
        loop.run()
    assert storage.list_dirs(join_uri(root, "checkpoints")) == []


def test_nonfinite_steps_within_the_budget_are_skipped(root):
    """max_nonfinite_steps=1: the NaN step 2 leaves weights and moments as after step 1, the run goes on."""
    clean = _loop(join_uri(root, "clean"), max_steps=1)
    clean.run()
    loop = _loop(join_uri(root, "skip"), objective=PoisonedAt({2}), max_steps=2, max_nonfinite_steps=1)
    loop.run()
    assert loop.progress.nonfinite_steps == 1 and loop.progress.global_step == 2
    assert all(torch.equal(v, _weights(clean)[k]) for k, v in _weights(loop).items())
    logged = [m for batch in loop.metrics.committed for m, step in batch if step == 2 and "train/loss" in m]
    assert [m["train/nonfinite_steps"] for m in logged] == [1]


def test_a_nonfinite_step_read_later_still_fails_before_its_checkpoint(root):
    """The loop reads a step's loss and gradient norm when it next needs a number (here the
    checkpoint of step 3, logging being every 4 steps): NaN at step 2 fails the stage there, naming
    step 2, and no checkpoint is written."""
    from trainer_core.errors import NonFiniteError

    loop = _loop(root, objective=PoisonedAt({2}), log_every=4, async_save=False)
    with pytest.raises(NonFiniteError, match="non-finite train/grad_norm=nan, train/loss=nan at global_step 2 "):
        loop.run()
    assert loop.progress.global_step == 3
    assert storage.list_dirs(join_uri(root, "checkpoints")) == []


def test_a_skipped_step_between_logs_is_counted_at_the_next_log(root):
    """max_nonfinite_steps=1, NaN at step 2, logged every 3: step 3's metrics carry the skip."""
    loop = _loop(root, objective=PoisonedAt({2}), max_nonfinite_steps=1, log_every=3)
    loop.run()
    logged = {step: m for batch in loop.metrics.committed for m, step in batch if "train/loss" in m}
    assert sorted(logged) == [3, 6]
    assert logged[3]["train/nonfinite_steps"] == 1 and logged[6]["train/nonfinite_steps"] == 1
    assert loop.progress.nonfinite_steps == 1 and loop.progress.consumed_tokens == 6 * 4


def test_a_nonfinite_evaluation_fails_the_stage_before_its_checkpoint(root):
    """eval/loss NaN after step 3's update (a checkpoint step): no step-3 checkpoint, whose manifest
    would hold a NaN metric."""
    from trainer_core.errors import NonFiniteError

    loop = _loop(root, objective=Regression(eval_losses=[1.0, float("nan")]), async_save=False)
    with pytest.raises(NonFiniteError, match=r"non-finite eval/loss=nan at global_step 3 \(held-out evaluation"):
        loop.run()
    assert storage.list_dirs(join_uri(root, "checkpoints")) == []


class _Fence:
    """A write fence that can be revoked (another attempt took the lease over)."""

    def __init__(self) -> None:
        self.revoked = False
        self.checked: list[str] = []

    def check(self, what: str) -> None:
        from trainer_core.checkpoint.lease import LeaseLostError

        self.checked.append(what)
        if self.revoked:
            raise LeaseLostError(f"taken over: {what} is not written")


def test_attempt_checkpoints_have_names_of_their_own_and_are_fenced(root):
    """A session of an attempt writes ``step-XXXXXXXX-<attempt>`` directories, which resume finds
    beside another attempt's; once its fence is revoked it writes nothing more."""
    from trainer_core.checkpoint.lease import LeaseLostError

    loop = _loop(root, max_steps=3, async_save=False)
    loop.session.attempt, fence = "a1b2", _Fence()
    loop.session.fence = fence
    loop.run()
    ckpts = join_uri(root, "checkpoints")
    assert storage.list_dirs(ckpts) == ["step-00000003-a1b2"]
    assert find_latest(ckpts)[0] == join_uri(ckpts, "step-00000003-a1b2")
    assert any("manifest" in what for what in fence.checked) and any("purge" in what for what in fence.checked)
    resumed = _loop(root, max_steps=6, async_save=False)
    resumed.session.attempt, resumed.session.fence = "c3d4", _Fence()
    assert resumed.resume() and resumed.progress.global_step == 3
    resumed.session.fence.revoked = True
    with pytest.raises(LeaseLostError, match="taken over"):
        resumed.run()
    assert storage.list_dirs(ckpts) == ["step-00000003-a1b2"]  # the fenced attempt wrote no directory


@pytest.mark.parametrize("warmup,max_steps,min_lr_ratio", [(0, 10, 0.0), (3, 10, 0.1), (20, 10, 0.1), (5, 5, 0.5)])
def test_scheduler_matches_transformers_cosine_with_min_lr(warmup, max_steps, min_lr_ratio):
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from trainer_core.training.loop import build_scheduler

    cfg = TrainStageConfig(learning_rate=1e-3, warmup_steps=warmup, max_steps=max_steps, min_lr_ratio=min_lr_ratio)
    ours_opt, theirs_opt = (torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1e-3) for _ in range(2))
    ours = build_scheduler(ours_opt, cfg)
    theirs = get_cosine_with_min_lr_schedule_with_warmup(
        theirs_opt, num_warmup_steps=min(warmup, max_steps), num_training_steps=max_steps, min_lr_rate=min_lr_ratio
    )
    for _ in range(max_steps + 2):
        assert ours.get_last_lr() == theirs.get_last_lr()
        ours_opt.step(), theirs_opt.step()
        ours.step(), theirs.step()
    assert ours.state_dict().keys() == theirs.state_dict().keys()
