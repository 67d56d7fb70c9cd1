"""Which DeepSpeed checkpoints resume at another world size, and how the writer's world size is
read from the files (the resume itself runs in tests/integration/test_backends.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer_core.backends.deepspeed_zero import (
    group_hyperparameters,
    restore_group_hyperparameters,
    saved_world_size,
    untie_step_counts,
)
from trainer_core.checkpoint.manifest import Manifest
from trainer_core.checkpoint.train_state import resume_problem


def manifest(world_size: int) -> Manifest:
    return Manifest(
        kind="checkpoint",
        stage="sft",
        run_id="r",
        config_hash="h",
        backend="deepspeed",
        world_size=world_size,
        global_step=8,
        files=[],
        extra={"checkpoint_format": "deepspeed"},
    )


def backend(world_size: int) -> SimpleNamespace:
    return SimpleNamespace(name="deepspeed", checkpoint_format="deepspeed", world_size=world_size)


def test_a_deepspeed_checkpoint_of_any_world_size_is_resumable():
    for world_size in (1, 2, 3):
        assert resume_problem(manifest(2), backend(world_size), "h") is None
    assert resume_problem(manifest(2), backend(1), "other") == "written with another config (h)"


def test_untie_step_counts_gives_each_group_its_own_counter():
    """The DeepSpeed 0.19.8 ZeRO-3 universal load's shape: one ``step`` tensor in every sub-group's
    state. Stepped one group at a time (as ZeRO-3 steps its optimizer), the shared counter reaches
    10 for the second group on the first step after a resume at 8; untied, both groups are at 9."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]

    def resumed() -> torch.optim.AdamW:
        opt = torch.optim.AdamW([{"params": [p]} for p in params], lr=1e-3)
        shared = torch.tensor(8.0)
        for p in params:
            opt.state[p] = {"step": shared, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        return opt

    def step_group_by_group(opt: torch.optim.AdamW) -> list[float]:
        groups = [g["params"] for g in opt.param_groups]
        for i, group in enumerate(opt.param_groups):  # ZeRO-3: one sub-group's params at a time
            for j, g in enumerate(opt.param_groups):
                g["params"] = groups[j] if j == i else []
            for p in groups[i]:
                p.grad = torch.ones_like(p)
            opt.step()
        for g, ps in zip(opt.param_groups, groups):
            g["params"] = ps
        return [float(opt.state[p]["step"]) for p in params]

    assert step_group_by_group(resumed()) == [10.0, 10.0]  # the bug: group 1 stepped at 10, not 9
    opt = resumed()
    assert untie_step_counts(opt) == 1
    assert opt.state[params[0]]["step"] is not opt.state[params[1]]["step"]
    assert step_group_by_group(opt) == [9.0, 9.0]
    assert untie_step_counts(opt) == 0
    assert untie_step_counts(None) == 0


def test_saved_world_size_counts_the_optimizer_partitions(tmp_path):
    for name in (
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_2_mp_rank_00_optim_states.pt",
    ):
        (tmp_path / name).write_bytes(b"")
    assert saved_world_size(str(tmp_path)) == 3
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    (bf16 / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert saved_world_size(str(bf16)) == 2
    empty = tmp_path / "zero0"
    empty.mkdir()
    (empty / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert saved_world_size(str(empty)) is None


def test_group_settings_survive_a_load_that_copies_group_0():
    """DeepSpeed 0.19.8's ZeRO-3 universal load copies the saved group 0's settings (weight decay
    included) into every group; the groups' own settings come back, the loaded learning rate stays."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.AdamW(
        [{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}], lr=1e-3
    )
    before = group_hyperparameters(opt)
    for group in opt.param_groups:  # what the load does
        group.update({"weight_decay": 0.1, "lr": 7e-4})
    restore_group_hyperparameters(opt, before)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [7e-4, 7e-4]
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1]
    with pytest.raises(RuntimeError, match="had 1 param groups before loading and 2 after"):
        restore_group_hyperparameters(opt, before[:1])
    assert group_hyperparameters(None) == []


def test_untie_step_counts_places_steps_as_torch_does():
    """float32 on the CPU for a plain AdamW, on the parameter's device for a fused one (CPU here)."""
    param = torch.nn.Parameter(torch.ones(2))
    for fused in (False, True):
        opt = torch.optim.AdamW([param], lr=1e-3, fused=fused)
        opt.state[param] = {"step": torch.tensor(8, dtype=torch.float64)}
        assert untie_step_counts(opt) == 0
        step = opt.state[param]["step"]
        assert (step.dtype, step.device.type, float(step)) == (torch.float32, "cpu", 8.0)
