"""Mixture-of-experts training: the routers' load-balancing loss and expert-usage statistics.

A model has routers when its class declares them as transformers' recordable
``router_logits`` output (``_can_record_outputs``: Mixtral, Qwen2-MoE, OLMoE, ...). Forward
hooks on those router modules capture each training forward's router logits, [tokens, E] per
block; :class:`MoEObjective` wraps a stage's objective and, per micro-batch,

- adds ``moe.aux_loss_coef`` times transformers' ``load_balancing_loss_func`` of them (Switch
  Transformer, Fedus et al. 2021, eqs. 4-6: E times the sum over experts of the fraction of
  top-k assignments and the mean router probability; its minimum 1 means perfect balance),
  padding tokens left out, as ``MixtralForCausalLM`` adds it when ``output_router_logits`` is on;
- counts the top-k assignments of every expert in every block.

After each optimizer step the counts, summed over micro-batches and ranks, become per-block
expert-usage metrics: ``moe/layer<l>/expert<e>_share`` (fraction of the block's assignments;
uniform: 1/E), ``min_share``, ``max_share`` and ``entropy`` (nats, of the share distribution;
uniform: ln E), and ``moe/entropy`` (their mean over blocks). Dropped tokens are not reported:
these routers have no capacity limit and drop none. Forwards without gradient (evaluation,
reference passes, KTO's KL sequences) are not captured.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from trainer_core.errors import ConfigError
from trainer_core.training.loop import Objective, StepOutput


def _router_spec(model: nn.Module) -> tuple[type[nn.Module], int, Any] | None:
    """(router class, index of the logits in its output, the model's config), or None for a dense model."""
    for module in model.modules():
        recordable = getattr(type(module), "_can_record_outputs", None) or {}
        recorder = recordable.get("router_logits")
        if recorder is not None and hasattr(recorder, "target_class"):
            return recorder.target_class, recorder.index or 0, module.config
    return None


class RouterRecorder:
    """Forward hooks that keep the router logits of every forward run with gradient enabled.

    Args:
        routers: the router modules, in block order.
        index: where the logits sit in a router's output tuple.
    """

    def __init__(self, routers: list[nn.Module], index: int) -> None:
        self.logits: list[Tensor] = []
        self.index = index
        self.handles = [router.register_forward_hook(self._hook) for router in routers]

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self.logits.append(output[self.index] if isinstance(output, (tuple, list)) else output)

    def take(self) -> list[Tensor]:
        """The logits captured since the last call ([tokens, E] each, in call order), and forget them."""
        logits, self.logits = self.logits, []
        return logits

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()


def _token_mask(batch: dict[str, Tensor], rows: int) -> Tensor | None:
    """[rows] mask of the real tokens among a forward's ``rows`` router rows: the batch's
    attention mask (or chosen over rejected, the one forward of a pair batch, or the KTO
    completions) whose size matches; None for a packed batch (no padding)."""
    candidates = [batch.get("attention_mask")]
    if "chosen_attention_mask" in batch:
        candidates.append(torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]]))
    for mask in candidates:
        if mask is not None and mask.numel() == rows:
            return mask.reshape(-1)
    return None


