"""Host synchronisation of the training loop, counted on CPU, and the values it logs.

A CUDA host waits for the device whenever Python needs a tensor's value: ``.item()``,
``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool/float/int(tensor)`` (torchtitan keeps its train step
free of them; ``torch.cuda.set_sync_debug_mode`` reports them on a GPU). On CPU nothing waits, so
:class:`SyncCounter` counts those calls instead. The expected values are worked from their
definitions: ``train/loss`` of a step is the float32 sum of its micro-batches' loss sums divided by
the step's counted units, its metrics likewise, ``train/tokens_per_s`` the step's tokens over the sum
of its logged phase times.
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from tests.unit.toy_session import toy_session
from trainer_core.backends.single import SingleDeviceBackend
from trainer_core.checkpoint.session import MetricsBuffer
from trainer_core.config import TrainStageConfig
from trainer_core.data.batching import BucketedBatchSampler, DataPosition, iterate_batches
from trainer_core.training.loop import BatchSource, Objective, StepOutput, TrainLoop, build_scheduler, read_scalars
from trainer_core.training.timing import HostPhaseTimer, NullPhaseTimer, phase_timer

CONVERSIONS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
DATA_DEPENDENT = ("nonzero", "masked_select", "unique", "argwhere")  # output size known only on the device
HOST = weakref.WeakValueDictionary()  # id -> tensor of a collated (host) batch


def _is_mask(index) -> bool:
    indices = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


class SyncCounter:
    """Counts, per label, the calls that make a CUDA host wait for the device, while installed.

    Conversions to Python (``.item()``, ``float(t)``, ...), ops whose output size depends on the
    data (``nonzero``, ``masked_select``, ...) and boolean-mask indexing (``x[mask]``), called
    from Python; ``paused`` stops counting (host work on host tensors).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: Counter = Counter()
        self.label: tuple = ("outside",)
        self._paused = 0
        for name in CONVERSIONS + DATA_DEPENDENT:
            self._wrap(monkeypatch, torch.Tensor, name, lambda *args: True)
        for name in DATA_DEPENDENT:
            self._wrap(monkeypatch, torch, name, lambda *args: True)
        for name in ("__getitem__", "__setitem__"):
            self._wrap(monkeypatch, torch.Tensor, name, lambda tensor, index, *rest: _is_mask(index))

    def _wrap(self, monkeypatch, owner, name, waits) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if not self._paused and waits(*args):
                self.calls[(*self.label, name)] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    @contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextmanager
    def labelled(self, *label):
        before, self.label = self.label, label
        try:
            yield
        finally:
            self.label = before

    def total(self, *prefix) -> int:
        return sum(n for key, n in self.calls.items() if key[: len(prefix)] == prefix)


def _rows(n: int = 32) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    mask = (torch.rand(n, 3, generator=g) > 0.3).long()
    return [{"x": x[i], "y": y[i], "mask": mask[i]} for i in range(n)]


def _collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    batch = {k: torch.stack([r[k] for r in rows]) for k in ("x", "y", "mask")}
    HOST.update({id(v): v for v in batch.values()})
    return batch


def _is_host(tensor: torch.Tensor) -> bool:
    return HOST.get(id(tensor)) is tensor


class CopyingSource(BatchSource):
    """A BatchSource whose device copy is a real copy, so host and device batches differ on CPU."""

    def to_device(self, batch):
        return {k: v.clone() for k, v in super().to_device(batch).items()}


class Regression(Objective):
    """Squared error summed per example; counts from the host batch, the SFT way (``int(mask.sum())``).

    ``record``: per optimizer step, each micro-batch's (loss_sum, metric sums) as the loop saw them.
    """

    def __init__(self) -> None:
        self.micro: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        self.counter: SyncCounter | None = None

    def _host(self):
        return self.counter.paused() if self.counter else _nothing()

    def count(self, batch):
        assert _is_host(batch["x"]), "count must read the host batch"
        with self._host():
            return int(batch["mask"].sum())

    def num_tokens(self, batch):
        assert _is_host(batch["x"]), "num_tokens must read the host batch"
        with self._host():
            return int(batch["mask"].numel())

    def step(self, model, batch):
        assert not _is_host(batch["x"]), "the forward must see the device batch"
        errors = model(batch["x"]).squeeze(-1) - batch["y"]
        weights = batch["mask"].sum(-1).float()
        out = StepOutput(
            loss_sum=(weights * errors**2).sum(),
            metric_sums={"abs_error": (weights * errors.abs()).sum().detach(), "over": (errors > 0).float().sum()},
        )
        self.micro.append((out.loss_sum.detach().clone(), {k: v.clone() for k, v in out.metric_sums.items()}))
        return out

    def evaluate(self, model):
        with self._host():
            return {"loss": float(sum(r["y"].abs() for r in _rows(4)))}


