"""The chunked LM head through the supervised objectives: equal to the full-logits computation
in one process and through DDP, FSDP2 and DeepSpeed ZeRO-3 at 2 gloo ranks.

Tiny Llama (V = 300, H = 32), float32 on CPU, chunks of 4 tokens (several per micro-batch).
The reference is the full-logits computation in one process over the whole batch:
``compute_logprobs(model(...).logits)`` with ``sft_loss`` / ``dpo_loss``, and the gradients of
the loss summed over the batch divided by its count (tokens for SFT, pairs for DPO), which is
what the loop back-propagates.

At 2 ranks (this file is also the rank program: ``torchrun ... test_chunked_logprobs.py --out
OUT BACKEND...``) each rank takes half of the batch, with a different number of counted tokens
(so a different number of chunks), and runs the objective's ``step`` on the wrapped model:
the summed losses over ranks and the gathered gradients equal the single process's within
1e-5. So do the DPO reference pass through ``Backend.prepare_frozen`` (an FSDP2-sharded module,
a ZeRO-3 engine) and the largest [.., V] tensor allocated in forward and backward has at most
4 rows: the head ran chunked inside the wrapper, not as full logits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when torchrun runs this file

from tests.tiny import LLAMA_2X32  # noqa: E402
from trainer_core.modeling.forwards.heads import unwrap_causal_lm  # noqa: E402
from trainer_core.modeling.forwards.pairs import concat_pairs, reference_logprobs  # noqa: E402
from trainer_core.objectives.dpo import PairLogprobs, dpo_loss  # noqa: E402
from trainer_core.objectives.logprobs import compute_logprobs, sequence_logprobs, shift_mask  # noqa: E402
from trainer_core.objectives.sft import sft_loss  # noqa: E402
from trainer_core.training.supervised import DPOObjective, SFTObjective, collate_with_reference  # noqa: E402

VOCAB, CHUNK, BETA, PAD_ID = 300, 4, 0.5, 0
TOL = 1e-5
BACKENDS: dict[str, dict] = {
    "ddp": {"name": "ddp"},
    "fsdp2": {"name": "fsdp2"},
    # Every parameter partitioned, the LM head's included (by default ZeRO-3 keeps ones under 1e5 elements whole).
    "deepspeed-3": {
        "name": "deepspeed",
        "zero_stage": 3,
        "ds_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    },
}


def tiny_llama(seed: int) -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        **LLAMA_2X32,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    return AutoModelForCausalLM.from_config(config)


def _row(gen: torch.Generator, length: int, prompt: int) -> tuple[list[int], list[int]]:
    ids = torch.randint(1, VOCAB, (length,), generator=gen).tolist()
    return ids, [0] * prompt + [1] * (length - prompt)


def sft_rows() -> list[dict]:
    """4 rows; rows 0-1 (rank 0) count 13 + 15 = 28 next tokens, rows 2-3 (rank 1) 3 + 6 = 9."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(20, 7), (18, 3), (9, 6), (14, 8)]
    return [dict(zip(("input_ids", "loss_mask"), _row(gen, n, p))) for n, p in shapes]


def pair_rows(reference: list[list[float]] | None = None) -> list[dict]:
    """4 preference pairs of unequal lengths; with ``reference``, their reference log-probs."""
    gen = torch.Generator().manual_seed(4)
    rows = []
    for i, (n_c, n_r, p) in enumerate([(16, 11, 5), (12, 19, 4), (7, 9, 5), (13, 6, 2)]):
        (c, cm), (r, rm) = _row(gen, n_c, p), _row(gen, n_r, p)
        row = {"chosen_input_ids": c, "chosen_loss_mask": cm, "rejected_input_ids": r, "rejected_loss_mask": rm}
        if reference is not None:
            row["ref_chosen_logprobs"], row["ref_rejected_logprobs"] = reference[i]
        rows.append(row)
    return rows


