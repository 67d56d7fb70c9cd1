"""LoRA on every training stage (``lora.enabled``): real stage processes on the tiny pipeline.

- SFT and DPO with LoRA at 2 ranks on DDP and FSDP2 print the single device's losses;
- a LoRA SFT killed after its step-4 checkpoint and resumed ends with the uninterrupted run's
  weights, bit for bit; its checkpoints hold the adapters and their optimizer state only, a
  fraction of a full checkpoint close to (adapter parameters / all parameters);
- the committed model is the merge: base weight + (alpha / r) B A, checked by hand against the
  adapters of the last checkpoint and the SFT model the stage started from;
- DPO, GRPO and PPO with the reference as the policy's disabled adapter print the same lines
  (losses, KL, rewards) as with a separate reference model loaded from the same weights;
- the reward model trains its adapters and its score head;
- distillation's generalised JSD trains the student's adapters against a wider teacher (the
  teacher a separate model, never the disabled adapter).
"""

from __future__ import annotations

import io
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import safetensors.torch
import torch

from trainer_core import storage
from trainer_core.checkpoint.manifest import read_manifest
from trainer_core.config import PipelineConfig, load_config
from trainer_core.spec import build_spec
from trainer_core.storage import StageLayout, join_uri

from .helpers import (
    REPO_ROOT,
    RUN_ID,
    StageRun,
    TinyPipeline,
    assert_same_weights,
    checkpoint_uri,
    committed_steps,
    copy_checkpoint,
    final_weights,
    run_ranks,
    run_stage,
    stage_lines,
    why_failed,
    wider_teacher,
    write_spec,
)
from .rl_runs import rl_config

FIXTURES = REPO_ROOT / "tests" / "integration" / "fixtures"
STEPS = 8
SAVE_EVERY = 4
RANK, ALPHA = 4, 8.0
LORA = {"lora.enabled": True, "lora.rank": RANK, "lora.alpha": ALPHA}
PRINTED_REL, PRINTED_ABS = 1e-3, 1e-5
"""As in test_backends: printed metrics have 4 significant digits."""


def lora_config(pipeline: TinyPipeline, backend: str = "single", nproc: int = 1, **extra: Any) -> PipelineConfig:
    """The tiny pipeline with LoRA (r 4, alpha 8) on every training stage; SFT and DPO read 8
    examples a step whatever the world size, 8 steps, a checkpoint every 4 (all kept)."""
    overrides: dict[str, Any] = {
        **LORA,
        "backend.name": backend,
        "backend.nproc_per_node": nproc,
        "backend.device": "cpu",
        "sft.global_batch_size": 8,
        "dpo.grad_accum_steps": 2 // nproc,
        "dpo.rpo_alpha": 0.0,  # plain DPO (the demo adds RPO's term): its step-1 loss is log 2
    }
    for stage in ("sft", "dpo", "reward_model"):
        overrides.update(
            {
                f"{stage}.max_steps": STEPS,
                f"{stage}.save_every": SAVE_EVERY,
                f"{stage}.eval_every": SAVE_EVERY,
                f"{stage}.micro_batch_size": 4,
                f"{stage}.keep_last_checkpoints": STEPS,
                f"{stage}.learning_rate": 1e-2,
            }
        )
    overrides.update(extra)
    return load_config(base=pipeline.config.model_dump(mode="json"), overrides=overrides)


