"""The partial buffer: FIFO, JSON round trip with per-token bookkeeping, continuation budgets,
and a real engine continuing a cut-off response to exactly its budget."""

import json

from relayrl.engine.hf import HFEngine
from relayrl.partial import PartialBuffer
from relayrl.records import FinishReason, Group, Prompt, SamplingParams, Trajectory
from relayrl.rollout import continuation, generate_groups


def _group(gid, n_done=1):
    p = Prompt("p-" + gid, [{"role": "user", "content": "Add 1 2"}], "3", {"terms": 2})
    ts = [Trajectory(p, gid, i, [1, 2, 3]) for i in range(3)]
    for t in ts[:n_done]:
        t.response_ids, t.behav_logprobs, t.versions, t.finish_reason = [7, 8], [-0.1, -0.2], [0, 0], FinishReason.STOP
    ts[-1].response_ids, ts[-1].behav_logprobs, ts[-1].versions = [9, 9, 9], [-1.0, -1.5, -2.0], [0, 1, 1]
    ts[-1].finish_reason = FinishReason.ABORTED
    return Group(p, gid, ts)


def test_fifo():
    b = PartialBuffer()
    b.put(_group("a"))
    b.put(_group("b"))
    assert [g.group_id for g in b.take(1)] == ["a"] and len(b) == 1
    assert [g.group_id for g in b.take(5)] == ["b"] and len(b) == 0


def test_state_roundtrip_keeps_tokens_logprobs_versions():
    b = PartialBuffer()
    b.put(_group("a"))
    state = json.loads(json.dumps(b.state_dict()))
    b2 = PartialBuffer()
    b2.load_state_dict(state)
    (g,) = b2.take(1)
    t = g.trajectories[-1]
    assert t.response_ids == [9, 9, 9] and t.behav_logprobs == [-1.0, -1.5, -2.0] and t.versions == [0, 1, 1]
    assert t.finish_reason == FinishReason.ABORTED and not t.done and g.trajectories[0].done
    assert g.prompt.metadata == {"terms": 2}


def test_continuation_uses_remaining_budget():
    t = _group("a").trajectories[-1]
    r = continuation(t, SamplingParams(10, 0.7))
    assert r.params.max_new_tokens == 7 and r.response_so_far == [9, 9, 9] and r.params.temperature == 0.7


def test_engine_continues_only_unfinished_members(tiny):
    model, tok = tiny
    eng = HFEngine(model, tok)
    eng.eos_ids = set()
    try:
        g = _group("a")
        done_before = list(g.trajectories[0].response_ids)
        generate_groups(eng, [g], SamplingParams(10, 1.0))
        assert g.trajectories[0].response_ids == done_before  # finished member untouched
        last = g.trajectories[-1]
        assert len(last.response_ids) == 10 and last.response_ids[:3] == [9, 9, 9]
        assert last.versions[:3] == [0, 1, 1] and len(last.versions) == len(last.behav_logprobs) == 10
        assert last.finish_reason == FinishReason.LENGTH
    finally:
        eng.close()


def test_generate_until_aborts_the_rest_once_enough_groups_complete(tiny):
    from relayrl.rollout import generate_until, make_groups

    model, tok = tiny
    eng = HFEngine(model, tok)
    try:
        prompts = [Prompt(f"p{i}", [{"role": "user", "content": f"Add {i} 1"}], "1") for i in range(4)]
        groups = make_groups(prompts, tok, 2, tag="s0")
        # group 0 can finish fast (budget 2), the others would run to 300 tokens
        eos = tok.eos_token_id
        eng.eos_ids = {eos}
        params = SamplingParams(300, 1.0)
        for t in groups[0].trajectories:
            t.response_ids, t.behav_logprobs, t.versions = [5] * 299, [-1.0] * 299, [0] * 299
        complete, rest = generate_until(eng, groups, params, need=1)
        assert [g.group_id for g in complete][:1] == ["s0.0/p0"]
        assert len(complete) >= 1 and len(rest) == 4 - len(complete)
        cut = [t for g in rest for t in g.trajectories if not t.done]
        assert cut and all(t.finish_reason == FinishReason.ABORTED for t in cut)
        assert all(0 < len(t.response_ids) < 300 for t in cut)
        assert all(len(t.response_ids) == len(t.behav_logprobs) == len(t.versions) for t in cut)
        assert eng.num_pending() == 0
    finally:
        eng.close()


def test_failed_responses_are_dropped_not_scored_or_trained():
    """FAILED generations used to get a reward and a place in the batch."""
    from relayrl.records import FinishReason, Group, Prompt, Trajectory
    from relayrl.rollout import drop_failed

    p = Prompt("p", [])
    reasons = [FinishReason.STOP, FinishReason.FAILED, FinishReason.LENGTH]
    g1 = Group(p, "a", [Trajectory(p, "a", i, [1], [5], [-1.0], [0], r) for i, r in enumerate(reasons)])
    g2 = Group(p, "b", [Trajectory(p, "b", 0, [1], [], [], [], FinishReason.FAILED)])
    kept, dropped = drop_failed([g1, g2])
    assert dropped == 2 and [g.group_id for g in kept] == ["a"]
    assert [t.finish_reason for t in kept[0].trajectories] == [FinishReason.STOP, FinishReason.LENGTH]
