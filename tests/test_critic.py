"""The critic (critic.py): a value model beside the policy, trained on the same batch. Its body is the
policy's, its values line up with the per-token tensors, masked tokens carry no value loss, the
trainer computes GAE/EVPO advantages from its values at training time, and a resumed trainer
continues exactly (weights, optimiser and scheduler of both models)."""

import pytest
import torch

from relayrl.train.batch import build_batch
from relayrl.config import AlgoCfg, CriticCfg, TrainerCfg
from relayrl.train.critic import Critic, load_value_model
from relayrl.models import load_policy
from relayrl.rollout.groups import token_rewards
from relayrl.train.trainer import Trainer
from tests.test_trainer import _trajs

STEP = {"lr": 1e-2, "warmup_steps": 0}


def reward_batch(tok, seed=0, n=8):
    """A batch whose advantages are computed at training time: token rewards, two groups of four."""
    trajs = _trajs(tok, n, seed)
    for i, t in enumerate(trajs):
        t.reward = float(i % 3 == 0)
    group = torch.tensor([i // 4 for i in range(n)])
    return build_batch(trajs, torch.zeros(n), tok.pad_token_id, [token_rewards(t) for t in trajs], group)


def make(path, advantage="gae", ccfg=None, tkw=None, **akw):
    critic = Critic(load_value_model(path), ccfg or CriticCfg(lr=1e-2), TrainerCfg(**(tkw or STEP)), 10,
                    torch.device("cpu"))
    return Trainer(load_policy(path), TrainerCfg(**(tkw or STEP)), AlgoCfg(advantage=advantage, **akw), 1.0, 10, 16,
                   critic=critic)


def test_value_model_has_the_policys_body_and_a_fresh_head(tiny_path, tiny):
    model, tok = tiny
    vm = load_value_model(tiny_path, seed=0)
    policy = dict(model.named_parameters())
    body = dict(vm.body.named_parameters())
    assert body and all(torch.equal(p, policy[f"model.{k}"]) for k, p in body.items())
    assert vm.head.weight.abs().sum() > 0
    assert torch.equal(vm.head.weight, load_value_model(tiny_path, seed=0).head.weight)
    assert not torch.equal(vm.head.weight, load_value_model(tiny_path, seed=1).head.weight)
    batch = reward_batch(tok)
    critic = Critic(vm, CriticCfg(), TrainerCfg(micro_batch_tokens=60), 10, torch.device("cpu"))
    v = critic.values(batch)
    # V_j = head(h_j) at each position j, 0 off the mask: the same as one whole forward
    full = vm(batch.input_ids, batch.attention_mask)[:, :-1].detach() * batch.loss_mask
    assert v.shape == batch.loss_mask.shape and torch.allclose(v, full, atol=1e-5)
    assert (v[batch.loss_mask == 0] == 0).all() and (v[batch.loss_mask == 1] != 0).all()


def test_masked_tokens_carry_no_value_loss(tiny_path, tiny):
    """Tool results and template tokens (mask 0) take no part in the critic's loss: changing their
    targets changes nothing; changing a trained token's target does."""
    _, tok = tiny
    trajs = _trajs(tok)
    for t in trajs:
        t.mask = [1] + [0] * (len(t.response_ids) - 2) + [1] if len(t.response_ids) > 2 else []
    batch = build_batch(trajs, torch.zeros(8), tok.pad_token_id, [token_rewards(t) for t in trajs],
                        torch.arange(8) // 4)
    critic = Critic(load_value_model(tiny_path), CriticCfg(), TrainerCfg(), 10, torch.device("cpu"))
    batch.values = critic.values(batch)
    grads = []
    for k, where in enumerate((batch.loss_mask == 0, batch.loss_mask == 0, batch.loss_mask == 1)):
        batch.returns = torch.where(where, torch.full_like(batch.values, 7.0 * k), torch.zeros_like(batch.values))
        critic.model.zero_grad()
        critic._accumulate(batch, batch.loss_mask.sum().item())
        grads.append(torch.cat([p.grad.flatten() for p in critic.model.parameters()]))
    assert (batch.loss_mask == 0).any() and grads[0].abs().sum() > 0
    assert torch.equal(grads[0], grads[1]) and not torch.allclose(grads[0], grads[2])


@pytest.mark.parametrize("advantage", ["gae", "evpo"])
def test_a_step_trains_both_models_from_values_taken_at_training_time(tiny_path, tiny, advantage):
    _, tok = tiny
    tr = make(tiny_path, advantage)
    batch = reward_batch(tok)
    before = [p.detach().clone() for p in (*tr.model.parameters(), *tr.critic.model.parameters())]
    values = tr.critic.values(batch)
    m = tr.step(batch)
    after = [*tr.model.parameters(), *tr.critic.model.parameters()]
    n_policy = len(list(tr.model.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(before[:n_policy], after[:n_policy]))
    assert any(not torch.equal(a, b) for a, b in zip(before[n_policy:], after[n_policy:]))
    for k in ("critic/loss", "critic/grad_norm", "critic/ev", "critic/values_mean", "loss"):
        assert isinstance(m[k], float) and m[k] == m[k], k
    if advantage == "evpo":
        assert m["evpo/use_critic"] in (0.0, 1.0) and "evpo/ev" in m
    # the critic learnt toward the returns: its loss on the same batch went down
    batch.values = values
    from relayrl.algos.values import gae, value_loss

    _, returns = gae(batch.rewards, values, batch.loss_mask)
    new = tr.critic.values(batch)
    loss = lambda v: (value_loss(v, values, returns, batch.loss_mask, None)[0] * batch.loss_mask).sum()  # noqa: E731
    assert loss(new) < loss(values)


def _state(tr):
    opt = tr.state_dict()
    return {"policy": {k: v.clone() for k, v in tr.full_state_dict().items()},
            "critic": {k: v.clone() for k, v in tr.critic.full_state_dict().items()},
            "policy_opt": opt["optimizer"]["state"], "critic_opt": opt["critic"]["optimizer"]["state"],
            "lr": (tr.sched.last_epoch, tr.critic.sched.last_epoch)}


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_resumed_trainer_with_a_critic_continues_exactly(tiny_path, tiny):
    """Three steps straight, or one step, a save (weights, trainer state with the critic's, RNG) and two
    steps by a new trainer loaded from it: the same policy, critic, optimisers and schedules, bit for bit."""
    _, tok = tiny
    batches = [reward_batch(tok, seed=s) for s in range(3)]
    cfg = CriticCfg(lr=1e-2, updates_per_step=2, warmup_steps=2)
    torch.manual_seed(0)
    straight = make(tiny_path, "gae", cfg, {**STEP, "updates_per_step": 2})
    for b in batches:
        straight.step(b)
    torch.manual_seed(0)
    first = make(tiny_path, "gae", cfg, {**STEP, "updates_per_step": 2})
    first.step(batches[0])
    weights, state, rng = first.full_state_dict(), first.state_dict(), torch.get_rng_state()
    resumed = make(tiny_path, "gae", cfg, {**STEP, "updates_per_step": 2})
    resumed.model.load_state_dict(weights)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    for b in batches[1:]:
        resumed.step(b)
    a, b = _state(straight), _state(resumed)
    assert not torch.equal(a["critic"]["head.weight"], load_value_model(tiny_path).head.weight)
    assert _equal(a, b)


def test_trainer_and_checkpoint_refuse_a_critic_mismatch(tiny_path, tiny):
    _, tok = tiny
    with pytest.raises(ValueError, match="needs a critic"):
        Trainer(load_policy(tiny_path), TrainerCfg(), AlgoCfg(advantage="gae"), 1.0, 10, 16)
    with_critic = make(tiny_path).state_dict()
    plain = Trainer(load_policy(tiny_path), TrainerCfg(), AlgoCfg(), 1.0, 10, 16)
    with pytest.raises(ValueError, match="holds a critic"):
        plain.load_state_dict(with_critic)


def test_building_the_critic_leaves_the_runs_random_stream(tiny_path):
    """A run with a critic draws the same samples as one without (the head has its own seeded generator,
    and loading the body draws nothing from the run's stream)."""
    from relayrl.config import load_config
    from relayrl.train.critic import make_critic

    cfg = load_config(None, [f"model.path={tiny_path}", "algo.advantage=gae"])
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    critic = make_critic(cfg.critic, cfg.trainer, cfg.model.path, cfg.model.dtype, cfg.run.seed, cfg.run.steps)
    assert torch.equal(torch.rand(3), want) and critic.num_parameters() > 0


def test_a_critic_path_that_does_not_load_is_one_line_naming_the_field(tiny_path, tmp_path, capsys):
    from relayrl.cli import main

    rc = main(["train", f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "algo.advantage=gae",
               f"critic.path={tmp_path / 'nope'}", "data.eval_path=null", "run.progress=false"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("relayrl: model error: critic.path=") and "no such folder" in err
    assert not any(tmp_path.iterdir())  # (no run directory, whatever its name)
