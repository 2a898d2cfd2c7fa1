"""Engines as Ray actors: the same answers as in-process, weights and versions, and an actor
killed mid-generation is replaced without losing or repeating a token."""

import dataclasses
import os
import time

import pytest
import torch

from relayrl.config import RolloutCfg
from relayrl.records import FinishReason
from tests.test_engine_process import _check_logprobs, _req

ray = pytest.importorskip("ray", reason="Ray is part of the dev extra: pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def local_ray():
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="relayrl-tests")
    yield
    ray.shutdown()


def _spec(path, version=0):
    from relayrl.engine.spec import EngineSpec

    return EngineSpec(RolloutCfg(), path, path, "float32", version=version, threads=1, seed=0, max_model_len=512)


@pytest.mark.slow
def test_ray_engine_generates_loads_weights_and_survives_a_killed_actor(local_ray, tiny, tiny_path):
    from relayrl.engine.ray_engine import RayEngine

    model, tok = tiny
    eng = RayEngine(_spec(tiny_path, version=1), "test-engine-0", max_restarts=2)
    try:
        reqs = [_req(tok, f"r{i}", 12) for i in range(3)]
        for r, c in zip(reqs, eng.generate(reqs)):
            assert set(c.versions) == {1}
            _check_logprobs(model, r, c)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        eng.load_weights(model.state_dict(), 4)
        # long requests, one streaming; the actor is killed while they run
        long = [_req(tok, f"long{i}", 300) for i in range(3)]
        long[0].stream = True
        eng.submit(long)
        pieces, finals = [], {}
        deadline = time.time() + 120

        def collect(until):
            while not until():
                assert time.time() < deadline
                for c in eng.get(timeout=0.5):
                    if c.finish_reason is None:
                        pieces.append(c)
                    else:
                        finals[c.request_id] = c

        collect(lambda: len(pieces) >= 5)  # some tokens of the streaming request have come back
        assert not finals
        ray.kill(ray.get_actor("test-engine-0", namespace="relayrl-tests"))
        collect(lambda: len(finals) == 3)
        assert eng.restarts == 1 and eng.requeued >= 1
        streamed = [t for p in pieces for t in p.token_ids]
        s = finals["long0"]
        assert s.token_ids[:len(streamed)] == streamed  # the retry continued after what had streamed
        for r in long:
            c = finals[r.request_id]
            assert c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions) <= 300
            assert set(c.versions) == {4}  # the new actor was loaded with the current weights
            _check_logprobs(model, r, c)  # every token, before and after the kill, from the current weights
        # the replacement serves new requests, and a later update reaches it
        eng.load_weights(model.state_dict(), 5)
        c = eng.generate([_req(tok, "after", 8)])[0]
        assert set(c.versions) == {5}
    finally:
        eng.close()


def test_a_failing_actor_start_is_a_clear_error(local_ray, tmp_path):
    from relayrl.engine import EngineError
    from relayrl.engine.ray_engine import RayEngine

    with pytest.raises(EngineError, match="engine actor test-bad failed to start"):
        RayEngine(_spec(str(tmp_path / "missing")), "test-bad", start_timeout=120)


def test_engine_resources_no_node_offers_are_one_line_not_a_wait(local_ray, tiny_path):
    """ray.engine_resources that no live node offers: refused before any actor starts, naming what the nodes offer."""
    from relayrl.engine import EngineError
    from relayrl.engine.ray_engine import RayEngine, check_placement

    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"engine actor test-nowhere: the Ray cluster's live nodes hold 0 of the 1 "
                       r"engine\(s\) asking ray.engine_resources=\{'rollout': 1.0\} each \(its nodes: [0-9.]+:\d+: CPU 2"):
        RayEngine(_spec(tiny_path), "test-nowhere", resources={"rollout": 1.0})
    assert time.monotonic() - t0 < 60  # (never a wait for a node: generous, a loaded machine included)
    check_placement({"CPU": 1.0}, 2, "x")  # two actors asking one CPU fit the cluster's two
    with pytest.raises(EngineError, match="hold 2 of the 3 engine"):
        check_placement({"CPU": 1.0}, 3, "run.backend=ray")


