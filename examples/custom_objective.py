"""A custom ``Objective`` plugged into the pipeline's loop: SFT with label smoothing.

    python examples/custom_objective.py OUT_ROOT [--epsilon 0.1]

``TrainLoop`` brings gradient accumulation, clipping, the LR schedule, evaluation, checkpoints
and exact resume (run it twice: the second run resumes and trains nothing); the objective
brings the loss. Data and tokenizer come from the prepare_data stage (``examples/dpo.yaml``).
"""

import argparse

import torch

from trainer_core import (
    CheckpointSession,
    MetricsBuffer,
    Objective,
    StepOutput,
    TrainLoop,
    build_backend,
    build_trainer,
    causal_source,
    collate_causal,
    load_causal_lm,
    load_config,
    load_split,
    load_tokenizer_from,
    shift_mask,
)


class LabelSmoothedSFT(Objective):
    """Per completion token ``(1 - eps) NLL + eps * mean over the vocabulary of -log p``
    (Szegedy et al. 2016, "Rethinking the Inception Architecture", section 7). Count unit: a
    completion token; ``eval/loss`` is the plain NLL on a held-out batch."""

    def __init__(self, epsilon: float, held_out: dict[str, torch.Tensor]) -> None:
        self.epsilon, self.held_out = epsilon, held_out

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["loss_mask"][:, 1:].sum())

    def _losses(self, model, batch):  # each [B, T-1]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        nll = -logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        return nll, (1 - self.epsilon) * nll - self.epsilon * logp.mean(-1), shift_mask(batch["loss_mask"]).float()

    def step(self, model, batch) -> StepOutput:
        nll, losses, mask = self._losses(model, batch)
        return StepOutput(
            loss_sum=(losses * mask).sum(),
            num_tokens=int(batch["attention_mask"].sum()),
            metric_sums={"nll": (nll * mask).sum().detach()},
        )

    def evaluate(self, model) -> dict[str, float]:
        nll, _, mask = self._losses(model, self.held_out)
        return {"loss": float((nll * mask).sum() / mask.sum())}


parser = argparse.ArgumentParser()
parser.add_argument("out_root")
parser.add_argument("--epsilon", type=float, default=0.1)
args = parser.parse_args()
config = load_config("examples/dpo.yaml", overrides={"storage.root": args.out_root})
prepare = build_trainer(config, "prepare_data", run_id="objective-example")
prepare.run()  # tokenised splits and the tokenizer, committed under prepare.final_uri
tokenizer, cfg, backend = load_tokenizer_from(prepare.final_uri), config.sft, build_backend(config.backend)
train = causal_source(
    load_split(prepare.final_uri, "sft/train"),
    tokenizer.pad_token_id,
    cfg.micro_batch_size,
    seed=0,
    device=backend.device,
)
held_out = collate_causal(load_split(prepare.final_uri, "sft/eval")[:32], tokenizer.pad_token_id)
model = backend.wrap(load_causal_lm("init", config.model, tokenizer, seed=0))
session = CheckpointSession(
    f"{args.out_root}/label-smoothing/checkpoints",
    backend,
    fingerprint=f"eps={args.epsilon}",
    metrics=MetricsBuffer(printer=lambda metrics, step: print(f"step {step}: {metrics}")),
)
loop = TrainLoop(
    model=model,
    backend=backend,
    objective=LabelSmoothedSFT(args.epsilon, held_out),
    batches=train,
    cfg=cfg,
    session=session,
)
print(f"resumed: {loop.resume()}")
progress = loop.run()
print(
    f"global_step {progress.global_step}: eval/loss {progress.history['eval/loss']:.4f} "
    f"(first {progress.history['first/eval/loss']:.4f})"
)
