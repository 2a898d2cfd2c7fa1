"""Mixture-of-experts policies (``models.moe``): the engine records the experts each token went to, the trainer's
forwards replay them (algo.routing_replay=r3), the router still learns, and ``moe/routing_diff`` says how often
engine and trainer route apart. The situation that matters: a bfloat16 engine and a float32 trainer."""

import copy
import json

import pytest
import torch

from relayrl.config import AlgoCfg, TrainerCfg, load_config
from relayrl.demo import model as demo_model
from relayrl.engine.hf import HFEngine
from relayrl.models import moe
from relayrl.records import GenRequest, Group, Prompt, SamplingParams, Trajectory, group_from_dict, group_to_dict
from relayrl.train.batch import build_batch
from relayrl.train.packing import Packed
from relayrl.train.trainer import Trainer
from tests.families import build
from tests.test_chat_template import chatml_tokenizer  # noqa: F401 - a fixture

REPLAYED = ["qwen3_moe", "mixtral", "granitemoe", "gpt_oss", "deepseek_v3"]


@pytest.fixture(scope="module")
def tok():
    return demo_model.build_tokenizer(demo_model.RECIPE["seed"], 300)


def _moe(family, tok, experts=4.0, gate=0.3):
    """``family``'s tiny model with its experts' weights scaled up and its routers' down: near ties between experts
    (which a rounding flips) that change the output when flipped, as in a large model's many layers."""
    model = build(family, tok, head_scale=1.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.mul_(experts)
            elif name.endswith(("gate.weight", "router.weight")):
                p.mul_(gate)
    return model


def _sampled(model, tok, rows=16, dtype=torch.bfloat16):
    """Trajectories sampled by an engine holding ``model`` in ``dtype``, with the routes it recorded."""
    engine = HFEngine(copy.deepcopy(model).to(dtype), tok)
    try:
        g = torch.Generator().manual_seed(1)
        reqs = [GenRequest(f"r{i}", torch.randint(3, len(tok), (12,), generator=g).tolist(),
                           SamplingParams(24, 1.0, seed=i)) for i in range(rows)]
        done = engine.generate(reqs)
    finally:
        engine.close()
    return [Trajectory(Prompt(f"p{i}", []), "g", 0, r.prompt_ids, list(c.token_ids), list(c.logprobs),
                       list(c.versions), c.finish_reason, routes=moe.extend(None, c.routes)) for i, (r, c) in enumerate(zip(reqs, done))]


def _mismatch(model, trajs, tok, replay):
    batch = build_batch(trajs, torch.zeros(len(trajs)), tok.pad_token_id)
    tr = Trainer(model, TrainerCfg(), AlgoCfg(routing_replay=replay, kl_coef=0), 1.0, 10, 16)
    lp = tr.logprobs(batch)
    return float(((lp - batch.behav_logp).abs() * batch.loss_mask).sum() / batch.loss_mask.sum()), tr, batch


@pytest.mark.parametrize("family", REPLAYED)
def test_replaying_a_forwards_own_routes_changes_nothing_and_other_routes_change_it(family, tok):
    """Each family's weight formula: the routes a forward chose, replayed, give its logits exactly; other routes
    give other logits (the replay is used); a gradient reaches the router through the recomputed weights."""
    model = _moe(family, tok)
    ids = torch.randint(3, len(tok), (3, 10), generator=torch.Generator().manual_seed(0))
    rec = moe.Recorder(model)
    with torch.no_grad(), rec.capture():
        want = model(input_ids=ids).logits
    routes = rec.routes()
    layers, k = moe.shape(model)
    assert routes.shape == (30, layers, k) and routes.dtype == torch.uint8
    rp = moe.Replayer(model, replace=True)
    rp.use(routes)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, want, atol=1e-6)
    assert rp.stats.take()["moe/routing_diff"] == 0
    other = (routes.long() + 1) % int(moe.routers(model)[0][0].weight.shape[0])
    rp.use(other.to(torch.uint8))
    model.train()
    out = model(input_ids=ids).logits
    assert not torch.allclose(out, want, atol=1e-3)
    assert rp.stats.take()["moe/routing_diff"] == 1.0  # (every token's recorded set is not what it routes to live)
    out.square().mean().backward()
    grads = [p.grad for r, _ in moe.routers(model) for p in r.parameters() if p.dim() == 2]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    rp.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_bfloat16_engine_and_a_float32_trainer_route_apart_and_replay_brings_them_together(family, tok):
    """Without replay some tokens' experts differ between engine and trainer and the log-probs part by more;
    with r3 the trainer routes every token as the engine did (recorded again inside its forward) and the
    mismatch falls (measured: qwen3_moe 1.04e-3 -> 0.72e-3, mixtral 2.84e-3 -> 0.87e-3)."""
    model = _moe(family, tok)
    trajs = _sampled(model, tok)
    assert all(t.routes.shape[0] == len(t.prompt_ids) + len(t.response_ids) - 1 for t in trajs)
    off, tr_off, batch = _mismatch(model, trajs, tok, "off")
    diff_off = tr_off.fwd.route_stats(batch)["moe/routing_diff"]
    tr_off.close()
    on, tr, batch = _mismatch(copy.deepcopy(model), trajs, tok, "r3")
    # (measured live, without the replay, on the batch's rows: the same share)
    assert diff_off > 0 and tr.fwd.route_stats(batch, rows=batch.size)["moe/routing_diff"] == pytest.approx(diff_off)
    assert on < 0.8 * off, (off, on)
    # what the trainer's forward routed by, recorded after the replay's hook: the engine's routes, wherever recorded
    rec = moe.Recorder(tr.model)
    for i in range(4):  # (a row at a time: one forward each, as recorded)
        mb = batch.select([i])
        with rec.capture():
            tr.fwd.logprobs(mb)
        got = rec.routes()
        got = Packed(mb.attention_mask).unflat(got[None]) if tr.tcfg.pack else got.view(*mb.routes.shape)
        has = mb.routes[..., 0, 0] != moe.NO_ROUTE
        assert has.sum() > 20
        assert torch.equal(got[has].sort(-1).values, mb.routes[has].sort(-1).values)
    tr.close()


