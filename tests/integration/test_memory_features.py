"""Activation checkpointing, precision and compile on every backend (``trainer_core.backends.memory``).

A tiny Llama built from config (2 decoder layers, hidden 32, vocab 64, tied embeddings as in
the demo) takes one optimizer step on a fixed batch (B=4 rows of T=12 tokens, one padded;
labels -100 on padding). Legend: B batch, T tokens, V vocab.

Single device, in this process:

- activation checkpointing on vs off: the same loss and gradients (1e-6; measured: identical),
  each decoder layer's MLP runs twice in a step (forward, then recomputed in the backward)
  instead of once, state-dict keys unchanged, and the Hugging Face save reloads with no missing
  or unexpected key; evaluation, gradient-free forwards and cached decoding in train mode (the RL
  rollout) are not checkpointed and keep their KV cache;
- precision: ``fp32`` computes in fp32; ``bf16-mixed`` keeps fp32 weights, gradients and AdamW
  state (also for a model loaded in bf16) and computes in bf16 inside ``Backend.autocast``;
  ``bf16`` has everything in bf16; frozen models are cast to bf16 only under ``bf16``;
- compile (inductor, PyTorch's default backend) vs eager: the same loss and gradients (1e-5),
  with one graph for both blocks; with activation checkpointing inside the compiled block too.

Two gloo ranks (one ``torchrun`` job, this file as the rank script, see :func:`main`): DDP,
FSDP2, DeepSpeed ZeRO-2 and ZeRO-3, each with activation checkpointing on vs off (1e-6), the
recompute counted, the keys of ``full_state_dict``, of the module's state dict and (FSDP2) of
the DCP state dict unchanged; under ``fp32``, ``bf16-mixed`` and ``bf16`` with the dtypes of
:data:`PRECISION_DTYPES`; FSDP2 with checkpointing and compile (``aot_eager``: the inductor
path is the single device's test) in the backend's order: checkpoint, ``fully_shard``, compile.

GPU (marked ``gpu``, deselected on CPU): FSDP2 ``bf16-mixed`` with activation checkpointing on
CUDA (NCCL), one rank per GPU up to 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.tiny import LLAMA_2X32
from trainer_core.backends import build_backend, memory
from trainer_core.config import BackendConfig, TrainStageConfig
from trainer_core.generation.static_decode import cache_argument

REPO_ROOT = Path(__file__).resolve().parents[2]
VOCAB = 64
GRAD_ATOL = 1e-6
"""Activation checkpointing recomputes the same ops on the same inputs: gradients agree to 1e-6
(measured: bit for bit on CPU)."""
COMPILE_ATOL = 1e-5
"""Inductor fuses and reorders float32 ops: compiled vs eager within 1e-5 on CPU."""


# --- the model, the batch, one step ---------------------------------------------------------


def tiny_llama(dtype: torch.dtype = torch.float32) -> nn.Module:
    """A 2-layer Llama from config, seeded (every call gives the same weights)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        **LLAMA_2X32,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def make_batch(device: torch.device, rank: int = 0, world_size: int = 1) -> dict[str, Tensor]:
    """This rank's rows of a fixed batch: input_ids, attention_mask [B, T] (1 = token, row 1
    padded after 8 tokens), labels [B, T] (-100 on padding). Rank r of w takes rows r, r + w, ..."""
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    rows = slice(rank, None, world_size)
    return {
        "input_ids": ids[rows].to(device),
        "attention_mask": mask[rows].to(device),
        "labels": labels[rows].to(device),
    }


def count_mlp_calls(model: nn.Module) -> list[int]:
    """A one-element counter of the decoder layers' MLP forwards (a pre-hook: a recompute that
    stops early after the MLP's last saved tensor would not reach a post-hook)."""
    calls = [0]
    for layer in model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def full_grads(backend: Any, model: nn.Module) -> dict[str, Tensor]:
    """Collective: every parameter's whole gradient (float32, CPU), by plain parameter name."""
    if backend.name == "deepspeed":
        from deepspeed.utils import safe_get_full_grad

        named = backend.unwrap(model).named_parameters()
        return {n: safe_get_full_grad(p).detach().float().cpu() for n, p in named}
    out = {}
    for n, p in backend.unwrap(model).named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[n] = grad.detach().float().cpu()
    return out


