"""skyrl-gym environments (``init`` / ``step`` / ``close`` over OpenAI-style messages).

    env.name: skyrl:gsm8k_multi_turn          env.args: {env_config: {...}, extras: {...}}

Each episode makes its environment with ``skyrl_gym.make(NAME, env_config=..., extras=...)``; the
extras are skyrl's per-row fields: ``reward_spec`` (``{"method": "rule", "ground_truth": <the row's
answer>}`` unless the row's ``metadata.reward_spec`` gives one), ``extra_info`` (the row's metadata),
and ``env.args.extras`` on top. ``init(prompt messages)`` gives the conversation the policy starts
from; each ``step(text)`` gives the observations (messages), that step's reward and whether it is
done. Environments that need a service (search, SQL databases) need it running.
"""

from __future__ import annotations

import asyncio

from relayrl.extras import require
from relayrl.envs.base import Env, StepResult
from relayrl.records import Prompt


class SkyRLEnv(Env):
    def __init__(self, name: str, env_config: dict | None = None, extras: dict | None = None):
        self.gym = self.check(name)
        self.name, self.env_config, self.extras = name, env_config, dict(extras or {})
        self.env = None

    @staticmethod
    def check(name: str):
        gym = require("skyrl_gym", "skyrl", "env.name=skyrl:...")
        if name not in gym.registry:
            raise ValueError(f"env.name=skyrl:{name}: not a skyrl-gym environment; registered: "
                             f"{', '.join(sorted(gym.registry))}")
        return gym

    async def reset(self, prompt: Prompt) -> list[dict]:
        meta = dict(prompt.metadata)
        extras = {"reward_spec": meta.get("reward_spec") or {"method": "rule", "ground_truth": prompt.answer},
                  "extra_info": meta, **self.extras}
        self.env = self.gym.make(self.name, env_config=self.env_config, extras=extras)
        messages, _ = await asyncio.to_thread(self.env.init, [dict(m) for m in prompt.messages])
        return list(messages)

    async def step(self, text: str) -> StepResult:
        out = await asyncio.to_thread(self.env.step, text)
        done = bool(out["done"])
        return StepResult([] if done else list(out["observations"]), float(out["reward"]), done)

    async def close(self) -> None:
        if self.env is not None:
            await asyncio.to_thread(self.env.close)
            self.env = None