@contextmanager
def _nothing():
    yield


class RecordingBuffer(MetricsBuffer):
    def __init__(self) -> None:
        super().__init__(sink=None, printer=None)
        self.emitted: list[tuple[dict[str, float], int]] = []

    def emit(self, metrics, step):
        self.emitted.append((metrics, step))
        super().emit(metrics, step)


def _loop(root: str, objective: Regression, **cfg) -> TrainLoop:
    torch.manual_seed(0)
    rows = _rows()
    settings = dict(
        max_steps=8, grad_accum_steps=2, save_every=100, eval_every=100, warmup_steps=2, learning_rate=0.05, log_every=4
    )
    settings.update(cfg)
    stage_cfg = TrainStageConfig(**settings)
    backend = SingleDeviceBackend("cpu")
    session = toy_session(root, backend, RecordingBuffer(), keep_last=2, asynchronous=False)
    sampler = BucketedBatchSampler([1] * len(rows), micro_batch_size=4, seed=0)
    source = CopyingSource(rows=rows, sampler=sampler, collate=_collate, device=torch.device("cpu"))
    return TrainLoop(
        model=nn.Linear(4, 1), backend=backend, objective=objective, batches=source, cfg=stage_cfg, session=session
    )


def _instrument(loop: TrainLoop, counter: SyncCounter) -> None:
    """Label conversions by where they happen: inside a step, inside the backend's optimizer step,
    in the loop's read of the device, in evaluation or checkpointing (counted apart)."""
    loop.objective.counter = counter
    step, read, optimizer_step = loop._optimizer_step, loop._read, loop.backend.optimizer_step
    evaluate, save = loop._evaluate, loop.save

    def labelled(fn, kind):
        def wrapper(*args, **kwargs):
            if kind == "backend":
                with counter.labelled(*counter.label[:2], "backend"):
                    return fn(*args, **kwargs)
            with counter.labelled(kind, loop.progress.global_step + (kind == "step")):
                return fn(*args, **kwargs)

        return wrapper

    loop._optimizer_step = labelled(step, "step")
    loop._read = labelled(read, "read")
    loop.backend.optimizer_step = labelled(optimizer_step, "backend")
    loop._evaluate = labelled(evaluate, "eval")
    loop.save = labelled(save, "save")


@pytest.fixture
def root():
    return f"memory://sync-{uuid.uuid4().hex}"


def test_an_optimizer_step_never_waits_and_a_logging_step_reads_once(root, monkeypatch):
    """8 steps of 2 micro-batches, logged every 4: no conversion in any step; one ``tolist`` per
    read (steps 4 and 8), nothing else outside evaluation."""
    loop = _loop(root, Regression())
    counter = SyncCounter(monkeypatch)
    _instrument(loop, counter)
    loop.run()
    assert loop.progress.global_step == 8
    assert counter.total("step") == 0, dict(counter.calls)
    reads = {key: n for key, n in counter.calls.items() if key[0] == "read"}
    assert reads == {("read", 4, "tolist"): 1, ("read", 8, "tolist"): 1}
    assert counter.total("outside") == 0, dict(counter.calls)
    assert [step for _, step in loop.metrics.emitted] == [0, 4, 8, 8]  # eval 0, logs 4 and 8, eval 8


def test_skipping_nonfinite_steps_leaves_at_most_the_backends_one_decision(root, monkeypatch):
    """With max_nonfinite_steps > 0 the backend decides before ``optimizer.step()`` whether to skip;
    that decision is the only conversion a step may make (none once it is taken on the device)."""
    loop = _loop(root, Regression(), max_nonfinite_steps=2)
    counter = SyncCounter(monkeypatch)
    _instrument(loop, counter)
    loop.run()
    for step in range(1, 9):
        assert counter.total("step", step) - counter.total("step", step, "backend") == 0, dict(counter.calls)
        assert counter.total("step", step, "backend") <= 1, dict(counter.calls)


