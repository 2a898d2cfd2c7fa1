"""Partial responses: carried groups survive a JSON round trip with per-token bookkeeping, a real
engine continues a carried response to exactly its budget without touching finished members,
and a hold cuts responses at a token boundary and continues them after release."""

import json
import time

from relayrl.engine.hf import HFEngine
from relayrl.rollout.runner import EpisodeRunner
from relayrl.records import FinishReason, Group, Prompt, SamplingParams, Trajectory, group_from_dict, group_to_dict
from relayrl.rollout.groups import make_groups


def _group(gid, n_done=1):
    p = Prompt("p-" + gid, [{"role": "user", "content": "Add 1 2"}], "3", {"terms": 2})
    ts = [Trajectory(p, gid, i, [1, 2, 3]) for i in range(3)]
    for t in ts[:n_done]:
        t.response_ids, t.behav_logprobs, t.versions, t.finish_reason = [7, 8], [-0.1, -0.2], [0, 0], FinishReason.STOP
        t.complete, t.reward = True, 1.0
    ts[-1].response_ids, ts[-1].behav_logprobs, ts[-1].versions = [9, 9, 9], [-1.0, -1.5, -2.0], [0, 1, 1]
    ts[-1].finish_reason = FinishReason.ABORTED
    return Group(p, gid, ts)


def _runner(eng, tok):
    return EpisodeRunner(eng, tok, None, None, lambda text, prompt: (0.5, False))


def test_state_roundtrip_keeps_tokens_logprobs_versions():
    g = group_from_dict(json.loads(json.dumps(group_to_dict(_group("a")))))
    t = g.trajectories[-1]
    assert t.response_ids == [9, 9, 9] and t.behav_logprobs == [-1.0, -1.5, -2.0] and t.versions == [0, 1, 1]
    assert t.finish_reason == FinishReason.ABORTED and not t.done and not t.complete
    assert g.trajectories[0].done and g.trajectories[0].complete and g.trajectories[0].reward == 1.0
    assert g.prompt.metadata == {"terms": 2}


def test_engine_continues_only_unfinished_members(tiny):
    model, tok = tiny
    eng = HFEngine(model, tok)
    eng.eos_ids = set()
    runner = _runner(eng, tok)
    try:
        g = _group("a")
        done_before = list(g.trajectories[0].response_ids)
        runner.run(runner.group(g, SamplingParams(10, 1.0)))
        assert g.trajectories[0].response_ids == done_before and g.trajectories[0].reward == 1.0  # untouched
        last = g.trajectories[-1]
        assert len(last.response_ids) == 10 and last.response_ids[:3] == [9, 9, 9]
        assert last.versions[:3] == [0, 1, 1] and len(last.versions) == len(last.behav_logprobs) == 10
        assert last.finish_reason == FinishReason.LENGTH and last.complete and last.reward == 0.5
    finally:
        runner.close()
        eng.close()


def test_hold_cuts_at_a_token_boundary_and_release_continues(tiny):
    N = 400  # tokens per response: long enough to be cut part-way
    model, tok = tiny
    eng = HFEngine(model, tok)
    eng.eos_ids = set()
    runner = _runner(eng, tok)
    try:
        prompts = [Prompt(f"p{i}", [{"role": "user", "content": f"Add {i} 1"}], "1") for i in range(3)]
        groups = make_groups(prompts, tok, 2, tag="s0")

        async def all_groups():
            import asyncio
            return await asyncio.gather(*(runner.group(g, SamplingParams(N, 1.0)) for g in groups))

        fut = runner.submit(all_groups())
        deadline = time.time() + 30
        while not eng._busy:  # decoding has started: cut it a few tokens in
            assert time.time() < deadline
            time.sleep(0.001)
        time.sleep(0.02)
        runner.hold()
        trajs = [t for g in groups for t in g.trajectories]
        assert not runner.inflight and eng.num_pending() == 0
        cut = {t.request_id: list(t.response_ids) for t in trajs}
        assert any(0 < len(x) < N for x in cut.values())
        assert all(t.finish_reason == FinishReason.ABORTED for t in trajs if len(t.response_ids) < N)
        time.sleep(0.2)
        assert {t.request_id: t.response_ids for t in trajs} == cut  # nothing generated while held
        runner.release()
        fut.result(timeout=120)
        for t in trajs:
            assert len(t.response_ids) == N and t.response_ids[: len(cut[t.request_id])] == cut[t.request_id]
            assert len(t.versions) == len(t.behav_logprobs) == N and t.complete
        assert runner.continued > 0
    finally:
        runner.close()
        eng.close()


def test_failed_responses_are_dropped_not_scored_or_trained():
    """FAILED generations used to get a reward and a place in the batch."""
    from relayrl.records import FinishReason, Group, Prompt, Trajectory
    from relayrl.rollout.groups import drop_failed

    p = Prompt("p", [])
    reasons = [FinishReason.STOP, FinishReason.FAILED, FinishReason.LENGTH]
    g1 = Group(p, "a", [Trajectory(p, "a", i, [1], [5], [-1.0], [0], r) for i, r in enumerate(reasons)])
    g2 = Group(p, "b", [Trajectory(p, "b", 0, [1], [], [], [], FinishReason.FAILED)])
    kept, dropped = drop_failed([g1, g2])
    assert dropped == 2 and [g.group_id for g in kept] == ["a"]
    assert [t.finish_reason for t in kept[0].trajectories] == [FinishReason.STOP, FinishReason.LENGTH]
