"""TextArena's games as environments, seeded per row: single-player ones (``TextArenaEnv``), and
two-player ones as matches (``TextArenaMatch``, ``env.args: {num_players: 2}``: ``relayrl.envs.multi``).

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
import re
import threading

from relayrl.failures import one_line
from relayrl.envs.adapters.spec import MAX_SIZE, count_arg, parse_spec
from relayrl.extras import require
from relayrl.envs.base import Env, StepResult
from relayrl.envs.multi import MultiAgentEnv, MultiStep
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
    def __init__(self, game: str, seed: int, players: int = 1):
        ta = require("textarena", "textarena", FIELD)
        self.rng = None
        self.env = _call(self, ta.make, game)
        _call(self, lambda: self.env.reset(num_players=players, seed=seed))

    def observation(self) -> str:
        return _call(self, self.env.get_observation)[1]

    def turn(self) -> tuple[int, str]:
        """(the player to move, everything that player has been shown so far)."""
        return _call(self, self.env.get_observation)

    def step(self, action: str) -> bool:
        return _call(self, self.env.step, action)[0]

    def close(self) -> dict:
        return _call(self, self.env.close)[0]


def _start(game: str, seed: int, players: int = 1) -> tuple[_Game, str]:
    g = _Game(game, seed, players)
    return g, g.observation()


def rows(spec: str) -> list[dict]:
    require("textarena", "textarena", "data.path=textarena:...")
    game, args = parse_spec(spec, "data.path")
    size = count_arg(args, "size", 1000, spec, "data.path", 1, MAX_SIZE)
    seed = count_arg(args, "seed", 0, spec, "data.path", 0, 2**63 - 1)
    players = count_arg(args, "players", 1, spec, "data.path", 1, 8)  # (a two-player game's rows: players=2)
    if args:
        raise ValueError(f"data.path={spec!r}: unknown keys {sorted(args)} (size, seed, players)")
    out = []
    for i in range(size):
        s = seed * 1_000_003 + i
        try:
            _, observation = _start(game, s, players)
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


class TextArenaMatch(MultiAgentEnv):
    """A TextArena game of ``num_players`` (``env.args: {num_players: 2}``) as a multi-agent environment
    (``relayrl.envs.multi``): roles ``player_0``, ``player_1``, ...; each reads what the game showed it since
    its last move; the rewards ``close()`` gives (win 1, loss −1, draw 0 in TextArena's two-player games) and
    the outcome they imply. The scripted player: ``opponent`` (a checkpoint, ``envs.players.ModelPlayer``), else
    a uniform choice among the moves the observation lists ("Available Moves: '[0]', '[4]'"), seeded by the game
    so far; a game that lists none needs an ``opponent`` for the roles the policy does not play."""

    roles = ["player_0", "player_1"]

    def __init__(self, game: str, num_players: int = 2, system_prompt: str | None = None,
                 opponent: str | None = None, opponent_temperature: float = 1.0):
        super().__init__()
        if num_players != len(self.roles):
            raise ValueError(f"env.args.num_players={num_players}: two-player games only here")
        self.game, self.system_prompt = game, system_prompt
        self.opponent = None
        if opponent is not None:
            from relayrl.envs.players import ModelPlayer

            self.opponent = ModelPlayer(opponent, opponent_temperature, seed=0)
        self.env, self.seen, self.views = None, {}, {}
        self.seed = 0

    check = TextArenaEnv.check

    def _new(self, role: str, text: str) -> list[dict]:
        """What the game showed ``role`` since it last read (all of it the first time)."""
        old = self.seen.get(role, "")
        new = text[len(old):] if text.startswith(old) else text
        self.seen[role] = text
        msgs = [{"role": "user", "content": new.strip()}] if new.strip() else []
        if role not in self.views:
            self.views[role] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.views[role] += msgs
        return msgs

    async def reset(self, prompt: Prompt) -> dict[str, list[dict]]:
        self.seed = episode_seed(prompt)
        self.env = await asyncio.to_thread(_Game, self.game, self.seed, len(self.roles))
        pid, text = self.env.turn()
        first = self.roles[pid]
        self._new(first, text)
        return {first: list(self.views[first])}

    def turn(self) -> str:
        return self.roles[self.env.turn()[0]]

    async def scripted(self, role: str) -> str:
        if self.opponent is not None:
            return await self.opponent.move(self.views[role])
        listed = re.findall(r"'(\[[^\]]*\])'", self.seen[role].rsplit("Available Moves:", 1)[-1]) \
            if "Available Moves:" in self.seen.get(role, "") else []
        if not listed:
            raise ValueError(f"textarena:{self.game} lists no moves to choose from: give env.args.opponent (a "
                             "checkpoint) to play the roles the policy does not")
        return random.Random(f"{self.seed}/{self.seen[role]}").choice(listed)

    async def step(self, role: str, text: str) -> MultiStep:
        self.views.setdefault(role, []).append({"role": "assistant", "content": text})
        done = await asyncio.to_thread(self.env.step, text)
        if done:
            rewards = await asyncio.to_thread(self.env.close)
            self.env = None
            r = {self.roles[int(k)]: float(v) for k, v in rewards.items()}
            best = max(r.values())
            outcome = {k: "draw" if all(x == best for x in r.values()) else "win" if v == best else "loss"
                       for k, v in r.items()}
            return MultiStep(rewards=r, done=True, outcome=outcome)
        pid, shown = self.env.turn()
        nxt = self.roles[pid]
        if nxt not in self.seen:  # its first move: what the game showed it so far is its opening
            self._new(nxt, shown)
            return MultiStep(messages={nxt: list(self.views[nxt])})
        return MultiStep(messages={nxt: self._new(nxt, shown)})

    async def close(self) -> None:
        if self.env is not None:
            await asyncio.to_thread(self.env.close)
            self.env = None
