"""Tests that pin each documented definition of the method to exact values computed by hand.

Each expected value here is computed independently of the code under test (from the scheduler's
alphas_cumprod, from rewards, from explicit latent changes), so changing a definition (sigma_t ->
sigma_t^2 in `ddim_std`, dropping the lower advantage clip, reversing the replay's tie order, ...)
fails a test here, not only a property such as "mean 1" or "monotone".
"""
import math

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler

from diffrlhf.buffer.advantages import AdvantageComputer
from diffrlhf.buffer.replay import ReplayBuffer
from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.learner.timesteps import num_trained_steps, select_timesteps
from diffrlhf.learner.weighting import SCHEMES, latent_change, timestep_weights
from diffrlhf.policy.ddim import ddim_std, ddim_step_mean_std

# --------------------------------------------------------------------------- timestep weights

T = 10  # inference steps
ETA = 1.0
# SD1.5's scheduler config, written out here (not imported from the package) so the test stands alone.
SD15 = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
            set_alpha_to_one=False, steps_offset=1, clip_sample=False, prediction_type="epsilon")

# The latent change of step i (state i -> state i+1) for each batch row and latent element: [B=2, T, E=2].
# Not separable into (row) x (step) factors, so a per-step mean over rows and elements is the only
# reduction that gives these weights.
DELTAS = np.array([
    [[i + 1, -(T - i)] for i in range(T)],                                 # row 0
    [[3 if i % 2 == 0 else -1, 0.5 * (i - 4)] for i in range(T)],          # row 1
], dtype=np.float64)
Z0 = np.array([[5.0, -2.0], [0.5, 1.0]])  # the initial latents of the two rows
PROFILE = np.array([0.5, 2.0, 0.0, 1.0, 3.0, 0.25, 0.75, 1.5, 0.1, 0.9])  # an `oracle` probe's per-step variance
WIDTHS = (0.2, 0.35)  # gaussian_width: the default and one other


@pytest.fixture(scope="module")
def schedule():
    sched = DDIMScheduler(**SD15)
    sched.set_timesteps(T)
    return sched


def known_latents() -> torch.Tensor:
    """[B, T+1, C=1, h=2, w=1] latents whose step changes are exactly DELTAS."""
    z = np.concatenate([Z0[:, None, :], Z0[:, None, :] + np.cumsum(DELTAS, axis=1)], axis=1)  # [B, T+1, E]
    return torch.tensor(z, dtype=torch.float64).reshape(2, T + 1, 1, 2, 1)


def mean_one(x) -> np.ndarray:
    """The documented normalisation: sum_i w_i = T (mean 1 over the T steps)."""
    x = np.asarray(x, dtype=np.float64)
    return x * (len(x) / x.sum())


def hand_ddim_sigma(sched, eta: float) -> np.ndarray:
    """DDIM's std (eq. 16) at each of the chain's timesteps, from alphas_cumprod alone:
    sigma_t = eta * sqrt((1 - a_prev) / (1 - a_t)) * sqrt(1 - a_t / a_prev), where a_prev is the
    alpha_bar of the chain's next timestep and, after the last one, alphas_cumprod[0] (SD1.5's
    set_alpha_to_one=False: diffusers' final_alpha_cumprod)."""
    ac = sched.alphas_cumprod.double().numpy()
    ts = [int(t) for t in sched.timesteps]
    out = []
    for i, t in enumerate(ts):
        a_t = ac[t]
        a_prev = ac[ts[i + 1]] if i + 1 < len(ts) else float(sched.final_alpha_cumprod)
        out.append(eta * math.sqrt((1 - a_prev) / (1 - a_t)) * math.sqrt(1 - a_t / a_prev))
    return np.array(out)


def _gaussian(centre):
    def expected(sched, width):
        u = np.array([i / (T - 1) for i in range(T)])
        return mean_one([math.exp(-((x - centre) ** 2) / (2 * width**2)) for x in u])
    return expected