def test_logged_values_are_those_of_the_logged_step(root):
    """Each logged value equals its definition worked on the host from what the loop computed."""
    objective = Regression()
    loop = _loop(root, objective, log_every=3, max_steps=7)
    norms: list[float] = []
    optimizer_step = loop.backend.optimizer_step
    loop.backend.optimizer_step = lambda *a, **k: norms.append(optimizer_step(*a, **k)) or norms[-1]
    loop.run()

    rows, counts, tokens = _rows(), [], []
    batches = iterate_batches(BucketedBatchSampler([1] * len(rows), micro_batch_size=4, seed=0), DataPosition(0, 0))
    for step in range(7):
        micro = [_collate([rows[i] for i in next(batches)[0]]) for _ in range(2)]
        counts.append(sum(int(b["mask"].sum()) for b in micro))
        tokens.append(sum(b["mask"].numel() for b in micro))
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=loop.cfg.learning_rate)
    scheduler, lrs = build_scheduler(optimizer, loop.cfg), []
    for _ in range(7):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()

    logged = {step: m for m, step in loop.metrics.emitted if "train/loss" in m}
    assert sorted(logged) == [3, 6, 7]
    for step, m in logged.items():
        loss_sum, metric_sums = torch.zeros(()), {}
        for loss, sums in objective.micro[2 * (step - 1) : 2 * step]:
            loss_sum += loss
            for k, v in sums.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + v
        total = torch.tensor(float(counts[step - 1]))
        assert m["train/loss"] == float(loss_sum / total)
        assert m["train/abs_error"] == float(metric_sums["abs_error"] / total)
        assert m["train/over"] == float(metric_sums["over"] / total)
        assert m["train/grad_norm"] == float(norms[step - 1])
        assert m["train/lr"] == lrs[step - 1]
        assert m["train/consumed_samples"] == 8.0 * step
        seconds = m["time/forward_s"] + m["time/backward_s"] + m["time/optimizer_s"]
        assert m["train/tokens_per_s"] == pytest.approx(tokens[step - 1] / seconds, rel=1e-12)
        assert list(m)[:3] == ["train/loss", "train/grad_norm", "train/lr"]
    assert loop.progress.consumed_tokens == sum(tokens)


@pytest.mark.parametrize("packed", [False, True])
def test_the_sft_objective_step_waits_only_where_known(monkeypatch, packed):
    """The SFT objective's forward and backward on a device batch wait for the device only inside
    transformers (its count runs on the host batch, and the counted positions come as the host's
    ``counted_index``, selected with ``index_select``): for a padded batch, the SDPA check
    ``fast_all(padding_mask)`` that skips an all-ones mask (2 ``__bool__``); for a packed one (no
    mask), the test whether the position ids hold more than one sequence
    (``find_packed_sequence_indices``: 1 ``__bool__``)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainer_core.data.batching import collate_causal, collate_causal_packed
    from trainer_core.training.supervised import SFTObjective, causal_source

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
    )
    model = AutoModelForCausalLM.from_config(config)
    rows = [{"input_ids": list(range(1, n + 1)), "loss_mask": [0] * 2 + [1] * (n - 2)} for n in (5, 9, 7)]
    source = causal_source(rows, 0, 3, seed=0, device=torch.device("cpu"))
    objective = SFTObjective(source, 1)
    batch = {k: v.clone() for k, v in (collate_causal_packed if packed else collate_causal)(rows, 0).items()}
    counter = SyncCounter(monkeypatch)
    with counter.labelled("step"):
        objective.step(model, batch).loss_sum.backward()
    known = {("step", "__bool__"): 1 if packed else 2}
    assert dict(counter.calls) == known


def test_read_scalars_is_exact_and_copies_once(monkeypatch):
    """float32, bfloat16, float64 and int64 scalars and host numbers: equal to ``float(t)``, one copy."""
    values = [
        torch.tensor(1 / 3),
        torch.tensor(1 / 3, dtype=torch.bfloat16),
        torch.tensor(1 / 3, dtype=torch.float64),
        torch.tensor(2**40 + 1),
        7,
        0.25,
        torch.tensor(float("nan")),
    ]
    expected = [float(v) for v in values]
    counter = SyncCounter(monkeypatch)
    read = read_scalars(values, torch.device("cpu"))
    assert dict(counter.calls) == {("outside", "tolist"): 1}
    assert read[:6] == expected[:6] and read[6] != read[6]
    assert read_scalars([3, 0.5], torch.device("cpu")) == [3.0, 0.5]


def test_host_phase_timer_sums_each_phase():
    timer = HostPhaseTimer()
    for _ in range(2):
        with timer.phase("forward"):
            time.sleep(0.01)
    with timer.phase("optimizer"):
        pass
    seconds = timer.seconds()
    assert list(seconds) == ["forward", "optimizer"]
    assert 0.02 <= seconds["forward"] < 0.5 and 0 <= seconds["optimizer"] < 0.01
    assert isinstance(phase_timer(torch.device("cpu")), HostPhaseTimer)
    assert phase_timer(torch.device("cpu"), enabled=False).seconds() == {}
    assert isinstance(phase_timer(torch.device("cuda"), enabled=False), NullPhaseTimer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_phase_timer_measures_device_time_not_launch_time():
    """A queue of large matmuls launches in far less time than it runs: the events' time matches a
    synchronised wall clock (within 20%), and is read without synchronising before ``seconds()``."""
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    timer = phase_timer(device)
    start = time.perf_counter()
    with timer.phase("forward"):
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
    launched = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    seconds = timer.seconds()["forward"]
    assert seconds == pytest.approx(wall, rel=0.2)
    assert launched < 0.5 * seconds
