"""Two-player games for self-play (``relayrl.envs.multi``): small enough for the demo model to learn.

``Nim``: a pile of stones (the prompt's first number); the players take 1, 2 or 3 in turn and whoever
takes the last stone wins. A move is the number alone; anything else, or more than is left, loses at
once. The first player wins from every pile that is not a multiple of 4, by leaving one; against the
scripted player, who moves at random (a fixed function of the prompt and the game so far: the same game, the
same move), a player who knows the rule wins most matches, one who moves at random about half.
"""

from __future__ import annotations

import random
import re

from relayrl.envs import players
from relayrl.envs.multi import MultiAgentEnv, MultiStep
from relayrl.records import Prompt


def legal(pile: int) -> list[int]:
    return [k for k in (1, 2, 3) if k <= pile]


def best(pile: int) -> int | None:
    """The winning move (leave a multiple of 4), None where every move loses."""
    return pile % 4 or None


def opening(pile: int, first: bool) -> str:
    return f"Nim: {pile} stones. Take 1, 2 or 3; who takes the last wins. You are {'first' if first else 'second'}."


def after(taken: int, pile: int) -> str:
    """What a player reads after the other's move."""
    return f"They took {taken}. {pile} left."


def parse_move(text: str) -> int | None:
    m = re.fullmatch(r"\s*([0-9]+)\s*\.?\s*", text)
    return int(m.group(1)) if m else None


class Nim(MultiAgentEnv):
    """``skill``: the scripted player's chance of the winning move where there is one (0: random legal
    moves); ``seed``: its stream. ``opponent``: a checkpoint plays the scripted roles instead
    (``envs.players.ModelPlayer``: the policy's own earlier one, say), sampled at ``opponent_temperature``;
    ``pool:RUN_DIR``, one of that run's checkpoints per match (the random player until it has one)."""

    roles = ["first", "second"]

    def __init__(self, skill: float = 0.0, seed: int = 0, opponent: str | None = None,
                 opponent_temperature: float = 1.0):
        super().__init__()
        if not 0.0 <= skill <= 1.0:
            raise ValueError(f"skill={skill}: a probability in [0, 1]")
        self.skill, self.seed = skill, seed
        self.opponent = None
        if opponent is not None and not (opponent.startswith("pool:") and not players.pool(opponent)):
            self.opponent = players.ModelPlayer(opponent, opponent_temperature, max_new_tokens=4, seed=seed)
        self.pile, self.start, self.history, self.key = 0, 0, [], ""
        self.views: dict[str, list[dict]] = {}  # each role's conversation (what a model player reads)

    async def reset(self, prompt: Prompt) -> dict[str, list[dict]]:
        text = prompt.messages[-1]["content"] if prompt.messages else ""
        m = re.search(r"[0-9]+", text)
        if m is None or int(m.group()) < 1:
            raise ValueError(f"prompt {prompt.id!r}: no pile size (a positive number) in {text!r}")
        self.pile = self.start = int(m.group())
        self.key = prompt.id  # (the scripted player's stream: a training prompt's is not an evaluation prompt's)
        self.views = {r: [{"role": "user", "content": opening(self.pile, r == "first")}] for r in self.roles}
        return {r: list(v) for r, v in self.views.items()}

    async def scripted(self, role: str) -> str:
        if self.opponent is not None:
            return await self.opponent.move(self.views[role])
        return self.random_move()

    def random_move(self) -> str:
        rng = random.Random(f"{self.seed}/{self.key}/{self.history}")
        win = best(self.pile)
        if win is not None and rng.random() < self.skill:
            return str(win)
        return str(rng.choice(legal(self.pile)))

    async def step(self, role: str, text: str) -> MultiStep:
        other = self.roles[1 - self.roles.index(role)]
        k = parse_move(text)
        self.moves += 1
        self.views.setdefault(role, []).append({"role": "assistant", "content": text})
        if k is None or k not in legal(self.pile):  # an illegal move loses
            return MultiStep(rewards={role: 0.0, other: 1.0}, done=True, outcome={role: "loss", other: "win"},
                             info={"illegal_moves": 1})
        self.pile -= k
        self.history.append(k)
        if self.pile == 0:
            return MultiStep(rewards={role: 1.0, other: 0.0}, done=True, outcome={role: "win", other: "loss"})
        seen = [{"role": "user", "content": after(k, self.pile)}]
        self.views.setdefault(other, []).extend(seen)
        return MultiStep(messages={other: seen})


def transcripts(piles: list[int], skill: float, seed: int) -> list[dict]:
    """Conversations (``messages``) of the scripted player against itself, one per role and game, from
    that role's point of view: ``relayrl sft`` data for a warm start (``examples/self_play_data.py``)."""
    rows = []
    for i, pile in enumerate(piles):
        game = Nim(skill, seed + i)
        game.pile = game.start = pile
        game.key = str(pile)  # (the warm start's data as it was when the stream was keyed by the pile)
        views = {r: [{"role": "user", "content": opening(pile, r == "first")}] for r in game.roles}
        while game.pile:
            role = game.turn()
            other = game.roles[1 - game.roles.index(role)]
            move = game.random_move()
            views[role].append({"role": "assistant", "content": move})
            game.pile -= int(move)
            game.history.append(int(move))
            game.moves += 1
            if game.pile:
                views[other].append({"role": "user", "content": after(int(move), game.pile)})
        rows += [{"id": f"nim-{i}-{r}", "messages": views[r]} for r in game.roles if len(views[r]) > 1]
    return rows


