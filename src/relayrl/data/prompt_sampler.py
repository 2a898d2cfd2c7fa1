"""The prompt sampler: seeded epochs, and prompt selection from per-prompt posteriors.

Epochs. Each epoch is a seeded permutation of the prompts (``data.shuffle=false``: file order), and
every prompt is drawn once per epoch. With ``data.selection=uniform`` (the default) prompts are
drawn in that order.

Selection (``data.selection=vade|cures``, math in ``selection.py``) changes the order within an
epoch, never which prompts it holds: for n prompts it takes the next ``data.selection_pool`` × n of
the epoch's order as candidates, picks n by their posteriors, and appends the others to the end of
the epoch, where they are candidates again (the epoch's last draws take whatever is left). On a
dataset larger than the run (the demo) that is a choice among fresh candidates at every step; on a
small one it is a curriculum within each epoch. Posteriors are updated with every finished group's
rewards (``observe``), filtered groups included, failed episodes not.

All of it — cursor, the epoch's passed-over prompts, posteriors, the number of draws that seeds the
next one — is ``SamplerState``, checkpointed with the run (``snapshot``), so a resumed run draws
exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import copy
import random
import threading
from dataclasses import dataclass, field

import numpy as np

from relayrl.data import selection as sel
from relayrl.records import Prompt


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0  # in the epoch's order (its permutation, then ``deferred``)
    consumed: int = 0  # prompts drawn so far
    deferred: list[int] = field(default_factory=list)  # this epoch's prompts passed over by selection
    draws: int = 0  # selections so far (each one's random draws are seeded by it)
    version: int = 0  # the newest policy version whose outcomes were observed
    # "p:<prompt id>" / "g:<group key>" -> [successes, failures, version of the evidence]
    stats: dict = field(default_factory=dict)


class SelectionError(ValueError):
    pass


class PromptSampler:
    """Prompts for the rollout (``take``), and what became of them (``observe``); ``state`` is
    checkpointed so resume continues exactly. ``selection``: 'uniform', 'vade' or 'cures';
    ``pool``: candidates per prompt taken; ``forget``: evidence weight kept per policy version;
    ``key``: the metadata field grouping prompts for their prior (None: one group); ``strength``:
    the prior's pseudo-observations."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool = True, state: SamplerState | None = None,
                 selection: str = "uniform", pool: int = 4, forget: float = 0.9, key: str | None = None,
                 strength: float = 2.0):
        if selection != "uniform" and selection not in sel.PICKS:
            raise SelectionError(f"data.selection={selection!r} is not one of: uniform, {', '.join(sel.PICKS)}")
        self.prompts, self.seed, self.shuffle = prompts, seed, shuffle
        self.selection, self.pool, self.forget, self.key, self.strength = selection, pool, forget, key, strength
        if key is not None:
            missing = next((p for p in prompts if key not in p.metadata), None)
            if missing is not None:
                raise SelectionError(f"data.selection_key={key!r}: prompt {missing.id!r} has no metadata field "
                                     f"{key!r} (its metadata: {', '.join(missing.metadata) or 'none'})")
        self.state = state or SamplerState()
        self._order = self._permutation(self.state.epoch) + self.state.deferred
        self._lock = threading.Lock()
        self._picked: list[float] = []  # predicted success rates of the prompts selected since ``metrics``

    def _permutation(self, epoch: int) -> list[int]:
        idx = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 100003 + epoch).shuffle(idx)
        return idx

    def take(self, n: int) -> list[Prompt]:
        out: list[Prompt] = []
        with self._lock:
            s = self.state
            while len(out) < n:
                if s.position >= len(self._order):  # a new epoch
                    s.epoch, s.position, s.deferred = s.epoch + 1, 0, []
                    self._order = self._permutation(s.epoch)
                want = n - len(out)
                k = want if self.selection == "uniform" else min(want * self.pool, len(self._order) - s.position)
                cand = self._order[s.position:s.position + k]
                s.position += len(cand)
                chosen = self._choose(cand, want)
                passed = [i for j, i in enumerate(cand) if j not in set(chosen)]
                s.deferred += passed
                self._order += passed
                out += [self.prompts[cand[j]] for j in chosen]
            s.consumed += len(out)
        return out

    def _choose(self, cand: list[int], n: int) -> list[int]:
        """Positions in ``cand`` of the prompts to draw (all of them when there are no more than ``n``)."""
        if len(cand) <= n:
            return list(range(len(cand)))
        ab = [self._posterior(self.prompts[i]) for i in cand]
        alpha, beta = np.array([a for a, _ in ab]), np.array([b for _, b in ab])
        rng = np.random.default_rng([self.seed, 7919, self.state.draws])
        self.state.draws += 1
        chosen = sel.PICKS[self.selection](alpha, beta, n, rng)
        self._picked += [float(alpha[j] / (alpha[j] + beta[j])) for j in chosen]
        return chosen

    def _evidence(self, name: str) -> tuple[float, float]:
        s, f, v = self.state.stats.get(name, (0.0, 0.0, self.state.version))
        return sel.decayed(s, f, v, self.state.version, self.forget)

    def _group(self, p: Prompt) -> str:
        return "g:" + ("" if self.key is None else str(p.metadata[self.key]))

    def _posterior(self, p: Prompt) -> tuple[float, float]:
        pooled = self._evidence(self._group(p))
        return sel.posterior(sel.prior(*pooled, self.strength), *self._evidence("p:" + p.id))

    def observe(self, prompt: Prompt, rewards: list[float], version: int) -> None:
        """A finished group's rewards (failed episodes left out), sampled by policy ``version``."""
        if self.selection == "uniform" or not rewards:
            return
        ok = sel.successes(rewards)
        with self._lock:
            self.state.version = max(self.state.version, version)
            for name in ("p:" + prompt.id, self._group(prompt)):
                s, f = self._evidence(name)
                self.state.stats[name] = [s + ok, f + len(rewards) - ok, self.state.version]

    def snapshot(self) -> SamplerState:
        with self._lock:
            return copy.deepcopy(self.state)

    def metrics(self) -> dict:
        """The posterior mean success rate of the prompts selected since the last call, and the
        number of prompts with evidence."""
        if self.selection == "uniform":
            return {}
        with self._lock:
            picked, self._picked = self._picked, []
            tracked = sum(k.startswith("p:") for k in self.state.stats)
        return {"selection/predicted_p_mean": sum(picked) / len(picked) if picked else None,
                "selection/prompts_tracked": tracked}
