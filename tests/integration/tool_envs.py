"""A user's tool environment named by import path in the RL integration tests
(``tests.integration.tool_envs:<name>``), written as a user writes one: see
:class:`trainer_core.training.rl.environments.Environment` for the protocol."""

from __future__ import annotations

from trainer_core.training.rl.environments import EnvStep


class Counter:
    """A deterministic tool: a call once the policy's turn has ``every`` characters; the
    observation is the number of characters the episode's turns held so far, reward 0.25 a call."""

    name = "counter"

    def __init__(self, every: int = 12) -> None:
        self.every = every

    def reset(self, prompt):
        return {"chars": 0}

    def find_call(self, state, text):
        return text if len(text) >= self.every else None

    def step(self, state, call):
        state["chars"] += len(call)
        return EnvStep(f" ({state['chars']})", reward=0.25)