EXPECTED = {
    "uniform": lambda sched, width: np.ones(T),
    "latent_sq": lambda sched, width: mean_one((DELTAS**2).mean(axis=(0, 2))),
    "latent_abs": lambda sched, width: mean_one(np.abs(DELTAS).mean(axis=(0, 2))),
    "ddim_std": lambda sched, width: mean_one(hand_ddim_sigma(sched, ETA)),
    "gaussian_early": _gaussian(0.0),
    "gaussian_mid": _gaussian(0.5),
    "gaussian_late": _gaussian(1.0),
    "oracle": lambda sched, width: mean_one(PROFILE),
}


def test_every_scheme_has_a_pinned_expectation():
    assert set(EXPECTED) == set(SCHEMES), "a timestep weighting scheme without exact expected weights in this file"


def test_the_schedule_is_sd15s():
    """The chain's timesteps and alphas_cumprod the expectations are built from, themselves pinned."""
    sched = DDIMScheduler(**SD15)
    sched.set_timesteps(T)
    assert [int(t) for t in sched.timesteps] == [901, 801, 701, 601, 501, 401, 301, 201, 101, 1]
    betas = np.linspace(0.00085**0.5, 0.012**0.5, 1000) ** 2
    np.testing.assert_allclose(sched.alphas_cumprod.double().numpy(), np.cumprod(1 - betas), rtol=1e-5)
    assert float(sched.final_alpha_cumprod) == float(sched.alphas_cumprod[0])


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_scheme_weights_are_exactly_the_definition(schedule, scheme, width):
    assert scheme in EXPECTED, f"no pinned expectation for the scheme {scheme!r}"
    timesteps = schedule.timesteps.repeat(2, 1)  # [B, T], as the learner passes them
    profile = torch.tensor(PROFILE) if scheme == "oracle" else None
    got = timestep_weights(scheme, known_latents(), timesteps, schedule, eta=ETA, gaussian_width=width, profile=profile)
    expected = EXPECTED[scheme](schedule, width)
    assert got.shape == (T,)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=0, atol=1e-6)


def test_ddim_std_is_the_samplers_std_and_diffusers(schedule):
    """ddim_std (unnormalised) is sigma_t itself (not its square), the std the policy samples with,
    and diffusers' own eta * sqrt(variance) at every step that has a previous timestep."""
    ts = schedule.timesteps
    for eta in (1.0, 0.5):
        sigma = hand_ddim_sigma(schedule, eta)
        got = ddim_std(schedule, ts, eta)
        np.testing.assert_allclose(got.numpy(), sigma, rtol=1e-9, atol=0)
        for i, t in enumerate(ts):
            x = torch.zeros(1, 4, 2, 2)
            _, std = ddim_step_mean_std(schedule, x, t, x, eta)
            assert float(std) == pytest.approx(sigma[i], rel=1e-6)
            if i + 1 < len(ts):
                assert eta * float(schedule._get_variance(t, ts[i + 1])) ** 0.5 == pytest.approx(sigma[i], rel=1e-5)
    assert sigma[0] / sigma[-1] > 10  # the schedule is far from flat: sigma and sigma^2 normalise differently


def test_latent_change_over_ranks_is_the_mean_over_every_ranks_rows():
    """latent_change with `reduce`: rank 0 holds row 0, rank 1 rows 1-2; the result is the mean of
    |dz|^p over all three rows and their elements, not rank 0's own mean (unnormalised)."""
    deltas = np.concatenate([DELTAS, 2 * DELTAS[:1] + 1], axis=0)  # [3, T, E]
    z = np.concatenate([np.zeros((3, 1, 2)), np.cumsum(deltas, axis=1)], axis=1)
    lat = torch.tensor(z).reshape(3, T + 1, 1, 2, 1)
    for power in (1, 2):
        expected = (np.abs(deltas) ** power).mean(axis=(0, 2))
        d_other = (lat[1:, 1:] - lat[1:, :-1]).abs() ** power
        other = torch.cat([d_other.sum(dim=(0, 2, 3, 4)), torch.tensor([2.0 * 2])])  # rank 1's sums and its element count per step
        got = latent_change(lat[:1], power, reduce=lambda t: t + other)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)
        np.testing.assert_allclose(latent_change(lat, power).numpy(), expected, rtol=1e-12)  # one rank: the same


