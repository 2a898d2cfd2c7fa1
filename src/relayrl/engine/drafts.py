"""Where ``rollout.speculative``'s drafts come from: token sequences indexed by their n-grams (``NgramIndex``) and
the sources that hold them (``DraftStore``); ``engine/speculative.py`` verifies the drafts, exactly.

Drafts. A row's draft is what followed, elsewhere, the last tokens it has: the longest of its last
``max_n``, 4 or ``min_n`` tokens found in a source, and the tokens after that occurrence; while the row emits
that text, it goes on drafting from there (``Speculator._follow`` in ``speculative.py``: no lookup). Sources
(``DraftStore``), all keyed by the row's prompt, none a model, looked up in this order:

    history   the prompt's earlier responses (SPEC-RL's previous epoch), the last ``keep`` of each,
              ``max_tokens`` in all, the least recently used prompt forgotten first;
    siblings  the other responses of the same prompt in the engine's batch, live ones ahead of the row and
              finished ones (Seer's grouped drafts); with ``lead``, one row of each group decodes first, alone
              (Seer's divided rollout: its whole response drafts for its siblings, which wait for it);
    prompt    the row's own context: its prompt and what it generated (prompt lookup);
    recent    every prompt's recent responses, ``recent_tokens`` in all (SuffixDecoding's global tree): the text a
              task's responses share whatever the prompt (a format, a tool call's frame, the chat template's end).
"""

from __future__ import annotations

import functools
from collections import OrderedDict, deque
from typing import Sequence

SOURCES = ("siblings", "history", "prompt", "recent")
HISTORY_TOKENS = 200_000  # history's size: an index holds ~0.5 KB a token (its n-grams)


@functools.cache
def ngram_lengths(min_n: int, max_n: int) -> tuple[int, ...]:
    """The n-gram lengths an index holds: ``min_n``, ``max_n`` and the powers of 2 between (2, 4, 8)."""
    return tuple(sorted({min_n, max_n} | {2 ** i for i in range(1, max_n.bit_length()) if min_n < 2 ** i < max_n}))


