"""Hand-computed checks of the token-level estimators, the critic's math and reward shaping
(algos/values.py, algos/estimators.py, algos/shaping.py): expected values worked out in comments."""

import math

import pytest
import torch

from relayrl.algos import ESTIMATORS
from relayrl.algos.estimators import Knobs, evpo, reinforce_pp, reinforce_pp_baseline
from relayrl.algos.shaping import fold_kl, overlong_penalty
from relayrl.algos.values import explained_variance, gae, masked_whiten, token_returns, value_loss
from relayrl.records import Prompt, Trajectory
from relayrl.rollout.groups import token_rewards

T = torch.tensor


def test_token_returns_discount_and_masked_tokens_pass_through():
    # γ = 0.5: G_2 = 1, G_1 = 0.5, G_0 = 0.25
    assert torch.allclose(token_returns(T([[0.0, 0.0, 1.0]]), torch.ones(1, 3), 0.5), T([[0.25, 0.5, 1.0]]))
    # the middle token is masked (a tool result): not a step, its reward ignored, G passes through undiscounted
    assert torch.allclose(token_returns(T([[0.0, 5.0, 1.0]]), T([[1.0, 0.0, 1.0]]), 0.5), T([[0.5, 0.0, 1.0]]))


def test_gae_hand_computed():
    r, v = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.2, 0.8]])
    # γ = λ = 1: δ = [0.2 - 0.5, 0.8 - 0.2, 1 - 0.8] = [-0.3, 0.6, 0.2]; A = [0.5, 0.8, 0.2]; returns = A + V = 1
    adv, ret = gae(r, v, torch.ones(1, 3))
    assert torch.allclose(adv, T([[0.5, 0.8, 0.2]])) and torch.allclose(ret, torch.ones(1, 3))
    # γ = 0.9, λ = 0.5: A_2 = 0.2; δ_1 = 0.72 - 0.2 = 0.52, A_1 = 0.52 + 0.45·0.2 = 0.61;
    # δ_0 = 0.18 - 0.5 = -0.32, A_0 = -0.32 + 0.45·0.61 = -0.0455
    adv, _ = gae(r, v, torch.ones(1, 3), 0.9, 0.5)
    assert torch.allclose(adv, T([[-0.0455, 0.61, 0.2]]), atol=1e-6)
    # a masked middle token passes the next value (0.8) and the running A (0.2) through: δ_0 = 0.8 - 0.5
    adv, ret = gae(r, T([[0.5, 9.0, 0.8]]), T([[1.0, 0.0, 1.0]]))
    assert torch.allclose(adv, T([[0.5, 0.0, 0.2]])) and torch.allclose(ret, T([[1.0, 0.0, 1.0]]))


