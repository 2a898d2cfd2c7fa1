"""Exact speculative decoding from drafts that cost no model (``rollout.speculative``; the math:
docs/concepts/speculative.md, from ../spec/speculative.md A2–A3).

Drafts come from ``drafts.py`` (``DraftStore``: history, siblings, the prompt, recent responses); a row that keeps
to the text after its draft drafts on from there (``Speculator._follow``: no lookup).

Verification, sample and compare: one forward over the row's last token and its draft x_1..x_k gives
the sampling scores p_1..p_{k+1}, each conditioned on the draft before it. At each position i a token
y_i is drawn from p_i exactly as plain decoding draws it (the same seeded numbers at the same positions
for a seeded request); x_i is accepted while y_i = x_i, and the first y_i that differs is emitted in its
place and ends the row's step; when every x_i is accepted, y_{k+1} is emitted as well (the bonus).

Why it is exact: position i is examined only when x_1..x_{i−1} were accepted, so the row's real prefix
is the draft's and p_i is the right conditional; the token emitted there is y_i, a draw from p_i,
whatever x_i was. Accepting x with probability p(x) and, on rejection, drawing from p without x
renormalised (the rule for a deterministic draft) is the same law: P(x) = p(x), and for y ≠ x
P(y) = (1 − p(x)) · p(y)/(1 − p(x)) = p(y). The draft may depend on anything but the numbers drawn
for this step, so it changes how many forwards a response costs, never its distribution; each
emitted token's log-prob is log p_i(y_i) from the verification forward, the number plain decoding
records.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

from relayrl.algos.token_sampling import sample_tokens
from relayrl.engine.drafts import HISTORY_TOKENS, SOURCES, DraftStore, NgramIndex


def next_draft_length(k: int, drafted: int, accepted: int, k_max: int) -> int:
    """A row's next draft length: doubled after a draft accepted whole, else one past what was accepted."""
    if drafted == 0:
        return k
    return min(k_max, 2 * k if accepted == drafted else max(1, accepted + 1))


def draw_positions(scores: Tensor, temperature: float, seeds: Tensor | None = None, at: Tensor | None = None
                   ) -> Tensor:
    """A token per row and position [rows, k+1] from sampling ``scores`` [rows, k+1, vocab], each as plain decoding
    draws one there (``verify``'s ``draw``): the argmax at temperature 0, every position at once when no row is
    seeded, else position by position (a seeded row draws its own number at ``at`` + i)."""
    if temperature == 0:
        return scores.argmax(-1)
    if seeds is None:
        return sample_tokens(scores.flatten(0, 1)).view(scores.shape[:2])
    return torch.stack([sample_tokens(scores[:, i], seeds, at + i) for i in range(scores.shape[1])], 1)


def verify(scores: Tensor, drafts: Sequence[Sequence[int]], draw: Callable[[Tensor], Tensor]
           ) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """Sample and compare (module doc). ``scores`` [rows, k+1, vocab]: the sampling scores at the row's
    last token and at each draft token; ``drafts``: each row's draft, at most k tokens; ``draw(scores)`` a token
    per row and position [rows, k+1], each from its scores as plain decoding draws one (the engine's sampler:
    seeded rows draw their own numbers at each position). Returns the tokens each row emits (its accepted
    draft, then the token drawn at its first rejection or the bonus), their log-probs, and the accepted
    counts. The drawn tokens and their log-probs are the step's only copies from a GPU: the drafts are compared
    with them here, on the host, where the drafts were made."""
    drawn = draw(scores)  # [rows, k+1]
    lps = torch.log_softmax(scores.float(), dim=-1).gather(-1, drawn[..., None]).squeeze(-1)
    tokens, logprobs, accepted = [], [], []
    for draft, row, lp in zip(drafts, drawn.tolist(), lps.tolist()):
        a = 0
        while a < len(draft) and row[a] == draft[a]:
            a += 1
        tokens.append(row[:a + 1])  # accepted draft tokens equal the drawn ones; then the first difference
        logprobs.append(lp[:a + 1])
        accepted.append(a)
    return tokens, logprobs, accepted


def padded(drafts: Sequence[Sequence[int]], device=None) -> Tensor:
    """The drafts as one tensor [rows, the longest draft], padded with 0 (a verification forward's input)."""
    width = max(map(len, drafts), default=0)
    return torch.tensor([list(d) + [0] * (width - len(d)) for d in drafts], dtype=torch.long,
                        device=device).view(len(drafts), width)


