"""What a running stage sees: its spec, backend, tokenizer and metric sinks; and the final commit.

:func:`~trainer_core.stages.runner.run_spec` builds a :class:`StageContext` and hands it to the
stage module's ``run(ctx)``; stage modules never build backends or loggers themselves.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from trainer_core.backends import Backend
from trainer_core.checkpoint.lease import LeaseLostError, WriteFence, check_fence
from trainer_core.checkpoint.manifest import ArtifactWriter, Manifest
from trainer_core.checkpoint.session import CheckpointSession, MetricsBuffer
from trainer_core.config import LoraConfig, PipelineConfig, TrainStageConfig
from trainer_core.data.prepared import load_split
from trainer_core.errors import ConfigError, NonFiniteError
from trainer_core.modeling.lora import (
    adapter_base_model,
    adapter_files,
    apply_lora,
    attach_adapter,
    base_state_dict,
    check_continued,
    dequantized_state_dict,
    has_lora,
    is_trained,
    merged_state_dict,
    peft_config,
)
from trainer_core.modeling.forward import check_packed_rows_apart
from trainer_core.modeling.models import (
    adapter_source,
    load_causal_lm,
    load_reward_model,
    save_pretrained_to,
    save_tokenizer_to,
)
from trainer_core.registry import INIT_SOURCE
from trainer_core.spec import StageSpec
from trainer_core.storage import StageLayout, join_uri
from trainer_core.tracking import MetricLogger
from trainer_core.training.guard import nonfinite_weights
from trainer_core.training.loop import BatchSource, Objective, TrainLoop, summarize
from trainer_core.training.moe import MoEObjective, with_moe

log = logging.getLogger(__name__)


WALL_TIME_PREFIXES = ("time/", "memory/", "rollout/tokens_per_s")
"""Metrics that measure wall time or memory: never equal between two runs of the same work."""


@dataclass
class StageContext:
    """A running stage: its spec, backend, tokenizer and metric sink.

    Attributes:
        spec: the stage spec the task wrote.
        backend: where models run (its process group, if any, is joined).
        tokenizer: the pipeline's tokenizer (from prepare_data's output); None for prepare_data.
        metrics: the MLflow metric logger of the stage's nested run (rank 0; a no-op elsewhere
            and without tracking).
        print_timing: also print each step's wall-time metrics on a line of their own (the RL
            stages: the time split of an iteration).
        attempt: this launch's attempt id (the same on every rank): its checkpoints are written
            under names of their own; None: plain ``step-XXXXXXXX`` names.
        fence: what every rank checks before it writes (the stage's lease still held by this
            attempt, ``trainer_core.checkpoint.lease``); None: no check.
    """

    spec: StageSpec
    backend: Backend
    tokenizer: PreTrainedTokenizerBase | None
    metrics: MetricLogger
    print_timing: bool = False
    attempt: str | None = None
    fence: WriteFence | None = None

    def check_fence(self, what: str) -> None:
        """Collective: raise ``LeaseLostError`` on every rank unless this attempt still holds the
        stage's lease (see :func:`~trainer_core.checkpoint.lease.check_fence`)."""
        check_fence(self.fence, self.backend, what)

    @property
    def config(self) -> PipelineConfig:
        """The pipeline config."""
        return self.spec.config

    @property
    def fingerprint(self) -> str:
        """The stage fingerprint (computed once by whoever built the spec)."""
        return self.spec.fingerprint

    @property
    def layout(self) -> StageLayout:
        """The stage's output directories."""
        return StageLayout(self.spec.output_uri)

    @property
    def data_uri(self) -> str:
        """The prepare_data output this stage reads."""
        return self.input("data")

    def input(self, role: str) -> str:
        """The URI of input ``role``.

        Raises:
            ConfigError: the spec has no such input (a stage it needs was not run).
        """
        try:
            return self.spec.inputs[role]
        except KeyError:
            raise ConfigError(
                f"stage {self.spec.stage!r} needs input {role!r}; spec inputs: {sorted(self.spec.inputs)}"
            ) from None

    @property
    def is_main(self) -> bool:
        """True on rank 0: the one process that prints metrics, talks to MLflow and commits."""
        return self.backend.rank == 0

    def print_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Print a compact metrics line (the task streams it into the Prefect log); rank 0 only.

        Wall-time measurements (``time/*``, ``rollout/tokens_per_s``) and memory go on a second
        line, ``[stage] step N time: ...``, so that the first one is the same in two runs of the
        same work (what the resume tests compare)."""
        if not self.is_main:
            return
        timing = {k: v for k, v in metrics.items() if k.startswith(WALL_TIME_PREFIXES)}
        shown = {k: v for k, v in metrics.items() if k not in timing and not k.startswith("first/")}
        text = " ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items()))
        lines = f"[{self.spec.stage}] step {step}: {text}\n"
        if self.print_timing and timing:
            lines += f"[{self.spec.stage}] step {step} time: " + " ".join(
                f"{k}={v:.4g}" for k, v in sorted(timing.items())) + "\n"
        # One write call: print() writes the text and the newline separately, and a log line
        # from the async checkpoint saver's thread can land between them on a shared pipe.
        sys.stdout.write(lines)
        sys.stdout.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Print and send to MLflow at once (stages without checkpoints)."""
        self.print_metrics(metrics, step)
        self.metrics.log(metrics, step)

    def checkpoint_session(self, cfg: TrainStageConfig, *, extra: dict[str, Any] | None = None,
                           asynchronous: bool | None = None) -> CheckpointSession:
        """The stage's checkpoint session over ``<output>/checkpoints`` with a fresh metrics buffer.

        Args:
            cfg: the stage config (``keep_last_checkpoints``, ``async_save``).
            extra: more ``extra`` manifest fields (a loop's layout version).
            asynchronous: override of ``cfg.async_save``.
        """
        validate = self.backend.validate_replicas
        return CheckpointSession(
            self.layout.checkpoints,
            self.backend,
            fingerprint=self.fingerprint,
            metrics=MetricsBuffer(self.metrics, self.print_metrics),
            stage=self.spec.stage,
            run_id=self.spec.run_id,
            extra={"mlflow_run_id": self.spec.mlflow_run_id, **(extra or {})},
            keep_last=cfg.keep_last_checkpoints,
            asynchronous=cfg.async_save if asynchronous is None else asynchronous,
            validate_replicas=validate,
            attempt=self.attempt,
            fence=self.fence,
        )

    @property
    def lora(self) -> LoraConfig:
        """The stage's resolved LoRA settings (``PipelineConfig.lora_for``)."""
        return self.config.lora_for(self.spec.stage)

    @cached_property
    def input_adapter(self) -> str | None:
        """The local directory of the input ``model`` when it was committed as a PEFT adapter
        (``models.adapter_source``; materialised once), else None."""
        return adapter_source(self.input("model"))

    @property
    def continues_adapter(self) -> bool:
        """True when the trained model continues the adapter its input was committed as
        (``lora.continue_adapter`` and the input ``model`` is a PEFT adapter)."""
        return self.lora.enabled and self.lora.continue_adapter and self.input_adapter is not None

    @property
    def reference_is_disabled_adapter(self) -> bool:
        """True when the stage's reference is its policy with the adapter disabled: LoRA on,
        ``lora.reference_model: disabled_adapter``, the policy starts from the reference's
        weights (inputs ``model`` and ``reference`` are one source) and its adapter is new (a
        continued adapter, disabled, would leave the base, not the input model)."""
        inputs = self.spec.inputs
        return (self.lora.enabled and self.lora.reference_model == "disabled_adapter"
                and "reference" in inputs and inputs.get("model") == inputs["reference"]
                and not self.continues_adapter)

    def causal_lm(self, role: str) -> nn.Module:
        """The causal LM of input ``role`` (``load_causal_lm``; seeded by the pipeline seed).

        The trained model (role ``model``) gets LoRA adapters when the stage's ``lora`` is
        enabled: new ones, or the input's own adapter with ``lora.continue_adapter``.

        Raises:
            ConfigError: the input is missing or cannot be loaded (the message names the stage,
                the role and the source).
        """
        return self._load(load_causal_lm, role)

    def reward_model(self, role: str = "reward_model") -> nn.Module:
        """The reward model of input ``role`` (``load_reward_model``). Raises as :meth:`causal_lm`."""
        return self._load(load_reward_model, role)

    def _load(self, load, role: str) -> nn.Module:
        source = self.input(role)
        lora = self.lora if role == "model" else LoraConfig()
        try:
            upstream = self.input_adapter if role == "model" and self.continues_adapter else None
            base = adapter_base_model(upstream) if upstream is not None else source
            if lora.enabled and lora.quantize is not None:
                model = self._load_quantized(load, base)
            else:
                model = load(base, self.config.model, self.tokenizer, self.config.seed)
            if not lora.enabled:
                return model
            if upstream is None:
                return apply_lora(model, lora, self.config.seed)
            wanted = peft_config(lora, model)
            attach_adapter(model, upstream, trainable=True, seed=self.config.seed)
            check_continued(wanted, model.posttrain_lora, source)
            log.info("continuing the adapter of %s (base %s)", source, base)
            return model
        except ConfigError as e:
            raise ConfigError(f"stage {self.spec.stage}, input {role!r}: {e}") from e

    def adapter_base(self) -> str:
        """The plain model this stage's adapter applies to, as committed with
        ``lora.merge_on_commit: false``: the continued adapter's base, or the input ``model``
        when it is a plain model loaded by URI or hub id; "" when the stage must commit the base
        itself (a model built from config, or an upstream adapter merged into its base)."""
        if self.input_adapter is not None:
            return adapter_base_model(self.input_adapter) if self.continues_adapter else ""
        source = self.input("model")
        return "" if source == INIT_SOURCE else source

    def _load_quantized(self, load, source: str) -> nn.Module:
        """QLoRA's base: ``source`` loaded in 4-bit NF4 (bitsandbytes), ready for k-bit training, on
        the stage's device (bitsandbytes >= 0.48 has NF4 kernels for CPU as well as CUDA)."""
        try:
            import bitsandbytes  # noqa: F401
            from transformers import BitsAndBytesConfig
        except ImportError as e:
            raise ConfigError(f"lora.quantize=4bit needs the bitsandbytes package ({e})") from e
        import torch
        from peft import prepare_model_for_kbit_training

        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=torch.bfloat16)
        model = load(source, self.config.model, self.tokenizer, self.config.seed, quantization_config=quantization)
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)

    def load_rows(self, name: str) -> list[dict]:
        """Rows of a prepared split (e.g. ``sft/train``)."""
        return load_split(self.data_uri, name)


def train_stage(
    ctx: StageContext,
    model: nn.Module,
    objective: Objective,
    train: BatchSource,
    cfg: TrainStageConfig,
) -> dict[str, float]:
    """Resume from the latest checkpoint if any, train, and return the stage's final metrics.

    Packed micro-batches (``max_tokens_per_micro_batch``) need a model that keeps packed rows
    apart (:func:`~trainer_core.modeling.forward.check_packed_rows_apart`, ConfigError otherwise).

    A mixture-of-experts model trains with its routers' load-balancing loss (``cfg.moe``) and
    logs its expert usage (:mod:`trainer_core.training.moe`)."""
    if getattr(cfg, "max_tokens_per_micro_batch", None) is not None:
        check_packed_rows_apart(model, f"{ctx.spec.stage}.max_tokens_per_micro_batch")
    objective = with_moe(model, objective, cfg.moe.aux_loss_coef, ctx.spec.stage, cfg.moe.router_temperature)
    loop = TrainLoop(
        model=model, backend=ctx.backend, objective=objective, batches=train, cfg=cfg, session=ctx.checkpoint_session(cfg)
    )
    resumed = loop.resume()
    progress = loop.run()
    if isinstance(objective, MoEObjective):
        objective.remove_hooks()
    metrics = summarize(progress)
    metrics["resumed"] = float(resumed)
    metrics["consumed_samples"] = float(progress.consumed_samples)
    metrics["consumed_tokens"] = float(progress.consumed_tokens)
    return metrics


def commit_final(
    ctx: StageContext,
    metrics: dict[str, float],
    *,
    model: nn.Module | None = None,
    files: dict[str, bytes] | None = None,
    extra: dict[str, Any] | None = None,
) -> Manifest:
    """Write the stage's result to ``<output_uri>/final/`` and commit it (manifest last).

    Collective under a distributed backend: the model is consolidated from every rank's
    shards into one HF-format safetensors state dict on rank 0 (``Backend.full_state_dict``),
    which alone writes and commits; every rank returns the committed manifest. Weights holding
    NaN or infinity are never committed.

    Args:
        ctx: the stage context.
        metrics: final metrics recorded in the manifest.
        model: an HF model (possibly wrapped or sharded) to save with the tokenizer.
        files: other files, relative path -> bytes.
        extra: extra manifest fields (inputs, MLflow run id are added).

    Raises:
        NonFiniteError: a weight of ``model`` is NaN or infinite (on every rank; nothing written).
        LeaseLostError: another attempt took the stage's lease over (on every rank; nothing
            written).
        Exception: whatever failed rank 0's write (there; a ``RuntimeError`` naming it on the
            other ranks, which would otherwise wait for its manifest).
    """
    backend = ctx.backend
    weights, adapter = _final_weights(ctx, model)
    _refuse_nonfinite(ctx, model, weights)
    ctx.check_fence(f"the final output {ctx.layout.final}")
    if backend.world_size == 1:
        return _write_final(ctx, metrics, model, weights, files, extra, adapter)
    result: tuple[str, Any] | None = None
    if ctx.is_main:  # the other ranks wait for rank 0's outcome, whatever it is
        try:
            result = ("ok", _write_final(ctx, metrics, model, weights, files, extra, adapter).model_dump(mode="json"))
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks have it
            result, error = (type(e).__name__, f"rank 0 failed to commit {ctx.layout.final}: {e}"), e
    kind, data = backend.broadcast_object(result)
    if kind != "ok":
        if ctx.is_main:
            raise error
        raise LeaseLostError(data) if kind == LeaseLostError.__name__ else RuntimeError(f"{kind}: {data}")
    return Manifest.model_validate(data)


def _final_weights(ctx: StageContext, model: nn.Module | None) -> tuple[dict[str, Tensor] | None, AdapterCommit | None]:
    """The state dict rank 0 commits for ``model`` (None: the unwrapped model's own) and, for a
    LoRA model not merged on commit, its adapter commit. Collective under a process group
    (``Backend.full_state_dict`` gathers every rank's shards).

    A LoRA model is committed merged (a plain HF model, W + scaling B A) with
    ``lora.merge_on_commit``, else as the adapter in PEFT format over the base it was trained on.
    """
    backend = ctx.backend
    weights = backend.full_state_dict(model) if model is not None and backend.process_group else None
    if model is None or not has_lora(model) or not ctx.is_main:
        return weights, None
    plain = backend.unwrap(model)
    if ctx.lora.merge_on_commit:
        full = weights if weights is not None else plain.state_dict()
        return merged_state_dict(plain, full, copy=weights is None), None
    adapter = AdapterCommit.of(ctx, plain, weights if weights is not None else plain.state_dict())
    return adapter.weights, adapter


def _refuse_nonfinite(ctx: StageContext, model: nn.Module | None, weights: dict[str, Tensor] | None) -> None:
    """Raise :class:`NonFiniteError` on every rank when rank 0 finds NaN or infinity in the final
    ``weights`` (or, when None, the unwrapped model's own)."""
    backend = ctx.backend
    bad = None
    if model is not None and ctx.is_main:
        bad = nonfinite_weights(weights if weights is not None else backend.unwrap(model).state_dict())
    bad = backend.broadcast_object(bad) if backend.world_size > 1 else bad
    if bad:
        raise NonFiniteError(
            f"stage {ctx.spec.stage}: the final model has non-finite weights ({len(bad)} tensors, e.g. "
            f"{', '.join(bad[:3])}); it is not committed"
        )


BASE_DIR = "base"
"""Where an adapter commit puts the base model it was trained on when that base exists nowhere
else (built from config, or an upstream adapter merged into its base)."""


@dataclass
class AdapterCommit:
    """A final model committed as its LoRA adapter (``lora.merge_on_commit: false``).

    Attributes:
        files: ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's format).
        weights: the adapter's live tensors (checked for non-finite values before writing).
        base_model: the adapter's ``base_model_name_or_path``, also the manifest's
            ``extra.adapter.base_model``.
        base_weights: the base model's plain state dict when it is written under ``base/``.
    """

    files: dict[str, bytes]
    weights: dict
    base_model: str
    base_weights: dict | None

    @classmethod
    def of(cls, ctx: StageContext, model: nn.Module, state: dict) -> AdapterCommit:
        """The commit of ``model`` (unwrapped, adapted) whose full state dict is ``state``."""
        base = ctx.adapter_base()
        base_weights = None
        if not base:
            # a QLoRA base is committed dequantized: the weights its adapter was trained against
            base, base_weights = join_uri(ctx.layout.final, BASE_DIR), base_state_dict(dequantized_state_dict(model, state))
        trained = {k: v for k, v in state.items() if is_trained(k)}
        return cls(adapter_files(model, state, base), trained, base, base_weights)


def _write_final(ctx, metrics, model, weights, files, extra, adapter: AdapterCommit | None = None) -> Manifest:
    writer = ArtifactWriter(ctx.layout.final, overwrite=True)
    info = {"inputs": ctx.spec.inputs, "mlflow_run_id": ctx.spec.mlflow_run_id, **(extra or {})}
    if adapter is not None:
        plain = ctx.backend.unwrap(model)
        if adapter.base_weights is not None:
            save_pretrained_to(writer, plain, ctx.tokenizer, prefix=f"{BASE_DIR}/", state_dict=adapter.base_weights)
        for relpath, data in adapter.files.items():
            writer.write_bytes(relpath, data)
        save_tokenizer_to(writer, ctx.tokenizer)
        info["adapter"] = {"format": "peft", "base_model": adapter.base_model}
    elif model is not None:
        save_pretrained_to(writer, ctx.backend.unwrap(model), ctx.tokenizer, state_dict=weights)
    for relpath, data in (files or {}).items():
        writer.write_bytes(relpath, data)
    check_fence(ctx.fence, ctx.backend, f"the manifest of {writer.uri}", collective=False)  # rank 0 alone here
    manifest = writer.commit(
        kind="final",
        stage=ctx.spec.stage,
        run_id=ctx.spec.run_id,
        global_step=int(metrics.get("global_step", 0)),
        consumed_samples=int(metrics.get("consumed_samples", 0)),
        consumed_tokens=int(metrics.get("consumed_tokens", 0)),
        config_hash=ctx.fingerprint,
        backend=ctx.backend.name,
        world_size=ctx.backend.world_size,
        metrics=metrics,
        extra=info,
    )
    log.info("stage %s committed %s", ctx.spec.stage, writer.uri)
    return manifest
