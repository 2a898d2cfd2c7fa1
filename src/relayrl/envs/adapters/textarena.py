"""TextArena's single-player games as environments, seeded per row.

    env.name: textarena:GuessTheNumber-v0
    data.path: "textarena:GuessTheNumber-v0?size=1000&seed=0"     (rows: one seed each)

The game's first observation is the prompt; each assistant turn is a move (``env.step(action)``),
the game's new messages the next user turn; a finished game's reward (``close()``: 1 won, lower
otherwise) is the episode's. Seeds: a row's ``metadata.seed``, else a stable hash of its id, so a
row is the same game on every run. Games that need a download (word lists: Wordle, Hangman, ...)
fail at their first reset without one; GuessTheNumber, Minesweeper, TowerOfHanoi, FrozenLake,
Sudoku and others need none.
"""

from __future__ import annotations

import asyncio
import random
import threading

from relayrl.failures import one_line
from relayrl.envs.adapters.spec import MAX_SIZE, count_arg, parse_spec
from relayrl.extras import require
from relayrl.envs.base import Env, StepResult
from relayrl.envs.gym import episode_seed
from relayrl.records import Prompt

FIELD = "env.name=textarena:..."


# TextArena games draw from Python's process-global ``random`` (``reset(seed=...)`` seeds it). Each
# game keeps its own generator state, swapped in around its calls under one lock, so games running at
# once stay reproducible and the run's own use of ``random`` is untouched.
_LOCK = threading.Lock()


def _call(env, fn, *args):
    with _LOCK:
        outer = random.getstate()
        try:
            if env.rng is not None:
                random.setstate(env.rng)
            return fn(*args)
        finally:
            env.rng = random.getstate()
            random.setstate(outer)


class _Game:
    def __init__(self, game: str, seed: int):
        ta = require("textarena", "textarena", FIELD)
        self.rng = None
        self.env = _call(self, ta.make, game)
        _call(self, lambda: self.env.reset(num_players=1, seed=seed))

    def observation(self) -> str:
        return _call(self, self.env.get_observation)[1]

    def step(self, action: str) -> bool:
        return _call(self, self.env.step, action)[0]

    def close(self) -> dict:
        return _call(self, self.env.close)[0]


def _start(game: str, seed: int) -> tuple[_Game, str]:
    g = _Game(game, seed)
    return g, g.observation()


def rows(spec: str) -> list[dict]:
    require("textarena", "textarena", "data.path=textarena:...")
    game, args = parse_spec(spec, "data.path")
    size = count_arg(args, "size", 1000, spec, "data.path", 1, MAX_SIZE)
    seed = count_arg(args, "seed", 0, spec, "data.path", 0, 2**63 - 1)
    if args:
        raise ValueError(f"data.path={spec!r}: unknown keys {sorted(args)} (size, seed)")
    out = []
    for i in range(size):
        s = seed * 1_000_003 + i
        try:
            _, observation = _start(game, s)
        except Exception as e:  # noqa: BLE001 - an unknown game, or one that needs a download
            raise ValueError(f"data.path={spec!r}: TextArena cannot start {game!r} (a game that needs a download, "
                             f"or no such game): {type(e).__name__}: {one_line(str(e))[:300]}") from None
        out.append({"id": f"{game}-{s}", "prompt": observation.strip(), "answer": "", "metadata": {"seed": s}})
    return out


class TextArenaEnv(Env):
    def __init__(self, game: str, system_prompt: str | None = None):
        self.game, self.system_prompt = game, system_prompt
        self.env, self.seen = None, ""

    @staticmethod
    def check(game: str) -> None:
        require("textarena", "textarena", FIELD)
        from textarena.envs.registration import ENV_REGISTRY

        if game not in ENV_REGISTRY:
            raise ValueError(f"env.name=textarena:{game}: not a TextArena game (e.g. GuessTheNumber-v0)")

    async def reset(self, prompt: Prompt) -> list[dict]:
        self.env, self.seen = await asyncio.to_thread(_start, self.game, episode_seed(prompt))
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": self.seen.strip()}]

    async def step(self, text: str) -> StepResult:
        done = await asyncio.to_thread(self.env.step, text)
        if done:
            rewards = await asyncio.to_thread(self.env.close)
            self.env = None
            return StepResult([], float(rewards[0]), True, info={"game_won": int(rewards[0] > 0)})
        observation = self.env.observation()
        new = observation[len(self.seen):] if observation.startswith(self.seen) else observation
        self.seen = observation
        return StepResult([{"role": "user", "content": new.strip()}], 0.0, False)

    async def close(self) -> None:
        if self.env is not None:
            await asyncio.to_thread(self.env.close)
            self.env = None
