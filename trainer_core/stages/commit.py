"""A stage's final commit: its model (merged, or as its LoRA adapter over the base it was trained
on), tokenizer and other files written to ``<output_uri>/final/``, ``manifest.json`` last, by rank 0
alone under a distributed backend, never with non-finite weights, and fenced against a newer
attempt of the stage (:mod:`trainer_core.checkpoint.lease`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from trainer_core.checkpoint.lease import LeaseLostError, check_fence
from trainer_core.checkpoint.manifest import ArtifactWriter, Manifest
from trainer_core.errors import NonFiniteError
from trainer_core.modeling.lora import (
    adapter_files,
    base_state_dict,
    dequantized_state_dict,
    has_lora,
    is_trained,
    merged_state_dict,
)
from trainer_core.modeling.models import save_pretrained_to, save_tokenizer_to
from trainer_core.stages.context import StageContext
from trainer_core.storage import join_uri
from trainer_core.training.guard import nonfinite_weights

log = logging.getLogger(__name__)


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
    if ctx.models.lora.merge_on_commit:
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
        base = ctx.models.adapter_base()
        base_weights = None
        if not base:
            # a QLoRA base is committed dequantized: the weights its adapter was trained against
            base, base_weights = (
                join_uri(ctx.layout.final, BASE_DIR),
                base_state_dict(dequantized_state_dict(model, state)),
            )
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