def local_dtype(t: Tensor) -> str:
    """The dtype of a tensor or of its local shard (DTensor), as a string."""
    return str(getattr(t, "_local_tensor", t).dtype)


def train_step(backend: Any, model: nn.Module, batch: dict[str, Tensor], count_calls: bool = True) -> dict[str, Any]:
    """``backend.wrap``-ed ``model``: one forward and backward (as the loop does), an AdamW step,
    then a forward of the same batch. Returns losses, gradients, dtypes and, with ``count_calls``,
    the number of MLP forwards in the step (None without: the counting hook, a Python side
    effect, would break a compiled block's graph)."""
    raw = backend.unwrap(model)
    calls = count_mlp_calls(raw) if count_calls else [None]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = backend.setup_optimizer(
        model, optimizer, TrainStageConfig(micro_batch_size=2, grad_accum_steps=1)
    )
    with backend.grad_sync(model, is_last_micro_batch=True):
        with backend.autocast():
            out = model(**batch, use_cache=False)  # as trainer_core.modeling.forwards calls it
        backend.backward(model, out.loss / backend.world_size)
    grads = full_grads(backend, model)
    first_param = next(backend.unwrap(model).parameters())
    dtypes = {
        "param": local_dtype(first_param),
        "grad": local_dtype(first_param.grad) if first_param.grad is not None else None,
        "logits": str(out.logits.dtype),
    }
    step_calls = calls[0]
    backend.optimizer_step(model, optimizer, max_grad_norm=1.0)
    state = [s for s in optimizer.state.values() if "exp_avg" in s]
    dtypes["exp_avg"] = local_dtype(state[0]["exp_avg"]) if state else None
    with torch.no_grad(), backend.autocast():
        loss_after = model(**batch, use_cache=False).loss
    return {
        "model": model,
        "optimizer": optimizer,
        "loss": out.loss.item(),
        "loss_after": loss_after.item(),
        "grads": grads,
        "mlp_calls": step_calls,
        "dtypes": dtypes,
    }


def state_keys(backend: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[str] | None]:
    """Collective: the keys a checkpoint and the final save see: ``full_state_dict`` (rank 0),
    the plain module's ``state_dict`` and, on FSDP2, the DCP model and optimizer state dicts."""
    full = backend.full_state_dict(model)
    out: dict[str, list[str] | None] = {
        "full_state_dict": sorted(full) if full is not None else None,
        "state_dict": sorted(backend.unwrap(model).state_dict()),
    }
    if backend.name == "fsdp2":
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        out["dcp_model"], out["dcp_optim"] = sorted(model_sd), sorted(optim_sd["state"])
    return out


def max_abs_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """Largest absolute difference over the tensors of two dicts with the same keys."""
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


# --- the rank script (torchrun) ---------------------------------------------------------------

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "ddp/ac": ({"name": "ddp"}, {"activation_checkpointing": True}),
    "ddp/bf16-mixed+ac": ({"name": "ddp", "precision": "bf16-mixed"}, {"activation_checkpointing": True}),
    "fsdp2/ac": ({"name": "fsdp2"}, {"activation_checkpointing": True}),
    "fsdp2/bf16-mixed+ac": ({"name": "fsdp2", "precision": "bf16-mixed"}, {"activation_checkpointing": True}),
    "fsdp2/bf16+ac": ({"name": "fsdp2", "precision": "bf16"}, {"activation_checkpointing": True}),
    "fsdp2/ac+compile": ({"name": "fsdp2"}, {"activation_checkpointing": True, "compile": True}),
    "deepspeed-2/bf16-mixed+ac": (
        {"name": "deepspeed", "zero_stage": 2, "precision": "bf16-mixed"},
        {"activation_checkpointing": True},
    ),
    "deepspeed-3/bf16+ac": (
        {"name": "deepspeed", "zero_stage": 3, "precision": "bf16"},
        {"activation_checkpointing": True},
    ),
}
"""Case -> (backend fields of the reference run, fields the compared run adds)."""

