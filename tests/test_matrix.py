"""The composability matrix: every advantage estimator × policy loss × off-policy correction × KL
placement, and every pipeline mode × partial rollouts × single-turn/agent.

1. The trainer, the full product (7 estimators × 4 losses × 4 corrections × KL off / loss / reward,
   336 steps): one step on a batch with stale tokens (two policy versions) and token rewards; the
   loss is finite, the policy's weights change, and the critic's too where there is one; the step
   goes the advantages' way (Σ_t A_t·Δlog π_t > 0; the advantages rank the rewarded rows first),
   and a few cells match a step computed by hand from the tensors.
2. The whole pipeline, pairwise: two steps of ``relayrl train`` on a tiny model, on a set of runs
   that covers every *pair* of values of advantage, loss, correction, KL, mode, partial,
   single-turn/agent and adaptive sampling (fixed groups; dynamic sampling; adaptive budgets with
   dynamic sampling; VADE selection with both) at least once (``covering_runs``: a greedy covering array, deterministic);
   losses finite, policy (and critic) weights changed, checkpoint written, the first step along
   ∇ Σ_t A_t·log π_t (to first order). The full product,
   8 × 4 × 4 × 3 × 3 × 2 × 2 × 4 = 18,432 runs, is far too slow for CI; pairs catch the interactions
   of two choices, the usual source of composition bugs.
3. Combinations invalid by construction are rejected by the config, naming the fields.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import random

import pytest
import torch

from relayrl.algos import CORRECTIONS, ESTIMATORS, NEEDS_CRITIC, POLICY_LOSSES
from relayrl.config import AlgoCfg, ConfigError, CriticCfg, TrainerCfg, load_config
from relayrl.train.critic import Critic, load_value_model
from relayrl.models import load_policy
from relayrl.train.trainer import Trainer
from tests.test_critic import reward_batch

@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core machine two threads per tiny matmul spin against each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


KL = {"off": {"kl_coef": 0.0}, "loss": {"kl_coef": 0.1}, "reward": {"kl_coef": 0.1, "kl_mode": "reward"}}


def _stale_reward_batch(tok, model):
    """Rows 0-3 sampled by version 0 with behaviour log-probs off the current policy, rows 4-7 by version 1."""
    batch = reward_batch(tok)
    tr = Trainer(model, TrainerCfg(), AlgoCfg(), 1.0, 10, 16)
    cur = tr.logprobs(batch)
    noise = torch.linspace(-0.8, 0.8, cur.numel()).reshape(cur.shape)
    stale = torch.arange(8)[:, None] < 4
    batch.behav_logp = torch.where(stale, cur + noise, cur) * batch.loss_mask
    batch.versions = torch.where(stale & batch.loss_mask.bool(), 0, batch.versions.clamp(min=1))
    return batch


# the cells whose step is also computed by hand (``_by_hand_step``): GRPO and KL off, every correction's weight
# (m2po's batch mask aside) under the clipped ratio and the detached one
BY_HAND = {("grpo", "ppo_clip", c, "off") for c in ("none", "tis", "decoupled")} | {("grpo", "cispo", "tis", "off")}


def _by_hand_step(base, batch, loss: str, correction: str):
    """(loss, gradient by parameter name) of one cell's step from the tensors, written out: one forward of the
    whole batch, log π = log_softmax(logits)[target]; GRPO over R = [1, 0, 0, 1 | 0, 0, 1, 0] (row i: i % 3 == 0),
    group 0 mean 1/2, Bessel std sqrt(1/3); group 1 mean 1/4, std 1/2; on-policy, so π_old = π_θ and r = 1
    (inside every trust region): ℓ_t = -w_t·A·r_t (ppo_clip) or -w_t·A·log π_t (cispo, w·r detached),
    token_mean over the batch's trained tokens. w: 1 (none); min(π_old/π_behav, 2) (tis); π_old/π_behav on the
    stale rows 0-3, 0 above 5, 1 on the others (decoupled)."""
    model = copy.deepcopy(base)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.loss_mask
    a0, a1 = 0.5 / (math.sqrt(1 / 3) + 1e-6), 1 / (0.5 + 1e-6)
    adv = torch.tensor([a0, -a0, -a0, a0, -0.25 * a1, -0.25 * a1, 0.75 * a1, -0.25 * a1])[:, None]
    w = torch.exp(logp.detach() - batch.behav_logp)
    stale = (torch.arange(8)[:, None] < 4) & mask.bool()
    w = {"none": torch.ones_like(w), "tis": w.clamp(max=2.0),
         "decoupled": torch.where(stale, w * (w <= 5), torch.ones_like(w))}[correction]
    per_tok = -w * adv * (torch.exp(logp - logp.detach()) if loss == "ppo_clip" else logp)
    total = (per_tok * mask).sum() / mask.sum()
    total.backward()
    return total.item(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _watch(tr: Trainer) -> dict:
    """What the step computed: its advantages (after ``_advantages``) and its gradient (before Adam's step,
    after the norm clip)."""
    seen = {}
    advantages = tr._advantages

    def with_advantages(*a):
        out = advantages(*a)
        seen["adv"] = out[0].advantages
        return out

    def before_step(*_):
        seen["grad"] = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}

    tr._advantages = with_advantages
    tr.opt.register_step_pre_hook(before_step)
    return seen


@pytest.mark.parametrize("advantage", sorted(ESTIMATORS))
def test_trainer_full_product(tiny_path, tiny, advantage):
    """Each cell: finite loss, changed weights, and the step's direction: the advantage-weighted change of the
    trained tokens' log-probs, Σ_t A_t·Δlog π_t, is positive (a flipped sign or a loss that ignores A makes it
    negative or zero); without a critic, the advantages rank the rewarded responses above the others. The
    cells of ``BY_HAND`` also match a step computed by hand (a dropped or misapplied weight shows there)."""
    model, tok = tiny
    batch = _stale_reward_batch(tok, model)
    base, base_critic = load_policy(tiny_path), load_value_model(tiny_path)
    initial, head = base.state_dict(), base_critic.state_dict()
    rewarded = torch.tensor([i % 3 == 0 for i in range(8)])  # reward_batch's rewards: row i is 1 when i % 3 == 0
    before = None
    for loss, correction, kl in itertools.product(sorted(POLICY_LOSSES), sorted(CORRECTIONS), KL):
        what = f"{advantage} × {loss} × {correction} × KL {kl}"
        policy = copy.deepcopy(base)
        tcfg = TrainerCfg(lr=1e-2, warmup_steps=0, micro_batch_tokens=120)
        critic = Critic(copy.deepcopy(base_critic), CriticCfg(), tcfg, 10, torch.device("cpu")) \
            if advantage in NEEDS_CRITIC else None
        tr = Trainer(policy, tcfg, AlgoCfg(advantage=advantage, loss=loss, offpolicy=correction, **KL[kl]),
                     1.0, 10, 16, critic=critic)
        before = tr.logprobs(batch) if before is None else before  # (every cell starts from the same weights)
        seen = _watch(tr)
        m = tr.step(batch, version=1)
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0, (what, m)
        assert any(not torch.equal(p, initial[k]) for k, p in policy.state_dict().items()), what
        adv, mask = seen["adv"], batch.loss_mask
        gain = (adv * (tr.logprobs(batch) - before) * mask).sum().item()
        assert gain > 0, (what, gain)
        if advantage not in NEEDS_CRITIC:
            row = (adv * mask).sum(1) / mask.sum(1)
            assert row[rewarded].min() > 0 > row[~rewarded].max(), (what, row)
        if (advantage, loss, correction, kl) in BY_HAND:
            value, grad = _by_hand_step(base, batch, loss, correction)
            norm = torch.sqrt(sum((g ** 2).sum() for g in grad.values())).item()
            assert m["loss"] == pytest.approx(value, rel=1e-4, abs=1e-6) and m["grad_norm"] == pytest.approx(norm, rel=1e-3), \
                (what, m["loss"], value, m["grad_norm"], norm)
            scale = min(1.0, tcfg.grad_clip / norm)  # (the step's gradient is after the norm clip)
            for k, g in grad.items():
                torch.testing.assert_close(seen["grad"][k], g * scale, rtol=1e-3, atol=1e-6, msg=lambda e: f"{what} {k}: {e}")
        if critic is not None:
            assert math.isfinite(m["critic/loss"]), what
            assert any(not torch.equal(p, head[k]) for k, p in critic.model.state_dict().items()), what
        if kl == "reward":
            assert "kl_reward" in m and m["kl"] == 0, what  # folded into the reward, not a loss term
        if kl == "loss":
            assert "kl_reward" not in m, what


# -- the pipeline, pairwise --------------------------------------------------------------------------

DIMS = {
    "advantage": sorted(ESTIMATORS) + ["gigpo"],
    "loss": sorted(POLICY_LOSSES),
    "offpolicy": sorted(CORRECTIONS),
    "kl": list(KL),
    "mode": ["sync", "periodic", "async"],
    "partial": [False, True],
    "agent": [False, True],
    "sampling": ["fixed", "dynamic", "budget+dynamic", "vade+budget+dynamic"],
}
SAMPLING = {
    "fixed": ["rollout.budget=fixed", "rollout.dynamic_sampling=false", "data.selection=uniform"],
    "dynamic": ["rollout.budget=fixed", "rollout.dynamic_sampling=true", "data.selection=uniform"],
    "budget+dynamic": ["rollout.budget=adaptive", "rollout.dynamic_sampling=true", "data.selection=uniform"],
    # (budgets without dynamic sampling can train a step of groups that all stopped at budget_min with no variance:
    # nothing to learn, the policy unchanged, which this test would call a failure)
    "vade+budget+dynamic": ["rollout.budget=adaptive", "rollout.dynamic_sampling=true", "data.selection=vade"],
}


def valid(run: dict) -> bool:
    """The combinations the config accepts: GiGPO needs an agent, and its credit takes no KL reward."""
    return run["advantage"] != "gigpo" or (run["agent"] and run["kl"] != "reward")


def covering_runs(dims: dict = DIMS, seed: int = 0) -> list[dict]:
    """A pairwise covering array: valid runs (one value per dimension) such that every pair of values of
    two dimensions that some valid run holds appears in at least one. Greedy (the classic AETG-style
    choice): each next run is the valid one covering the most pairs not yet covered, ties broken by a
    seeded shuffle, so the list is deterministic."""
    names = list(dims)
    every = [dict(zip(names, values)) for values in itertools.product(*dims.values())]
    every = [r for r in every if valid(r)]
    random.Random(seed).shuffle(every)
    pairs = [frozenset(((a, r[a]), (b, r[b])) for a, b in itertools.combinations(names, 2)) for r in every]
    todo = set().union(*pairs)
    runs = []
    while todo:
        best = max(range(len(every)), key=lambda i: len(pairs[i] & todo))
        runs.append(every[best])
        todo -= pairs[best]
    return runs


RUNS = covering_runs()


def test_the_runs_cover_every_valid_pair():
    seen = {((a, r[a]), (b, r[b])) for r in RUNS for a, b in itertools.combinations(DIMS, 2)}
    for a, b in itertools.combinations(DIMS, 2):
        for va, vb in itertools.product(DIMS[a], DIMS[b]):
            held = any(valid({**r, a: va, b: vb}) for r in RUNS)  # some valid run can hold the pair
            assert not held or ((a, va), (b, vb)) in seen, (a, va, b, vb)
    assert all(valid(r) for r in RUNS) and len(RUNS) < 50
    assert (("advantage", "gigpo"), ("agent", False)) not in seen  # invalid: never run


def _args(run: dict, tiny_path: str) -> list[str]:
    a = [f"algo.advantage={run['advantage']}", f"algo.loss={run['loss']}", f"algo.offpolicy={run['offpolicy']}",
         f"run.mode={run['mode']}", f"rollout.partial={str(run['partial']).lower()}", "run.steps=2",
         "run.progress=false", "run.threads=1", "reward.workers=1", "data.eval_path=null", "trainer.lr=2e-2",
         "trainer.warmup_steps=0", "rollout.prompts_per_step=2", "rollout.group_size=4",
         *[f"algo.{k}={v}" for k, v in KL[run["kl"]].items()], *SAMPLING[run["sampling"]]]
    if run["agent"]:  # the agent demo's model and calculator: it calls the tool on about a third of its episodes
        a += ["model.path=builtin:agent-demo", "data.path=builtin:agent-demo", "env.name=calculator",
              "env.max_turns=2", "env.max_tokens=64", "rollout.max_new_tokens=32", "reward.fn=math"]
    else:
        a += [f"model.path={tiny_path}", "reward.fn=tests.rewards_for_tests:digit_fraction", "rollout.max_new_tokens=8"]
    return a


def _watch_steps(monkeypatch) -> list[tuple[float, bool]]:
    """Every ``Trainer.step`` of the run, as (⟨∇_θ Σ_t A_t·log π_t, Δθ⟩, whether any A ≠ 0): the step's
    advantages (after ``_advantages``), the gradient taken at the weights before the step. First order, so
    the size of the step does not matter (Σ_t A_t·Δlog π_t itself, after a step of lr 2e-2 on a trained model,
    is dominated by the second-order terms)."""
    out = []
    step, advantages = Trainer.step, Trainer._advantages

    def with_advantages(self, *a):
        res = advantages(self, *a)
        self._watched_adv = res[0].advantages * res[0].loss_mask
        return res

    def stepping(self, batch, version=None):
        params = [p for p in self.model.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        m = step(self, batch, version)
        adv, after = self._watched_adv, [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, b in zip(params, before):
                p.copy_(b)
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        logp = self.readout.logp(logits[:, :-1], batch.input_ids[:, 1:])
        grads = torch.autograd.grad((adv * logp).sum(), params, allow_unused=True)
        with torch.no_grad():
            for p, a in zip(params, after):
                p.copy_(a)
        inner = sum((g * (a - b)).sum() for g, a, b in zip(grads, after, before) if g is not None)
        out.append((float(inner), bool((adv != 0).any())))
        return m

    monkeypatch.setattr(Trainer, "_advantages", with_advantages)
    monkeypatch.setattr(Trainer, "step", stepping)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=["-".join(f"{v}" for v in r.values()) for r in RUNS])
def test_pipeline_pairwise(tiny_path, tmp_path, run, monkeypatch):
    from safetensors.torch import load_file

    from relayrl.models import resolve_model_path
    from relayrl.run.loop import train

    cfg = load_config(None, _args(run, tiny_path) + [f"run.output_dir={tmp_path}"])
    steps = _watch_steps(monkeypatch)
    summary = train(cfg)
    assert summary["steps"] == 2 and len(steps) == 2
    # the first step's direction (a fresh Adam: the second mixes in the first's momentum, from another batch):
    # the trained tokens' log-probs move with their advantages, to first order
    gain, moves = steps[0]
    assert gain > 0 if moves else gain == 0, steps
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows), rows
    ckpt = cfg.run_dir / "checkpoints" / "step_000002"
    base = resolve_model_path(cfg.model.path)
    after, before = load_file(ckpt / "model.safetensors"), load_file(f"{base}/model.safetensors")
    assert any(not torch.equal(after[k], before[k]) for k in before), "the policy did not change"
    if run["advantage"] in NEEDS_CRITIC:
        assert all(math.isfinite(r["critic/loss"]) for r in rows)
        critic = torch.load(ckpt / "trainer.pt", weights_only=False)["critic"]["weights"]
        initial = load_value_model(base, seed=cfg.run.seed).state_dict()
        assert any(not torch.equal(critic[k], initial[k]) for k in initial), "the critic did not change"
    if run["advantage"] == "evpo":
        assert all(r["evpo/use_critic"] in (0.0, 1.0) and math.isfinite(r["evpo/ev"]) for r in rows)
    if run["agent"]:  # multi-turn episodes were trained: a tool call, its result masked out, a second turn
        assert any(r["turns_mean"] > 1 for r in rows), [r["turns_mean"] for r in rows]


# -- invalid by construction ---------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,needle", [
    (["algo.advantage=gigpo"], "algo.advantage='gigpo' needs an environment (env.name)"),
    (["algo.advantage=gigpo", "env.name=calculator", "algo.kl_coef=0.1", "algo.kl_mode=reward"],
     "algo.kl_mode='reward' does not combine with algo.advantage='gigpo'"),
    (["algo.loss=gspo", "algo.dual_clip=2"], "algo.dual_clip is set, but it only applies with algo.loss=ppo_clip"),
    (["algo.loss=cispo", "algo.dual_clip=2"], "algo.dual_clip is set, but it only applies with algo.loss=ppo_clip"),
    (["algo.advantage=evpo", "algo.evpo_level=group", "rollout.group_size=1"],
     "algo.evpo_level='group' needs rollout.group_size > 1"),
    (["algo.advantage=gae", "algo.evpo_level=group"], "algo.evpo_level is set, but it only applies with "
                                                      "algo.advantage=evpo"),
    (["critic.lr=1e-3"], "critic.lr is set, but it only applies with a critic (algo.advantage=gae or evpo)"),
    (["algo.lam=0.9"], "algo.lam is set, but it only applies with a critic"),
    (["algo.gamma=0.9", "algo.advantage=rloo"], "algo.gamma is set, but it only applies with algo.advantage=gigpo, "
                                                "reinforce_pp, gae or evpo"),
    (["algo.kl_coef=0", "algo.kl_mode=reward"], "algo.kl_mode is set, but it only applies with algo.kl_coef > 0"),
    (["algo.overlong_buffer=8"], "algo.overlong_buffer is set, but it only applies with algo.overlong=punish"),
    (["algo.overlong=punish", "algo.overlong_buffer=200"], "algo.overlong_buffer=200 is longer than the response "
                                                           "budget, rollout.max_new_tokens=128"),
    (["algo.advantage=gae", "critic.updates_per_step=65"], "critic.updates_per_step=65 is more than the batch"),
    (["algo.offpolicy=m3po"], "algo.offpolicy='m3po' is not one of: decoupled, m2po, none, tis"),
    (["algo.loss=gspoo"], "algo.loss='gspoo' is not one of: cispo, gspo, gspo_token, ppo_clip"),
])
def test_invalid_combinations_are_rejected_by_name(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)


@pytest.mark.parametrize("overrides", [
    ["algo.advantage=gigpo", "env.name=calculator", "algo.kl_coef=0.1"],
    ["algo.advantage=evpo", "algo.evpo_level=group", "algo.lam=0.95", "algo.gamma=1.0", "critic.lr=1e-3"],
    ["algo.loss=gspo", "algo.clip_low=3e-4", "algo.clip_high=4e-4", "algo.agg=seq_mean_token_mean"],
    ["algo.overlong=punish", "algo.overlong_buffer=32"],
    ["algo.overlong=filter", "algo.kl_coef=0.01", "algo.kl_mode=reward", "algo.kl_estimator=k1"],
])
def test_valid_combinations_load(overrides):
    load_config(None, overrides)
