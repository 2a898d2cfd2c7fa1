"""Exact speculative decoding (``engine.speculative``): sequences sampled through drafts follow the policy's
own sampling distribution, computed exactly on a tiny model (a chi-square test over every sequence of three
tokens of a five-token vocabulary), at T = 1, T = 0.7, top-k and top-p, for drafts right, wrong and random;
a lenient acceptance rule (SPEC-RL's) fails the same test; log-probs are the policy's; drafts come from
siblings, earlier responses and the prompt."""

import dataclasses
import itertools
import math

import pytest
import torch

from relayrl.algos.token_sampling import sample_tokens, sampling_scores
from relayrl.records import FinishReason
from relayrl.engine.drafts import DraftStore, NgramIndex
from relayrl.engine.speculative import Speculator, draw_positions, next_draft_length, verify

V, L, STATES = 5, 3, 97


class Tiny:
    """Logits a fixed function of the whole prefix (a hashed state), vectorised over rows."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(STATES, V, generator=g) * 1.5

    @staticmethod
    def step(state, tok):
        return (state * 7 + tok + 1) % STATES

    def logits(self, state):
        return self.table[state]


def exact(model, T, top_k, top_p):
    """P(sequence) for every sequence of L tokens under the sampling distribution."""
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        state, p = torch.tensor([3]), 1.0
        for tok in seq:
            probs = torch.softmax(sampling_scores(model.logits(state), T, top_k, top_p), -1)[0]
            p *= float(probs[tok])
            state = model.step(state, tok)
        out[seq] = p
    return out


def speculative_sample(model, n, T, top_k, top_p, draft_of, rule=verify, gen=None):
    """n sequences of L tokens, every step a verification of a draft of 2 tokens from ``draft_of``
    (vectorised: ``draft_of(seqs, counts, gen)`` gives every live row's draft)."""
    seqs, counts, states = torch.full((n, L), -1), torch.zeros(n, dtype=torch.long), torch.full((n,), 3)
    draw = lambda s: draw_positions(s, T)  # noqa: E731  (the engine's own draw)
    while (live := (counts < L).nonzero().squeeze(1)).numel():
        drafts = draft_of(model, seqs[live], counts[live], gen)  # [rows, 2]
        st, scores = states[live], []
        for j in range(drafts.shape[1] + 1):
            scores.append(sampling_scores(model.logits(st), T, top_k, top_p))
            if j < drafts.shape[1]:
                st = model.step(st, drafts[:, j])
        tokens, _, _ = rule(torch.stack(scores, 1), drafts.tolist(), draw)
        width = max(map(len, tokens))
        emitted = torch.tensor([t + [-1] * (width - len(t)) for t in tokens])
        for j in range(width):
            tok = emitted[:, j]
            go = (tok >= 0) & (counts[live] < L)
            rows = live[go]
            seqs[rows, counts[rows]] = tok[go]
            states[rows] = model.step(states[rows], tok[go])
            counts[rows] += 1
    return [tuple(s) for s in seqs.tolist()]


def chi_square_rejects(samples, probs, z=3.09):
    """Pearson's chi-square over the cells with expected count ≥ 5 (the rest pooled) above its 0.999
    quantile (Wilson–Hilferty)."""
    n = len(samples)
    counts = {s: 0 for s in probs}
    for s in samples:
        counts[s] += 1
    stat, pooled_o, pooled_e, cells = 0.0, 0, 0.0, 0
    for s, p in probs.items():
        if n * p >= 5:
            stat += (counts[s] - n * p) ** 2 / (n * p)
            cells += 1
        else:
            pooled_o, pooled_e = pooled_o + counts[s], pooled_e + n * p
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / max(pooled_e, 1e-9)
        cells += 1
    df = cells - 1
    return stat > df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def always_zero(model, seqs, counts, gen):
    return torch.zeros(len(seqs), 2, dtype=torch.long)


def random_draft(model, seqs, counts, gen):
    return torch.randint(0, V, (len(seqs), 2), generator=gen)


def likely_draft(model, seqs, counts, gen):
    """The greedy continuation of each row: a draft often accepted."""
    state = torch.full((len(seqs),), 3)
    for j in range(L):
        go = j < counts
        state = torch.where(go, model.step(state, seqs[:, j].clamp(min=0)), state)
    out = []
    for _ in range(2):
        t = model.logits(state).argmax(-1)
        out.append(t)
        state = model.step(state, t)
    return torch.stack(out, 1)


@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8)])
def test_sequences_through_drafts_have_the_policy_s_distribution(T, top_k, top_p):
    torch.manual_seed(0)
    model, gen = Tiny(), torch.Generator().manual_seed(1)
    probs = exact(model, T, top_k, top_p)
    for draft in (always_zero, random_draft, likely_draft):
        samples = speculative_sample(model, 40000, T, top_k, top_p, draft, gen=gen)
        assert not chi_square_rejects(samples, probs), (draft, T, top_k, top_p)


