"""Every forward of the pipeline: what a model (or a model's LM head) gives the tokens a loss reads.

The rule for what lives here and what lives in :mod:`trainer_core.objectives`: **a forward takes a
model; a pure function takes tensors.** A function that is handed a model (plain or as a backend
wrapped it), or a model's LM head (hidden states and the head's weight: the head kernels, which
are the last step of a forward and carry its memory plan), is a forward and lives in this
package. A function of what a forward produced (logits, log-probs, masks), with no model and no
head in sight, is pure maths and lives in :mod:`trainer_core.objectives`, the losses' floor
(:mod:`trainer_core.objectives.logprobs`: ``compute_logprobs``, ``shift_mask``,
``sequence_logprobs``, the RL stages' log-probs and entropies from full logits, the engines'
log-prob of a sampled token). Each forward has one name; the modules import each other downwards
only (kernels and heads at the bottom).

- :mod:`~trainer_core.modeling.forwards.kernels`: the LM head kernels: log-probs (and entropies,
  the summed NLL, Liger's fused kernel on CUDA, the distillation divergence) of target tokens
  through an output projection, a chunk of tokens at a time.
- :mod:`~trainer_core.modeling.forwards.heads`: the HF model inside a backend's wrapper, its
  decoder and plain linear head, a frozen model's whole head, a forward replaced for one call.
- :mod:`~trainer_core.modeling.forwards.token`: causal-LM forwards that score counted tokens only
  (per-token log-probs, their sum per sequence, SFT's summed NLL).
- :mod:`~trainer_core.modeling.forwards.rewards`: reward-model forwards (a scalar head, or the
  implicit reward of a causal LM), padded or packed.
- :mod:`~trainer_core.modeling.forwards.pairs`: the offline preference stages' forwards (DPO's
  pairs, KTO's completions and KL sequences, the reward of each side, the reference's log-probs
  of a split).
- :mod:`~trainer_core.modeling.forwards.completion`: online RL's forwards (log-probs, entropies and
  values of completions under the trainable policy-and-value module or a frozen causal LM, a
  teacher's hidden states).
- :mod:`~trainer_core.modeling.forwards.padding_free`: a padded batch's real tokens as one packed
  row, and the check that a model keeps packed rows apart.
"""