# --------------------------------------------------------------------------- advantage clipping

def hand_normalise(r) -> np.ndarray:
    r = np.asarray(r, dtype=np.float64)
    return (r - r.mean()) / (np.sqrt(((r - r.mean()) ** 2).mean()) + 1e-6)  # population std, + 1e-6 (DDPO)


def assert_clipped_both_sides(adv, unclipped, clip):
    """Rows beyond +/-clip are exactly +/-clip; the others are the hand normalisation."""
    assert adv.dtype == np.float32
    low, high = unclipped < -clip, unclipped > clip
    inside = ~(low | high)
    assert low.any() and high.any() and inside.any(), "the rewards must exceed the clip on both sides"
    assert (adv[low] == np.float32(-clip)).all() and (adv[high] == np.float32(clip)).all()
    assert adv.min() == np.float32(-clip) and adv.max() == np.float32(clip)
    np.testing.assert_allclose(adv[inside], unclipped[inside], rtol=1e-6, atol=1e-7)


CLIP = 1.25
GROUP_A = [-20.0, -1.0, 0.0, 1.0, 2.0, 25.0]
GROUP_B = [100.0, 101.0, 130.0, 99.0, 70.0, 100.5]
PROMPTS = ["a"] * 6 + ["b"] * 6


def test_batch_advantages_are_clipped_on_both_sides():
    r = np.array([-50.0, -3.0, -1.0, 0.0, 1.0, 2.0, 4.0, 60.0])
    adv = AdvantageComputer("batch", clip_max=CLIP)(["p"] * 8, r)
    assert_clipped_both_sides(adv, hand_normalise(r), CLIP)


def test_group_advantages_are_clipped_on_both_sides():
    r = np.array(GROUP_A + GROUP_B)
    adv = AdvantageComputer("group", clip_max=CLIP)(PROMPTS, r)
    unclipped = np.concatenate([hand_normalise(GROUP_A), hand_normalise(GROUP_B)])
    assert_clipped_both_sides(adv, unclipped, CLIP)


def test_per_prompt_advantages_are_clipped_on_both_sides():
    ac = AdvantageComputer("per_prompt", clip_max=CLIP, buffer_size=16, min_count=6)
    r1 = np.array(GROUP_A + GROUP_B)
    adv1 = ac(PROMPTS, r1)  # 6 rewards per prompt >= min_count: each prompt's own statistics
    assert_clipped_both_sides(adv1, np.concatenate([hand_normalise(GROUP_A), hand_normalise(GROUP_B)]), CLIP)
    # A second epoch: each prompt is normalised by its history (first + second epoch, 12 <= 16 rewards).
    new_a, new_b = [30.0, 0.5, -30.0], [100.0, 160.0, 40.0]
    adv2 = ac(["a"] * 3 + ["b"] * 3, np.array(new_a + new_b))
    unclipped = []
    for hist, new in ((GROUP_A + new_a, new_a), (GROUP_B + new_b, new_b)):
        h = np.array(hist)
        unclipped += list((np.array(new) - h.mean()) / (h.std() + 1e-6))
    assert_clipped_both_sides(adv2, np.array(unclipped), CLIP)


# --------------------------------------------------------------------------- replay

def rows(epoch, adv, t=2):
    n = len(adv)
    return TrajectoryBatch(
        prompts=[f"p{epoch}-{i}" for i in range(n)],
        latents=torch.zeros(n, t + 1, 1, 1, 1), timesteps=torch.arange(t).repeat(n, 1), log_probs=torch.zeros(n, t),
        prompt_embeds=torch.zeros(n, 1, 1), images=torch.zeros(n, 1, 1, 3, dtype=torch.uint8), seeds=torch.arange(n),
        policy_version=torch.full((n,), epoch), sample_ids=torch.arange(n) + 100 * epoch,
        rewards=torch.zeros(n), advantages=torch.as_tensor(adv, dtype=torch.float32),
    )


