"""Length-aware ordering of the rollout request queue (Seer, Hermes).

Expected lengths come from the request's finished siblings in the same group first (they share
the prompt, so they are the best predictor), then from the prompt's history across steps, then
from all recent responses. Policies:

- ``fifo``: arrival order.
- ``partial_first``: continued (partial) responses first, then arrival order (APRIL serves its
  buffer first).
- ``longest_first``: longest expected total length first; for a synchronous batch barrier this
  minimises the makespan (LPT).
- ``srpt``: shortest expected remaining length first, for streaming consumers (mean latency,
  hence staleness).
- ``gittins``: highest Gittins index first, for when lengths are uncertain:
  G(a) = sup_Δ P(S − a ≤ Δ | S > a) / E[min(S − a, Δ) | S > a], a = tokens generated so far.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Pending:
    request_id: str
    prompt_id: str
    group_id: str
    generated: int = 0  # tokens already generated (a continued partial response)
    arrival: int = 0  # submission order
    partial: bool = False


class LengthModel:
    """Observed response lengths by group, by prompt (last ``per_prompt``) and overall (last ``window``)."""

    def __init__(self, per_prompt: int = 16, window: int = 512, default: int = 64, max_groups: int = 4096,
                 max_prompts: int = 100_000):
        # bounded: the oldest groups and prompts are forgotten first (a long run must not grow memory)
        self.by_group: OrderedDict[str, list[int]] = OrderedDict()
        self.by_prompt: OrderedDict[str, deque] = OrderedDict()
        self.recent: deque = deque(maxlen=window)
        self.default, self.per_prompt = default, per_prompt
        self.max_groups, self.max_prompts = max_groups, max_prompts

    def observe(self, prompt_id: str, group_id: str, length: int) -> None:
        self.by_group.setdefault(group_id, []).append(length)
        self.by_group.move_to_end(group_id)
        self.by_prompt.setdefault(prompt_id, deque(maxlen=self.per_prompt)).append(length)
        self.by_prompt.move_to_end(prompt_id)
        self.recent.append(length)
        for table, cap in ((self.by_group, self.max_groups), (self.by_prompt, self.max_prompts)):
            while len(table) > cap:
                table.popitem(last=False)

    def forget_group(self, group_id: str) -> None:
        self.by_group.pop(group_id, None)

    def samples(self, prompt_id: str, group_id: str) -> list[int]:
        for source in (self.by_group.get(group_id), self.by_prompt.get(prompt_id), self.recent):
            if source:
                return list(source)
        return [self.default]


def expected_total(samples: list[int]) -> float:
    return sum(samples) / len(samples)


def expected_remaining(samples: list[int], age: int) -> float:
    """E[S − a | S > a]; past every observed length, assume as much again as already generated."""
    rest = [s - age for s in samples if s > age]
    return sum(rest) / len(rest) if rest else float(max(age, 1))


def gittins_index(samples: list[int], age: int) -> float:
    """sup over Δ of P(R ≤ Δ) / E[min(R, Δ)] with R = S − a given S > a (empirical)."""
    rest = sorted(s - age for s in samples if s > age)
    if not rest:
        return 1.0 / max(age, 1)
    best, n = 0.0, len(rest)
    for i, delta in enumerate(rest):
        p_done = (i + 1) / n
        e_min = (sum(rest[: i + 1]) + delta * (n - i - 1)) / n
        best = max(best, p_done / e_min)
    return best


def order(pending: list[Pending], policy: str, model: LengthModel) -> list[Pending]:
    """``pending`` in the order the engine should serve it under ``policy``."""
    if policy not in SCHEDULERS:
        raise ValueError(f"unknown scheduling policy {policy!r}; valid: {', '.join(SCHEDULERS)}")
    return sorted(pending, key=SCHEDULERS[policy](model))


SCHEDULERS = {
    "fifo": lambda m: lambda p: p.arrival,
    "partial_first": lambda m: lambda p: (not p.partial, p.arrival),
    "longest_first": lambda m: lambda p: (-expected_total(m.samples(p.prompt_id, p.group_id)), p.arrival),
    "srpt": lambda m: lambda p: (expected_remaining(m.samples(p.prompt_id, p.group_id), p.generated), p.arrival),
    "gittins": lambda m: lambda p: (-gittins_index(m.samples(p.prompt_id, p.group_id), p.generated), p.arrival),
}