class Runs:
    """Every stage run of this module, started once, two at a time."""

    def __init__(self, pipeline: TinyPipeline, root: str) -> None:
        self.pipeline, self.root = pipeline, root
        self.sft = StageLayout(pipeline.baseline_uris["sft"]).final
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.futures: dict[str, Any] = {}

    def inputs(self, stage: str) -> dict[str, str]:
        """LoRA starts from the tiny pipeline's trained SFT model on every stage (SFT included)."""
        data = self.pipeline.data_uri
        return {
            "sft": {"data": data, "model": self.sft},
            "reward_model": {"data": data, "model": self.sft},
            "dpo": {"data": data, "model": self.sft, "reference": self.sft},
            "grpo": {"data": data, "model": self.sft, "reference": self.sft},
            "ppo": {
                "data": data,
                "model": self.sft,
                "reference": self.sft,
                "reward_model": StageLayout(self.pipeline.baseline_uris["reward_model"]).final,
            },
            "distill": {"data": data, "model": self.sft, "reference": self.teacher},
        }[stage]

    @property
    def teacher(self) -> str:
        return wider_teacher(self.pipeline, os.path.join(self.root, "teacher"))

    def spec(
        self, name: str, stage: str, config: PipelineConfig, inputs: dict[str, str] | None = None
    ) -> tuple[str, str]:
        output = os.path.join(self.root, name)
        spec = build_spec(config, stage, RUN_ID, inputs or self.inputs(stage), output_uri=output, writer_id=f"w-{name}")
        return write_spec(spec, f"{output}.spec.json"), output

    def start(self, name: str, fn, *args) -> None:
        self.futures[name] = self.pool.submit(fn, *args)

    def result(self, name: str) -> Any:
        return self.futures[name].result()

    def stage(
        self, name: str, stage: str, config: PipelineConfig, inputs: dict[str, str] | None = None
    ) -> tuple[StageRun, str]:
        path, output = self.spec(name, stage, config, inputs)
        run = run_stage(path)
        assert run.returncode == 0, why_failed(run)
        return run, output

    def adapter_handoff(self) -> dict[str, tuple[StageRun, str]]:
        """SFT from config (init) committed as an adapter, then DPO from it twice: continuing its
        adapter, and merging it to start a new one (itself committed as an adapter)."""
        data, keep = self.pipeline.data_uri, {"merge_on_commit": False}
        out = {
            "sft": self.stage(
                "sft-adapter", "sft", lora_config(self.pipeline, **{"sft.lora": keep}), {"data": data, "model": "init"}
            )
        }
        sft = StageLayout(out["sft"][1]).final
        inputs = {"data": data, "model": sft, "reference": sft}
        out["continue"] = self.stage(
            "dpo-continue",
            "dpo",
            lora_config(self.pipeline, **{"dpo.lora": {**keep, "continue_adapter": True}}),
            inputs,
        )
        out["new"] = self.stage("dpo-new", "dpo", lora_config(self.pipeline, **{"dpo.lora": keep}), inputs)
        return out

    def ranks(self, name: str, backend: str) -> tuple[StageRun, dict[str, str]]:
        extra = {"backend.zero_stage": int(backend[-1])} if backend.startswith("deepspeed") else {}
        config = lora_config(self.pipeline, backend.split("-")[0], 2, **extra)
        specs, outputs = [], {}
        for stage in ("sft", "dpo"):
            path, outputs[stage] = self.spec(f"{name}-{stage}", stage, config)
            specs.append(path)
        job = run_ranks([str(FIXTURES / "backend_stages.py"), *specs], 2)
        assert job.returncode == 0, why_failed(job)
        return job, outputs

    def resume(self) -> tuple[StageRun, str]:
        _, full = self.result("sft")
        path, output = self.spec("sft-resumed", "sft", lora_config(self.pipeline))
        copy_checkpoint(full, SAVE_EVERY, output)
        run = run_stage(path)
        assert run.returncode == 0, why_failed(run)
        return run, output


@pytest.fixture(scope="module")
def runs(tiny_pipeline: TinyPipeline, tmp_path_factory) -> Runs:
    store = Runs(tiny_pipeline, str(tmp_path_factory.mktemp("lora")))
    single = lora_config(tiny_pipeline)
    rl = {stage: rl_config(tiny_pipeline, stage, **LORA) for stage in ("grpo", "ppo")}
    separate = {"lora.reference_model": "separate"}
    store.start("handoff", store.adapter_handoff)
    store.start("sft", store.stage, "sft", "sft", single)
    store.start("ranks-fsdp2", store.ranks, "fsdp2", "fsdp2")
    store.start("dpo", store.stage, "dpo", "dpo", single)
    store.start("ranks-ddp", store.ranks, "ddp", "ddp")
    store.start("ranks-deepspeed-3", store.ranks, "deepspeed-3", "deepspeed-3")
    store.start("ranks-deepspeed-2", store.ranks, "deepspeed-2", "deepspeed-2")
    store.start("dpo-separate", store.stage, "dpo-separate", "dpo", lora_config(tiny_pipeline, **separate))
    store.start("resume", store.resume)
    store.start("grpo", store.stage, "grpo", "grpo", rl["grpo"])
    store.start(
        "grpo-separate", store.stage, "grpo-separate", "grpo", rl_config(tiny_pipeline, "grpo", **LORA, **separate)
    )
    store.start("ppo", store.stage, "ppo", "ppo", rl["ppo"])
    store.start("ppo-separate", store.stage, "ppo-separate", "ppo", rl_config(tiny_pipeline, "ppo", **LORA, **separate))
    store.start("reward_model", store.stage, "reward_model", "reward_model", single)
    store.start(
        "distill",
        store.stage,
        "distill",
        "distill",
        rl_config(
            tiny_pipeline,
            "distill",
            **LORA,
            **{"distill.loss": "generalized_jsd", "distill.teacher_from": store.teacher},
        ),
    )
    yield store
    store.pool.shutdown(wait=True, cancel_futures=True)