def no_residual(scores, drafts, draw):
    """The classic mistake: x accepted with probability p(x), and on rejection a token drawn from p with x
    left in (not the residual)."""
    drafts = torch.tensor(drafts)
    probs, k = torch.softmax(scores, -1), drafts.shape[1]
    p_draft = probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    kept = (torch.rand_like(p_draft) < p_draft).long().cumprod(1).sum(1)
    drawn = draw(scores)
    return [d[:a] + [t[a]] for d, a, t in zip(drafts.tolist(), kept.tolist(), drawn.tolist())], None, kept


def test_an_inexact_acceptance_rule_fails_the_same_test():
    """SPEC-RL's lenience (a draft token kept whenever the policy gives it at least a fifth of the top
    token's probability), or a rejection that draws from p with the draft token left in, biases the
    sequences: the chi-square test sees it."""
    def lenient(scores, drafts, draw):
        drafts, probs = torch.tensor(drafts), torch.softmax(scores, -1)
        p_draft = probs[:, :-1].gather(-1, drafts[..., None]).squeeze(-1)
        kept = (p_draft >= 0.2 * probs[:, :-1].max(-1).values).long().cumprod(1).sum(1)
        drawn = draw(scores)
        tokens = [d[:a] + [t[a]] for d, a, t in zip(drafts.tolist(), kept.tolist(), drawn.tolist())]
        return tokens, None, kept

    torch.manual_seed(0)
    model = Tiny()
    probs = exact(model, 1.0, 0, 1.0)
    for rule in (lenient, no_residual):
        samples = speculative_sample(model, 40000, 1.0, 0, 1.0, likely_draft, rule=rule)
        assert chi_square_rejects(samples, probs), rule


def test_greedy_accepts_exactly_the_argmax_and_seeded_rows_emit_what_plain_decoding_would():
    model = Tiny(3)
    scores = torch.stack([model.logits(torch.tensor([s, s + 1])) for s in (5, 9, 11)], 1)  # [2, 3, V]
    best = scores.argmax(-1)
    drafts = torch.stack([best[:, 0], (best[:, 1] + 1) % V], 1)  # first right, second wrong
    tokens, lps, acc = verify(scores, drafts.tolist(), lambda s: s.argmax(-1))
    assert acc == [1, 1] and tokens == best[:, :2].tolist()
    logp = torch.log_softmax(scores, -1)
    assert torch.allclose(torch.tensor(lps), logp.gather(-1, best[..., None]).squeeze(-1)[:, :2])
    # seeded: the token drawn at each position is the one plain decoding draws there, the draft aside
    seeds, at = torch.tensor([7, 8]), torch.tensor([4, 4])
    plain = [sample_tokens(scores[:, i], seeds, at + i) for i in range(3)]
    drafts = torch.stack([plain[0], plain[1]], 1)

    def draw(s):  # (the engine's seeded draw: each position's own numbers)
        return draw_positions(s, 1.0, seeds, at)

    tokens, _, acc = verify(scores, drafts.tolist(), draw)
    assert acc == [2, 2] and tokens == torch.stack(plain, 1).tolist()  # the bonus too
    tokens, _, acc = verify(scores, [[], drafts[1, :1].tolist()], draw)
    assert acc == [0, 1] and tokens == [[int(plain[0][0])], [int(plain[0][1]), int(plain[1][1])]]