def test_masked_whiten_and_its_minimum():
    # mean 2, Bessel variance (1 + 0 + 1)/2 = 1; the masked 100 counts for nothing
    out = masked_whiten(T([[1.0, 2.0, 3.0, 100.0]]), T([[1.0, 1.0, 1.0, 0.0]]))
    assert torch.allclose(out, T([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6)
    # one trained token has no variance: nothing to train (a batch overlong=filter emptied), not an error
    assert torch.equal(masked_whiten(T([[1.0, 2.0]]), T([[1.0, 0.0]])), torch.zeros(1, 2))


def test_explained_variance_hand_computed():
    r, m = T([1.0, 0.0, 1.0, 0.0]), torch.ones(4)
    assert explained_variance(r, r, m).item() == pytest.approx(1.0)  # a perfect critic
    assert explained_variance(r, torch.full((4,), 0.5), m).item() == pytest.approx(0.0)  # the mean: explains none
    assert explained_variance(r, T([1.0, 1.0, 0.0, 0.0]), m).item() == pytest.approx(-1.0)  # 1 - 0.5/0.25
    assert explained_variance(torch.ones(4), torch.zeros(4), m).item() == 0.0  # returns without variance


def test_value_loss_clipped_hand_computed():
    # token 0: V moved 1 from V_old = 0, clipped to 0.5: max((1-2)², (0.5-2)²)/2 = 2.25/2; token 1: unclipped 1/2
    loss, m = value_loss(T([[1.0, 0.0]]), torch.zeros(1, 2), T([[2.0, -1.0]]), torch.ones(1, 2), 0.5)
    assert torch.allclose(loss, T([[1.125, 0.5]])) and m["clip_frac"].item() == pytest.approx(0.5)
    loss, _ = value_loss(T([[1.0, 0.0]]), torch.zeros(1, 2), T([[2.0, -1.0]]), torch.ones(1, 2), None)
    assert torch.allclose(loss, T([[0.5, 0.5]]))


def test_reinforce_pp_whitens_token_returns_over_the_batch():
    # G = [[1, 1, 1], [0, 0, -]]: 5 tokens, mean 0.6, Bessel variance (3·0.16 + 2·0.36)/4 = 0.3
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret, _ = reinforce_pp(T([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), mask, T([0, 0]), None, Knobs())
    s = math.sqrt(0.3)
    assert ret is None
    assert torch.allclose(adv, T([[0.4 / s] * 3, [-0.6 / s, -0.6 / s, 0.0]]), atol=1e-5)


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens():
    # R = [1, 0 | 0.5 | 0.7, 0.1]: groups → [0.5, -0.5 | · | 0.3, -0.3]; group 1 is one response left of
    # group_size 2 (relayrl.failures): A = 0 and out of the whitening. Over the other 4: mean 0, Bessel var 0.68/3
    r, g = T([[1.0], [0.0], [0.5], [0.7], [0.1]]), T([0, 0, 1, 2, 2])
    adv, _, _ = reinforce_pp_baseline(r, torch.ones(5, 1), g, None, Knobs(group_size=2))
    s = math.sqrt(0.68 / 3)
    assert torch.allclose(adv.flatten(), T([0.5 / s, -0.5 / s, 0.0, 0.3 / s, -0.3 / s]), atol=1e-5)
    # group_size=1 chosen (each group one response by design, here all of them): R itself, whitened
    adv, _, _ = reinforce_pp_baseline(T([[1.0], [0.0], [0.5]]), torch.ones(3, 1), T([0, 1, 2]), None,
                                      Knobs(group_size=1))
    assert torch.allclose(adv.flatten(), T([1.0, -1.0, 0.0]), atol=1e-4)  # mean 0.5, Bessel var 0.25


def test_outcome_estimators_sum_the_token_rewards_and_broadcast():
    # GRPO on R = [1, 0] (the outcome reward on the last token, a KL reward folded in on the others)
    rewards, mask = T([[-0.1, 1.1, 0.0], [0.2, -0.2, 0.0]]), T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv, ret, _ = ESTIMATORS["grpo"](rewards, mask, T([0, 0]), None, Knobs())
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert ret is None and torch.allclose(adv, T([[a, a, 0.0], [-a, -a, -a]]), atol=1e-5)


R3, M3, G3 = T([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]), torch.ones(3, 2), T([0, 0, 1])  # G = [1, 1 | 0, 0 | 0, 0]


def test_evpo_takes_the_critic_when_it_explains_the_returns():
    # V: R - V = [0, 0, 0, 0, -.3, -.3]: Var 0.02 against Var(G) = 2/9: EV = 0.91 > 0. GAE's raw A = -V's
    # error on row 2, [0, 0, 0, 0, -.3, -.3]; whitened: mean -0.1, Bessel std sqrt(0.12/5)
    v = T([[1.0, 1.0], [0.0, 0.0], [0.3, 0.3]])
    adv, ret, m = evpo(R3, M3, G3, v, Knobs())
    assert m["evpo/ev"].item() == pytest.approx(0.91, abs=1e-5) and m["evpo/use_critic"].item() == 1.0
    s = math.sqrt(0.12 / 5)
    assert torch.allclose(adv, T([[0.1 / s] * 2, [0.1 / s] * 2, [-0.2 / s] * 2]), atol=1e-4)
    assert torch.allclose(ret, T([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]), atol=1e-6)  # the critic's targets: GAE's


def test_evpo_falls_back_to_the_batch_mean_when_the_critic_explains_nothing():
    # V = [0, 0 | 1, 1 | 0, 0]: R - V = [1, 1, -1, -1, 0, 0], Var 2/3: EV = 1 - 3 = -2 → G - mean(G), whitened:
    # deviations [2/3, 2/3, -1/3 × 4], Bessel variance (8/9 + 4/9)/5
    adv, _, m = evpo(R3, M3, G3, T([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]), Knobs())
    assert m["evpo/ev"].item() == pytest.approx(-2.0) and m["evpo/use_critic"].item() == 0.0
    s = math.sqrt((12 / 9) / 5)
    assert torch.allclose(adv, T([[2 / 3 / s] * 2, [-1 / 3 / s] * 2, [-1 / 3 / s] * 2]), atol=1e-4)
    # ... which is REINFORCE++'s advantage (γ = 1)
    assert torch.allclose(adv, reinforce_pp(R3, M3, G3, None, Knobs())[0], atol=1e-6)


def test_evpo_per_group():
    # group 0 (rows 0, 1): G = [1, 1, 0, 0], R - V = [.2, .2, -.1, -.1]: EV 0.91 → critic: raw A [.2, .2, -.1, -.1];
    # group 1 (row 2): its returns do not vary (EV 0) → its own mean baseline: 0. Raw [.2, .2, -.1, -.1, 0, 0],
    # whitened: mean 1/30, Bessel variance 0.0933/5
    v = T([[0.8, 0.8], [0.1, 0.1], [0.3, 0.3]])
    adv, _, m = evpo(R3, M3, G3, v, Knobs(evpo_level="group"))
    assert m["evpo/use_critic"].item() == pytest.approx(0.5)
    raw = T([[0.2, 0.2], [-0.1, -0.1], [0.0, 0.0]])
    s = math.sqrt(((raw - 1 / 30) ** 2).sum().item() / 5)
    assert torch.allclose(adv, (raw - 1 / 30) / s, atol=1e-4)


def test_overlong_penalty_hand_computed():
    # L_max 10, L_c 4: free up to 6, then -1/4 per token, -1 at 10 and beyond
    got = overlong_penalty(T([6, 7, 8, 10, 12]), 10, 4)
    assert torch.allclose(got, T([0.0, -0.25, -0.5, -1.0, -1.0]))


def test_fold_kl_into_the_rewards():
    # k1 = log π_old - log π_ref = [0.5, -1]; β = 0.1: r - β·KL = [-0.05, 1.1]
    out, m = fold_kl(T([[0.0, 1.0]]), T([[-1.0, -2.0]]), T([[-1.5, -1.0]]), torch.ones(1, 2), 0.1, "k1")
    assert torch.allclose(out, T([[-0.05, 1.1]])) and m["kl_reward"].item() == pytest.approx(-0.25)


def test_token_rewards_sit_on_each_turns_last_trained_token():
    p = Prompt("p", [{"role": "user", "content": "x"}])
    t = Trajectory(p, "g", 0, [1], [5, 6, 7, 8], reward=1.0)
    assert token_rewards(t) == [0.0, 0.0, 0.0, 1.0]  # single turn: the outcome on the last token
    # two turns: turn 0's tokens 0-1 (then a tool result, mask 0), turn 1's tokens 4-5
    a = Trajectory(p, "g", 0, [1], [5, 6, 7, 8, 9, 10], mask=[1, 1, 0, 0, 1, 1], turns=[0, 0, 0, 0, 1, 1],
                   reward=1.2, info={"step_rewards": [0.2, 1.0]})
    assert token_rewards(a) == [0.0, 0.2, 0.0, 0.0, 0.0, 1.0]
    assert token_rewards(a, bonus=-0.5) == [0.0, 0.2, 0.0, 0.0, 0.0, 0.5]  # shaping goes with the last step


def test_training_batch_overlong_filter_and_punish(tiny):
    """``algo.overlong``: 'filter' takes truncated responses out of the loss (their rewards still count in
    the group baselines); 'punish' adds DAPO's penalty to the reward on the last token."""
    from relayrl.config import AlgoCfg
    from relayrl.records import FinishReason, Group
    from relayrl.rollout.groups import training_batch
    from tests.test_trainer import _trajs

    _, tok = tiny
    trajs = _trajs(tok)
    for i, t in enumerate(trajs):
        t.reward = float(i % 2)
        t.finish_reason = FinishReason.LENGTH if i in (1, 6) else FinishReason.STOP
    groups = [Group(trajs[0].prompt, "g0", trajs[:4]), Group(trajs[4].prompt, "g1", trajs[4:])]
    lengths = [len(t.response_ids) for t in trajs]
    batch, m = training_batch(groups, AlgoCfg(overlong="filter"), 11, tok.pad_token_id)
    per_row = batch.loss_mask.sum(1).tolist()
    assert per_row == [0 if i in (1, 6) else n for i, n in enumerate(lengths)]
    assert m["overlong/filtered_frac"] == pytest.approx(2 / 8) and batch.group.tolist() == [0] * 4 + [1] * 4
    # every row's reward sits on its last response token, the filtered rows' too (for their group baselines)
    assert batch.rewards.sum(1).tolist() == [t.reward for t in trajs]
    batch, m = training_batch(groups, AlgoCfg(overlong="punish", overlong_buffer=4), 11, tok.pad_token_id)
    want = [t.reward + min(0.0, max(-1.0, (7 - n) / 4)) for t, n in zip(trajs, lengths)]
    assert batch.rewards.sum(1).tolist() == pytest.approx(want)
    assert any(n > 7 for n in lengths) and m["overlong/penalty_mean"] < 0
    last = [int(torch.nonzero(batch.loss_mask[i]).max()) for i in range(8)]
    assert all(batch.rewards[i, last[i]] == pytest.approx(want[i]) for i in range(8))



def _filtered_batch(groups):
    """The batch of groups of one-token responses, given as (rewards, indices cut at the budget), under
    algo.overlong=filter, as the loop builds it."""
    from relayrl.config import AlgoCfg
    from relayrl.records import FinishReason, Group
    from relayrl.rollout.groups import training_batch

    p, out = Prompt("p", [{"role": "user", "content": "q"}]), []
    for k, (rewards, truncated) in enumerate(groups):
        trajs = [Trajectory(p, f"g{k}", i, [1], [2], [0.0], [0],
                            FinishReason.LENGTH if i in truncated else FinishReason.STOP, reward=r)
                 for i, r in enumerate(rewards)]
        out.append(Group(p, f"g{k}", trajs))
    batch, _ = training_batch(out, AlgoCfg(overlong="filter"), 4, pad_id=0)
    return batch


S3, S03 = math.sqrt(1 / 3), math.sqrt(0.3)


@pytest.mark.parametrize("name,want", [
    # group 0: R = [1, 1, 0, 0], response 0 truncated: its reward 1 counts in the baseline (mean 0.5, Bessel
    # std sqrt(1/3)), its advantage is 0 (no trained token); scored 0 instead it gave [0, 1.5, -0.5, -0.5].
    # group 1: R = [1, 0], nothing truncated: mean 0.5, std sqrt(1/2)
    ("grpo", [0.0, 0.5 / S3, -0.5 / S3, -0.5 / S3, 0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)]),
    ("dr_grpo", [0.0, 0.5, -0.5, -0.5, 0.5, -0.5]),
    # leave-one-out: G/(G-1) · (R − mean); scored 0, group 0 gave [0, 1, -1/3, -1/3]
    ("rloo", [0.0, 2 / 3, -2 / 3, -2 / 3, 1.0, -1.0]),
    # R − mean over the 5 trained tokens [0.5, -0.5, -0.5, 0.5, -0.5], whitened: mean -0.1, Bessel var 0.3
    ("reinforce_pp_baseline", [0.0, 0.6 / S03, -0.4 / S03, -0.4 / S03, 0.6 / S03, -0.4 / S03]),
])
def test_overlong_filter_keeps_the_true_reward_in_the_group_baseline(name, want):
    batch = _filtered_batch([([1.0, 1.0, 0.0, 0.0], {0}), ([1.0, 0.0], set())])
    assert batch.loss_mask.sum(1).tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # out of the loss: no gradient
    adv, _, _ = ESTIMATORS[name](batch.rewards, batch.loss_mask, batch.group, None, Knobs())
    assert torch.allclose(adv.sum(1), T(want), atol=1e-5), adv.sum(1)
    assert (adv * (1 - batch.loss_mask)).abs().sum() == 0
