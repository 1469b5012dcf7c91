"""ReCAST (learner/recast.py): discriminability, gains, and the Sinkhorn reward-by-step weights."""
import math

import numpy as np
import pytest
import torch

from diffrlhf.learner.recast import (SinkhornError, discriminability, nonnegative, recast_weights,
                                     renyi_divergence, sinkhorn_weights, timestep_gains)


def numpy_sinkhorn(gains, budgets, temperatures, iterations=100_000):
    """Independent reference: plain-domain (non-log) Sinkhorn on K = exp(g_hat / tau), run to 1e-14."""
    g, lam, tau = (np.asarray(x, dtype=np.float64) for x in (gains, budgets, temperatures))
    mean = g.mean(1, keepdims=True)
    g_hat = np.where(mean > 0, g / np.where(mean > 0, mean, 1.0), 1.0)
    k = np.exp(g_hat / tau[:, None])
    rows, cols = lam / lam.sum(), np.full(g.shape[1], 1.0 / g.shape[1])
    a, b = np.ones(g.shape[0]), np.ones(g.shape[1])
    for _ in range(iterations):
        a = rows / (k @ b)
        b = cols / (k.T @ a)
        w = a[:, None] * k * b[None, :]
        if max(abs(w.sum(1) - rows).max(), abs(w.sum(0) - cols).max()) < 1e-14:
            return w
    raise AssertionError("the reference Sinkhorn did not converge")


@pytest.mark.parametrize("shape", [(1, 5), (2, 3), (3, 10), (5, 50)])
def test_sinkhorn_meets_marginals_and_matches_plain_reference(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    gains = torch.rand(shape, generator=gen, dtype=torch.float64) * 3
    budgets = torch.arange(1, shape[0] + 1, dtype=torch.float64)  # unequal
    taus = 0.5 + 1.5 * torch.rand(shape[0], generator=gen, dtype=torch.float64)
    w = sinkhorn_weights(gains, budgets, taus)
    assert w.dtype == torch.float64 and w.shape == shape
    assert torch.allclose(w.sum(1), budgets / budgets.sum(), rtol=0, atol=1e-9)
    assert torch.allclose(w.sum(0), torch.full((shape[1],), 1 / shape[1], dtype=torch.float64), rtol=0, atol=1e-9)
    np.testing.assert_allclose(w.numpy(), numpy_sinkhorn(gains.numpy(), budgets.numpy(), taus.numpy()), rtol=0, atol=1e-8)


def test_sinkhorn_raises_when_it_cannot_converge():
    assert issubclass(SinkhornError, RuntimeError)
    gains = torch.tensor([[1.0, 2, 3, 4], [4, 3, 2, 1]])
    with pytest.raises(SinkhornError, match=r"in 1 iterations: marginal residual \d\.\d+e-\d+"):
        sinkhorn_weights(gains, [1, 3], iterations=1)
    # a tiny temperature makes the kernel nearly a 0/1 matrix: Sinkhorn crawls
    with pytest.raises(SinkhornError, match=r"in 100 iterations: marginal residual 2\.5"):
        sinkhorn_weights(gains, [1, 3], temperatures=1e-3, iterations=100)
    assert sinkhorn_weights(gains, [1, 3], iterations=100).shape == (2, 4)  # the same kernel at tau = 1 converges


@pytest.mark.parametrize("kwargs, word", [
    (dict(gains=[1.0, 2.0], budgets=[1.0]), "gains"),                        # not [R, T]
    (dict(gains=[[1.0, -0.1]], budgets=[1.0]), "non-negative"),
    (dict(gains=[[1.0, float("nan")]], budgets=[1.0]), "finite"),
    (dict(gains=[[1.0, 2.0]], budgets=[1.0, 2.0]), "budgets"),               # one budget per reward
    (dict(gains=[[1.0, 2.0], [1.0, 0.0]], budgets=[1.0, 0.0]), "budgets"),
    (dict(gains=[[1.0, 2.0]], budgets=[1.0], temperatures=0.0), "temperatures"),
    (dict(gains=[[1.0, 2.0], [1.0, 0.0]], budgets=[1.0, 1.0], temperatures=[1.0, -1.0]), "temperatures"),
    (dict(gains=[[1.0, 2.0], [1.0, 0.0]], budgets=[1.0, 1.0], temperatures=[1.0, 1.0, 1.0]), "temperatures"),
    (dict(gains=[[1.0, 2.0]], budgets=[1.0], iterations=0), "iterations"),
])
def test_sinkhorn_rejects_bad_inputs(kwargs, word):
    with pytest.raises(ValueError, match=word):
        sinkhorn_weights(**kwargs)


def test_equal_gain_profiles_give_each_reward_its_budget_at_every_step():
    profile = torch.tensor([0.1, 0.5, 2.0, 0.0, 1.2], dtype=torch.float64)
    budgets = torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64)
    w = sinkhorn_weights(profile.repeat(3, 1), budgets, temperatures=0.7)
    expected = (budgets / budgets.sum() / 5)[:, None].expand(3, 5)
    assert torch.allclose(w, expected, rtol=0, atol=1e-9)


