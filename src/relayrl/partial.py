"""The partial-rollout buffer (APRIL): groups whose responses were cut off, carried to the next step.

A group enters when a step has its batch and aborts what is still running; its finished members
keep their responses and are not regenerated, its unfinished ones keep their tokens, behaviour
log-probs and per-token versions, and continue with what is left of their token budget
(``rollout.continuation``). The next step serves the buffer first, oldest group first. The
buffer is part of the checkpoint (``state_dict`` is JSON-safe), so a crash loses nothing.
"""

from __future__ import annotations

from collections import deque

from relayrl.records import Group, group_from_dict, group_to_dict


class PartialBuffer:
    def __init__(self):
        self._groups: deque[Group] = deque()

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: Group) -> None:
        """A cut-off group, or a complete one the step had no room for (it is served first next step)."""
        self._groups.append(group)

    def take(self, n: int) -> list[Group]:
        """Up to ``n`` groups, oldest first."""
        return [self._groups.popleft() for _ in range(min(n, len(self._groups)))]

    def peek(self) -> list[Group]:
        return list(self._groups)

    def unfinished_tokens(self) -> int:
        return sum(len(t.response_ids) for g in self._groups for t in g.trajectories if not t.done)

    def state_dict(self) -> list[dict]:
        return [group_to_dict(g) for g in self._groups]

    def load_state_dict(self, state: list[dict]) -> None:
        self._groups = deque(group_from_dict(d) for d in state)