class MoEObjective:
    """An objective plus the routers' load-balancing loss and expert-usage counts (module docstring).

    Args:
        inner: the stage's objective (counts, evaluation and its own metrics are its own).
        recorder: the hooks on the trained model's routers.
        num_experts: E, experts per block.
        top_k: experts per token.
        aux_loss_coef: weight of the load-balancing loss (0: counted, not added).
    """

    def __init__(self, inner: Objective, recorder: RouterRecorder, num_experts: int, top_k: int,
                 aux_loss_coef: float) -> None:
        self.inner = inner
        self.recorder = recorder
        self.num_experts, self.top_k, self.aux_loss_coef = num_experts, top_k, aux_loss_coef
        self.num_layers = len(recorder.handles)

    def __getattr__(self, name: str) -> Any:  # num_tokens, evaluate, metric_denominators, eval_source, ...
        return getattr(self.inner, name)

    def count(self, batch: dict[str, Tensor]) -> int:
        return self.inner.count(batch)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return self.inner.evaluate(model)

    def step(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        self.recorder.take()  # drop what activation checkpointing's recompute captured in the last backward
        out = self.inner.step(model, batch)
        logits = self.recorder.take()
        if not logits:
            return out
        if len(logits) % self.num_layers:
            raise RuntimeError(f"captured {len(logits)} router outputs, not a multiple of the {self.num_layers} blocks")
        forwards = [logits[i : i + self.num_layers] for i in range(0, len(logits), self.num_layers)]
        aux = torch.stack([
            load_balancing_loss_func(tuple(f), self.num_experts, self.top_k, _token_mask(batch, f[0].shape[0]))
            for f in forwards
        ]).mean()
        counts = torch.zeros(self.num_layers, self.num_experts, device=aux.device)
        for forward in forwards:
            mask = _token_mask(batch, forward[0].shape[0])
            for layer, layer_logits in enumerate(forward):
                chosen = torch.topk(layer_logits.detach().float(), self.top_k, dim=-1).indices  # [tokens, k]
                weight = torch.ones_like(chosen, dtype=torch.float32) if mask is None else (
                    mask.to(torch.float32)[:, None].expand_as(chosen))
                counts[layer].scatter_add_(0, chosen.reshape(-1), weight.reshape(-1))
        sums = dict(out.metric_sums)
        sums["moe/aux_loss"], sums["moe/micro_batches"] = aux.detach(), torch.ones((), device=aux.device)
        for layer in range(self.num_layers):
            for expert in range(self.num_experts):
                sums[f"moe/layer{layer}/expert{expert}/tokens"] = counts[layer, expert]
        aux_loss = self.aux_loss_coef * aux if self.aux_loss_coef else None
        return StepOutput(loss_sum=out.loss_sum, num_tokens=out.num_tokens, metric_sums=sums, aux_loss=aux_loss)

    def finalize_metrics(self, metric_sums: dict[str, Tensor]) -> dict[str, Tensor]:
        """``moe/aux_loss`` (its mean over the step's micro-batches, unweighted) and the per-block
        expert shares, their min, max and entropy, from the step's assignment counts (summed over
        ranks); removes the sums it reads from ``metric_sums``."""
        if "moe/aux_loss" not in metric_sums:
            return {}
        out: dict[str, Tensor] = {"moe/aux_loss": metric_sums.pop("moe/aux_loss") / metric_sums.pop("moe/micro_batches")}
        entropies = []
        for layer in range(self.num_layers):
            keys = [f"moe/layer{layer}/expert{e}/tokens" for e in range(self.num_experts)]
            counts = torch.stack([torch.as_tensor(metric_sums.pop(k)) for k in keys]).float()
            share = counts / counts.sum().clamp(min=1.0)
            for expert in range(self.num_experts):
                out[f"moe/layer{layer}/expert{expert}_share"] = share[expert]
            entropy = -(share * share.clamp(min=1e-12).log()).sum()
            out[f"moe/layer{layer}/min_share"], out[f"moe/layer{layer}/max_share"] = share.min(), share.max()
            out[f"moe/layer{layer}/entropy"] = entropy
            entropies.append(entropy)
        out["moe/entropy"] = torch.stack(entropies).mean()
        return out


def with_moe(model: nn.Module, objective: Objective, aux_loss_coef: float, section: str) -> Objective:
    """``objective`` wrapped in a :class:`MoEObjective` when ``model`` (plain or wrapped by a
    backend) has routers; ``objective`` itself for a dense model.

    Raises:
        ConfigError: ``aux_loss_coef`` is set for a model without routers (names
            ``<section>.moe.aux_loss_coef``).
    """
    spec = _router_spec(model)
    if spec is None:
        if aux_loss_coef:
            raise ConfigError(f"{section}.moe.aux_loss_coef={aux_loss_coef}: the model has no mixture-of-experts "
                              "routers")
        return objective
    router_class, index, config = spec
    routers = [m for m in model.modules() if isinstance(m, router_class)]
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts")
    top_k = config.num_experts_per_tok
    return MoEObjective(objective, RouterRecorder(routers, index), num_experts, top_k, aux_loss_coef)

