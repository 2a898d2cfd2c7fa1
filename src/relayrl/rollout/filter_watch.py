"""A note when dynamic sampling multiplies generation step after step (``rollout.dynamic_sampling``)."""

from __future__ import annotations

from collections import deque


class FilterWatch:
    """Says once when dynamic sampling has multiplied generation for ``steps`` steps in a row: each
    filtered at least its cap, or at least 3 times the groups it trained (generation 4x what is
    trained). A weak base model (or one that solves everything) makes most groups zero-variance, and
    every step then silently generates up to 1 + rollout.dynamic_sampling_max times the groups it
    trains. (The demo filters 1-2.5x its batch while it learns: that is the price of groups that
    teach, not a surprise to warn about.)"""

    def __init__(self, batch: int, cap_factor: int, steps: int = 3):
        self.batch, self.cap_factor, self.steps = batch, cap_factor, steps
        self.recent: deque[int] = deque(maxlen=steps)
        self.said = False

    def update(self, filtered: int) -> str | None:
        """This step's filtered groups; the note, the first time the condition holds."""
        cap = self.cap_factor * self.batch
        self.recent.append(filtered if filtered >= min(cap, 3 * self.batch) else -1)
        if self.said or len(self.recent) < self.steps or min(self.recent) < 0:
            return None
        self.said = True
        made = sum(self.recent) + self.steps * self.batch
        return (f"dynamic sampling filtered {', '.join(map(str, self.recent))} groups in the last {self.steps} steps "
                f"(the cap is rollout.dynamic_sampling_max={self.cap_factor} × rollout.prompts_per_step={self.batch} "
                f"= {cap} a step): their rewards had no variance (every response right, or every one wrong), so "
                f"generation made {made / (self.steps * self.batch):.1f}× the groups trained. A model that solves "
                "almost nothing (or everything) makes most groups so; rollout.dynamic_sampling=false trains on the "
                "groups as they come, a lower rollout.dynamic_sampling_max bounds the extra generation")