def collate_sft(rows: list[dict]) -> dict[str, Tensor]:
    from trainer_core.data.batching import collate_causal

    return collate_causal(rows, PAD_ID)


# --- the single-process full-logits reference ------------------------------------------------


def full_token_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor) -> Tensor:
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, T, V]
    return compute_logprobs(logits, input_ids) * shift_mask(loss_mask)


def full_pair_logprobs(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    input_ids, attention_mask, loss_mask = concat_pairs(batch)
    token_logprobs = full_token_logprobs(model, input_ids, attention_mask, loss_mask)
    logprobs = sequence_logprobs(token_logprobs, shift_mask(loss_mask))
    return logprobs[: len(logprobs) // 2], logprobs[len(logprobs) // 2 :]


def full_sft(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss sum, gradients of loss sum / counted tokens) from the full logits."""
    loss_sum, num_counted = sft_loss(
        full_token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"]),
        shift_mask(batch["loss_mask"]),
    )
    return loss_sum.detach(), grads_of(model, loss_sum / num_counted)


def full_dpo(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """(DPO loss sum, gradients of loss sum / pairs) from the full logits."""
    chosen, rejected = full_pair_logprobs(model, batch)
    pairs = PairLogprobs(chosen, rejected, batch["ref_chosen_logprobs"], batch["ref_rejected_logprobs"])
    losses, _ = dpo_loss(pairs, beta=BETA)
    return losses.sum().detach(), grads_of(model, losses.mean())


def full_reference(model: nn.Module, rows: list[dict]) -> list[list[float]]:
    from trainer_core.data.batching import collate_pairs

    with torch.no_grad():
        chosen, rejected = full_pair_logprobs(model, collate_pairs(rows, PAD_ID))
    return [[c, r] for c, r in zip(chosen.tolist(), rejected.tolist())]


def grads_of(model: nn.Module, loss: Tensor) -> dict[str, Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def max_diff(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    return max(float((actual[k] - expected[k]).abs().max()) for k in expected)


# --- one process -----------------------------------------------------------------------------


def test_sft_objective_equals_the_full_logits_loss_and_gradients():
    """``SFTObjective.step`` (chunks of 4 over N = 37 counted tokens): loss sum and every gradient
    of loss sum / N equal the full-logits computation within 1e-5."""
    model, batch = tiny_llama(0), collate_sft(sft_rows())
    expected_sum, expected_grads = full_sft(model, batch)
    num_counted = int(batch["loss_mask"][:, 1:].sum())
    assert num_counted == 37
    out = SFTObjective(None, 0, chunk_size=CHUNK).step(model, batch)
    grads = grads_of(model, out.loss_sum / num_counted)
    assert abs(float(out.loss_sum.detach()) - float(expected_sum)) <= TOL * max(1.0, abs(float(expected_sum)))
    assert max_diff(grads, expected_grads) <= TOL


def test_dpo_objective_and_reference_pass_equal_the_full_logits():
    """``reference_logprobs`` (no grad, batches of 3) and ``DPOObjective.step``: reference log-probs,
    loss sum and every gradient of the mean loss equal the full-logits computation within 1e-5."""
    reference, policy = tiny_llama(1), tiny_llama(0)
    expected_ref = full_reference(reference, pair_rows())
    ref = reference_logprobs(reference, pair_rows(), PAD_ID, 3, torch.device("cpu"), chunk_size=CHUNK)
    assert torch.allclose(torch.tensor(ref), torch.tensor(expected_ref), atol=TOL, rtol=0)
    batch = collate_with_reference(pair_rows(expected_ref), PAD_ID)
    expected_sum, expected_grads = full_dpo(policy, batch)
    out = DPOObjective(BETA, None, 0, chunk_size=CHUNK).step(policy, batch)
    grads = grads_of(policy, out.loss_sum / 4)
    assert abs(float(out.loss_sum.detach()) - float(expected_sum)) <= TOL
    assert max_diff(grads, expected_grads) <= TOL


def test_rpo_adds_the_chosen_nll_per_token():
    """``rpo_alpha``: each pair's loss gains ``alpha * (-pi_c / |c|)`` (RPO, Pang et al. 2024 eq. 1),
    from the full logits by hand; ``nll_loss`` sums that NLL over the pairs."""
    policy = tiny_llama(0)
    batch = collate_with_reference(pair_rows([[-3.0, -4.0]] * 4), PAD_ID)
    chosen, _ = full_pair_logprobs(policy, batch)
    nll = -chosen.detach() / batch["chosen_lengths"]
    assert len(set(batch["chosen_lengths"].tolist())) > 1  # the per-pair normalisation matters
    plain = DPOObjective(BETA, None, 0, chunk_size=CHUNK).step(policy, batch)
    rpo = DPOObjective(BETA, None, 0, chunk_size=CHUNK, rpo_alpha=0.5).step(policy, batch)
    assert abs(float(rpo.loss_sum - plain.loss_sum) - 0.5 * float(nll.sum())) <= TOL
    assert abs(float(rpo.metric_sums["nll_loss"]) - float(nll.sum())) <= TOL
    assert "nll_loss" not in plain.metric_sums


# --- two ranks -------------------------------------------------------------------------------


def test_wrapped_models_at_two_ranks_equal_the_single_process(tmp_path):
    """DDP, FSDP2 and ZeRO-3 at 2 gloo ranks (ranks with 28 and 9 counted SFT tokens): SFT and DPO
    loss sums over ranks, every gradient and the reference pass's log-probs within 1e-5 of the
    single process's full-logits computation; no [.., V] tensor of more than 4 rows is allocated.
    Under FSDP2 and ZeRO-3 the LM head's weight is a shard outside the forward: the wrapper's
    hooks gathered it for the chunked head."""
    from tests.integration.helpers import run_ranks

    out = tmp_path / "results.json"
    job = run_ranks([str(Path(__file__).resolve()), "--out", str(out), *BACKENDS], 2, timeout_s=400)
    assert job.returncode == 0, job.tail(60)
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(BACKENDS)
    for backend, values in results.items():
        for key in ("sft/loss_sum", "sft/grads", "reference/logprobs", "dpo/loss_sum", "dpo/grads"):
            assert values[key] <= TOL, (backend, key, values)
        for key in ("sft/vocab_rows", "dpo/vocab_rows", "reference/vocab_rows"):
            assert 0 < values[key] <= CHUNK, (backend, key, values)
        assert values["head_sharded"] == float(backend != "ddp"), (backend, values)


# --- the rank program ------------------------------------------------------------------------


class VocabRows:
    """Largest number of rows of a [.., V] tensor an operator allocates inside the block (views left out)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        rows = self.rows = [0]

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not func.is_view:
                    for t in out if isinstance(out, (tuple, list)) else [out]:
                        if isinstance(t, torch.Tensor) and t.ndim and t.shape[-1] == VOCAB:
                            rows[0] = max(rows[0], t.numel() // VOCAB)
                return out

        self.mode = Mode()

    @property
    def max_rows(self) -> int:
        return self.rows[0]


def wrapped_grads(backend, model: nn.Module) -> dict[str, Tensor]:
    """Collective: every parameter's whole gradient (FSDP2 DTensor shards gathered, ZeRO partitions gathered)."""
    if backend.name == "deepspeed":
        from deepspeed.utils import safe_get_full_grad

        return {n: safe_get_full_grad(p).detach().clone() for n, p in model.module.named_parameters()}
    grads = {}
    for name, p in backend.unwrap(model).named_parameters():
        grads[name] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.detach().clone()
    return grads


def setup(backend, model: nn.Module) -> nn.Module:
    """``backend.wrap`` then ``setup_optimizer`` (where DeepSpeed builds its engine), as the stages do."""
    from trainer_core.config import TrainStageConfig

    wrapped = backend.wrap(model)
    cfg = TrainStageConfig(max_steps=1, micro_batch_size=2, grad_accum_steps=1, learning_rate=1e-3, warmup_steps=0)
    wrapped, _ = backend.setup_optimizer(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-3), cfg)
    return wrapped


def head_sharded(backend, model: nn.Module) -> bool:
    """Whether the LM head's weight is only a shard outside the forward (FSDP2: a DTensor; ZeRO-3: empty)."""
    weight = unwrap_causal_lm(model).lm_head.weight
    if backend.name == "fsdp2":
        return type(weight).__name__ == "DTensor"
    return backend.name == "deepspeed" and weight.data.numel() == 0


def train_step(backend, objective, model: nn.Module, batch: dict[str, Tensor], total: float) -> tuple[Tensor, int]:
    """One micro-batch as the loop runs it; returns (loss sum over ranks, largest [.., V] rows)."""
    rows = VocabRows()
    with backend.grad_sync(model, is_last_micro_batch=True), rows.mode:
        out = objective.step(model, batch)
        backend.backward(model, out.loss_sum / total)
    return backend.all_reduce_sum(out.loss_sum.detach()), rows.max_rows


def compare(backend) -> dict[str, float]:
    """This rank's half of the SFT and DPO batches through ``backend``, against the whole batch in one process."""
    rank, results = backend.rank, {}
    half = slice(2 * rank, 2 * rank + 2)

    sft = sft_rows()
    batch = collate_sft(sft)
    expected_sum, expected_grads = full_sft(tiny_llama(0), batch)
    model = setup(backend, tiny_llama(0))
    results["head_sharded"] = float(head_sharded(backend, model))
    total = float(batch["loss_mask"][:, 1:].sum())
    objective = SFTObjective(None, 0, chunk_size=CHUNK)
    loss_sum, results["sft/vocab_rows"] = train_step(backend, objective, model, collate_sft(sft[half]), total)
    results["sft/loss_sum"] = abs(float(loss_sum) - float(expected_sum)) / max(1.0, abs(float(expected_sum)))
    results["sft/grads"] = max_diff(wrapped_grads(backend, model), expected_grads)
    del model

    expected_ref = full_reference(tiny_llama(1), pair_rows())
    frozen = backend.prepare_frozen(tiny_llama(1))
    rows = VocabRows()
    with rows.mode:
        ref = reference_logprobs(frozen, pair_rows()[half], PAD_ID, 2, backend.device, chunk_size=CHUNK)
    results["reference/vocab_rows"] = rows.max_rows
    gathered = [lp for part in backend.all_gather_object(ref) for lp in part]
    results["reference/logprobs"] = float((torch.tensor(gathered) - torch.tensor(expected_ref)).abs().max())
    del frozen

    pairs = pair_rows(expected_ref)
    expected_sum, expected_grads = full_dpo(tiny_llama(0), collate_with_reference(pairs, PAD_ID))
    model = setup(backend, tiny_llama(0))
    objective = DPOObjective(BETA, None, 0, chunk_size=CHUNK)
    batch = collate_with_reference(pairs[half], PAD_ID)
    loss_sum, results["dpo/vocab_rows"] = train_step(backend, objective, model, batch, float(len(pairs)))
    results["dpo/loss_sum"] = abs(float(loss_sum) - float(expected_sum))
    results["dpo/grads"] = max_diff(wrapped_grads(backend, model), expected_grads)
    return results


def main() -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    from trainer_core.backends import build_backend
    from trainer_core.config import BackendConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("backends", nargs="+", choices=sorted(BACKENDS))
    args = parser.parse_args()

    @record
    def run() -> None:
        results, backend = {}, None
        for name in args.backends:
            backend = build_backend(BackendConfig(device="cpu", nproc_per_node=2, **BACKENDS[name]))
            results[name] = compare(backend)
            print(f"rank {backend.rank} {name}: {json.dumps(results[name])}", flush=True)
        if backend.rank == 0:
            Path(args.out).write_text(json.dumps(results, indent=1))
        backend.barrier()
        backend.close()

    run()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