def test_drafts_come_from_siblings_earlier_responses_and_the_prompt():
    ix = NgramIndex([1, 4, 5, 6, 7, 4, 5, 8], min_n=1, max_n=2)
    assert ix.lookup([4, 5], 3) == (2, [8])  # the most recent occurrence
    assert NgramIndex([1, 9, 4, 5, 6, 7, 4, 5, 8], 1, 3).lookup([9, 4, 5], 2) == (3, [6, 7])  # the longest match
    assert NgramIndex([1, 2, 3], 1, 2).lookup([3], 2) == (0, [])  # nothing after it
    ix.extend([9])
    assert ix.lookup([5, 8], 2) == (2, [9])  # extended as the response grows
    store = DraftStore(("siblings", "history", "prompt"), keep=2, max_tokens=12, min_n=1, max_n=3)
    prompt = [10, 11, 12]
    # at a response's first token the prompt's end is the tail: an earlier response is the draft
    store.finished(prompt, store.index(prompt, [20, 21, 22, 23]))
    assert store.draft(prompt, store.index(prompt), 3) == ([20, 21, 22], "history")
    assert store.draft(prompt, store.index(prompt, [20, 21]), 5) == ([22, 23], "history")
    # a sibling that ran ahead gives the longer draft
    ahead = store.index(prompt, [20, 21, 30, 31, 32, 33])
    assert store.draft(prompt, store.index(prompt, [20, 21]), 5, [ahead]) == ([30, 31, 32, 33], "siblings")
    # the row's own context (prompt lookup)
    assert store.draft([1, 2, 3, 4, 7], store.index([1, 2, 3, 4, 7], [2, 3]), 2) == ([4, 7], "prompt")
    # a capped, least-recently-used history: the last 2 responses of a prompt, 12 tokens in all
    store.finished(prompt, store.index(prompt, [24, 25]))
    store.finished(prompt, store.index(prompt, [26, 27]))
    assert store.draft(prompt, store.index(prompt), 3)[0] == [26, 27] and store.tokens == 10
    store.finished([1], store.index([1], [5, 6]))  # 13 tokens: the least recently used prompt goes
    assert store.draft(prompt, store.index(prompt), 3) == ([], None) and store.tokens == 3
    # every prompt's recent responses: another prompt's response drafts the text they share (here from the
    # chat template's end, [11, 12]); 8 tokens kept, the index rebuilt from its last 8 past twice that
    store = DraftStore(["recent"], min_n=1, max_n=3, recent_tokens=8)
    store.finished(prompt, store.index(prompt, [20, 21, 22]))
    assert store.draft([13, 11, 12], store.index([13, 11, 12]), 3) == ([20, 21, 22], "recent")
    assert store.draft([13, 11, 12], store.index([13, 11, 12], [20, 21, 22]), 3) == ([], None)
    store.finished([1, 2, 3], store.index([1, 2, 3], list(range(30, 37))))  # 16 tokens: all kept
    assert store.draft([13, 11, 12], store.index([13, 11, 12]), 2) == ([20, 21], "recent")
    store.finished([4], store.index([4], [40, 41]))  # past 16: the first response forgotten
    assert store.draft([13, 11, 12], store.index([13, 11, 12]), 2) == ([], None) and len(store.recent.seq) == 11
    with pytest.raises(ValueError, match="unknown draft sources"):
        DraftStore(sources=("siblings", "model"))
    assert [next_draft_length(4, 4, 4, 8), next_draft_length(4, 4, 1, 8), next_draft_length(8, 8, 8, 8),
            next_draft_length(4, 0, 0, 8)] == [8, 2, 8, 4]
    # the engine's view: rows of one prompt, their indexes kept as they grow, a finished one in history
    spec = Speculator(max_draft=4)
    d, src = spec.drafts([("a", prompt, [20, 21, 22], 10), ("b", prompt, [20], 10)])
    assert d == [[], [21, 22]] and src == [None, "siblings"]
    spec.finished("a", prompt, [20, 21, 22, 23, 2], True)
    d, src = spec.drafts([("b", prompt, [20, 21], 10), ("c", prompt, [20, 21], 10)])
    # (b kept to the text its draft came from, a's, found as a sibling's: it goes on there, with no lookup; c looks
    # a's response up in history)
    assert d == [[22, 23, 2], [22, 23, 2]] and src == ["siblings", "history"] and spec.follow["b"][0] is spec.follow[
        "c"][0]
    spec.store.history.clear()  # (followed, the text is no lookup's: b goes on in it; where b leaves it, no draft)
    assert spec.drafts([("b", prompt, [20, 21, 22], 10)]) == ([[23, 2]], ["siblings"])
    assert spec.drafts([("b", prompt, [20, 21, 22, 9], 10)]) == ([[]], [None]) and "b" not in spec.follow


