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

The Switch loss assumes softmax top-k routing (Mixtral, Qwen2-MoE, OLMoE); routers that say
nothing of their experts and top-k (``num_experts``, ``top_k``) get neither loss nor statistics.
After each optimizer step the counts, summed over micro-batches and ranks, become per-block
expert-usage metrics: ``moe/layer<l>/expert<e>_share`` (fraction of the block's assignments;
uniform: 1/E), ``min_share``, ``max_share`` and ``entropy`` (nats, of the share distribution;
uniform: ln E), and ``moe/entropy`` (their mean over blocks). Dropped tokens are not reported:
these routers have no capacity limit and drop none. Forwards without gradient (evaluation,
reference passes, KTO's KL sequences) are not captured.

An optional router temperature schedule (``moe.router_temperature``: start, end, steps) divides
the router logits of the training forwards by a temperature moved linearly from ``start`` to
``end`` over ``steps`` optimizer steps (a function of ``global_step``, so a resumed run takes the
same temperatures); > 1 spreads the routing early in training. Evaluation, reference passes and
the committed model route at temperature 1.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from trainer_core.config import RouterTemperatureConfig
from trainer_core.errors import ConfigError
from trainer_core.training.loop import Objective, StepOutput

log = logging.getLogger(__name__)


def _router_spec(model: nn.Module) -> tuple[type[nn.Module], int] | None:
    """(router class, index of the logits in its output), or None for a dense model."""
    for module in model.modules():
        recordable = getattr(type(module), "_can_record_outputs", None) or {}
        recorder = recordable.get("router_logits")
        if recorder is not None and hasattr(recorder, "target_class"):
            return recorder.target_class, recorder.index or 0
    return None


def _routing(router: nn.Module) -> tuple[int, int] | None:
    """(experts, experts per token) of a router module (its ``num_experts`` and ``top_k``, as
    transformers' top-k routers keep them), or None when it does not say."""
    experts, top_k = getattr(router, "num_experts", None), getattr(router, "top_k", None)
    return (int(experts), int(top_k)) if isinstance(experts, int) and isinstance(top_k, int) else None


class RouterRecorder:
    """Forward hooks that keep the router logits, and the experts it chose, of every forward run
    with gradient enabled.

    The chosen experts are the router's own output when it returns them (an integer [tokens, k]
    tensor last in its output tuple, as transformers' top-k routers do), else the top-k of the
    logits.

    Args:
        routers: the router modules, in block order.
        index: where the logits sit in a router's output tuple.
        top_k: experts per token.
    """

    def __init__(self, routers: list[nn.Module], index: int, top_k: int) -> None:
        self.logits: list[Tensor] = []
        self.chosen: list[Tensor] = []
        self.index, self.top_k = index, top_k
        self.handles = [router.register_forward_hook(self._hook) for router in routers]

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        logits = output[self.index] if isinstance(output, (tuple, list)) else output
        last = output[-1] if isinstance(output, (tuple, list)) else None
        if isinstance(last, Tensor) and not last.is_floating_point() and last.shape == (logits.shape[0], self.top_k):
            chosen = last
        else:
            chosen = torch.topk(logits.detach(), self.top_k, dim=-1).indices
        self.logits.append(logits)
        self.chosen.append(chosen.detach())

    def take(self) -> tuple[list[Tensor], list[Tensor]]:
        """The logits ([tokens, E]) and chosen experts ([tokens, k]) captured since the last call,
        in call order; forgets them."""
        out = self.logits, self.chosen
        self.logits, self.chosen = [], []
        return out

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()


def router_temperature(schedule: RouterTemperatureConfig, steps_done: int) -> float:
    """The temperature of the optimizer step after ``steps_done`` steps: ``start`` at the first
    step, moved linearly to ``end``, reached after ``schedule.steps`` steps and kept."""
    frac = min(steps_done, schedule.steps) / schedule.steps
    return schedule.start + (schedule.end - schedule.start) * frac


class RouterTemperature:
    """Forward pre-hooks that divide the routers' input hidden states by a temperature in forwards
    run with gradient enabled. A router whose logits are a bias-free linear map of its input
    (``F.linear(h, weight)``: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) then computes logits / T,
    and its softmax, top-k choice and routing weights from them.

    Args:
        routers: the router modules.

    Raises:
        ConfigError: a router has a bias or no ``[experts, hidden]`` weight (its logits would not
            scale with its input).
    """

    def __init__(self, routers: list[nn.Module]) -> None:
        for router in routers:
            weight, bias = getattr(router, "weight", None), getattr(router, "bias", None)
            if not isinstance(weight, Tensor) or weight.dim() != 2 or bias is not None:
                raise ConfigError(
                    f"moe.router_temperature: the router {type(router).__name__} is not a bias-free "
                    "linear map of its input; its logits cannot be tempered here"
                )
        self._value = 1.0
        # One scale per (device, dtype) the routers' inputs come in, updated in place: no host-to-device
        # copy per router forward, and a compiled block sees a tensor, not a new constant.
        self._scales: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self.handles = [router.register_forward_pre_hook(self._hook) for router in routers]

    @property
    def temperature(self) -> float:
        """The temperature of the training forwards now."""
        return self._value

    @temperature.setter
    def temperature(self, value: float) -> None:
        self._value = float(value)
        value32 = torch.tensor(self._value, dtype=torch.float32)  # rounded as the first placement rounds it
        for scale in self._scales.values():
            scale.copy_(value32)

    def _hook(self, module: nn.Module, args: tuple) -> tuple | None:
        if not torch.is_grad_enabled():
            return None
        hidden = args[0]  # divided by 1.0 once the schedule has ended: exact, the same bits
        key = (hidden.device, hidden.dtype)
        scale = self._scales.get(key)
        if scale is None:
            scale = torch.full((), self._value, dtype=torch.float32).to(device=hidden.device, dtype=hidden.dtype)
            self._scales[key] = scale
        return (hidden / scale, *args[1:])

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


class MoEObjective(Objective):
    """An objective plus the routers' load-balancing loss and expert-usage counts (module docstring).

    Args:
        inner: the stage's objective (counts, evaluation and its own metrics are its own).
        recorder: the hooks on the trained model's routers.
        num_experts: E, experts per block.
        top_k: experts per token.
        aux_loss_coef: weight of the load-balancing loss (0: counted, not added).
        temperature: the router temperature schedule and its hooks, or None (temperature 1).
    """

    def __init__(
        self,
        inner: Objective,
        recorder: RouterRecorder,
        num_experts: int,
        top_k: int,
        aux_loss_coef: float,
        temperature: tuple[RouterTemperatureConfig, RouterTemperature] | None = None,
    ) -> None:
        self.inner = inner
        self.recorder = recorder
        self.num_experts, self.top_k, self.aux_loss_coef = num_experts, top_k, aux_loss_coef
        self.num_layers = len(recorder.handles)
        self.temperature = temperature

    @property
    def metric_denominators(self) -> Mapping[str, str]:  # type: ignore[override]
        """The inner objective's (its own metrics keep their denominators)."""
        return self.inner.metric_denominators

    def count(self, batch: dict[str, Tensor]) -> int:
        """The inner objective's count."""
        return self.inner.count(batch)

    def num_tokens(self, batch: dict[str, Tensor]) -> int | None:
        """The inner objective's token count."""
        return self.inner.num_tokens(batch)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """The inner objective's held-out metrics (evaluation adds no router loss)."""
        return self.inner.evaluate(model)

    def begin_step(self, steps_done: int) -> None:
        """Set the router temperature of the optimizer step after ``steps_done`` steps (the loop
        calls it before each step's first micro-batch)."""
        if self.temperature is not None:
            schedule, hooks = self.temperature
            hooks.temperature = router_temperature(schedule, steps_done)

    def remove_hooks(self) -> None:
        """Remove the router hooks (after training: the committed model routes as it is)."""
        self.recorder.remove()
        if self.temperature is not None:
            self.temperature[1].remove()

    def step(self, model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
        self.recorder.take()  # drop what activation checkpointing's recompute captured in the last backward
        out = self.inner.step(model, batch)
        logits, chosen = self.recorder.take()
        if not logits:
            return out
        if len(logits) % self.num_layers:
            raise RuntimeError(f"captured {len(logits)} router outputs, not a multiple of the {self.num_layers} blocks")
        starts = range(0, len(logits), self.num_layers)
        masks = [_token_mask(batch, logits[i].shape[0]) for i in starts]
        aux = torch.stack(
            [
                load_balancing_loss_func(tuple(logits[i : i + self.num_layers]), self.num_experts, self.top_k, mask)
                for i, mask in zip(starts, masks)
            ]
        ).mean()
        counts = torch.zeros(self.num_layers, self.num_experts, device=aux.device)
        for i, mask in zip(starts, masks):
            for layer in range(self.num_layers):
                experts = chosen[i + layer]  # [tokens, k]
                weight = (
                    torch.ones(experts.shape, device=aux.device)
                    if mask is None
                    else (mask.to(aux.device, torch.float32)[:, None].expand(experts.shape))
                )
                counts[layer].scatter_add_(0, experts.reshape(-1).to(aux.device), weight.reshape(-1))
        sums = dict(out.metric_sums)
        sums["moe/aux_loss"], sums["moe/micro_batches"] = aux.detach(), torch.ones((), device=aux.device)
        sums["moe/expert_tokens"] = counts
        aux_loss = self.aux_loss_coef * aux if self.aux_loss_coef else None
        return StepOutput(loss_sum=out.loss_sum, num_tokens=out.num_tokens, metric_sums=sums, aux_loss=aux_loss)

    def finalize_metrics(self, metric_sums: dict[str, Tensor]) -> dict[str, Tensor]:
        """``moe/aux_loss`` (its mean over the step's micro-batches, unweighted) and the per-block
        expert shares, their min, max and entropy, from the step's assignment counts (summed over
        ranks); removes the sums it reads from ``metric_sums``."""
        if "moe/aux_loss" not in metric_sums:
            return {}
        out: dict[str, Tensor] = {
            "moe/aux_loss": metric_sums.pop("moe/aux_loss") / metric_sums.pop("moe/micro_batches")
        }
        if self.temperature is not None:
            out["moe/router_temperature"] = torch.tensor(self.temperature[1].temperature)
        entropies = []
        all_counts = metric_sums.pop("moe/expert_tokens").float()  # [blocks, experts]
        for layer in range(self.num_layers):
            counts = all_counts[layer]
            share = counts / counts.sum().clamp(min=1.0)
            for expert in range(self.num_experts):
                out[f"moe/layer{layer}/expert{expert}_share"] = share[expert]
            entropy = -(share * share.clamp(min=1e-12).log()).sum()
            out[f"moe/layer{layer}/min_share"], out[f"moe/layer{layer}/max_share"] = share.min(), share.max()
            out[f"moe/layer{layer}/entropy"] = entropy
            entropies.append(entropy)
        out["moe/entropy"] = torch.stack(entropies).mean()
        return out


def with_moe(
    model: nn.Module,
    objective: Objective,
    aux_loss_coef: float,
    section: str,
    temperature: RouterTemperatureConfig | None = None,
) -> Objective:
    """``objective`` wrapped in a :class:`MoEObjective` when ``model`` (plain or wrapped by a
    backend) has routers; ``objective`` itself for a dense model.

    Args:
        model: the trained model.
        objective: the stage's objective.
        aux_loss_coef: ``<section>.moe.aux_loss_coef``.
        section: the stage's config section (for messages).
        temperature: ``<section>.moe.router_temperature``, or None.

    Raises:
        ConfigError: ``aux_loss_coef`` or ``temperature`` is set for a model without routers, or
            for routers that do not say their experts and top-k (names ``<section>.moe...``);
            ``temperature`` for routers that are not a bias-free linear map.
    """
    spec = _router_spec(model)
    if spec is None:
        if aux_loss_coef:
            raise ConfigError(
                f"{section}.moe.aux_loss_coef={aux_loss_coef}: the model has no mixture-of-experts routers"
            )
        if temperature is not None:
            raise ConfigError(f"{section}.moe.router_temperature: the model has no mixture-of-experts routers")
        return objective
    router_class, index = spec
    routers = [m for m in model.modules() if isinstance(m, router_class)]
    routing = {_routing(r) for r in routers}
    if len(routing) != 1 or None in routing:
        if aux_loss_coef or temperature is not None:
            what = f"aux_loss_coef={aux_loss_coef}" if aux_loss_coef else "router_temperature"
            raise ConfigError(
                f"{section}.moe.{what}: the routers of {router_class.__name__} "
                "do not say their experts and top-k (num_experts, top_k): no load-balancing loss or "
                "router temperature here"
            )
        log.warning(
            "%s: no expert statistics (the routers of %s do not say their experts and top-k)",
            section,
            router_class.__name__,
        )
        return objective
    ((num_experts, top_k),) = routing
    tempered = None
    if temperature is not None:
        try:
            tempered = (temperature, RouterTemperature(routers))
        except ConfigError as e:
            raise ConfigError(f"{section}.{e}") from e
    return MoEObjective(objective, RouterRecorder(routers, index, top_k), num_experts, top_k, aux_loss_coef, tempered)