F32, BF16 = "torch.float32", "torch.bfloat16"
PRECISION_DTYPES: dict[str, dict[str, str | None]] = {
    "ddp/bf16-mixed+ac": {"param": F32, "grad": F32, "logits": BF16, "exp_avg": F32},
    "fsdp2/bf16-mixed+ac": {"param": F32, "grad": F32, "logits": BF16, "exp_avg": F32},
    "fsdp2/bf16+ac": {"param": BF16, "grad": BF16, "logits": BF16, "exp_avg": BF16},
    "deepspeed-2/bf16-mixed+ac": {"param": BF16, "grad": None, "logits": BF16, "exp_avg": F32},
    "deepspeed-3/bf16+ac": {"param": BF16, "grad": None, "logits": BF16, "exp_avg": BF16},
}
"""Dtypes after a step (parameter: its local shard; gradient: None where ZeRO keeps it in the
optimizer's partitions): DDP autocasts fp32 weights; FSDP2 all-gathers fp32 shards as bf16
(``bf16-mixed``) or shards bf16 (``bf16``); DeepSpeed's bf16 engine computes with a bf16 module
over fp32 AdamW state (``bf16-mixed``: the fp32 master copy) or bf16 state (``bf16``)."""


def run_case(base: dict[str, Any], extra: dict[str, Any], device: str) -> dict[str, Any]:
    """Collective: the reference and the compared run of one case; what rank 0 reports."""
    runs = {}
    for label, fields in (("off", base), ("on", {**base, **extra})):
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        backend = build_backend(BackendConfig(device=device, nproc_per_node=int(os.environ["WORLD_SIZE"]), **fields))
        batch = make_batch(backend.device, backend.rank, backend.world_size)
        result = train_step(backend, backend.wrap(tiny_llama()), batch, count_calls=not fields.get("compile"))
        result["keys"] = state_keys(backend, result.pop("model"), result.pop("optimizer"))
        result["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        runs[label] = result
    off, on = runs["off"], runs["on"]
    return {
        "loss": [off["loss"], on["loss"]],
        "loss_after": [off["loss_after"], on["loss_after"]],
        "grad_max_diff": max_abs_diff(off["grads"], on["grads"]),
        "mlp_calls": [off["mlp_calls"], on["mlp_calls"]],
        "keys": [off["keys"], on["keys"]],
        "dtypes": on["dtypes"],
        "plain_keys": sorted(tiny_llama().state_dict()),
        "compiled_graphs": [off["graphs"], on["graphs"]],
    }


def main() -> int:
    """``torchrun ... test_memory_features.py --out OUT.json --device cpu|cuda CASE...``: rank 0
    writes ``{case: run_case(...)}``."""
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    memory.COMPILE_BACKEND = "aot_eager"  # inductor is the single device's test; here: the order of wrappers
    results = {}
    for case in args.cases:
        results[case] = run_case(*CASES[case], device=args.device)
        print(f"rank {dist.get_rank()}: {case} done", flush=True)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    import gc

    gc.collect()
    dist.destroy_process_group()
    return 0


# --- single device ----------------------------------------------------------------------------


def single(device: str = "cpu", **fields: Any) -> Any:
    return build_backend(BackendConfig(device=device, **fields))


def test_activation_checkpointing_same_step_recomputes_each_layer_and_keeps_keys(tmp_path):
    """Off vs on: loss and gradients within 1e-6 (measured: equal); 2 MLP forwards a step
    without, 4 with (each layer's forward recomputed in the backward); after the step the same
    loss again; the state dict has the plain keys and the HF save reloads with none missing."""
    from transformers import AutoModelForCausalLM

    runs = {}
    for flag in (False, True):
        backend = single(activation_checkpointing=flag)
        model = backend.wrap(tiny_llama())
        assert len(memory.checkpointed_layers(model)) == (2 if flag else 0)
        runs[flag] = train_step(backend, model, make_batch(backend.device))
    off, on = runs[False], runs[True]
    assert on["loss"] == pytest.approx(off["loss"], abs=GRAD_ATOL)
    assert max_abs_diff(off["grads"], on["grads"]) <= GRAD_ATOL
    assert on["loss_after"] == pytest.approx(off["loss_after"], abs=GRAD_ATOL)
    assert (off["mlp_calls"], on["mlp_calls"]) == (2, 4)
    model = on["model"]
    assert sorted(model.state_dict()) == sorted(tiny_llama().state_dict())
    model.save_pretrained(tmp_path)
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_checkpointing_only_when_training_and_the_kv_cache_is_kept():
    """Evaluation (eval mode) and gradient-free forwards run each layer once; a cached decoding
    step in train mode without gradients (as the RL rollout generates) gives the logits it gives
    without checkpointing: the KV cache is used, not dropped."""
    batch = make_batch(torch.device("cpu"))
    logits = []
    for flag in (False, True):
        model = single(activation_checkpointing=flag).wrap(tiny_llama())
        calls = count_mlp_calls(model)
        with torch.no_grad():
            first = model(input_ids=batch["input_ids"], use_cache=True)
            step = model(
                input_ids=batch["input_ids"][:, :1],
                **{cache_argument(): getattr(first, cache_argument())},
                use_cache=True,
            )
        logits.append(step.logits)
        model.eval()
        model(**batch, use_cache=False).loss.backward()
        assert calls[0] == 6  # 2 layers x 3 forwards, no recompute
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("precision", "weights", "logits", "state"),
    [
        ("fp32", "torch.float32", "torch.float32", "torch.float32"),
        ("auto", "torch.float32", "torch.float32", "torch.float32"),  # auto on CPU: fp32
        ("bf16-mixed", "torch.float32", "torch.bfloat16", "torch.float32"),
        ("bf16", "torch.bfloat16", "torch.bfloat16", "torch.bfloat16"),
    ],
)
def test_precision_dtypes_on_one_device(precision, weights, logits, state):
    """Weights, gradients and AdamW state in ``weights``/``state``; logits (inside the backend's
    autocast) in ``logits``. A bf16 forward stays near the fp32 one (same weights): loss within 2 %."""
    reference = train_step(
        single(precision="fp32"), single(precision="fp32").wrap(tiny_llama()), make_batch(torch.device("cpu"))
    )
    backend = single(precision=precision)
    result = train_step(backend, backend.wrap(tiny_llama()), make_batch(backend.device))
    assert result["dtypes"] == {"param": weights, "grad": weights, "logits": logits, "exp_avg": state}
    assert result["loss"] == pytest.approx(reference["loss"], rel=2e-2)


