"""Which prompts a step trains on, and how many responses each gets: pure math of the sampling state.

Posteriors. Every prompt has a Beta posterior over its success rate p (a reward clipped to [0, 1]
counts as that fraction of a success: binary verifiers give whole ones). Evidence is forgotten
geometrically, by ``forget`` per policy version since it was gathered (VADE's non-stationarity:
the policy moves, old outcomes describe an older policy). A prompt's prior is the pooled evidence of
its *group* — the prompts sharing a metadata value (``data.selection_key``: a difficulty level, the
number of terms; else all prompts) — as a Beta of ``strength`` pseudo-observations around the
group's mean. So a prompt never seen starts where its group stands, which is what makes selection
work on a large dataset where most prompts are seen once (the demo draws 640 of 20,000).

Selection (``data.selection``), among candidate prompts:
  vade   Thompson sampling: draw p̃ ~ Beta(α, β) per candidate, keep the n with the largest
         p̃(1 − p̃) (the variance of a binary reward: zero for solved and hopeless prompts, whose
         group advantage is zero). VADE's exact score and decay are unconfirmed
         (algorithms.md §4): this is the reading written there, with one forgetting rate.
  cures  CurES-style weighting: sample n without replacement with probability ∝ sqrt(p̂(1 − p̂)),
         p̂ the posterior mean (the standard deviation of a binary reward, to which a prompt's
         expected group-normalised gradient is proportional), floored so no prompt is never drawn.
         A softer preference than vade's; the paper's own closed form is not reproduced here.

Budgets (``rollout.budget=adaptive``; DARS/AR3PO/XRPO): a group first gets ``n0`` responses; one whose
rewards have no variance stops there (solved or hopeless: more samples would still teach nothing);
one with variance asks for ``(n_max − n0) · 4p̂(1 − p̂)`` more (most at p̂ = 0.5), granted from its own
reserve ``G − n0`` and the surplus the stopped groups of its window left (``extra_samples``).

Everything here is a pure function of numbers (and a seeded numpy Generator where it draws).
"""

from __future__ import annotations

import math

import numpy as np

FLOOR = 0.05  # cures: the smallest weight, relative to the largest possible (sqrt(1/4))


def decayed(successes: float, failures: float, since: int, now: int, forget: float) -> tuple[float, float]:
    """Evidence gathered at version ``since``, seen from version ``now``: each weighted forget^(now − since)."""
    w = forget ** max(0, now - since)
    return successes * w, failures * w


def prior(successes: float, failures: float, strength: float) -> tuple[float, float]:
    """Beta prior of ``strength`` pseudo-observations around a group's pooled mean (Laplace-smoothed:
    an empty group gives Beta(strength/2, strength/2), mean 0.5)."""
    mean = (successes + 1.0) / (successes + failures + 2.0)
    return strength * mean, strength * (1.0 - mean)


def posterior(prior_ab: tuple[float, float], successes: float, failures: float) -> tuple[float, float]:
    return prior_ab[0] + successes, prior_ab[1] + failures


def vade_pick(alpha: np.ndarray, beta: np.ndarray, n: int, rng: np.random.Generator) -> list[int]:
    """Indices of the ``n`` candidates with the largest p̃(1 − p̃), p̃ ~ Beta(α, β) (ties: the earlier)."""
    p = rng.beta(alpha, beta)
    score = p * (1.0 - p)
    return sorted(np.argsort(-score, kind="stable")[:n].tolist())


def cures_weights(alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """sqrt(p̂(1 − p̂)), p̂ = α/(α + β), floored at ``FLOOR`` × its maximum 1/2."""
    mean = alpha / (alpha + beta)
    return np.maximum(np.sqrt(mean * (1.0 - mean)), FLOOR * 0.5)


def cures_pick(alpha: np.ndarray, beta: np.ndarray, n: int, rng: np.random.Generator) -> list[int]:
    """``n`` candidates drawn without replacement with probability ∝ ``cures_weights`` (Gumbel top-k)."""
    keys = np.log(cures_weights(alpha, beta)) + rng.gumbel(size=len(alpha))
    return sorted(np.argsort(-keys, kind="stable")[:n].tolist())


PICKS = {"vade": vade_pick, "cures": cures_pick}


def successes(rewards: list[float]) -> float:
    """A reward counts as that fraction of a success, clipped to [0, 1]."""
    return float(sum(min(1.0, max(0.0, r)) for r in rewards))


def wanted_extra(rewards: list[float], n_max: int) -> int:
    """Responses a group with these first-stage ``rewards`` asks for beyond them: none without variance,
    else ⌈(n_max − n) · 4p̂(1 − p̂)⌉ with p̂ its success rate (all of n_max − n at p̂ = 1/2)."""
    n = len(rewards)
    if n == 0 or max(rewards) - min(rewards) < 1e-9:
        return 0
    p = successes(rewards) / n
    return max(0, math.ceil((n_max - n) * 4.0 * p * (1.0 - p) - 1e-9))


def grant(wanted: int, reserve: int, surplus: int) -> tuple[int, int]:
    """(responses granted, the window's surplus after it): the group's own ``reserve`` first, then the
    surplus; a reserve it does not use goes to the surplus."""
    from_reserve = min(wanted, reserve)
    from_surplus = min(wanted - from_reserve, surplus)
    return from_reserve + from_surplus, surplus - from_surplus + (reserve - from_reserve)
