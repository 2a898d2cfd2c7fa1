"""Hand-computed checks of step-level agent credit (expected values worked out in comments)."""

import pytest
import torch

from relayrl.algos.agents import discounted_returns, gigpo, steps_to_tokens

# Group 0: episodes 0, 1 (rewards 1, 0). Group 1: episodes 2, 3, 4 (rewards 1, 1, 0): unequal sizes.
EP_R = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
EP_G = torch.tensor([0, 0, 1, 1, 1])
# steps:         e0 s0, e0 s1, e1 s0, e1 s1, e2, e3, e4
STEP_EP = torch.tensor([0, 0, 1, 1, 2, 3, 4])
STEP_R = torch.tensor([0.9, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
# e0 and e1 share anchor 10 at their first step, not at their second (11 vs 12: step sets of one).
# Group 1 also sees anchor 10, but step sets never span groups.
ANCHOR = torch.tensor([10, 11, 10, 12, 10, 10, 10])


def test_discounted_returns_three_steps_interleaved():
    # γ = 0.5. episode 0 rewards 0, 0, 1: R = 0 + 0.5(0 + 0.5·1) = 0.25, 0 + 0.5·1 = 0.5, 1
    # episode 1 rewards 1, 2 (its steps interleaved with episode 0's): R = 1 + 0.5·2 = 2, 2
    r = torch.tensor([0.0, 1.0, 0.0, 2.0, 1.0])
    ep = torch.tensor([0, 1, 0, 1, 0])
    assert torch.allclose(discounted_returns(r, ep, 0.5), torch.tensor([0.25, 2.0, 0.5, 2.0, 1.0]))
    # γ = 0.95 (the spec default), a reward only at the last of 3 steps: 0.95², 0.95, 1
    out = discounted_returns(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0, 0, 0]), 0.95)
    assert torch.allclose(out, torch.tensor([0.9025, 0.95, 1.0]))


def test_gigpo_mean_normalisation_hand_computed():
    # A^E: group 0 mean 0.5 → +0.5, −0.5; group 1 mean 2/3 → 1/3, 1/3, −2/3
    # A^S: set (g0, anchor 10) = {0.9, 0.0}, mean 0.45 → +0.45 (e0 s0), −0.45 (e1 s0)
    #      sets (g0, 11), (g0, 12) have one step → 0
    #      set (g1, anchor 10) = {1, 1, 0}, mean 2/3 → 1/3, 1/3, −2/3 (merging it with group 0's
    #      anchor 10 would give mean 2.9/5 = 0.58 instead)
    # A = A^E + A^S: e0: 0.5 + 0.45, 0.5 + 0 | e1: −0.5 − 0.45, −0.5 + 0 | g1: 2/3, 2/3, −4/3
    a = gigpo(EP_R, EP_G, STEP_R, STEP_EP, ANCHOR)
    assert torch.allclose(a, torch.tensor([0.95, 0.5, -0.95, -0.5, 2 / 3, 2 / 3, -4 / 3]), atol=1e-6)
    # ω = 0.5: group 1 becomes 1/3 + 1/6 = 0.5, 0.5, −2/3 − 1/3 = −1
    a = gigpo(EP_R, EP_G, STEP_R, STEP_EP, ANCHOR, omega=0.5)
    assert torch.allclose(a[4:], torch.tensor([0.5, 0.5, -1.0]), atol=1e-6)


def test_gigpo_std_normalisation_hand_computed():
    # group 0 rewards {1, 0}: Bessel std sqrt((0.25 + 0.25) / 1) = 0.70711 → A^E = ±0.5 / 0.70711 = ±0.70711
    # set (g0, 10) = {0.9, 0}: std sqrt(2 · 0.45² / 1) = 0.63640 → A^S = ±0.45 / 0.63640 = ±0.70711
    # group 1 rewards {1, 1, 0}: std sqrt((1/9 + 1/9 + 4/9) / 2) = 0.57735 → 0.57735, 0.57735, −1.15470;
    # its step set holds the same values, so A = twice that
    a = gigpo(EP_R, EP_G, STEP_R, STEP_EP, ANCHOR, normalize="std")
    expected = torch.tensor([1.41421, 0.70711, -1.41421, -0.70711, 1.15470, 1.15470, -2.30940])
    assert torch.allclose(a, expected, atol=1e-4)
    with pytest.raises(ValueError, match="mean, std"):
        gigpo(EP_R, EP_G, STEP_R, STEP_EP, ANCHOR, normalize="whiten")


def test_gigpo_group_of_one_and_step_order():
    # one episode alone in its group: A^E = R (mean 0), every step set has one step → A = R = 0.3
    one = torch.tensor([0])
    a = gigpo(torch.tensor([0.3]), one, torch.tensor([0.5, 0.7]), torch.tensor([0, 0]), torch.tensor([1, 2]))
    assert torch.allclose(a, torch.tensor([0.3, 0.3]))
    # steps arriving in another order (episodes finished by different policy versions, out of
    # order) give the same advantage per step
    perm = torch.tensor([6, 2, 4, 0, 5, 1, 3])
    a = gigpo(EP_R, EP_G, STEP_R[perm], STEP_EP[perm], ANCHOR[perm])
    assert torch.allclose(a, gigpo(EP_R, EP_G, STEP_R, STEP_EP, ANCHOR)[perm])


def test_steps_to_tokens():
    # tokens of step 0, a tool-output token (−1), tokens of step 1 | step 2, then padding
    token_step = torch.tensor([[0, 0, -1, 1, 1], [2, 2, -1, -1, -1]])
    out = steps_to_tokens(torch.tensor([0.95, 0.5, -0.95]), token_step)
    assert torch.equal(out, torch.tensor([[0.95, 0.95, 0.0, 0.5, 0.5], [-0.95, -0.95, 0.0, 0.0, 0.0]]))
    assert torch.equal(steps_to_tokens(torch.zeros(0), torch.tensor([-1, -1])), torch.zeros(2))