def test_hardmine_ranks_by_abs_advantage_and_breaks_ties_newest_epoch_first_then_row_order():
    buf = ReplayBuffer(max_epochs=2, mode="hardmine", k=6)
    buf.add(1, rows(1, [2.0, -3.0, 3.0, 1.0]))
    buf.add(2, rows(2, [-3.0, 2.0, 0.5, 3.0]))
    buf.add(3, rows(3, [9.0, 9.0, 9.0, 9.0]))  # the current epoch: never replayed
    sel = buf.sample_hardmined(3)
    # |A| = 3: epoch 2's rows 0, 3, then epoch 1's rows 1, 2; |A| = 2: epoch 2's row 1, then epoch 1's row 0.
    assert sel.sample_ids.tolist() == [200, 203, 101, 102, 201, 100]
    assert sel.advantages.tolist() == [-3.0, 3.0, -3.0, 3.0, 2.0, 2.0]  # the sign is kept, only |A| ranks
    batch = buf.training_batch(3)
    assert batch.sample_ids.tolist() == [300, 301, 302, 303, 200, 203, 101, 102, 201, 100]
    assert batch.replayed.tolist() == [False] * 4 + [True] * 6
    assert buf.sample_hardmined(3, k=3).sample_ids.tolist() == [200, 203, 101]  # the first k of the same ranking
    assert len(buf.sample_hardmined(3, k=100)) == 8  # k beyond the past rows: all of them


def test_hardmine_window_is_the_last_max_epochs_epochs_and_the_buffer_is_bounded():
    buf = ReplayBuffer(max_epochs=2, mode="hardmine", k=3)
    advs = {0: [50.0, 40.0], 1: [30.0, 0.1], 2: [20.0, 0.2], 3: [10.0, 0.3], 4: [60.0, 60.0]}
    for e in range(4):
        buf.add(e, rows(e, advs[e]))
    # At epoch 3 the window is epochs 1 and 2 (3 - max_epochs .. 2); epoch 0 (the largest |A|) has left it.
    assert sorted(buf.epochs) == [1, 2, 3] and len(buf) == 6
    assert buf.sample_hardmined(3).sample_ids.tolist() == [100, 200, 201]
    buf.add(4, rows(4, advs[4]))
    assert sorted(buf.epochs) == [2, 3, 4] and len(buf) == 6  # the bound: max_epochs + 1 epochs, whatever was run
    assert buf.sample_hardmined(4).sample_ids.tolist() == [200, 300, 301]
    for e in range(5, 40):
        buf.add(e, rows(e, [float(e), -1.0]))
        assert sorted(buf.epochs) == [e - 2, e - 1, e] and len(buf) == 6
    # Without replay nothing past is read, so nothing past is kept: only the current epoch.
    for mode, k in (("none", 3), ("hardmine", 0)):
        plain = ReplayBuffer(max_epochs=2, mode=mode, k=k)
        for e in range(4):
            plain.add(e, rows(e, advs[e]))
            assert sorted(plain.epochs) == [e] and plain.training_batch(e).sample_ids.tolist() == [100 * e, 100 * e + 1]
    # The window filter itself, apart from eviction: an epoch older than the window is never replayed
    # even while it is still stored (here stored by hand).
    buf.epochs[36] = rows(36, [1000.0, 1000.0])
    assert set(buf.sample_hardmined(39, k=4).policy_version.tolist()) == {37, 38}
    # max_epochs = 0 keeps only the current epoch: nothing to replay.
    none = ReplayBuffer(max_epochs=0, mode="hardmine", k=3)
    none.add(0, rows(0, [5.0]))
    none.add(1, rows(1, [1.0]))
    assert sorted(none.epochs) == [1] and none.sample_hardmined(1) is None
    assert none.training_batch(1).sample_ids.tolist() == [100]