def test_a_row_of_zero_gains_is_uniform():
    gains = torch.tensor([[0.2, 1.0, 3.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    flat = torch.tensor([[0.2, 1.0, 3.0], [4.0, 4.0, 4.0]], dtype=torch.float64)  # g_hat of both: all ones
    assert torch.allclose(sinkhorn_weights(gains, [1, 2]), sinkhorn_weights(flat, [1, 2]), rtol=0, atol=1e-12)
    w = sinkhorn_weights(torch.zeros(2, 3), [1, 2])
    assert torch.allclose(w, torch.tensor([[1 / 9] * 3, [2 / 9] * 3], dtype=torch.float64), rtol=0, atol=1e-9)


def test_weights_are_free_of_each_rewards_gain_scale():
    gains = torch.rand(3, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    scaled = gains * torch.tensor([[1.0], [1e-4], [250.0]], dtype=torch.float64)
    w, w_scaled = sinkhorn_weights(gains, [1, 2, 3], [0.5, 1, 2]), sinkhorn_weights(scaled, [1, 2, 3], [0.5, 1, 2])
    assert torch.allclose(w, w_scaled, rtol=0, atol=1e-12)


def test_two_by_two_kernel_closed_form():
    # g_hat = gains / row mean: [[0.5, 1.5], [2, 0]]; tau = [1, 0.5] -> log K = [[0.5, 1.5], [4, 0]]
    gains, budgets, taus = [[1.0, 3.0], [2.0, 0.0]], [1.0, 3.0], [1.0, 0.5]
    cross = math.exp(0.5 + 0.0 - 1.5 - 4.0)  # K11 K22 / (K12 K21), which Sinkhorn's scalings keep
    r1, r2 = 0.25, 0.75
    # W = [[a, r1 - a], [1/2 - a, r2 - 1/2 + a]] (rows r, columns 1/2); a (a + r2 - 1/2) = cross (r1 - a)(1/2 - a)
    roots = np.roots([1 - cross, r2 - 0.5 + cross * (r1 + 0.5), -cross * r1 / 2])
    (a,) = [x.real for x in roots if max(0, r1 - 0.5) < x.real < min(r1, 0.5)]
    expected = torch.tensor([[a, r1 - a], [0.5 - a, r2 - 0.5 + a]], dtype=torch.float64)
    w = sinkhorn_weights(gains, budgets, taus, tolerance=1e-13)
    assert torch.allclose(w, expected, rtol=0, atol=1e-9)


def test_gains_telescope_and_clip_dips():
    d = torch.rand(4, 10, generator=torch.Generator().manual_seed(5), dtype=torch.float64).cumsum(-1)
    g = timestep_gains(d)
    assert torch.allclose(g.sum(-1), d[:, -1], rtol=0, atol=1e-12)
    # D(0) = 0 is prepended; the dip 0.5 -> 0.3 is a gain of 0, not -0.2; a negative D(1) gains 0
    hand = timestep_gains(torch.tensor([[0.5, 0.3, 0.9], [-0.1, 0.2, 0.2]], dtype=torch.float64))
    assert torch.allclose(hand, torch.tensor([[0.5, 0.0, 0.6], [0.0, 0.3, 0.0]], dtype=torch.float64), rtol=0, atol=1e-15)


def test_renyi_divergence_hand_values():
    assert renyi_divergence(torch.tensor([0.5, 1.5])).item() == pytest.approx(math.log(1.25), abs=1e-15)
    assert renyi_divergence(torch.tensor([0.5, 1.5]), alpha=3).item() == pytest.approx(math.log(1.75) / 2, abs=1e-15)
    r = torch.rand(2, 3, 7, generator=torch.Generator().manual_seed(6), dtype=torch.float64) * 2
    d = renyi_divergence(r, alpha=3.0)  # reduces the last dim only
    assert d.shape == (2, 3)
    np.testing.assert_allclose(d.numpy(), np.log((r.numpy() ** 3).mean(-1)) / 2, rtol=1e-13)
    assert renyi_divergence(torch.zeros(3)).item() == pytest.approx(math.log(1e-30))  # the clamp


@pytest.mark.parametrize("alpha, ratios, word", [
    (1.0, [1.0], "alpha"), (0.0, [1.0], "alpha"), (-2.0, [1.0], "alpha"),
    (2.0, [1.0, -0.5], "non-negative"), (2.0, [1.0, float("inf")], "finite"),
])
def test_renyi_divergence_rejects_bad_inputs(alpha, ratios, word):
    with pytest.raises(ValueError, match=word):
        renyi_divergence(torch.tensor(ratios), alpha)


def test_discriminability():
    # rho = conditional / prompt = [0.5, 1.5] (not prompt / conditional)
    hand = discriminability(torch.tensor([[[1.0, 3.0]]]), torch.tensor([[2.0, 2.0]]))
    assert hand.shape == (1, 1) and hand.item() == pytest.approx(math.log(1.25), abs=1e-15)
    prompt = torch.rand(2, 6, generator=torch.Generator().manual_seed(7), dtype=torch.float64) + 0.1
    assert torch.equal(discriminability(prompt[:, None, :].expand(2, 4, 6), prompt), torch.zeros(2, 4, dtype=torch.float64))
    cond = torch.rand(2, 4, 6, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    scale = torch.tensor([3.0, 1e-3], dtype=torch.float64)
    assert torch.allclose(discriminability(cond * scale[:, None, None], prompt * scale[:, None]),
                          discriminability(cond, prompt), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="nonnegative"):
        discriminability(cond, torch.cat([prompt[:, :5], torch.zeros(2, 1, dtype=torch.float64)], 1))
    with pytest.raises(ValueError, match="non-negative"):
        discriminability(-cond, prompt)
    with pytest.raises(ValueError, match=r"\[R, T, N\]"):
        discriminability(cond, prompt[:, :5])


def test_nonnegative_shifts_only_rewards_with_a_negative_minimum():
    gen = torch.Generator().manual_seed(9)
    rewards = torch.stack([torch.randn(4, 5, generator=gen, dtype=torch.float64) - 3,   # negative minimum
                           torch.rand(4, 5, generator=gen, dtype=torch.float64) + 1,    # positive
                           torch.rand(4, 5, generator=gen, dtype=torch.float64)])
    rewards[2, 1, 1] = 0.0                                                             # minimum exactly 0
    shifted, shifts = nonnegative(rewards)
    assert torch.equal(shifts, torch.tensor([rewards[0].min().item(), 0.0, 0.0], dtype=torch.float64))
    assert shifted[0].min().item() == 0.0 and torch.equal(shifted[1:], rewards[1:])
    assert torch.allclose(shifted, rewards - shifts[:, None, None], rtol=0, atol=0)
    for row, shifted_row in zip(rewards, shifted):  # a shift keeps which observation a reward prefers
        assert torch.equal(row.flatten().argsort(stable=True), shifted_row.flatten().argsort(stable=True))


def test_recast_weights_composes_the_steps():
    gen = torch.Generator().manual_seed(10)
    prompt = torch.rand(2, 16, generator=gen, dtype=torch.float64) + 0.5
    # the conditional means approach the final rewards as the chain denoises
    final = prompt * (0.2 + 1.6 * torch.rand(2, 16, generator=gen, dtype=torch.float64))
    mix = torch.linspace(0.1, 1.0, 6, dtype=torch.float64)[None, :, None]
    cond = (1 - mix) * prompt[:, None, :] + mix * final[:, None, :]
    out = recast_weights(cond, prompt, [1.0, 2.0], alpha=2.0, temperatures=[1.0, 0.5])
    d = discriminability(cond, prompt, 2.0)
    assert set(out) == {"discriminability", "gains", "weights"}
    assert torch.equal(out["discriminability"], d) and torch.equal(out["gains"], timestep_gains(d))
    assert torch.equal(out["weights"], sinkhorn_weights(timestep_gains(d), [1.0, 2.0], [1.0, 0.5]))
    assert torch.allclose((6 * out["weights"]).sum(0), torch.ones(6, dtype=torch.float64), rtol=0, atol=1e-8)