def test_a_step_verifies_as_wide_as_its_drafts_pay_for():
    """Widths: the cost line fitted from timed forwards, a source's keep rate, and the width with the most expected
    tokens a second (hand-computed: 2 rows, one with a draft of 2 from a source keeping half its tokens)."""
    from relayrl.engine.speculative import Widths

    w = Widths(warmup=4)
    assert w.width([2, 0], ["history", None]) == 3  # (before the warm-up: every draft whole)
    for tokens in (1, 2, 3, 4, 8):
        w.timed(tokens, 1.0 + 0.1 * tokens)
    t0, t1 = w.line()
    assert abs(t0 - 1.0) < 1e-9 and abs(t1 - 0.1) < 1e-9
    held_up = Widths(warmup=4)  # (a stalled forward counts as 3 predicted: 3 · 1.8 s for 8 tokens, not 100 s)
    for tokens, seconds in ((1, 1.1), (2, 1.2), (3, 1.3), (4, 1.4), (8, 100.0)):
        held_up.timed(tokens, seconds)
    d = held_up.decay
    assert abs(held_up.sums[2] - (d ** 4 * 1.1 + d ** 3 * 1.2 + d * d * 1.3 + d * 1.4 + 5.4)) < 1e-9
    assert w.alpha("history") == 0.5  # (the prior)
    # width 1: 2 tokens / 1.2 s = 1.667; 2: (2 + 0.5) / 1.4 = 1.786; 3: (2 + 0.5 + 0.25) / 1.6 = 1.719
    assert w.width([2, 0], ["history", None]) == 2
    w.outcome("history", 2, 0)
    w.outcome("history", 2, 0)  # α ≈ 1 / (1 + 3) (forgetting 0.5% an outcome): (2 + 0.25) / 1.4 = 1.607 < 1.667
    kept, cut = 0.995 ** 2, 0.995 ** 2 + 0.995 + 1
    assert abs(w.alpha("history") - kept / (kept + cut)) < 1e-12 and w.width([2, 0], ["history", None]) == 1
    flat = Widths(warmup=4)  # (a forward as long whatever it feeds, as on a GPU: the widest)
    for tokens in (1, 2, 3, 4):
        flat.timed(tokens, 1.0)
    assert flat.width([2, 0], ["history", None]) == 3
    # the engine's view: a declined draft's first token compared with what the plain step drew
    spec = Speculator(max_draft=4)
    spec.widths = w  # one row: width 1, 1 / 1.1 s = 0.91; 2: 1.25 / 1.2 = 1.04; 3: 1.31 / 1.3 = 1.01
    prompt = [1, 2, 3]
    spec.finished("a", prompt, [20, 21, 22, 23, 2], True)
    assert spec.drafts([("b", prompt, [20], 10)]) == ([[21]], ["history"])  # (its draft of 4 cut to 1)
    spec.widths = steep = Widths(warmup=4)  # (a forward as long as its tokens: no draft at α = 1/2 pays)
    for tokens in (1, 2, 3, 4):
        steep.timed(tokens, 0.1 * tokens)
    d, src = spec.drafts([("b", prompt, [20], 10)])
    assert d == [[]] and src == [None] and spec.probes == [(21, "history")] and spec.take() == {"declined": 4}
    spec.plain([[21]], None)  # kept: a plain step drew the draft's first token
    assert steep.kept["history"] == [1.0 * 0.995 + 1, 1.0 * 0.995] and spec.probes is None


