"""Many engines behind one router: least-loaded placement, an episode's turns on one engine,
aborts reach the right engine, and a weight update reaches every engine before any resumes."""

import contextlib

import pytest
import torch

from relayrl.engine.base import Engine
from relayrl.engine.hf import HFEngine
from relayrl.engine.router import EngineRouter
from relayrl.records import Completion, FinishReason, GenRequest, SamplingParams
from tests.test_engine_process import _check_logprobs, _req


class _Recorder(Engine):
    """Answers every request at once with one token; records pauses and loads in one shared log."""

    def __init__(self, name, log):
        self.name, self.log, self._v, self._done, self.got = name, log, 0, [], []

    version = property(lambda self: self._v)

    def submit(self, requests):
        self.got += [r.request_id for r in requests]
        self._done += [Completion(r.request_id, [7], [-0.5], [self._v], FinishReason.STOP) for r in requests]

    def get(self, timeout=None):
        out, self._done = self._done, []
        return out

    def abort(self, ids):
        self.log.append((self.name, "abort", tuple(ids)))

    @contextlib.contextmanager
    def pause(self):
        self.log.append((self.name, "pause"))
        yield
        self.log.append((self.name, "resume"))

    @contextlib.contextmanager
    def asleep(self):
        self.log.append((self.name, "sleep"))
        yield
        self.log.append((self.name, "wake"))

    def load_weights(self, sd, version):
        self.log.append((self.name, "load", version))
        self._v = version

    def num_pending(self):
        return 0


def test_every_engine_sleeps_while_the_trainer_steps():
    log = []
    router = EngineRouter([_Recorder("a", log), _Recorder("b", log)])
    try:
        with router.asleep():
            assert sorted(log) == [("a", "sleep"), ("b", "sleep")]
        assert sorted(log[2:]) == [("a", "wake"), ("b", "wake")]
    finally:
        router.close()


def test_weights_reach_every_engine_before_any_resumes():
    log = []
    router = EngineRouter([_Recorder("a", log), _Recorder("b", log)])
    try:
        router.load_weights({}, 3)
        loads = [i for i, e in enumerate(log) if e[1] == "load"]
        resumes = [i for i, e in enumerate(log) if e[1] == "resume"]
        assert len(loads) == 2 and max(loads) < min(resumes)
        assert router.version == 3 and all(e.version == 3 for e in router.engines)
    finally:
        router.close()


def test_least_loaded_placement_and_episode_affinity():
    log = []
    a, b = _Recorder("a", log), _Recorder("b", log)
    router = EngineRouter([a, b])
    try:
        p = SamplingParams(4)
        router.submit([GenRequest(f"ep{i}#0", [1, 2], p) for i in range(4)])
        assert sorted(a.got + b.got) == [f"ep{i}#0" for i in range(4)] and len(a.got) == len(b.got) == 2
        first = {rid.split("#")[0]: ("a" if rid in a.got else "b") for rid in a.got + b.got}
        # the engine with fewer pending requests takes the next new episode
        router.submit([GenRequest("new#0", [1], p)])
        assert router.loads() in ([3, 2], [2, 3])
        done = {c.request_id for c in router.drain()}
        assert done == {f"ep{i}#0" for i in range(4)} | {"new#0"} and router.num_pending() == 0
        # later turns of each episode go to the engine that served its first (its prefix cache)
        router.submit([GenRequest(f"ep{i}#1", [1, 2, 7, 3], p) for i in range(4)])
        for i in range(4):
            assert (f"ep{i}#1" in a.got) == (first[f"ep{i}"] == "a")
        list(router.drain())
        router.submit([GenRequest("ep0#2", [1], p)])
        router.abort(["ep0#2", "unknown"])
        owner = first["ep0"]
        assert (owner, "abort", ("ep0#2",)) in log and not any(e[1] == "abort" and e[0] != owner for e in log)
    finally:
        router.close()


@pytest.mark.slow
def test_router_over_two_hf_engines(tiny):
    """Real engines: completions come back from both, log-probs match the model, versions move together."""
    model, tok = tiny
    engines = [HFEngine(model, tok, version=1), HFEngine(type(model)(model.config).eval(), tok, version=1)]
    engines[1].model.load_state_dict(model.state_dict())
    router = EngineRouter(engines)
    try:
        reqs = [_req(tok, f"e{i}#0", 10) for i in range(6)]
        for r, c in zip(reqs, router.generate(reqs)):
            assert set(c.versions) == {1}
            _check_logprobs(model, r, c)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        router.load_weights(model.state_dict(), 2)
        reqs = [_req(tok, f"f{i}#0", 10) for i in range(4)]
        for r, c in zip(reqs, router.generate(reqs)):
            assert set(c.versions) == {2}
            _check_logprobs(model, r, c)
    finally:
        router.close()