def assert_close_lines(actual: dict[int, dict[str, str]], expected: dict[int, dict[str, str]]) -> None:
    assert sorted(actual) == sorted(expected)
    for step, values in expected.items():
        assert sorted(actual[step]) == sorted(values), step
        for key, value in values.items():
            got = actual[step][key]
            assert float(got) == pytest.approx(float(value), rel=PRINTED_REL, abs=PRINTED_ABS), (step, key, got, value)


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "deepspeed-2", "deepspeed-3"])
@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_lora_at_two_ranks_tracks_the_single_device(runs, backend, stage):
    job, outputs = runs.result(f"ranks-{backend}")
    single, _ = runs.result(stage)
    expected = single.step_metrics()
    assert sorted(expected) == list(range(STEPS + 1))
    assert "train/loss" in expected[STEPS]
    assert_close_lines(stage_lines(job, stage).step_metrics(), expected)
    manifest = read_manifest(StageLayout(outputs[stage]).final)
    assert (manifest.backend, manifest.world_size, manifest.global_step) == (backend.split("-")[0], 2, STEPS)


def adapter_count(weights: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() for k, v in weights.items() if ".lora_A." in k or ".lora_B." in k)


def test_lora_checkpoint_holds_the_adapters_and_their_optimizer_state_only(runs, tiny_pipeline):
    _, output = runs.result("sft")
    ckpt = checkpoint_uri(output, STEPS)
    weights = safetensors.torch.load(storage.read_bytes(join_uri(ckpt, "model.safetensors")))
    assert weights and all(".lora_A.default." in k or ".lora_B.default." in k for k in weights)
    base = final_weights(tiny_pipeline.baseline_uris["sft"])
    adapters, total = adapter_count(weights), sum(v.numel() for v in base.values())
    # r x (in + out) per adapted linear: 7 per block (q k v o gate up down) x 2 blocks.
    h, i, kv = 32, 64, 32 // 4 * 2  # hidden, intermediate, key-value width (4 heads, 2 kv heads)
    per_block = RANK * ((h + h) + (h + kv) + (h + kv) + (h + h) + 2 * (h + i) + (i + h))
    assert adapters == 2 * per_block
    baseline = tiny_pipeline.baseline_uris["sft"]
    full_ckpt = checkpoint_uri(baseline, committed_steps(baseline)[-1])  # the same model, fully trained
    size = lambda uri: len(storage.read_bytes(join_uri(uri, "model.safetensors")))
    full_weights = safetensors.torch.load(storage.read_bytes(join_uri(full_ckpt, "model.safetensors")))
    full_elements = sum(v.numel() for v in full_weights.values())  # a tied head under both names
    # float32 payload plus safetensors' JSON header (about 100 bytes a tensor): the expected factor
    # adapters / full_elements (0.108 here; r x (in + out) against in x out on a real model).
    assert 4 * adapters <= size(ckpt) <= 4 * adapters + 150 * len(weights)
    assert 4 * full_elements <= size(full_ckpt) <= 4 * full_elements + 150 * len(full_weights)
    # AdamW's two moments, for the adapters only (the file's own overhead is per tensor).
    moments = lambda uri: sum(
        v.numel()
        for state in torch.load(io.BytesIO(storage.read_bytes(join_uri(uri, "optimizer.pt"))))["state"].values()
        for k, v in state.items()
        if k != "step"
    )
    assert moments(ckpt) == 2 * adapters and moments(full_ckpt) == 2 * total