class Widths:
    """How wide a step's verification forward is (1: a plain decoding step), from what a forward costs and what
    the drafts in hand are expected to keep; a budget (``batch_tokens``) alone verified every draft, where a few
    rows' drafts cost a whole batch a forward twice as wide.

    Cost: a forward's seconds as a line in the tokens it feeds, t0 + t1 · tokens, fitted by least squares over
    about the last ``memory`` forwards, decoding and verifying alike (the rows of a batch finish one by one, so
    plain decoding spans the token counts too: the line is learned without drafting). Keep: a source's draft
    token is kept with probability α, its kept tokens over kept tokens plus drafts cut short (a geometric law),
    counted from verifications and, on plain steps, from whether the token drawn is the draft's first. A row
    whose draft is cut to w − 1 tokens then emits 1 + α + … + α^(w−1) tokens on average; the width with the most
    tokens per second wins. Until ``warmup`` forwards are timed every draft is verified whole; after, a forward
    timed at more than 3 times the line's prediction counts as 3 times it.

    Exactness is untouched: the choice depends on the drafts and on earlier steps, never on the numbers this
    step draws."""

    def __init__(self, memory: int = 64, warmup: int = 16):
        self.decay, self.warmup, self.timed_forwards, self.outlier = 1 - 1 / memory, warmup, 0, 3.0
        self.sums = [0.0] * 5  # (forgetting) n, Σ tokens, Σ seconds, Σ tokens², Σ tokens · seconds
        self.kept: dict[str, list[float]] = {}  # source -> [kept draft tokens, drafts cut short]

    def timed(self, tokens: int, seconds: float) -> None:
        # A forward held up (a collection, the machine's other work) counts as at most ``outlier`` times the line's
        # prediction: one stall no longer tilts the line for the next ``memory`` forwards.
        if (line := self.line()) is not None:
            seconds = min(seconds, self.outlier * (line[0] + line[1] * tokens))
        d = self.decay
        self.sums = [d * a + b for a, b in zip(self.sums, (1.0, tokens, seconds, tokens * tokens, tokens * seconds))]
        self.timed_forwards += 1

    def line(self) -> tuple[float, float] | None:
        """(t0, t1), or None while too few forwards are timed or their token counts do not vary."""
        n, x, y, xx, xy = self.sums
        spread = n * xx - x * x
        if self.timed_forwards < self.warmup or spread <= 1e-9 * n * xx:
            return None
        t1 = max(0.0, (n * xy - x * y) / spread)
        return max(1e-9, (y - t1 * x) / n), t1

    def outcome(self, source: str, drafted: int, accepted: int) -> None:
        k = self.kept.setdefault(source, [1.0, 1.0])  # (before any: α = 1/2)
        k[0] = 0.995 * k[0] + accepted
        k[1] = 0.995 * k[1] + (accepted < drafted)

    def alpha(self, source: str) -> float:
        k = self.kept.get(source, (1.0, 1.0))
        return k[0] / (k[0] + k[1])

    def width(self, lengths: Sequence[int], sources: Sequence[str | None]) -> int:
        """The width for rows whose drafts have ``lengths`` (from ``sources``): 1 + the draft tokens a row may feed."""
        longest = max(lengths, default=0)
        if (line := self.line()) is None or not longest:
            return longest + 1
        t0, t1 = line
        rows, best, best_rate = len(lengths), 1, len(lengths) / (t0 + t1 * len(lengths))
        power = {s: 1.0 for s in sources if s}
        tokens = float(rows)
        for j in range(1, longest + 1):  # (width j + 1: each row keeps up to j draft tokens)
            for s in power:
                power[s] *= self.alpha(s)
            tokens += sum(power[s] for n, s in zip(lengths, sources) if s and n >= j)
            rate = tokens / (t0 + t1 * rows * (j + 1))
            if rate > best_rate:
                best, best_rate = j + 1, rate
        return best


