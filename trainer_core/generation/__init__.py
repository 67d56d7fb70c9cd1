"""Generation: sampling completions from a policy.

- :mod:`~trainer_core.generation.engines`: the RL rollouts' engines behind one Protocol (``hf``:
  transformers' ``generate``-equivalent loop; ``static``: a static KV cache, compiled decode).
- :mod:`~trainer_core.generation.static_decode`: the ``static`` engine's attention and KV cache.
- :mod:`~trainer_core.generation.sampling`: the token draws both engines make.
- :mod:`~trainer_core.generation.completions`: batched generation and reward-model scoring for
  the ``score`` and ``evaluate`` stages.

Nothing here trains: the RL loop that uses the engines is :mod:`trainer_core.training.rl`.
"""