def test_bf16_mixed_keeps_fp32_master_weights_of_a_bf16_model_and_frozen_dtypes():
    """A model loaded in bf16 (``model.dtype: bfloat16``) trains under ``bf16-mixed`` with fp32
    weights; frozen models keep their dtype except under pure ``bf16``."""
    backend = single(precision="bf16-mixed")
    assert {p.dtype for p in backend.wrap(tiny_llama(torch.bfloat16)).parameters()} == {torch.float32}
    assert {p.dtype for p in backend.prepare_frozen(tiny_llama()).parameters()} == {torch.float32}
    assert {p.dtype for p in single(precision="bf16").prepare_frozen(tiny_llama()).parameters()} == {torch.bfloat16}
    assert isinstance(backend.autocast(), torch.autocast)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["eager-blocks", "checkpointed-blocks"])
def test_compiled_blocks_match_eager(checkpointing):
    """``compile: true`` (inductor) vs eager: loss, gradients and the loss after the step within
    1e-5; the blocks' forwards are compiled into one graph that serves both (no graph break, with
    the checkpoint inside it too) and the keys are unchanged."""
    torch._dynamo.reset()
    eager, compiled = (single(compile=flag, activation_checkpointing=checkpointing) for flag in (False, True))
    expected = train_step(eager, eager.wrap(tiny_llama()), make_batch(eager.device))
    model = compiled.wrap(tiny_llama())
    assert all(isinstance(b.__dict__.get("forward"), memory.CompiledForward) for b in model.model.layers)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = train_step(compiled, model, make_batch(compiled.device), count_calls=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1  # both blocks, one graph, no break
    assert got["loss"] == pytest.approx(expected["loss"], abs=COMPILE_ATOL)
    assert max_abs_diff(expected["grads"], got["grads"]) <= COMPILE_ATOL
    assert got["loss_after"] == pytest.approx(expected["loss_after"], abs=COMPILE_ATOL)
    assert sorted(model.state_dict()) == sorted(tiny_llama().state_dict())


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_compiled_blocks_match_eager_on_cuda(precision):
    """``compile: true`` (inductor, Triton kernels) vs eager on CUDA, with activation checkpointing:
    the same loss, gradients and loss after the step (fp32: 1e-4; bf16-mixed: 2e-2, bf16 compute),
    one graph for both blocks."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch._dynamo.reset()
    eager, compiled = (
        single("cuda", compile=flag, activation_checkpointing=True, precision=precision) for flag in (False, True)
    )
    atol = 1e-4 if precision == "fp32" else 2e-2
    expected = train_step(eager, eager.wrap(tiny_llama()), make_batch(eager.device), count_calls=False)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = train_step(compiled, compiled.wrap(tiny_llama()), make_batch(compiled.device), count_calls=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    assert got["loss"] == pytest.approx(expected["loss"], abs=atol)
    assert max_abs_diff(expected["grads"], got["grads"]) <= atol
    assert got["loss_after"] == pytest.approx(expected["loss_after"], abs=atol)


# --- two ranks --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, Any]:
    """Every case of :data:`CASES` in one 2-rank gloo job; rank 0's results."""
    from tests.integration.helpers import run_ranks

    out = tmp_path_factory.mktemp("memory") / "results.json"
    job = run_ranks([str(Path(__file__)), "--out", str(out), "--device", "cpu", *CASES], 2, timeout_s=240)
    assert job.returncode == 0, job.tail(60)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_checkpointing_same_step_and_keys(two_ranks, case):
    """At 2 gloo ranks, with the case's features on vs off: loss, gradients (whole, gathered)
    and the loss after the step within 1e-6; the MLPs run 2 forwards a step without
    checkpointing and 4 with; every state-dict view has the same keys as without, all of them
    plain Hugging Face names; graphs were compiled only where the case compiles."""
    result = two_ranks[case]
    (off_loss, on_loss), (off_after, on_after) = result["loss"], result["loss_after"]
    assert on_loss == pytest.approx(off_loss, abs=GRAD_ATOL)
    assert result["grad_max_diff"] <= GRAD_ATOL
    assert on_after == pytest.approx(off_after, abs=GRAD_ATOL)
    assert result["mlp_calls"] == [2, None if "compile" in case else 4]
    off_keys, on_keys = result["keys"]
    assert on_keys == off_keys
    plain = set(result["plain_keys"])
    assert all(set(keys) <= plain for keys in on_keys.values() if keys is not None), on_keys
    assert on_keys["state_dict"] == result["plain_keys"]
    assert result["compiled_graphs"][0] == 0 and (result["compiled_graphs"][1] > 0) == ("compile" in case)


@pytest.mark.parametrize("case", list(PRECISION_DTYPES))
def test_two_ranks_precision_dtypes(two_ranks, case):
    """Weights, gradients, AdamW state and logits in the dtypes of :data:`PRECISION_DTYPES`."""
    assert two_ranks[case]["dtypes"] == PRECISION_DTYPES[case]


# --- GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_fsdp2_bf16_mixed_with_checkpointing_on_cuda(tmp_path):
    """FSDP2 on CUDA (NCCL, one rank per GPU up to 2), ``bf16-mixed`` with activation
    checkpointing on vs off: the same step (loss and gradients within bf16 tolerance, 1e-3),
    the recompute, plain keys, fp32 shards and gradients, bf16 logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.integration.helpers import run_ranks

    nproc = min(2, torch.cuda.device_count())
    out = tmp_path / "results.json"
    job = run_ranks(
        [str(Path(__file__)), "--out", str(out), "--device", "cuda", "fsdp2/bf16-mixed+ac"], nproc, timeout_s=300
    )
    assert job.returncode == 0, job.tail(60)
    result = json.loads(out.read_text())["fsdp2/bf16-mixed+ac"]
    assert result["loss"][1] == pytest.approx(result["loss"][0], rel=1e-3)
    assert result["grad_max_diff"] <= 1e-3
    assert result["mlp_calls"] == [2, 4]
    assert result["keys"][1] == result["keys"][0]
    assert result["dtypes"] == PRECISION_DTYPES["fsdp2/bf16-mixed+ac"]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))  # ``tests`` as a package, when torchrun runs this file
    sys.exit(main())