class Speculator:
    """The engine's drafts and their accounting: a draft per live row (``drafts``), its length adapted to
    what the row accepted (``next_draft_length``), the step's width chosen (``Widths``; ``choose=False``: every
    draft verified), finished responses kept as history, and counts by source since the last ``take``."""

    def __init__(self, sources: Sequence[str] = SOURCES, max_draft: int = 8, batch_tokens: int = 64, keep: int = 4,
                 max_tokens: int = HISTORY_TOKENS, lead: bool = False, choose: bool = True):
        if max_draft < 1:
            raise ValueError(f"rollout.speculative_max_draft must be at least 1, got {max_draft}")
        self.store = DraftStore(sources, keep=keep, max_tokens=max_tokens)
        self.max_draft, self.batch_tokens, self.lead = max_draft, batch_tokens, lead
        self.group_done: dict[int, list[NgramIndex]] = {}  # prompt -> its responses finished in this batch
        self.k: dict[str, int] = {}  # request id -> its next draft length
        self.rows: dict[str, tuple[int, NgramIndex]] = {}  # request id -> its prompt's key, its end and response so far
        # request id -> where its last draft was found: the index, the draft's start there, the row's length then, source
        self.follow: dict[str, tuple[NgramIndex, int, int, str]] = {}
        self.counts: dict[str, int] = {}
        self.widths = Widths() if choose else None
        self.probes: list[tuple[int, str] | None] | None = None  # a plain step's drafts: (first token, source)
        self.lock = threading.Lock()  # (counted on the engine's thread, taken on the trainer's)

    def batch(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """A new batch of rows (``prompts``: each row's prompt ids): its rows' finished responses are kept as their
        siblings' drafts until the next batch, and the parts it decodes in, one after the other (``divide``: with
        ``lead``, one row of each prompt first; else all at once)."""
        keys = [self.store.key(p) for p in prompts]
        self.group_done = {k: [] for k in keys}  # (an earlier batch's responses of the same prompt are history's)
        self.follow.clear()  # (an earlier batch's drafts are looked up again)
        return divide(keys) if self.lead and "siblings" in self.store.sources else [list(range(len(keys)))]

    def drafts(self, rows: Sequence[tuple[str, Sequence[int], Sequence[int], int]]
               ) -> tuple[list[list[int]], list[str | None]]:
        """``rows``: (request id, prompt ids, response so far, tokens it may still emit). Returns each row's
        draft (maybe empty) and its source. A verification
        forward holds at most ``batch_tokens`` tokens (rows × (k + 1)): past that the forward costs about what
        its tokens cost, and drafts that are often rejected would cost more than they save."""
        cap = self.batch_tokens // max(1, len(rows)) - 1
        if cap < 1:
            return [[] for _ in rows], [None] * len(rows)
        indexes, by_prompt = [], {}
        for rid, prompt, response, _ in rows:
            key, own = self.rows.get(rid) or (self.store.key(prompt), None)
            own = self._index(own, prompt, response)
            self.rows[rid] = key, own
            indexes.append((key, own))
            by_prompt.setdefault(key, []).append(own)
        out, sources = [], []
        for (rid, prompt, _, left), (key, own) in zip(rows, indexes):
            k = min(self.k.setdefault(rid, min(4, self.max_draft)), left - 1, cap)  # (room for the token drawn after)
            d, src = self._follow(rid, own, k) if k > 0 else ([], None)
            if k > 0 and not d:
                ahead = [s for s in by_prompt[key] if len(s.seq) > len(own.seq)] + self.group_done.get(key, [])
                d, src, index, end = self.store.found(prompt, own, k, ahead, key)
                if index is not None:
                    self.follow[rid] = index, end, len(own.seq), src
            out.append(d)
            sources.append(src)
        self.probes = None
        if self.widths is not None and any(out):
            width = self.widths.width([len(d) for d in out], sources)
            if width == 1:  # a plain step: what it draws is compared with the drafts' first tokens (``plain``)
                self.probes = [(d[0], src) if d else None for d, src in zip(out, sources)]
                with self.lock:
                    add_counts(self.counts, {"declined": sum(map(len, out))})
                return [[] for _ in out], [None] * len(out)
            out = [d[:width - 1] for d in out]
        return out, sources

    def _follow(self, rid: str, own: NgramIndex, k: int) -> tuple[list[int], str | None]:
        """The row's draft where every token it emitted since its last draft was found is the text after that
        draft's place (a sibling's, an earlier response's): the text's next ``k`` tokens, with no lookup (and a
        sibling's n-grams left unindexed). ([], None) where the row left that text or came to its end."""
        if (f := self.follow.pop(rid, None)) is None:
            return [], None
        index, at, length, src = f
        at += len(own.seq) - length
        if at < len(index.seq) and index.seq[at - len(own.seq) + length:at] == own.seq[length:]:
            self.follow[rid] = index, at, len(own.seq), src
            return index.seq[at:at + k], src
        return [], None

    def accepted(self, request_ids: Sequence[str], drafts: Sequence[Sequence[int]], accepted: Sequence[int],
                 sources: Sequence[str | None]) -> None:
        """A verification's outcome: each row's next draft length and the counts."""
        lengths = [len(d) for d in drafts]
        counts = {"drafted": sum(lengths), "accepted": sum(accepted)}
        for rid, n, a, src in zip(request_ids, lengths, accepted, sources):
            self.k[rid] = next_draft_length(self.k.get(rid, 1), n, a, self.max_draft)
            if src is not None:
                add_counts(counts, {f"drafted_{src}": n, f"accepted_{src}": a})
                if self.widths is not None:
                    self.widths.outcome(src, n, a)
        with self.lock:
            add_counts(self.counts, counts)

    def plain(self, tokens: Sequence[Sequence[int]], started: float | None) -> None:
        """A plain decoding step's tokens (a token a row), its forward begun at ``started`` (None: a prefill's):
        counted, timed, and, where ``drafts`` declined to verify, each draft's first token kept or not (the same
        event a verification would have seen)."""
        self.forward(len(tokens), len(tokens))
        if started is not None:
            self.timed(len(tokens), time.perf_counter() - started)
        probes, self.probes = self.probes, None
        if probes is not None and self.widths is not None:
            for probe, t in zip(probes, tokens):
                if probe is not None:
                    self.widths.outcome(probe[1], 1, int(t[0] == probe[0]))

    def timed(self, tokens: int, seconds: float) -> None:
        """A decoding or verification forward of ``tokens`` tokens (rows × width) took ``seconds``, its tokens
        drawn and copied to the host."""
        if self.widths is not None:
            self.widths.timed(tokens, seconds)

    def forward(self, rows: int, emitted: int) -> None:
        """A decoding forward over ``rows`` rows that emitted ``emitted`` tokens (a verification or not)."""
        with self.lock:
            add_counts(self.counts, {"row_forwards": rows, "emitted": emitted})

    def finished(self, request_id: str, prompt_ids: Sequence[int], response: Sequence[int], complete: bool) -> None:
        self.k.pop(request_id, None)
        self.follow.pop(request_id, None)
        key, own = self.rows.pop(request_id, None) or (self.store.key(prompt_ids), None)
        if complete:  # (a response cut by a weight update goes on later: its end is kept then)
            own = self._index(own, prompt_ids, response)
            self.store.finished(prompt_ids, own, key)
            if "siblings" in self.store.sources and key in self.group_done:
                self.group_done[key].append(own)

    def remember(self, responses: Iterable[tuple[Sequence[int], Sequence[int]]]) -> int:
        """Earlier responses, (prompt ids, response ids) oldest first, kept as if just finished: history and
        ``recent`` across a resume (``run.resume.restore_drafts``, from the rollout records). Returns how many."""
        if not {"history", "recent"} & set(self.store.sources):
            return 0
        n = 0
        for prompt, response in responses:
            self.store.finished(prompt, self.store.index(prompt, response))
            n += 1
        return n

    def _index(self, own: NgramIndex | None, prompt: Sequence[int], response: Sequence[int]) -> NgramIndex:
        """A row's index (``own``, or a new one) brought up to its whole ``response``."""
        if own is None:
            return self.store.index(prompt, response)
        own.extend(response[len(own.seq) - min(len(prompt), self.store.max_n):])
        return own

    def take(self) -> dict[str, int]:
        """The counts since the last call (``metrics`` makes them the step's ``spec/...`` numbers)."""
        with self.lock:
            c, self.counts = self.counts, {}
        return c


def divide(keys: Sequence) -> list[list[int]]:
    """Seer's divided rollout: the rows (by their prompts' ``keys``) in the parts they decode in, one after the
    other: the first row of each prompt (its lead), then the rest, which draft from their lead's whole response;
    one part where no prompt has two rows."""
    first: dict = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    leads = sorted(first.values())
    rest = [i for i in range(len(keys)) if first[keys[i]] != i]
    return [leads, rest] if rest else [leads]


def add_counts(into: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
    for k, v in counts.items():
        into[k] = into.get(k, 0) + v
    return into


def run_summary(counts: dict[str, int]) -> tuple[dict, str] | None:
    """A run's speculation in its summary.json and a line of its log, from its counts (None: no forward counted)."""
    if not counts.get("row_forwards"):
        return None
    drafted, accepted = counts.get("drafted", 0), counts.get("accepted", 0)
    tpf = counts["emitted"] / counts["row_forwards"]
    kept = f" ({accepted / drafted:.0%})" if drafted else ""
    return ({"drafted": drafted, "accepted": accepted, "declined": counts.get("declined", 0),
             "tokens_per_forward": round(tpf, 3)},
            f"speculative decoding: {tpf:.2f} tokens a forward; {accepted:,} of {drafted:,} draft tokens kept{kept}")


def metrics(counts: dict[str, int]) -> dict[str, float]:
    """A step's ``spec/...`` metrics from its counts: tokens drafted and accepted (and by source), and the tokens
    a row emitted per decoding forward (1 without speculation)."""
    out = {f"spec/{k}": float(v) for k, v in counts.items() if k not in ("row_forwards", "emitted")}
    out.setdefault("spec/drafted", 0.0)
    out.setdefault("spec/accepted", 0.0)
    if counts.get("row_forwards"):
        out["spec/tokens_per_forward"] = counts["emitted"] / counts["row_forwards"]
    return out
