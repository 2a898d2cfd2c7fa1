"""Several agents in one episode: the multi-agent environment API, and who plays each role.

    class MultiAgentEnv:
        roles = ["first", "second"]                        # every role of the game
        async def reset(self, prompt) -> {role: messages}   # what each role sees first
        def turn(self) -> str | list[str]                   # whose move it is now (a list: acting at once)
        async def step(self, role, text) -> MultiStep       # a role's move in; observations per role out
        def scripted(self, role) -> str                     # a move of the environment's own player

One instance per match (``args`` from the config go to the constructor). The policy plays the roles in
``env.roles`` (all of them by default: self-play), each role's turns recorded token-in-token-out as a
trajectory of its own, from its own point of view (its prompt, its moves trained, what the others did
as observations, not trained), with its own reward; the environment's ``scripted`` player plays the
other roles. Evaluation plays the policy in each role of ``env.eval_roles`` against the scripted player
in the others: its ``win_rate`` counts the matches whose ``MultiStep.outcome`` says ``"win"`` for the
policy's role. A role's trajectories are compared with the same prompt's trajectories of that role
(the group baseline per prompt and role).

Any ``reset``/``turn``/``step``/``scripted`` that raises, passes its deadline, names a role the game
does not have or gives a non-finite reward fails that match: each of its trajectories is left out of
training and counted (``relayrl.failures``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from relayrl.records import Prompt

OUTCOMES = ("win", "loss", "draw")


@dataclass
class MultiStep:
    """What follows one role's move."""

    messages: dict[str, list[dict]] = field(default_factory=dict)  # observations per role, read before its next turn
    rewards: dict[str, float] | None = None  # each role's reward when the match is over (a role left out: 0)
    done: bool = False
    outcome: dict[str, str] = field(default_factory=dict)  # "win" | "loss" | "draw" per role, when done
    info: dict = field(default_factory=dict)  # counts summed into the episodes' metrics


class MultiAgentEnv:
    """Base class: two roles taking turns, the first starting. Subclasses give ``reset``, ``step``
    and (for roles the policy does not play) ``scripted``."""

    roles: list[str] = ["first", "second"]

    def __init__(self):
        self.moves = 0

    async def reset(self, prompt: Prompt) -> dict[str, list[dict]]:
        return {r: list(prompt.messages) for r in self.roles}

    def turn(self) -> str | list[str]:
        """The role to move now, or a list of roles that move at once (each sees the game as it stood: their
        moves are generated together, then passed to ``step`` in this order)."""
        return self.roles[self.moves % len(self.roles)]

    async def step(self, role: str, text: str) -> MultiStep:
        raise NotImplementedError

    def scripted(self, role: str) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no scripted player for role {role!r}")


def is_multi_agent(cls) -> bool:
    return isinstance(getattr(cls, "roles", None), (list, tuple)) and callable(getattr(cls, "turn", None))


def family(role: str | None) -> str | None:
    """Roles named ``NAME#k`` (``solver#1``, ``solver#2``) are one role for baselines and adapters: ``NAME``."""
    return role.partition("#")[0] if role else role


def families(roles) -> tuple[str, ...]:
    """The distinct ``family`` of each of ``roles``, in order: the adapters of ``model.lora.per_role``."""
    return tuple(dict.fromkeys(family(r) for r in roles))


@dataclass(frozen=True)
class Players:
    """A multi-agent environment's factory and who plays: the policy the roles in ``train`` (in a
    training match) or one role of ``eval`` (in an evaluation match), the scripted player the others. The first
    ``solo`` trajectories of a training group each play a match alone, in the roles of ``train`` in turn
    (``env.vs_scripted``)."""

    make: Callable
    roles: tuple[str, ...]  # the environment's
    train: tuple[str, ...]
    eval: tuple[str, ...]
    solo: int = 0

    def __call__(self):
        return self.make()

    @classmethod
    def of(cls, make: Callable, env_cls, name: str, train: list[str], eval_roles: list[str],
           group_size: int | None = None, vs_scripted: float = 0.0) -> "Players":
        """Checked against the environment's roles: a one-line error naming the field otherwise."""
        roles = tuple(env_cls.roles)
        if not roles or len(set(roles)) != len(roles) or not all(isinstance(r, str) and r for r in roles):
            raise ValueError(f"env.name={name}: {env_cls.__name__}.roles must be distinct role names, got {roles!r}")
        for fld, chosen in (("env.roles", train), ("env.eval_roles", eval_roles)):
            unknown = [r for r in chosen if r not in roles]
            if unknown:
                raise ValueError(f"{fld}: {', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} "
                                 f"not a role of {env_cls.__name__} (its roles: {', '.join(roles)})")
            if len(set(chosen)) != len(chosen):
                raise ValueError(f"{fld}: a role is named twice ({chosen})")
        train_t, eval_t = tuple(train) or roles, tuple(eval_roles) or roles
        r = len(train_t)  # (solo: whole rounds of the roles, each as often; at least one where vs_scripted > 0)
        solo = max(1, round(vs_scripted * (group_size or 0) / r)) * r if vs_scripted else 0
        scripted = (set(roles) - set(train_t)).union(*(set(roles) - {r} for r in eval_t))  # (evaluation: one each)
        if solo:  # (a solo match: each role of train against the others)
            scripted = scripted.union(*(set(roles) - {r} for r in train_t))
        if scripted and getattr(env_cls, "scripted", MultiAgentEnv.scripted) is MultiAgentEnv.scripted:
            raise ValueError(f"env.name={name}: {env_cls.__name__} has no scripted player (def scripted(self, role)) "
                             f"for the roles the policy does not play ({', '.join(sorted(scripted))})")
        if group_size is not None and group_size % len(train_t):  # (None: evaluation only)
            raise ValueError(f"rollout.group_size={group_size} is not a multiple of the {len(train_t)} roles the policy "
                             f"plays (env.roles: {', '.join(train_t)}): each match fills one trajectory per role")
        if group_size is not None and solo >= group_size:
            raise ValueError(f"env.vs_scripted={vs_scripted:g}: {solo} of a group's {group_size} trajectories, in "
                             f"whole rounds of the {r} roles, would play the scripted player alone, and no self-play "
                             "match would be left (a larger rollout.group_size, or a smaller share)")
        return cls(make, roles, train_t, eval_t, solo)

    def matches(self, trajs: list, train: bool) -> list[dict]:
        """The matches of one group: in training, trajectories ``0 … solo−1`` each a match of its own (role
        ``train[i % R]``), then ``solo + k·R … solo + k·R+R−1`` match k, one per role of ``train`` (R of them); in
        evaluation each trajectory is a match of its own, its role the ``eval`` role of its index."""
        if not train:
            return [{self.eval[t.sample_idx % len(self.eval)]: t} for t in trajs]
        by: dict[int, dict] = {}
        for t in trajs:
            i, r = t.sample_idx - self.solo, len(self.train)
            key = i // r if i >= 0 else -1 - t.sample_idx  # (solo matches: negative keys, one each)
            by.setdefault(key, {})[self.train[t.sample_idx % r]] = t
        return list(by.values())
