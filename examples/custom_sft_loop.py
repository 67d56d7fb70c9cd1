"""A custom SFT loop from Tier 1 primitives only: tokenizer, model, loss, optimizer, manifest.

    python examples/custom_sft_loop.py OUT_DIR [--steps 40]

Trains a tiny Llama built from config to answer two-number additions, then commits it as an HF
model directory with a manifest written last and reads that back. No config file, no stage, no
backend.
"""

import argparse
import random

import torch

from trainer_core import (
    ArtifactWriter,
    build_optimizer,
    build_scheduler,
    collate_causal,
    encode_chat,
    load_causal_lm,
    masked_token_logprobs,
    read_manifest,
    save_pretrained_to,
    sft_loss,
    shift_mask,
    train_tokenizer,
)
from trainer_core.config import ModelConfig, ModelInit, SFTConfig

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()

rng = random.Random(0)
pairs = [(a, b) for a in range(30) for b in range(30)]
chats = [([{"role": "user", "content": f"What is {a} + {b}?"}], f"{a} + {b} = {a + b}") for a, b in pairs]
tokenizer = train_tokenizer([f"{m[0]['content']} {c}" for m, c in chats], vocab_size=320, min_frequency=2)
rows = [
    encode_chat(tokenizer, messages, completion, max_length=64, max_prompt_length=32) for messages, completion in chats
]

model = load_causal_lm(
    "init", ModelConfig(init=ModelInit(hidden_size=32, intermediate_size=64, num_hidden_layers=2)), tokenizer, seed=0
)
cfg = SFTConfig(max_steps=args.steps, learning_rate=3e-3, warmup_steps=4)
optimizer = build_optimizer(model, cfg)
scheduler = build_scheduler(optimizer, cfg)

for step in range(1, cfg.max_steps + 1):
    batch = collate_causal(rng.sample(rows, 16), pad_id=tokenizer.pad_token_id)
    logprobs = masked_token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    loss_sum, num_tokens = sft_loss(logprobs, shift_mask(batch["loss_mask"]))
    loss = loss_sum / num_tokens  # mean NLL per completion token
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if step == 1 or step % 10 == 0:
        print(f"step {step}: loss={loss.item():.4f}", flush=True)

writer = ArtifactWriter(args.out_dir, overwrite=True)
save_pretrained_to(writer, model, tokenizer)  # an HF model directory: safetensors, config, tokenizer
writer.commit(
    kind="final", stage="custom-sft", run_id="example", global_step=cfg.max_steps, metrics={"train/loss": loss.item()}
)
manifest = read_manifest(args.out_dir)
print(f"committed {len(manifest.files)} files at global_step {manifest.global_step}")