def tensor_elements(obj: Any) -> int:
    """Elements of every tensor anywhere in a loaded DeepSpeed file (dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if isinstance(obj, dict):
        return sum(tensor_elements(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_elements(v) for v in obj)
    return 0


@pytest.mark.parametrize("backend", ["deepspeed-2", "deepspeed-3"])
def test_deepspeed_lora_checkpoint_holds_the_adapters_only(runs, tiny_pipeline, backend):
    """A 2-rank ZeRO-2 / ZeRO-3 LoRA checkpoint (``exclude_frozen_parameters``): its files hold the
    adapters' fp32 master copies and two AdamW moments, and under ZeRO-2 their weights (4.0 x the
    adapter elements; ZeRO-3: 3.0 x), never a frozen base weight: at most 4.5 x, where the tiny
    model's own weights are 6.9 x. Before ``frozen_aliases_excluded`` the tied, frozen ``lm_head``
    stayed in the ZeRO-2 checkpoint (6.3 x)."""
    _, outputs = runs.result(f"ranks-{backend}")
    ckpt = checkpoint_uri(outputs["sft"], STEPS)
    ds = join_uri(ckpt, "deepspeed")
    files = [path for path in storage.list_files(ds) if path.endswith(".pt")]
    assert any("optim_states" in path for path in files) and any("model_states" in path for path in files), files
    elements = sum(
        tensor_elements(
            torch.load(io.BytesIO(storage.read_bytes(join_uri(ds, path))), map_location="cpu", weights_only=False)
        )
        for path in files
    )
    _, single = runs.result("sft")
    adapters = adapter_count(
        safetensors.torch.load(storage.read_bytes(join_uri(checkpoint_uri(single, STEPS), "model.safetensors")))
    )
    base = sum(v.numel() for v in final_weights(tiny_pipeline.baseline_uris["sft"]).values())
    assert 3 * adapters <= elements <= 4.5 * adapters < base, (elements, adapters, base)


def test_committed_model_is_base_plus_scaled_b_times_a(runs, tiny_pipeline):
    _, output = runs.result("sft")
    merged = final_weights(output)
    base = final_weights(tiny_pipeline.baseline_uris["sft"])
    adapters = safetensors.torch.load(storage.read_bytes(join_uri(checkpoint_uri(output, STEPS), "model.safetensors")))
    assert sorted(merged) == sorted(base)  # a plain HF model: no adapter keys
    adapted = 0
    for name, weight in base.items():
        prefix = name.removesuffix(".weight")
        a, b = adapters.get(f"{prefix}.lora_A.default.weight"), adapters.get(f"{prefix}.lora_B.default.weight")
        if a is None:
            assert torch.equal(merged[name], weight), name  # frozen, unadapted: unchanged
            continue
        adapted += 1
        expected = weight + (ALPHA / RANK) * (b @ a)
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name
        assert not torch.equal(merged[name], weight), name  # the adapter learned something
    assert adapted == 14


def test_killed_lora_stage_resumes_to_the_same_weights(runs):
    resumed, output = runs.result("resume")
    _, uninterrupted = runs.result("sft")
    assert min(resumed.step_metrics()) == SAVE_EVERY + 1  # trained steps 5-8 only
    assert_same_weights(final_weights(output), final_weights(uninterrupted))


@pytest.mark.parametrize("stage", ["dpo", "grpo", "ppo"])
def test_disabled_adapter_reference_equals_a_separate_reference_model(runs, stage):
    disabled, out_disabled = runs.result(stage)
    separate, out_separate = runs.result(f"{stage}-separate")
    said = "reference: the policy with its LoRA adapter disabled"
    assert said in disabled.output and said not in separate.output
    lines = disabled.step_metrics()
    assert lines and lines == separate.step_metrics()
    if stage == "dpo":
        margins = [float(v) for k, v in lines[STEPS].items() if "margin" in k]  # the reference is not the policy
        assert "train/loss" in lines[STEPS] and margins and all(m != 0.0 for m in margins), lines[STEPS]
    else:
        assert any(float(v.get("objective/kl", v.get("policy/kl_avg", "0"))) != 0.0 for v in lines.values())
    assert_same_weights(final_weights(out_disabled), final_weights(out_separate))


def test_reward_model_trains_adapters_and_score_head(runs, tiny_pipeline):
    run, output = runs.result("reward_model")
    ckpt = safetensors.torch.load(storage.read_bytes(join_uri(checkpoint_uri(output, STEPS), "model.safetensors")))
    assert "score.weight" in ckpt and adapter_count(ckpt) > 0
    assert set(ckpt) - {"score.weight"} == {k for k in ckpt if ".lora_" in k}
    assert sorted(final_weights(output)) == sorted(final_weights(tiny_pipeline.baseline_uris["reward_model"]))


def test_distillation_trains_the_adapters_against_a_separate_teacher(runs, tiny_pipeline):
    """LoRA distill with the generalised JSD: the teacher is loaded as its own model (not the
    disabled adapter, whose inputs differ), the divergence falls, the checkpoint holds adapters only
    and the committed merge differs from the SFT student."""
    run, output = runs.result("distill")
    assert "reference: the policy with its LoRA adapter disabled" not in run.output
    steps = run.step_metrics()
    jsd = [float(steps[s]["distill/jsd_avg"]) for s in sorted(steps)]
    assert sum(jsd[-2:]) / 2 < sum(jsd[:2]) / 2, jsd
    last = max(committed_steps(output))
    ckpt = safetensors.torch.load(storage.read_bytes(join_uri(checkpoint_uri(output, last), "model.safetensors")))
    assert adapter_count(ckpt) > 0 and all(".lora_" in k for k in ckpt)
    merged, sft = final_weights(output), final_weights(tiny_pipeline.baseline_uris["sft"])
    assert sorted(merged) == sorted(sft) and any(not torch.equal(merged[k], sft[k]) for k in sft)


def committed_files(output: str) -> dict[str, int]:
    return storage.list_files(StageLayout(output).final)


def adapter_weights(output: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load(storage.read_bytes(join_uri(StageLayout(output).final, "adapter_model.safetensors")))


def test_adapter_commit_is_peft_format_over_its_base(runs, tiny_pipeline):
    """merge_on_commit false: the final directory holds PEFT's adapter files, the tokenizer and
    (the model was built from config) the base under base/; ``peft`` over that base computes
    what posttrain's loader gives when it merges the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer_core.modeling.models import load_causal_lm, local_model_path

    _, output = runs.result("handoff")["sft"]
    final = StageLayout(output).final
    files = committed_files(output)
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "base/config.json",
        "base/model.safetensors",
        "tokenizer.json",
    } <= set(files) and "model.safetensors" not in files
    manifest = read_manifest(final)
    assert manifest.extra["adapter"] == {"format": "peft", "base_model": join_uri(final, "base")}
    weights = adapter_weights(output)
    assert len(weights) == 28 and all(k.startswith("base_model.model.model.layers.") for k in weights)
    assert files["adapter_model.safetensors"] < files["base/model.safetensors"] / 5

    x = torch.randint(3, 100, (2, 12))
    merged = load_causal_lm(final, tiny_pipeline.config.model, None, seed=0)
    local = local_model_path(final)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(join_uri(local, "base")), local)
    with torch.no_grad():
        assert torch.allclose(peft_model(x).logits, merged(x).logits, atol=1e-5)