def test_routes_go_through_a_checkpoint_and_a_continued_response_keeps_the_routes_it_had(tok):
    """A held group's routes survive the partial-rollout buffer's JSON; a continued response appends only the
    positions beyond what it recorded (its earlier tokens replay what they were sampled with)."""
    model = _moe("qwen3_moe", tok)
    t = _sampled(model, tok, rows=1)[0]
    back = group_from_dict(json.loads(json.dumps(group_to_dict(Group(t.prompt, "g", [t])))))
    assert torch.equal(back.trajectories[0].routes, t.routes)
    later = torch.full((t.routes.shape[0] + 5, *t.routes.shape[1:]), 7, dtype=torch.uint8)
    grown = moe.extend(t.routes, later)
    assert torch.equal(grown[: len(t.routes)], t.routes) and (grown[len(t.routes):] == 7).all()
    assert len(grown) == len(later)
    with pytest.raises(moe.MoEError, match="routes of shape"):
        moe.routes_tensor([t], 40, 5, 2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"], ids=["sync", "async-engine-process"])
def test_a_run_on_a_mixture_of_experts_replays_routes_and_reports_them(tok, tmp_path, mode):
    """``relayrl train`` on a tiny qwen3_moe (its engine in bfloat16) with algo.routing_replay=r3: every step
    writes moe/routing_diff; async: the routes come from an engine process (as bytes, not shared tensors)."""
    from relayrl.run.loop import train
    from tests.test_e2e import EASY

    path = tmp_path / "moe"
    _moe("qwen3_moe", tok).save_pretrained(path)
    tok.save_pretrained(path)
    cfg = load_config(None, [*EASY, f"model.path={path}", f"run.output_dir={tmp_path}", "run.steps=3",
                             "rollout.dtype=bfloat16", "algo.routing_replay=r3", f"run.mode={mode}"])
    train(cfg)
    m = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    # (measured on rows the current weights sampled: async's stale rows, routed apart by the policy's own drift at
    # this lr, are not an engine mismatch; a step with none reports nothing)
    assert len(m) == 3 and "moe/routing_diff" in m[0]
    assert all(0 <= x["moe/routing_diff"] < 0.05 for x in m if "moe/routing_diff" in x)
    assert all(x["grad_norm"] > 0 for x in m)


def test_a_router_relayrl_has_no_recipe_for_is_named(tok):
    model = build("qwen3_moe", tok)
    gate = model.model.layers[0].mlp.gate
    gate.__class__ = type("OddTopKRouter", (type(gate),), {})  # (a family whose weight formula relayrl does not know)
    assert moe.is_moe(model) and not moe.replayable(model)
    with pytest.raises(moe.MoEError, match="OddTopKRouter .*layers.0.mlp.gate.* no recipe"):
        Trainer(model, TrainerCfg(), AlgoCfg(routing_replay="r3", kl_coef=0), 1.0, 10, 16)


def test_vllm_on_this_cpu_cannot_return_routes_and_says_what_to_use(tmp_path):
    """vLLM 0.32 returns routed experts from its Model Runner V2 only, which needs Triton on a GPU (found here:
    its CPU build loads qwen3_moe and samples it, but refuses enable_return_routed_experts)."""
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("a GPU: vLLM can return routes here")
    from relayrl.engine.base import EngineError
    from relayrl.engine.vllm import VLLMEngine

    with pytest.raises(EngineError, match="routing_replay=r3 with rollout.engine=vllm.*rollout.engine=hf"):
        VLLMEngine(str(tmp_path), [1], routes=True)


def test_a_lora_adapter_on_a_mixture_of_experts_adapts_attention_and_the_replay_reaches_its_routers(tok):
    """model.lora.targets=all-linear on qwen3_moe: the attention's projections (the experts are fused 3-D tensors
    and the routers plain weights, not linear layers: both stay the base's); the trainer replays the routes through
    PEFT's wrapper, and the adapter gets a gradient."""
    from relayrl.config.sections import LoraCfg
    from relayrl.train import lora

    model = _moe("qwen3_moe", tok)
    trajs = _sampled(model, tok, rows=4)
    wrapped, spec = lora.wrap(model, LoraCfg(r=4))
    assert set(spec.targets) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    batch = build_batch(trajs, torch.ones(len(trajs)), tok.pad_token_id)
    tr = Trainer(wrapped, TrainerCfg(), AlgoCfg(routing_replay="r3", kl_coef=0), 1.0, 10, 16)
    m = tr.step(batch)
    assert "moe/routing_diff" in m and m["grad_norm"] > 0
    assert all(p.grad is None or not p.requires_grad for n, p in wrapped.named_parameters() if "lora" not in n)
    tr.close()


def test_the_load_balancing_loss_by_hand():
    """E · Σ_e f_e · P_e: two tokens, two experts, top-1. Router probabilities (0.75, 0.25) for both; both sent to
    expert 0: f = (1, 0), P = (0.75, 0.25): 2 · 0.75 = 1.5. One to each: f = (0.5, 0.5): 2 · 0.5 = 1.0."""
    logits = torch.tensor([[torch.log(torch.tensor(3.0)), 0.0]] * 2)
    assert moe.aux_loss({0: (logits, torch.tensor([[0], [0]]))}).item() == pytest.approx(1.5)
    assert moe.aux_loss({0: (logits, torch.tensor([[0], [1]]))}).item() == pytest.approx(1.0)
    # two layers: their mean
    both = {0: (logits, torch.tensor([[0], [0]])), 1: (logits, torch.tensor([[0], [1]]))}
    assert moe.aux_loss(both).item() == pytest.approx(1.25)


def test_the_routers_aux_loss_when_asked_moves_the_routers(tok):
    """algo.router_aux_coef > 0: the step reports moe/aux_loss and the routers get its gradient (off, the default:
    no such term)."""
    model = _moe("qwen3_moe", tok)
    trajs = _sampled(model, tok, rows=4)
    batch = build_batch(trajs, torch.zeros(len(trajs)), tok.pad_token_id)  # (zero advantages: no policy gradient)
    for coef in (0.0, 0.5):
        m = copy.deepcopy(model)
        tr = Trainer(m, TrainerCfg(), AlgoCfg(routing_replay="r3", kl_coef=0, router_aux_coef=coef), 1.0, 10, 16)
        out = tr.step(batch)
        moved = any(not torch.equal(a, b) for (n, a), b in zip(m.named_parameters(), model.parameters())
                    if n.endswith("gate.weight"))
        assert ("moe/aux_loss" in out) == bool(coef) and moved == bool(coef), (coef, out.get("moe/aux_loss"))
        tr.close()


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")  # (_capture_grads)
@pytest.mark.slow
def test_two_fsdp_ranks_replay_routes_as_one_process_does(tok, tmp_path):
    """trainer.fsdp=true on a mixture of experts with r3: each rank replays its micro-batches' routes, the routing
    diff's live forward runs on every rank; loss, metrics, gradient and weights of two gloo ranks = one process's."""
    from tests.test_distributed import _close, _run, _sharded, _trainer

    path = tmp_path / "moe"
    model = _moe("qwen3_moe", tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    batch = build_batch(_sampled(model, tok, rows=8), torch.linspace(-1, 1, 8), tok.pad_token_id)
    tkw = {"lr": 1e-2, "warmup_steps": 0, "micro_batch_tokens": 60, "logprob_chunk_tokens": 0}
    akw = {"routing_replay": "r3", "kl_coef": 0.1}
    torch.manual_seed(0)
    ref = _run(lambda weights=None: _trainer(str(path), {**tkw, "share_prefix": False}, akw, "float32", weights,
                                             device="cpu"), [(batch, 0)])
    got = _sharded(str(path), {"r3": (tkw, akw, "float32", [(batch, 0)], 0)}, tmp_path)["r3"]
    assert "moe/routing_diff" in ref["metrics"][0] and ref["metrics"][0]["kl"] >= 0
    assert any(".mlp.gate." in k and g.abs().sum() > 0 for k, g in ref["grads"][0].items())  # the routers learn
    _close(got["metrics"], ref["metrics"], "metrics", 1e-4, 1e-6)
    _close(got["grads"], ref["grads"], "grads", 1e-4, 1e-6)
    # (the experts' gradients agree to 1e-6, summed in another order; Adam's first step moves a weight by
    # lr·g/(|g|+eps): an element whose gradient is near 0 moves by anything up to lr, decided by the order of the
    # sum — 2.5e-5 apart measured when the run's thread count differed, the suite on two processes. Where the
    # gradient is not near 0 the step is lr·sign(g), the same on both sides: there the weights agree to 1e-5.)
    for k, w in ref["weights"].items():
        g, diff = ref["grads"][0].get(k), (got["weights"][k].float() - w.float()).abs()
        assert diff.max() <= 1.01 * tkw["lr"], k  # no weight moved further than Adam's first step can
        firm = g.abs() > 1e-4 if g is not None else torch.ones_like(diff, dtype=torch.bool)
        assert not firm.any() or diff[firm].max() < 1e-5, (k, diff[firm].max())


def test_a_multi_turn_episode_keeps_a_route_for_every_token_it_fed_and_replays_them(chatml_tokenizer):
    """Two turns with an observation between them (not trained): the engine fed the observation's tokens at the
    second turn, so every position of the trajectory has its route, and replaying them gives the engine's log-probs."""
    from relayrl.envs.base import Env, StepResult
    from relayrl.records import FinishReason
    from relayrl.rollout.runner import EpisodeLimits, EpisodeRunner

    class TwoTurns(Env):
        def __init__(self):
            self.turns = 0

        async def step(self, text):
            self.turns += 1
            if self.turns == 1:
                return StepResult([{"role": "user", "content": "go on"}])
            return StepResult(reward=1.0, done=True)

    tok = chatml_tokenizer
    model = _moe("qwen3_moe", tok)
    stops = list(range(0, len(tok), 3))  # (a random model's turns end within a few tokens)
    runner = EpisodeRunner(HFEngine(copy.deepcopy(model), tok, eos_token_ids=stops), tok, TwoTurns,
                           EpisodeLimits(2, 200), lambda text, prompt: (0.0, None), eos_ids=stops)
    try:
        p = Prompt("p", [{"role": "user", "content": "hello"}])
        t = Trajectory(p, "g", 0, [])
        runner.run(runner.episode(t, SamplingParams(12, 1.0, seed=3)))
    finally:
        runner.close()
    assert t.failure is None and t.info["turns"] == 2 and 0 in t.mask and t.finish_reason != FinishReason.FAILED
    routes = torch.as_tensor(t.routes)
    assert routes.shape[0] == len(t.prompt_ids) + len(t.response_ids) - 1  # every token fed forward
    assert (routes != moe.NO_ROUTE).all()
    mismatch, _, _ = _mismatch(model, [t], tok, "r3")
    assert mismatch < 1e-4