def _scan(seq, tail, k, lengths=(2, 4, 8)):
    """The lookup by its definition: the longest end of ``tail`` that occurs with a token after it (of the lengths
    an index holds), its most recent occurrence."""
    tail = list(tail)[-max(lengths):]
    for n in [n for n in reversed(lengths) if n <= len(tail)]:
        for end in range(len(seq) - 1, n - 1, -1):  # (seq[end]: the token after the n-gram)
            if seq[end - n:end] == tail[-n:]:
                return n, seq[end:end + k]
    return 0, []


def test_a_lookup_finds_what_a_scan_finds():
    """The index (built in two parts, as a growing response is) answers as a scan of the sequence does."""
    import random

    g = random.Random(0)
    for _ in range(2000):
        seq = [g.randrange(3) for _ in range(g.randrange(0, 40))]
        tail = [g.randrange(3) for _ in range(g.randrange(0, 11))]
        index = NgramIndex(seq[:len(seq) // 2])
        index.extend(seq[len(seq) // 2:])
        assert index.lookup(tail, 3) == _scan(seq, tail, 3), (seq, tail)


def test_a_lead_per_prompt_decodes_first_and_finished_siblings_stay_drafts():
    from relayrl.engine.speculative import divide

    assert divide(["a", "b", "a", "c", "b", "a"]) == [[0, 1, 3], [2, 4, 5]]  # the leads (singletons too), the rest
    assert divide(["a", "b"]) == [[0, 1]] and divide([]) == [[]]
    p, q = [10, 11, 12], [13, 14]
    spec = Speculator(sources=("siblings",), max_draft=4, lead=True)
    assert spec.batch([p, p, q]) == [[0, 2], [1]]
    assert Speculator(sources=("history",), lead=True).batch([p, p]) == [[0, 1]]  # (no siblings: no lead)
    spec.finished("a", p, [20, 21, 22, 23, 2], True)  # the lead ended: its response drafts for its siblings
    spec.finished("c", q, [5, 6], False)  # (a response cut short is not a draft)
    d, src = spec.drafts([("b", p, [20], 10), ("d", q, [5], 10)])
    assert d == [[21, 22, 23, 2], []] and src == ["siblings", None]
    spec.batch([p])  # another batch, of the same prompt: the first one's responses are history's, not siblings
    assert spec.drafts([("b", p, [20], 10)])[1] == [None]


def _requests(tok, n, budget, seed0=None, temp=1.0, top_p=1.0):
    from relayrl.records import GenRequest, SamplingParams

    ids = tok.apply_chat_template([{"role": "user", "content": "Sum mod 10: a=3 b=4"}], add_generation_prompt=True)
    ids = list(ids["input_ids"])
    return [GenRequest(f"r{i}", ids, SamplingParams(budget, temp, top_p, seed=None if seed0 is None else seed0 + i))
            for i in range(n)]


def test_the_engine_emits_what_plain_decoding_does_with_the_policy_s_log_probs(tiny):
    """A seeded request draws the same number at the same position with or without a draft, so the engine with
    speculation returns plain decoding's tokens; each log-prob is the model's own. The same prompts again:
    the earlier responses are drafts accepted whole, several tokens per forward; finish reasons and budgets
    as without."""
    from relayrl.engine.hf import HFEngine
    from relayrl.engine.speculative import Speculator, metrics
    from relayrl.models import token_logprobs

    model, tok = tiny
    plain = HFEngine(model, tok, fast_decode=True)
    spec = Speculator(max_draft=8, choose=False)  # (every draft verified: a width chosen from timed forwards depends
    fast = HFEngine(model, tok, fast_decode=True, speculator=spec)  # on the machine's load; Widths has its own test)
    try:
        for temp, top_p in ((1.0, 1.0), (0.7, 0.9)):
            want = plain.generate(_requests(tok, 6, 40, seed0=100, temp=temp, top_p=top_p))
            for again in (False, True):  # the second time, history has every response
                got = fast.generate(_requests(tok, 6, 40, seed0=100, temp=temp, top_p=top_p))
                for w, g in zip(want, got):
                    assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
                    assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4)
                m = metrics(spec.take())
            # (a row's draft is the earlier response, or a sibling ahead, that matches its last tokens longest)
            assert m["spec/accepted"] > 0.6 * m["spec/drafted"] > 0, m
            assert m["spec/tokens_per_forward"] > 2, m
        # the log-probs are the model's own, from a full forward
        r = _requests(tok, 1, 24, seed0=7)[0]
        c = fast.generate([r])[0]
        ids = torch.tensor([r.prompt_ids + c.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, len(r.prompt_ids) - 1 : -1]
        assert torch.allclose(token_logprobs(logits, ids[:, len(r.prompt_ids):])[0], torch.tensor(c.logprobs),
                              atol=1e-4)
    finally:
        plain.close()
        fast.close()


def test_the_lead_s_response_drafts_for_its_siblings_and_changes_no_token(tiny):
    """Seer's divided rollout: a lead per prompt decodes first; greedy siblings then take its whole response as
    drafts (several tokens a forward), where lockstep siblings draft nothing; seeded sampled rows emit what plain
    decoding does, lead or not."""
    from relayrl.engine.hf import HFEngine
    from relayrl.engine.speculative import Speculator, metrics

    model, tok = tiny
    plain = HFEngine(model, tok, fast_decode=True)
    engines = {lead: HFEngine(model, tok, fast_decode=True,  # (every draft verified, as above)
                              speculator=Speculator(("siblings",), 8, 256, lead=lead, choose=False))
               for lead in (False, True)}
    try:
        for temp in (0.0, 1.0):
            reqs = lambda: _requests(tok, 4, 24, seed0=100, temp=temp) + [  # noqa: E731
                dataclasses.replace(r, request_id=f"q{i}", prompt_ids=r.prompt_ids[:-3])
                for i, r in enumerate(_requests(tok, 3, 24, seed0=200, temp=temp))]
            want = plain.generate(reqs())
            m = {}
            for lead, eng in engines.items():
                got = eng.generate(reqs())
                assert [g.token_ids for g in got] == [w.token_ids for w in want]
                for w, g in zip(want, got):
                    assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4)
                m[lead] = metrics(eng._spec.take())
            assert m[False]["spec/drafted"] == 0, m  # in lockstep no sibling is ahead
            if temp == 0:  # greedy siblings write their lead's response: every draft kept
                assert m[True]["spec/accepted_siblings"] == m[True]["spec/drafted_siblings"] > 0, m
                assert m[True]["spec/tokens_per_forward"] > 1.5, m  # (the leads: one a forward)
        # a sibling aborted while its lead decodes comes back at once, with no token
        eng = engines[True]
        reqs = _requests(tok, 3, 24, seed0=100)
        got = {c.request_id: c for c in eng.generate(reqs, on_complete=lambda c: c.request_id == "r0" and
                                                     eng.abort(["r1"]))}
        assert got["r1"].finish_reason == FinishReason.ABORTED and got["r1"].token_ids == []
        assert got["r2"].finish_reason != FinishReason.ABORTED and got["r2"].token_ids
    finally:
        for eng in (plain, *engines.values()):
            eng.close()


def test_the_model_s_own_forward_turns_speculation_off_with_a_warning(tiny):
    from relayrl.engine.hf import HFEngine
    from relayrl.engine.speculative import Speculator

    model, tok = tiny
    with pytest.warns(UserWarning, match="rollout.speculative: off"):
        eng = HFEngine(model, tok, fast_decode=False, speculator=Speculator())
    try:
        assert eng._spec is None and len(eng.generate(_requests(tok, 2, 8))) == 2
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_a_run_with_speculation_reports_its_drafts_and_keeps_the_alarm_quiet(tmp_path, mode):
    """The demo model (a random one's samples are noise: drafts seldom match) on two prompts, so every step
    meets earlier responses (history); async runs the engine in its own process, whose counts come back. The
    engine's log-probs stay the trainer's (the sampling alarm on)."""
    import json

    from relayrl.config import load_config
    from relayrl.demo.model import demo_model_path
    from relayrl.run.loop import train

    demo = str(demo_model_path(log=lambda *a: None))

    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Sum mod 10: a={i} b=4", "answer": str(i + 4)}) + "\n"
                            for i in range(2)))
    cfg = load_config(None, [f"model.path={demo}", f"run.output_dir={tmp_path}", f"data.path={data}",
                             "data.eval_path=null", "rollout.speculative=on", f"run.mode={mode}", "run.steps=4",
                             "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=24",
                             "rollout.budget=fixed", "rollout.dynamic_sampling=false", "run.progress=false"])
    train(cfg)
    m = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("spec/drafted" in x for x in m)
    # (drafts verified and kept, their counts back from the engine's process; how many tokens a forward emits is left
    # to the width chooser, which times forwards: a busy machine makes it verify fewer drafts, so no test bounds it —
    # a CI run with another test beside it saw 1.01 tokens a forward; the tests with choose=False bound it exactly)
    assert 0 < sum(x["spec/accepted"] for x in m) <= sum(x["spec/drafted"] for x in m)
    mismatch = [x["logprob_mismatch_mean"] for x in m if x.get("logprob_mismatch_mean") is not None]
    assert mismatch and max(mismatch) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_drafts_change_no_token_and_the_log_probs_are_the_model_s(tiny_path):
    """rollout.device=cuda with speculation: the drafts, their verification and every position's draw on the GPU;
    seeded rows emit plain decoding's tokens there too, the second time several tokens a forward, with the log-probs
    of a full forward (to the GPU's float rounding)."""
    from relayrl.engine.hf import HFEngine
    from relayrl.engine.speculative import Speculator, metrics
    from relayrl.models import load_policy, load_tokenizer, token_logprobs

    model, tok = load_policy(tiny_path).eval().to("cuda"), load_tokenizer(tiny_path)
    plain, spec = HFEngine(model, tok, fast_decode=True), Speculator(max_draft=8, choose=False)
    fast = HFEngine(model, tok, fast_decode=True, speculator=spec)
    try:
        want = plain.generate(_requests(tok, 6, 40, seed0=100, temp=0.7, top_p=0.9))
        for again in (False, True):  # the second time, the first time's responses are drafts
            got = fast.generate(_requests(tok, 6, 40, seed0=100, temp=0.7, top_p=0.9))
            assert [g.token_ids for g in got] == [w.token_ids for w in want]
            m = metrics(spec.take())
        assert m["spec/tokens_per_forward"] > 2, m
        r = _requests(tok, 1, 24, seed0=7)[0]
        c = fast.generate([r])[0]
        ids = torch.tensor([r.prompt_ids + c.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, len(r.prompt_ids) - 1 : -1]
        lp = token_logprobs(logits, ids[:, len(r.prompt_ids):])[0].cpu()
        assert torch.allclose(lp, torch.tensor(c.logprobs), atol=1e-3)
    finally:
        plain.close()
        fast.close()