class NgramIndex:
    """A token sequence and, for each of its n-grams with a token after it (n in ``lengths``: ``min_n``, ``max_n``
    and the powers of 2 between), where its most recent such occurrence ends: a draft is a dictionary lookup, not a
    scan. Extended as a response grows; its n-grams indexed when it is next looked up (a row's own index often never
    is). Indexing is the drafts' largest cost (a dictionary entry per token and length), hence a few lengths, not
    every one: a match is as long as the longest length found, where the text agrees further back or not."""

    def __init__(self, tokens: Sequence[int] = (), min_n: int = 2, max_n: int = 8):
        self.seq: list[int] = list(tokens)
        self.ends: dict[tuple[int, ...], int] = {}
        self.min_n, self.max_n, self.indexed = min_n, max_n, 0
        self.lengths = ngram_lengths(min_n, max_n)

    def extend(self, tokens: Sequence[int]) -> None:
        self.seq.extend(tokens)

    def _catch_up(self) -> None:
        """Index the n-grams seq[p - n:p] (a token after them, at p) for the positions p not yet indexed, each
        length's in one pass of ``zip`` (its tuples made in C); a later occurrence overwrites an earlier one."""
        seq, ends, stop = self.seq, self.ends, len(self.seq)
        for n in self.lengths:
            first = max(self.indexed, n)
            if first < stop:
                ends.update(zip(zip(*[seq[first - n + i:stop - n + i] for i in range(n)]), range(first, stop)))
        self.indexed = stop

    def __len__(self) -> int:
        return len(self.seq)

    def find(self, tail: Sequence[int]) -> tuple[int, int]:
        """(n, where the most recent occurrence of ``tail``'s last n tokens ends), for the longest n of ``lengths``
        found; (0, 0) if none. Where an n-gram occurs, so does every shorter end of it (with the same token after
        it): a miss is one lookup (the shortest), the longest is found by bisection."""
        if self.indexed < len(self.seq):
            self._catch_up()
        ends, lengths = self.ends, self.lengths
        tail = tuple(tail[-self.max_n:])
        lo, hi = 0, len(lengths) - 1  # (indexes into lengths)
        while hi >= 0 and lengths[hi] > len(tail):
            hi -= 1
        if hi < 0 or (end := ends.get(tail[-lengths[0]:])) is None:
            return 0, 0
        while lo < hi:  # (ends[tail[-lengths[lo]:]] is end; none longer than lengths[hi] occurs)
            mid = (lo + hi + 1) // 2
            if (e := ends.get(tail[-lengths[mid]:])) is None:
                hi = mid - 1
            else:
                lo, end = mid, e
        return lengths[lo], end

    def lookup(self, tail: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(n, the up to ``k`` tokens after ``find``'s occurrence); (0, []) if none."""
        n, end = self.find(tail)
        return n, self.seq[end:end + k] if n else []


class DraftStore:
    """Responses by prompt, for drafts: the live rows' (siblings, and each row's own context) and finished
    ones (history); each an ``NgramIndex`` of the prompt's last ``max_n`` tokens and the response (a response's
    first tokens follow the prompt's end)."""

    def __init__(self, sources: Sequence[str] = SOURCES, keep: int = 4, max_tokens: int = HISTORY_TOKENS,
                 min_n: int = 2, max_n: int = 8, prompts: int = 256, recent_tokens: int = 20_000):
        bad = [s for s in sources if s not in SOURCES]
        if bad:
            raise ValueError(f"unknown draft sources {bad}; valid: {', '.join(SOURCES)}")
        self.sources, self.keep, self.min_n, self.max_n = tuple(sources), keep, min_n, max_n
        self.anywhere = "prompt" in self.sources or "recent" in self.sources  # (sources every row has)
        # history: the last ``keep`` responses of each prompt, ``max_tokens`` in all, the least recently used prompt
        # forgotten first
        self.max_tokens, self.tokens = max_tokens, 0
        self.history: OrderedDict[int, deque[NgramIndex]] = OrderedDict()
        self.prompts = prompts  # whole prompts indexed for prompt lookup, the least recently used forgotten first
        self.prompt_index: OrderedDict[int, NgramIndex] = OrderedDict()
        self.recent_tokens, self.recent = recent_tokens, NgramIndex(min_n=min_n, max_n=max_n)

    @staticmethod
    def key(prompt_ids: Sequence[int]) -> int:
        """A prompt's key: its hash (a dictionary hashes a tuple key again at every lookup, a prompt's hundreds of
        tokens; two prompts of one hash would share drafts, which costs acceptance, never exactness)."""
        return hash(tuple(prompt_ids))

    def index(self, prompt_ids: Sequence[int], response: Sequence[int] = ()) -> NgramIndex:
        """A new row's (or a finished response's) index."""
        return NgramIndex(list(prompt_ids[-self.max_n:]) + list(response), self.min_n, self.max_n)

    def finished(self, prompt_ids: Sequence[int], index: NgramIndex, key: int | None = None) -> None:
        """A response that ended (its ``index``, kept as it is: not extended after): a draft for the prompt's later
        responses (and, with ``recent``, for any prompt's)."""
        if "recent" in self.sources:
            if len(self.recent.seq) + len(index.seq) > 2 * self.recent_tokens:  # (rebuilt from its last half)
                self.recent = NgramIndex(self.recent.seq[-self.recent_tokens:], self.min_n, self.max_n)
            self.recent.extend(index.seq)
        if "history" not in self.sources:
            return
        key = self.key(prompt_ids) if key is None else key
        kept = self.history.pop(key, None) or deque()
        kept.append(index)  # (its n-grams indexed if it is looked up: most prompts of a run never come again)
        self.tokens += len(index.seq)
        if len(kept) > self.keep:
            self.tokens -= len(kept.popleft())
        self.history[key] = kept
        while self.tokens > self.max_tokens and self.history:
            self.tokens -= sum(map(len, self.history.popitem(last=False)[1]))

    def _prompt(self, prompt_ids: Sequence[int], key: int) -> NgramIndex:
        found = self.prompt_index.pop(key, None) or NgramIndex(prompt_ids, self.min_n, self.max_n)
        self.prompt_index[key] = found
        while len(self.prompt_index) > self.prompts:
            self.prompt_index.popitem(last=False)
        return found

    def _sources(self, prompt_ids, key, own, siblings, kept):
        """The indexes a row's draft is looked up in, in order, with their source's name: history first (its
        indexes are built once, when first looked up; a live sibling's grows every step, so a match that history
        makes whole leaves the siblings' n-grams unindexed)."""
        for h in reversed(kept or ()):
            if not any(h is s for s in siblings):  # (a response of this batch is among the siblings too: looked up once)
                yield h, "history"
        if "siblings" in self.sources:
            yield from ((s, "siblings") for s in siblings)
        if "prompt" in self.sources:
            yield own, "prompt"
            yield self._prompt(prompt_ids, key), "prompt"
        if "recent" in self.sources:  # (last: a prompt's own sources win a tie)
            yield self.recent, "recent"

    def draft(self, prompt_ids: Sequence[int], own: NgramIndex, k: int, siblings: Sequence[NgramIndex] = (),
              key: int | None = None) -> tuple[list[int], str | None]:
        """The draft of up to ``k`` tokens for a row (``own``: its index; ``key``: its prompt's, if known) and its
        source: the longest match of its last tokens, then the longest continuation."""
        d, src, _, _ = self.found(prompt_ids, own, k, siblings, key)
        return d, src

    def found(self, prompt_ids: Sequence[int], own: NgramIndex, k: int, siblings: Sequence[NgramIndex] = (),
              key: int | None = None) -> tuple[list[int], str | None, NgramIndex | None, int]:
        """``draft``'s draft and source, and the index it is in and where in its sequence it begins."""
        key = self.key(prompt_ids) if key is None else key
        kept = self.history.get(key) if "history" in self.sources else None
        if k <= 0 or not (siblings or kept or self.anywhere):  # (a new prompt's rows in lockstep: nothing to look up)
            return [], None, None, 0
        tail = tuple(own.seq[-self.max_n:])
        best: tuple[int, int, NgramIndex | None, int, str | None] = (0, 0, None, 0, None)
        for index, src in self._sources(prompt_ids, key, own, siblings, kept):
            n, end = index.find(tail)
            room = min(k, len(index.seq) - end) if n else 0  # (the draft's length)
            if (n, room) > best[:2]:  # (the first of the longest: history's and a prompt's own sources win a tie)
                best = n, room, index, end, src
                if n == len(tail) and room == k:  # (none can be longer: the others are not looked up)
                    break
        n, room, index, end, src = best
        return (index.seq[end:end + room], src, index, end) if room else ([], None, None, 0)