PILES = range(5, 16)  # the demo's starting piles (a match lasts at most 8 turns of a role)


def rows(which: str) -> list[dict]:
    """The self-play demo's built-in data: ``nim`` (4,000 prompts) and ``nim-eval`` (each pile once) name a
    starting pile; ``nim-sft`` is 2,000 games of the random scripted player against itself (``transcripts``).
    The proposer-solver curriculum's: ``proposer-solver`` (4,000 matches' prompts; ``-eval``: 200 more, their
    problems the scripted proposer's), ``proposer-sft`` (2,000
    problems of the task's distribution written on request, and 2,000 worked solutions)."""
    rng = random.Random(which)
    if which in ("proposer-solver", "proposer-solver-eval", "proposer-sft"):
        from relayrl.demo import task

        if which in ("proposer-solver", "proposer-solver-eval"):  # the matches' prompts: the same ask, ids vary
            n, tag = (4000, "ps") if which == "proposer-solver" else (200, "ps-eval")  # (the scripted proposer's
            return [{"id": f"{tag}-{i}", "prompt": ProposerSolver.ASK, "answer": ""} for i in range(n)]  # draw: the id)
        asks = [{"id": f"propose-{i}", "prompt": ProposerSolver.ASK, "response": task.prompt_text(task.sample_terms(rng))}
                for i in range(2000)]
        return asks + task.make_sft_rows(2000, seed=3, id_prefix="solve")  # (and keep solving)
    if which == "nim-sft":
        return transcripts([rng.choice(PILES) for _ in range(2000)], skill=0.0, seed=7)
    piles = [rng.choice(PILES) for _ in range(4000)] if which == "nim" else list(PILES)
    return [{"id": f"{which}-{i}", "prompt": f"{p} stones", "answer": "first" if p % 4 else "second"}
            for i, p in enumerate(piles)]


# -- a proposer-solver curriculum on the demo task (relayrl.demo.task) --------------------------------------

PROBLEM = re.compile(r"Sum mod 10:((?: [a-l]=[0-9])+)\s*$")


def parse_problem(text: str) -> list[int] | None:
    """The terms of a demo-task problem written as the task writes them ("Sum mod 10: a=3 b=4"), None if
    it is not one (tags in order, 2 to 12 terms)."""
    from relayrl.demo import task

    m = PROBLEM.fullmatch(text.strip())
    if m is None:
        return None
    pairs = [p.split("=") for p in m.group(1).split()]
    if [t for t, _ in pairs] != list(task.TAGS[: len(pairs)]) or not task.MIN_TERMS <= len(pairs) <= task.MAX_TERMS:
        return None
    return [int(v) for _, v in pairs]


def half_solved(solved: int, tries: int) -> float:
    """The proposer's reward: 1 for a problem the solvers solve half the time, falling linearly to 0 for one
    they always or never solve (1 − |2p − 1|, p the solve rate)."""
    return 1.0 - abs(2 * solved / tries - 1) if tries else 0.0


class ProposerSolver(MultiAgentEnv):
    """One role writes a problem of the demo task, four solvers answer it at once (roles ``solver#1`` …
    ``solver#4``: one family, one baseline). A solver's reward is 1 for the right answer; the proposer's
    ``half_solved`` of theirs (0 for a problem that is not one: the match ends there). The scripted
    proposer writes a random problem of the task's distribution (evaluation: the solver's accuracy); the
    scripted solver answers right."""

    roles = ["proposer"] + [f"solver#{i}" for i in range(1, 5)]
    ASK = "Write a problem."

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed, self.terms, self.answers = seed, None, {}

    async def reset(self, prompt: Prompt) -> dict[str, list[dict]]:
        self.key = prompt.id
        return {"proposer": [{"role": "user", "content": self.ASK}]}

    def turn(self) -> str | list[str]:
        return "proposer" if self.terms is None else self.roles[1:]

    def scripted(self, role: str) -> str:
        from relayrl.demo import task

        if role == "proposer":
            return task.prompt_text(task.sample_terms(random.Random(f"{self.seed}/{self.key}")))
        return task.solution_text(self.terms)

    async def step(self, role: str, text: str) -> MultiStep:
        from relayrl.envs.answers import last_boxed

        solvers = self.roles[1:]
        if role == "proposer":
            self.terms = parse_problem(text)
            if self.terms is None:  # not a problem: nothing to solve
                return MultiStep(rewards={"proposer": 0.0}, done=True, outcome={"proposer": "loss"},
                                 info={"bad_problems": 1})
            from relayrl.demo import task

            shown = task.prompt_text(self.terms)
            return MultiStep(messages={s: [{"role": "user", "content": shown}] for s in solvers})
        self.answers[role] = last_boxed(text) == str(sum(self.terms) % 10)
        if len(self.answers) < len(solvers):
            return MultiStep()
        solved = sum(self.answers.values())
        rewards = {"proposer": half_solved(solved, len(solvers)), **{s: float(self.answers[s]) for s in solvers}}
        outcome = {"proposer": "win" if 0 < solved < len(solvers) else "loss",
                   **{s: "win" if self.answers[s] else "loss" for s in solvers}}
        return MultiStep(rewards=rewards, done=True, outcome=outcome, info={"solved": solved})
