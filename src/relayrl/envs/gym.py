"""An adapter for gymnasium-style text environments (``reset``/``step`` over strings), so that
procedurally generated tasks plug in as they are:

    env.reset(seed=...) -> (observation: str, info)
    env.step(action: str) -> (observation: str, reward: float, terminated: bool, truncated: bool, info)

Config: ``env.name: relayrl.envs.gym:GymTextEnv`` and ``env.args: {make: "my_tasks:make_env"}``,
where ``make_env()`` returns such an environment (importable from the project folder, or
``path/file.py:make_env``). Each dataset row is one task: its environment is reset with the
row's ``metadata.seed`` if it has one, else a stable hash of the row id, so a prompt means the
same task on every run. Observations reach the policy as user turns, its turns go back as
actions; ``gymnasium`` itself is not needed.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

from relayrl.envs.base import Env, StepResult, import_object
from relayrl.records import Prompt


def episode_seed(prompt: Prompt) -> int:
    if isinstance(prompt.metadata.get("seed"), int):
        return prompt.metadata["seed"]
    return int.from_bytes(hashlib.sha256(prompt.id.encode()).digest()[:4], "little")


class GymTextEnv(Env):
    def __init__(self, make: str | Callable, system_prompt: str | None = None):
        self.make = import_object(make, "env.args.make") if isinstance(make, str) else make
        self.system_prompt = system_prompt
        self.env = None

    async def reset(self, prompt: Prompt) -> list[dict]:
        self.env = self.make()
        obs, _ = await asyncio.to_thread(self.env.reset, seed=episode_seed(prompt))
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": str(obs)}]

    async def step(self, text: str) -> StepResult:
        obs, reward, terminated, truncated, info = await asyncio.to_thread(self.env.step, text)
        done = bool(terminated or truncated)
        return StepResult([] if done else [{"role": "user", "content": str(obs)}], float(reward), done)