def test_next_stage_continues_the_adapter_or_starts_a_new_one(runs):
    """DPO from an adapter commit: continuing trains the SFT adapter further (same base in its
    manifest, its starting adapter the SFT one, the reference the SFT model loaded merged);
    a new adapter goes on the merged SFT model (committed as its base), with the disabled-adapter
    reference. Both start with the policy equal to the reference: loss log 2 at step 1."""
    out = runs.result("handoff")
    (_, sft), (cont, cont_out), (new, new_out) = out["sft"], out["continue"], out["new"]
    sft_base = read_manifest(StageLayout(sft).final).extra["adapter"]["base_model"]
    disabled = "reference: the policy with its LoRA adapter disabled"
    assert "continuing the adapter of" in cont.output and disabled not in cont.output
    assert "continuing the adapter of" not in new.output and disabled in new.output
    for run in (cont, new):
        assert float(run.step_metrics()[1]["train/loss"]) == pytest.approx(math.log(2), abs=2e-4)

    assert read_manifest(StageLayout(cont_out).final).extra["adapter"]["base_model"] == sft_base
    new_final = StageLayout(new_out).final
    assert read_manifest(new_final).extra["adapter"]["base_model"] == join_uri(new_final, "base")

    first = lambda output: safetensors.torch.load(
        storage.read_bytes(join_uri(checkpoint_uri(output, SAVE_EVERY), "model.safetensors"))
    )
    sft_b = {
        k.removeprefix("base_model.model.").replace(".lora_B.", ".lora_B.default."): v
        for k, v in adapter_weights(sft).items()
        if ".lora_B." in k
    }
    cosine = lambda a, b: float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))
    cont_b, new_b = first(cont_out), first(new_out)
    assert min(cosine(cont_b[k], v) for k, v in sft_b.items()) > 0.7  # the SFT adapter, trained a little further
    assert max(abs(cosine(new_b[k], v)) for k, v in sft_b.items()) < 0.4  # a fresh adapter
    merged_sft = final_weights_of(join_uri(new_final, "base"))
    assert sorted(merged_sft) == sorted(final_weights_of(sft_base))
    assert any(not torch.equal(merged_sft[k], v) for k, v in final_weights_of(sft_base).items())


