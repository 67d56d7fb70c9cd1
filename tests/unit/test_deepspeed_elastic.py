"""Which DeepSpeed checkpoints resume at another world size, and how the writer's world size is
read from the files (the resume itself runs in tests/integration/test_backends.py)."""

from __future__ import annotations

from types import SimpleNamespace

from trainer_core.backends.deepspeed_zero import saved_world_size
from trainer_core.checkpoint.manifest import Manifest
from trainer_core.checkpoint.train_state import resume_problem


def manifest(world_size: int) -> Manifest:
    return Manifest(kind="checkpoint", stage="sft", run_id="r", config_hash="h", backend="deepspeed",
                    world_size=world_size, global_step=8, files=[], extra={"checkpoint_format": "deepspeed"})


def backend(world_size: int, reshards: bool) -> SimpleNamespace:
    return SimpleNamespace(name="deepspeed", checkpoint_format="deepspeed", world_size=world_size,
                           resumes_other_world_sizes=reshards)


def test_zero3_keeps_its_world_size_zero2_does_not():
    assert resume_problem(manifest(2), backend(1, reshards=True), "h") is None
    assert resume_problem(manifest(2), backend(1, reshards=False), "h") == (
        "DeepSpeed ZeRO-3 partitions of 2 ranks; this run has 1")
    assert resume_problem(manifest(2), backend(2, reshards=False), "h") is None


def test_saved_world_size_counts_the_optimizer_partitions(tmp_path):
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_2_mp_rank_00_optim_states.pt"):
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