# --------------------------------------------------------------------------- timestep selection

def test_weighted_selection_coefficient_is_k_over_t_pi():
    """c_i = k / (T pi_i) (Horvitz-Thompson), computed by hand for an uncapped, a capped and a
    zero-weight case. Uncapped with mean-one weights, pi_i = k w_i / T, so c_i = 1 / w_i."""
    gen = torch.Generator().manual_seed(0)
    w = torch.tensor([0.5, 1.5, 1.0, 1.0, 0.25, 1.75])  # sum 6 = T
    steps, coef = select_timesteps("weighted", w, 200, 2, gen)
    torch.testing.assert_close(coef, (1 / w)[steps])
    # capped: pi = [1, 1/3, 1/3, 1/3] (step 0's 2 * 2.5 / 4 > 1 is cut to 1, the rest share k - 1 = 1)
    w = torch.tensor([2.5, 0.5, 0.5, 0.5])
    steps, coef = select_timesteps("weighted", w, 200, 2, gen)
    hand = {0: 2 / (4 * 1.0), 1: 2 / (4 / 3), 2: 2 / (4 / 3), 3: 2 / (4 / 3)}  # [0.5, 1.5, 1.5, 1.5]
    assert ((steps == 0).sum(dim=1) == 1).all()  # pi_0 = 1: step 0 in every draw, once
    torch.testing.assert_close(coef, torch.tensor([[hand[int(s)] for s in r] for r in steps]))
    # zero weights: k = 3 shrinks to the 2 positive steps, pi = [0, 1, 0, 1], c = 2 / (4 * 1)
    steps, coef = select_timesteps("weighted", torch.tensor([0.0, 2.0, 0.0, 2.0]), 5, 3, gen)
    assert steps.shape == (5, 2) and sorted(steps[0].tolist()) == [1, 3]
    torch.testing.assert_close(coef, torch.full((5, 2), 0.5))


def test_num_trained_steps_rounds_and_keeps_one():
    """k = round(T * fraction), at least 1."""
    assert num_trained_steps(10, 0.29) == 3  # 2.9 rounds up (int() would truncate to 2)
    assert num_trained_steps(10, 0.21) == 2
    assert num_trained_steps(50, 0.25) == 12  # 12.5: Python's round, half to even
    assert num_trained_steps(10, 0.01) == 1 and num_trained_steps(10, 1.0) == 10


def test_oracle_weights_are_the_positive_part_of_each_steps_variance_share():
    """`oracle`'s w_i (before the mean-one scaling) = max(0, V_i - V_{i+1}), V_k = the mean over
    trajectories of the within-group variance (ddof 1) of the M branches sharing the state after k
    steps, V_T = 0; a share that sampling noise puts below 0 weighs 0 (not |share|)."""
    from diffrlhf.learner.weighting import oracle_profile

    # rewards[P=2, T=3 levels, M=3 branches]: level 1 varies more than level 0, so step 0's share is < 0
    r = np.array([[[0.0, 1.0, 2.0], [0.0, 3.0, 6.0], [1.0, 1.0, 4.0]],
                  [[2.0, 2.0, 5.0], [1.0, 1.0, 1.0], [0.0, 2.0, 4.0]]])
    v = np.array([np.mean([np.var(r[p, k], ddof=1) for p in range(2)]) for k in range(3)])  # [2.0, 4.5, 3.5]
    shares = v - np.append(v[1:], 0.0)  # [-2.5, 1.0, 3.5]
    assert shares[0] < 0
    np.testing.assert_allclose(oracle_profile(r).numpy(), np.maximum(shares, 0.0), rtol=1e-12)
    got = timestep_weights("oracle", torch.zeros(1, 4, 1), torch.arange(3), profile=oracle_profile(r))
    np.testing.assert_allclose(got.double().numpy(), mean_one(np.maximum(shares, 0.0)), atol=1e-6)