def _perturbed(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model.state_dict()


def test_an_update_through_the_collective_reaches_the_actor(local_ray, tiny, tiny_path):
    """rollout.weight_sync=collective: the update broadcast to the actor in buckets (1 MB: several) is the policy it
    samples."""
    from relayrl.engine.ray_engine import RayEngine

    model, tok = tiny
    spec = _spec(tiny_path, version=1)
    eng = RayEngine(dataclasses.replace(spec, rollout=RolloutCfg(weight_sync="collective", sync_bucket_mb=1)), "test-c")
    try:
        assert eng.sync_note == "collective (gloo, 2 ranks, buckets of ≤ 1 MB)"
        eng.load_weights(_perturbed(model), 3)
        r = _req(tok, "c", 8)
        c = eng.generate([r])[0]
        assert set(c.versions) == {3} and isinstance(eng._weights, dict)
        _check_logprobs(model, r, c)
    finally:
        eng.close()


@pytest.mark.slow  # (three actors started)
def test_the_object_store_path_and_auto_where_the_group_cannot_be_formed(local_ray, tiny, tiny_path, monkeypatch):
    """file: Ray's object store; auto: the store where the group cannot be formed, and why; collective: an error."""
    from relayrl.engine.ray_engine import RayEngine

    model, tok = tiny
    spec = _spec(tiny_path, version=1)
    store = RayEngine(dataclasses.replace(spec, rollout=RolloutCfg(weight_sync="file")), "test-f")
    try:
        assert store.sync_note == "Ray's object store (rollout.weight_sync=file)" and store._channel is None
        store.load_weights(_perturbed(model), 4)
        assert not isinstance(store._weights, dict)  # (a reference in Ray's store)
    finally:
        store.close()

    from relayrl.engine import EngineError, weight_sync

    def taken(*a, **k):
        raise RuntimeError("The server socket has failed to listen on any local network address. port 29500 taken")

    # auto through the collective, then the group cannot be formed with a replacement: it gets the update by the store
    later = RayEngine(spec, "test-l")
    try:
        later.load_weights(_perturbed(model), 3)
        assert isinstance(later._weights, dict)
        with monkeypatch.context() as m:
            m.setattr(weight_sync.Channel, "store", staticmethod(taken))
            ray.kill(ray.get_actor("test-l", namespace="relayrl-tests"))
            r = _req(tok, "l", 4)
            c = later.generate([r])[0]
        assert later.restarts == 1 and c.versions == [3] * 4 and not isinstance(later._weights, dict)
        assert later.sync_note.startswith("Ray's object store (rollout.weight_sync=auto: the collective could not")
        _check_logprobs(model, r, c)
    finally:
        later.close()

    monkeypatch.setattr(weight_sync.Channel, "store", staticmethod(taken))
    auto = RayEngine(spec, "test-a")  # (auto, the default: the store where the group cannot be formed, and why)
    try:
        assert auto.sync_note == ("Ray's object store (rollout.weight_sync=auto: the collective could not be formed: "
                                  "The server socket has failed to listen on any local network address. port 29500 taken)")
        auto.load_weights(_perturbed(model), 5)
        assert not isinstance(auto._weights, dict) and auto.generate([_req(tok, "a", 4)])[0].versions == [5] * 4
    finally:
        auto.close()
    with pytest.raises(EngineError, match="engine actor test-x: rollout.weight_sync=collective: the group could not "
                       "be formed: The server socket"):
        RayEngine(dataclasses.replace(spec, rollout=RolloutCfg(weight_sync="collective")), "test-x")


@pytest.mark.slow
@pytest.mark.parametrize("path", ["file", "collective"])
def test_an_actor_killed_mid_update_is_replaced_holding_the_update(local_ray, tiny, tiny_path, path):
    """The update reaches an actor that hangs in it (SIGSTOP), then dies (SIGKILL): ``load_weights`` returns once
    the replacement holds the new weights and version, and what it generates is the new policy's."""
    import signal
    import threading

    from relayrl.engine.ray_engine import RayEngine

    model, tok = tiny
    spec = _spec(tiny_path, version=1)
    spec = dataclasses.replace(spec, rollout=RolloutCfg(weight_sync=path, sync_bucket_mb=1, sync_timeout_s=30))
    eng = RayEngine(spec, f"test-engine-u-{path}", max_restarts=2)
    try:
        eng.load_weights(_perturbed(model), 2)  # (the collective formed)
        pid = ray.get(ray.get_actor(f"test-engine-u-{path}", namespace="relayrl-tests").pid.remote())
        os.kill(pid, signal.SIGSTOP)
        update = threading.Thread(target=eng.load_weights, args=(_perturbed(model), 3), daemon=True)
        update.start()
        update.join(2.0)
        assert update.is_alive()  # the update is in flight, the actor stopped in it
        os.kill(pid, signal.SIGKILL)
        update.join(180)
        assert not update.is_alive() and eng.restarts == 1 and eng.version == 3
        r = _req(tok, "after", 8)
        c = eng.generate([r])[0]
        assert set(c.versions) == {3}
        _check_logprobs(model, r, c)  # the replacement's weights are the update's
    finally:
        eng.close()


@pytest.mark.slow
def test_pause_holds_across_a_restart(local_ray, tiny, tiny_path):
    """A restart while the rollout is paused leaves the new actor paused: what was in flight
    waits for the resume."""
    from relayrl.engine.ray_engine import RayEngine

    _, tok = tiny
    eng = RayEngine(_spec(tiny_path), "test-engine-p")
    try:
        with eng.pause():
            eng.submit([_req(tok, "waits", 8)])
            ray.kill(ray.get_actor("test-engine-p", namespace="relayrl-tests"))
            deadline = time.time() + 120
            while eng.restarts == 0:
                assert time.time() < deadline
                assert eng.get(timeout=0.5) == []
            assert eng.get(timeout=2.0) == []  # paused: nothing is generated
        (c,) = list(eng.drain(timeout=60))
        assert c.request_id == "waits" and c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    finally:
        eng.close()


def test_an_actor_s_drafts_and_their_counts(local_ray, tiny, tiny_path):
    """rollout.speculative in an actor: an earlier response given to it (a resume's) drafts for the prompt's next
    response, and its spec/... counts come back to the trainer's side."""
    import dataclasses

    from relayrl.engine.hf import HFEngine
    from relayrl.engine.ray_engine import RayEngine
    from relayrl.engine.spec import EngineSpec

    model, tok = tiny
    req = _req(tok, "r", 8)
    req = dataclasses.replace(req, params=dataclasses.replace(req.params, temperature=0.0))
    local = HFEngine(model, tok)
    try:
        (greedy,) = local.generate([req])  # (what the actor will decode: its drafts are kept whole)
    finally:
        local.close()
    spec = EngineSpec(RolloutCfg(speculative="on"), tiny_path, tiny_path, "float32", threads=1, seed=0,
                      max_model_len=512)
    eng = RayEngine(spec, "test-engine-s")
    try:
        assert eng.remember([(req.prompt_ids, greedy.token_ids)]) == 1
        (c,) = eng.generate([req])
        counts = eng.take_spec()
        assert c.token_ids == greedy.token_ids and counts["accepted_history"] > 0 and counts["row_forwards"] > 0
        assert eng.take_spec() == {}  # (since the last call)
    finally:
        eng.close()


def test_reward_workers_in_a_ray_actor(local_ray):
    """run.backend=ray's verifier pool: scores as locally, failures counted on this side, a bad
    reward.fn the same error as locally; a lost actor stops the run naming it (an EngineError), never the user's
    verifier failing."""
    from relayrl.engine import EngineError
    from relayrl.run.ray_pools import RayRewardRunner

    runner = RayRewardRunner("tests.rewards_for_tests:flaky", timeout_s=5.0, workers=1)
    try:
        out = runner.score([("abc", None, {}), ("abcd", None, {}), ("", None, {})])
        assert out[1] == (0.5, None) and [out[0][1]["kind"], out[2][1]["kind"]] == ["reward", "reward"]
        assert runner.stats.failures == 2 and "flaky verifier" in runner.stats.last_error
        ray.kill(runner._actor)
        with pytest.raises(EngineError, match=r"the verifier pool's Ray actor \(tests.rewards_for_tests:flaky\) was "
                           "lost: .*ActorDiedError"):
            runner.score([("abc", None, {})])
    finally:
        runner.close()
    with pytest.raises(ValueError, match="no_such_module"):
        RayRewardRunner("no_such_module:fn", workers=1)


def test_python_tool_workers_in_a_ray_actor(local_ray):
    """run.backend=ray's python tool (env.name=python): the code runs under the actor's worker pool,
    not this process's, with the local tool's text; a lost actor reads as a sandbox failure."""
    from relayrl.envs import python_tool
    from relayrl.run.ray_pools import RayPythonTool

    tool = RayPythonTool(timeout_s=5.0, workers=1, sandbox="none")
    try:
        ancestors = ("import os\npid, seen = os.getpid(), []\nwhile pid > 1:\n"
                     "    pid = int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1]); seen.append(pid)\n"
                     "print(seen)")
        chain = eval(tool(ancestors))
        actor = ray.get(tool._actor.pid.remote())
        assert actor != os.getpid() and actor in chain  # the actor's pool ran it
        assert "timed out after 1.0 s" in tool("while True: pass", timeout_s=1.0)
        python_tool.use_default(lambda: tool)  # what the pipeline installs for env.name=python
        assert python_tool.python("print(6 * 7)") == "42\n"
        ray.kill(tool._actor)
        assert "the sandbox failed: its Ray actor was lost" in tool("print(1)")
    finally:
        python_tool.use_default()
    with pytest.raises(RuntimeError, match="could not start its workers: .*memory_mb"):
        RayPythonTool(memory_mb=1)