def final_weights_of(model_dir: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load(storage.read_bytes(join_uri(model_dir, "model.safetensors")))


def test_qlora_commits_the_dequantized_base_plus_scaled_b_times_a(tiny_pipeline, tmp_path):
    """QLoRA (``lora.quantize: 4bit``) on CPU, in this process: SFT from a saved model (hidden
    64: bitsandbytes' CPU kernels need rows of at least one 64-value block) for 4 steps, committed
    merged. The commit is a plain model (no ``quantization_config``, ``nn.Linear`` layers) whose
    adapted weights are ``dequant(nf4(W)) + (alpha / r) B A``: the NF4 round trip computed here
    with bitsandbytes' own functions (double quantization, 64-value blocks), B and A from the last
    checkpoint. Within a tenth of the NF4 error, not exactly: bitsandbytes' CPU kernels repack the
    weight and its block scales on the first forward, which moves the dequantized values by up to
    ~3e-4 here (the NF4 error itself is ~8e-3)."""
    bnb = pytest.importorskip("bitsandbytes", minversion="0.48")
    from transformers import AutoModelForCausalLM

    from trainer_core.data.prepared import load_tokenizer_from
    from trainer_core.modeling.models import load_causal_lm
    from trainer_core.stages.runner import run_spec

    config = lora_config(
        tiny_pipeline,
        **{
            "model.init.hidden_size": 64,
            "model.init.intermediate_size": 128,
            "sft.lora": {"quantize": "4bit"},
            "sft.max_steps": SAVE_EVERY,
        },
    )
    tokenizer = load_tokenizer_from(tiny_pipeline.data_uri)
    base_dir, output = str(tmp_path / "base"), str(tmp_path / "qlora")
    load_causal_lm("init", config.model, tokenizer, seed=1).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    spec = build_spec(config, "sft", RUN_ID, {"data": tiny_pipeline.data_uri, "model": base_dir}, output_uri=output)
    assert run_spec(spec).global_step == SAVE_EVERY

    final = StageLayout(output).final
    committed = AutoModelForCausalLM.from_pretrained(final)
    assert getattr(committed.config, "quantization_config", None) is None
    assert type(committed.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    merged, base = final_weights(output), final_weights_of(base_dir)
    adapters = safetensors.torch.load(
        storage.read_bytes(join_uri(checkpoint_uri(output, SAVE_EVERY), "model.safetensors"))
    )
    adapted = 0
    for name, weight in base.items():
        prefix = name.removesuffix(".weight")
        a, b = adapters.get(f"{prefix}.lora_A.default.weight"), adapters.get(f"{prefix}.lora_B.default.weight")
        if a is None:
            continue
        adapted += 1
        packed, state = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
        dequantized = bnb.functional.dequantize_4bit(packed, state).to(weight.dtype)
        expected = dequantized + (ALPHA / RANK) * (b @ a).to(weight.dtype)
        nf4_error = float((dequantized - weight).abs().max())
        assert nf4_error > 1e-3, name  # 4 bits: the base the adapter was trained on is not W
        assert float((merged[name] - expected).abs().max()) < 0.1 * nf4_error, name
    assert adapted == 7 * config.model.init.num_hidden_layers
