"""Online RL (PPO, GRPO and its family): the loop and what it is made of.

- :mod:`~trainer_core.training.rl.trainer`: the loop (rollout, then epochs of mini-batch updates).
- :mod:`~trainer_core.training.rl.batches`: prompt order, sampling rounds, batch sizes, the
  algorithm protocol, the rollout's metrics.
- :mod:`~trainer_core.training.rl.rollout`: the rollout's records (``RolloutBatch``); their
  forwards are :mod:`trainer_core.modeling.forwards.completion`'s.
- :mod:`~trainer_core.training.rl.rewards`: the reward functions behind one Protocol.
- :mod:`~trainer_core.training.rl.ptx`: the supervised (ptx) term mixed into every step.
"""
