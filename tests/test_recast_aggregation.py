"""ReCAST's two aggregations (issue 53, step 1: the math, no Ray): "pre" (buffer/credit.py, each
step's mixed reward normalised into an advantage) and "loss" (learner/credit.py, per-reward
advantages weighted by T W in the loss), against hand computations and the weighted sum."""
import numpy as np
import pytest
import torch

from diffrlhf.buffer.advantages import AdvantageComputer
from diffrlhf.buffer.credit import RecastCredit, check_weights, recast_advantages
from diffrlhf.learner.credit import build_credit
from diffrlhf.learner.loss import ppo_clipped_loss
from diffrlhf.learner.recast import sinkhorn_weights
from diffrlhf.rewards import WeightedSum

RNG = np.random.default_rng(0)
B, R, T = 8, 2, 5
TERMS = RNG.normal(size=(B, R))
PROMPTS = ["p"] * B
BUDGETS = [2.0, 0.5]


def batch_adv(prompts, r):
    return AdvantageComputer("batch", clip_max=5.0)(prompts, r)


def test_equal_gain_profiles_make_pre_train_on_the_weighted_sums_advantage_at_every_step():
    w = sinkhorn_weights(torch.ones(R, T), BUDGETS).numpy()  # equal profiles: W = lambda_i / (Lambda T)
    np.testing.assert_allclose(T * w, np.repeat((np.array(BUDGETS) / sum(BUDGETS))[:, None], T, 1), atol=1e-9)
    pre = recast_advantages("pre", PROMPTS, TERMS, w, BUDGETS, batch_adv)
    assert pre.shape == (B, T) and pre.dtype == np.float32
    ws = WeightedSum([{"name": "jpeg_compressibility", "weight": BUDGETS[0]}, {"name": "jpeg_incompressibility", "weight": BUDGETS[1]}])
    summed = sum(wt * TERMS[:, i] for i, (_, wt, _) in enumerate(ws.terms))  # the weighted_sum's own weights
    for s in range(T):
        np.testing.assert_allclose(pre[:, s], batch_adv(PROMPTS, summed), atol=1e-5)


def test_pre_is_each_steps_mixed_reward_by_hand():
    w = np.array([[0.30, 0.25, 0.20, 0.02, 0.03], [0.00, 0.00, 0.05, 0.10, 0.05]])
    w = w / w.sum(0, keepdims=True) / T  # any W with columns 1/T: reward 0 early, reward 1 late
    pre = recast_advantages("pre", PROMPTS, TERMS, w, BUDGETS, batch_adv)
    lam = sum(BUDGETS)
    for s in range(T):
        mixed = lam * sum(T * w[i, s] * TERMS[:, i] for i in range(R))
        np.testing.assert_allclose(pre[:, s], batch_adv(PROMPTS, mixed), atol=1e-5)


def test_loss_mode_gives_each_reward_its_own_advantage_and_weights_it_by_tw_in_the_loss():
    w = sinkhorn_weights(torch.tensor([[1.0, 0.5, 0.0, 0.2, 0.1], [0.0, 0.1, 0.8, 0.4, 1.0]]), BUDGETS).numpy()
    adv = recast_advantages("loss", PROMPTS, TERMS, w, BUDGETS, batch_adv)
    assert adv.shape == (B, R)
    for i in range(R):
        np.testing.assert_allclose(adv[:, i], batch_adv(PROMPTS, TERMS[:, i]), atol=1e-6)
    steps = torch.tensor([0, 1, 2, 3, 4, 0, 2, 4])
    # the learner's half (learner/credit.py) as PolicyLearner.update uses it: one clipped loss per reward column
    from types import SimpleNamespace

    batch = SimpleNamespace(term_advantages=torch.from_numpy(adv))
    terms = build_credit("loss", w).step_advantages(batch, torch.arange(B), steps).double()
    logp = torch.tensor(RNG.normal(scale=0.05, size=B))
    old = torch.zeros(B, dtype=torch.float64)
    clip = 0.02
    got = sum(ppo_clipped_loss(logp, old, terms[:, i], clip)[0] for i in range(terms.shape[1]))
    # by hand: mean over rows of sum_i (T W)_{i,s} * max(-A_i r, -A_i clip(r))
    r = np.exp(logp.numpy())
    hand = 0.0
    for b in range(B):
        for i in range(R):
            a = adv[b, i]
            hand += T * w[i, steps[b]] * max(-a * r[b], -a * np.clip(r[b], 1 - clip, 1 + clip)) / B
    assert float(got) == pytest.approx(hand, rel=1e-5)


def test_bad_weights_and_modes_are_named():
    with pytest.raises(ValueError, match=r"ReCAST weights are \(2, 4\) but the batch has 3 rewards"):
        check_weights(np.ones((2, 4)), 3, 4)
    with pytest.raises(ValueError, match="non-negative"):
        check_weights(-np.ones((2, 4)), 2, 4)
    with pytest.raises(ValueError, match="several rewards per row"):
        recast_advantages("pre", PROMPTS, TERMS[:, :1], np.ones((1, T)) / T, [1.0], batch_adv)
    with pytest.raises(ValueError, match="choose pre or loss"):
        recast_advantages("off", PROMPTS, TERMS, np.ones((R, T)) / (R * T), BUDGETS, batch_adv)


def test_the_buffers_credit_needs_its_weights_and_survives_a_checkpoint():
    credit = RecastCredit("pre", BUDGETS)
    with pytest.raises(RuntimeError, match="no weights yet"):
        credit.term_advantages(PROMPTS, TERMS, batch_adv)
    w = sinkhorn_weights(torch.ones(R, T), BUDGETS).numpy()
    credit.set_weights(w)
    again = RecastCredit("pre", [1.0, 1.0])
    again.load_state_dict(credit.state_dict())
    np.testing.assert_array_equal(again.term_advantages(PROMPTS, TERMS, batch_adv), credit.term_advantages(PROMPTS, TERMS, batch_adv))
