"""Reward-model forwards: a scalar head's score of each row, or the implicit reward of a causal
LM that is one (:data:`IMPLICIT_REWARD_KEY`), of padded rows or of a packed batch.

Shape legend: B batch (rows), T tokens, R packed sequences, S packed tokens.
"""

from __future__ import annotations

from functools import partial

from torch import Tensor, nn
from transformers import PreTrainedModel

from trainer_core.modeling.forwards.heads import forward_replaced, unwrap_causal_lm
from trainer_core.modeling.forwards.token import padded_sequence_logprobs
from trainer_core.objectives.logprobs import shift_mask


IMPLICIT_REWARD_KEY = "posttrain_implicit_reward"
"""Attribute of an HF config (saved in its ``config.json``) that makes a causal LM a reward model
with the reference-free implicit reward; its value is ``{"beta": float}``
(:func:`implicit_reward_beta`)."""


def implicit_reward_beta(model: nn.Module) -> float | None:
    """``beta`` of a causal LM that is an implicit reward model (:data:`IMPLICIT_REWARD_KEY` in its
    config), or None: the model is a scalar-head (sequence-classification) reward model or a policy.

    Args:
        model: an HF model, plain or as a backend wrapped it.
    """
    spec = getattr(getattr(unwrap_causal_lm(model), "config", None), IMPLICIT_REWARD_KEY, None)
    return None if spec is None else float(spec["beta"])


def mark_implicit_reward(model: nn.Module, beta: float) -> None:
    """Make the causal LM ``model`` an implicit reward model of scale ``beta`` (written to its
    config, and so to the ``config.json`` of every directory it is saved to).

    Raises:
        ValueError: ``beta`` is not positive.
    """
    if not beta > 0:
        raise ValueError(f"implicit reward beta must be > 0, got {beta}")
    setattr(unwrap_causal_lm(model).config, IMPLICIT_REWARD_KEY, {"beta": float(beta)})


def sequence_rewards(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor, counted_index: Tensor | None = None
) -> Tensor:
    """A reward model's reward of each padded (prompt + completion) row, [B] float32.

    Two parameterisations, told apart by the model (:func:`implicit_reward_beta`):

    - scalar head (InstructGPT, Ouyang et al. 2022; TRL's ``RewardTrainer``): an HF
      ``*ForSequenceClassification`` with one label, read at each row's last real token;
      ``loss_mask`` is not used.
    - implicit, reference-free (SimPO, Meng et al. 2024, eq. 4): a causal LM's mean log-probability
      of the completion tokens times ``beta``, ``r(x, y) = beta / |y| * log pi(y | x)``; the
      completion is where ``loss_mask`` is 1 (:func:`~trainer_core.modeling.forwards.token.padded_sequence_logprobs`).

    Args:
        model: the reward model, plain or as a backend wrapped it.
        input_ids: [B, T] long, right-padded.
        attention_mask: [B, T] long, 1 = real token.
        loss_mask: [B, T] long, 1 = completion token.
        counted_index: the collated batch's ``counted_index`` of ``loss_mask``, or None.
    """
    beta = implicit_reward_beta(model)
    if beta is None:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float()
    logprobs = padded_sequence_logprobs(model, input_ids, attention_mask, loss_mask, counted_index)
    return beta * logprobs.float() / shift_mask(loss_mask).sum(-1).clamp(min=1)


def _packed_scores_forward(
    base: nn.Module, score: nn.Module, input_ids: Tensor, position_ids: Tensor, last_token_index: Tensor
) -> Tensor:
    """A sequence classifier's forward for one packed call: the base model, then ``score`` at the pooled positions."""
    hidden = base(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state  # [1, S, H]
    return score(hidden[0, last_token_index])  # [R, 1]


def packed_sequence_scores(
    model: nn.Module, input_ids: Tensor, position_ids: Tensor, last_token_index: Tensor
) -> Tensor:
    """Scalar scores of the R sequences of a packed batch from a ``*ForSequenceClassification`` model.

    Equal (up to float rounding) to the pooled ``logits`` of the same sequences padded into a
    [R, T] batch: the base model runs on the packed tokens (``position_ids`` restart per sequence,
    so no token attends across sequences) and the ``score`` head on each sequence's pooled
    position only, inside one call of ``model`` (wrapped or not, as
    :func:`~trainer_core.modeling.forwards.token.masked_token_logprobs`).

    Args:
        model: an HF sequence classifier with one label (``score`` head), plain or wrapped by a backend.
        input_ids: [1, S] long.
        position_ids: [1, S] long, restarting at 0 at each sequence.
        last_token_index: [R] long, each sequence's pooled position
            (:func:`~trainer_core.data.batching.collate_pairs_packed`).

    Returns:
        [R] float32 scores.

    Raises:
        ValueError: the unwrapped model has no ``score`` head.
    """
    inner = unwrap_causal_lm(model)
    score = getattr(inner, "score", None)
    if not isinstance(inner, PreTrainedModel) or not isinstance(score, nn.Module):
        raise ValueError(
            f"{type(inner).__name__} is not a sequence classifier with a `score` head: cannot score packed rows"
        )
    base = getattr(inner, inner.base_model_prefix)
    with forward_replaced(inner, partial(_packed_scores_forward, base, score)):
        scores = model(input_ids=input_ids, position_ids=position_ids, last_token_index=last_token_index)
    return scores.squeeze(-1).float()
