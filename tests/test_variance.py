"""The per-step variance by branching (issue 20): the estimator against processes whose per-step
variance is known in closed form, its error bars, and the branching on the tiny random model."""
import json
import math

import numpy as np
import pytest
import torch

from diffrlhf.actors.workers import SamplerWorker
from research.bench import variance
from diffrlhf.deploy.config import load_config
from diffrlhf.policy.branching import (FRESH, branch_seed, branch_trajectories, conditional_variances, pearson,
                                       per_step_variance, spearman)
from diffrlhf.policy.ddim import ddim_step_mean_std, ddim_step_with_logprob, guided_noise_pred
from diffrlhf.policy.models import load_components
from diffrlhf.policy.sampler import SamplingSettings, sample_trajectories
from diffrlhf.rewards import build_reward

# ----------------------------------------------------------------------------- a synthetic process

C = np.array([1.5, 0.2, 1.0, 0.6, 0.05, 0.8])  # per-level noise scales: level l's noise is eps_l


def branch_grid(rng, f, c, num_trajectories, num_branches):
    """rewards[P, L, M] of R = f(eps) with eps ~ N(0, I_L): level l keeps the recorded trajectory's
    eps_0..eps_{l-1} and resamples the rest in each branch (what branching does to the noise)."""
    L = len(c)
    recorded = rng.standard_normal((num_trajectories, 1, L))
    grid = np.empty((num_trajectories, L, num_branches))
    for level in range(L):
        fresh = rng.standard_normal((num_trajectories, num_branches, L))
        grid[:, level] = f(np.where(np.arange(L) < level, recorded, fresh))
    return grid


def linear(eps):
    return eps @ C


def lognormal(eps):
    return np.exp(eps @ (0.3 * C))


def lognormal_conditional_variances(c):
    """E[Var(exp(S) | eps_<l)] for S = sum c_k eps_k: with a = sum_{k<l} c_k^2 and b = sum_{k>=l} c_k^2,
    Var(exp(S) | fixed) = exp(2 S_fixed) (e^{2b} - e^b) and E[exp(2 S_fixed)] = e^{2a}."""
    sq = c**2
    out = []
    for level in range(len(c)):
        a, b = sq[:level].sum(), sq[level:].sum()
        out.append(math.exp(2 * a + b) * (math.exp(b) - 1))
    return np.array(out)


def test_linear_gaussian_shares_are_the_squared_scales():
    """R = sum_l c_l eps_l: level l adds exactly c_l^2 (independent noises); the shares sum to Var(R)."""
    rng = np.random.default_rng(0)
    grid = branch_grid(rng, linear, C, 3000, 3)
    shares, se = (x.numpy() for x in per_step_variance(grid))
    z = (shares - C**2) / se
    assert np.all(np.abs(z) < 4), f"shares {shares} vs {C**2}, z {z}"
    cond, cond_se = (x.numpy() for x in conditional_variances(grid))
    assert shares.sum() == pytest.approx(cond[0], rel=1e-12)  # telescoping: exactly E[Var(R | F_0)]
    assert abs(cond[0] - (C**2).sum()) < 4 * cond_se[0]  # = Var(R), the total
    expected_cond = np.cumsum((C**2)[::-1])[::-1]
    assert np.all(np.abs(cond - expected_cond) < 4 * cond_se)


def test_unbiased_with_two_branches():
    """With M = 2 the biased (ddof=0) variance would be half the truth; ddof=1 has no bias."""
    rng = np.random.default_rng(1)
    grid = branch_grid(rng, linear, C, 20000, 2)
    cond, cond_se = (x.numpy() for x in conditional_variances(grid))
    total = (C**2).sum()
    assert abs(cond[0] - total) < 4 * cond_se[0]
    assert abs(cond[0] / 2 - total) > 20 * cond_se[0]


def test_nonlinear_lognormal_shares_match_closed_form():
    """A reward that is not additive in the noises: the shares depend on the order, and match the closed form."""
    c = 0.3 * C
    v = lognormal_conditional_variances(c)
    expected = v - np.append(v[1:], 0.0)
    rng = np.random.default_rng(2)
    grid = branch_grid(rng, lognormal, c, 4000, 4)
    shares, se = (x.numpy() for x in per_step_variance(grid))
    z = (shares - expected) / se
    assert np.all(np.abs(z) < 4), f"shares {shares} vs {expected}, z {z}"
    assert shares.sum() == pytest.approx(conditional_variances(grid)[0][0].item(), rel=1e-12)
    # order matters for a non-additive reward: the same scale adds more variance later in the chain
    assert expected[0] / c[0] ** 2 < expected[2] / c[2] ** 2


def test_error_bars_are_calibrated():
    """Over repeated experiments the spread of the share estimates matches the reported s.e."""
    rng = np.random.default_rng(3)
    est, ses = [], []
    for _ in range(300):
        s, e = per_step_variance(branch_grid(rng, linear, C, 40, 3))
        est.append(s.numpy())
        ses.append(e.numpy())
    ratio = np.std(est, axis=0, ddof=1) / np.mean(ses, axis=0)
    assert np.all((ratio > 0.8) & (ratio < 1.2)), ratio
    assert np.all(np.abs(np.mean(est, axis=0) - C**2) < 4 * np.std(est, axis=0, ddof=1) / np.sqrt(300))


def test_estimator_input_checks():
    with pytest.raises(ValueError, match="M >= 2"):
        per_step_variance(np.zeros((3, 2, 1)))
    with pytest.raises(ValueError, match="finite"):
        per_step_variance(np.full((3, 2, 2), np.nan))


def test_correlations_against_references():
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal(20), rng.standard_normal(20)
    assert pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
    d = np.argsort(np.argsort(x)) - np.argsort(np.argsort(y))  # no ties: 1 - 6 sum d^2 / (n (n^2 - 1))
    assert spearman(x, y) == pytest.approx(1 - 6 * (d**2).sum() / (20 * (20**2 - 1)))
    assert spearman(x, np.exp(x)) == pytest.approx(1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0)  # ties get their mean rank
    assert math.isnan(pearson(np.ones(5), x[:5]))  # a flat profile (uniform) has no correlation


# ----------------------------------------------------------------------------- the branching


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    """One tiny-random model for the module: branching changes no weights."""
    return load_components(str(tiny_folder))


@pytest.fixture(scope="module")
def recorded(tiny):
    neg = tiny.encode_prompts([""])
    settings = SamplingSettings(num_steps=6, eta=1.0, guidance_scale=5.0, resolution=32)
    return sample_trajectories(tiny, ["a red circle", "two blue squares"], [11, 12], settings, 0, [0, 1], neg), neg


def test_branch_group_shares_its_prefix_and_continues_with_its_own_noise(tiny, small_settings, recorded):
    batch, neg = recorded
    k, m = 3, 3
    seeds = [branch_seed(0, p, k, j) for p in range(2) for j in range(m)]
    out = branch_trajectories(tiny, batch, k, m, seeds, small_settings, neg)
    assert len(out) == 6 and out.latents.shape == batch.latents.repeat_interleave(m, 0).shape
    for p in range(2):
        group = out.latents[p * m:(p + 1) * m]
        for j in range(m):  # the prefix z_T .. z_after_k, bit for bit, and its log-probs
            assert torch.equal(group[j, : k + 1], batch.latents[p, : k + 1])
            assert torch.equal(out.log_probs[p * m + j, :k], batch.log_probs[p, :k])
        assert not torch.equal(group[0, k + 1], group[1, k + 1]) and not torch.equal(group[1, k + 1], group[2, k + 1])
        assert len({out.images[p * m + j].numpy().tobytes() for j in range(m)}) == m
    # The first new step is a DDIM step of the policy from the shared state with the branch's own noise:
    # its mean recomputed from z_after_k, and the noise = the first draw of the branch's generator.
    z_k = out.latents[:, k]
    t = batch.timesteps[0, k]
    eps = guided_noise_pred(tiny.unet, z_k, t, out.prompt_embeds, neg, small_settings.guidance_scale)
    mean, std = ddim_step_mean_std(tiny.scheduler, eps, t, z_k, small_settings.eta)
    drawn = torch.stack([torch.randn(z_k.shape[1:], generator=torch.Generator().manual_seed(s)) for s in seeds])
    torch.testing.assert_close((out.latents[:, k + 1] - mean) / std, drawn, atol=1e-4, rtol=1e-4)
    _, logp, _, _ = ddim_step_with_logprob(tiny.scheduler, eps, t, z_k, small_settings.eta, prev_sample=out.latents[:, k + 1])
    torch.testing.assert_close(logp, out.log_probs[:, k], atol=1e-5, rtol=1e-5)


def test_fresh_branch_is_the_sampler_and_last_step_branch_has_zero_variance(tiny, small_settings, recorded):
    batch, neg = recorded
    # FRESH with the recorded seeds is the recorded sample itself (the same loop, the same noise).
    same = branch_trajectories(tiny, batch, FRESH, 1, batch.seeds.tolist(), small_settings, neg)
    assert torch.equal(same.latents, batch.latents) and torch.equal(same.images, batch.images)
    torch.testing.assert_close(same.log_probs, batch.log_probs, atol=0, rtol=0)
    # After the last step nothing is left to sample: every branch is the recorded image, zero variance.
    t_count, m = batch.num_steps, 4
    last = branch_trajectories(tiny, batch, t_count, m, [branch_seed(0, p, t_count, j) for p in range(2) for j in range(m)],
                               small_settings, neg)
    for p in range(2):
        for j in range(m):
            assert torch.equal(last.images[p * m + j], batch.images[p])
            assert torch.equal(last.latents[p * m + j], batch.latents[p])
    reward = build_reward("jpeg_compressibility")
    r = reward(last.images.numpy(), last.prompts).reshape(2, 1, m)
    assert per_step_variance(r)[0].tolist() == [0.0]


def test_branch_checks_its_inputs(tiny, small_settings, recorded):
    batch, neg = recorded
    with pytest.raises(ValueError, match="branch step"):
        branch_trajectories(tiny, batch, batch.num_steps + 1, 2, [1, 2, 3, 4], small_settings, neg)
    with pytest.raises(ValueError, match="seeds"):
        branch_trajectories(tiny, batch, 1, 2, [1, 2, 3], small_settings, neg)


def test_sampler_worker_branch_is_the_policy_function(tiny, tiny_folder, recorded, small_settings):
    """SamplerWorker.branch (the Ray role, run in-process) gives the local function's branches:
    its LoRA starts at B = 0, the base model exactly."""
    batch, neg = recorded
    cfg = load_config("tiny", overrides=[f"model.name={tiny_folder}", "model.device=cpu", "sample.num_steps=6",
                                         "sample.resolution=32", "system.torch_threads=2"])
    worker = SamplerWorker(cfg)
    seeds = [branch_seed(5, p, 2, j) for p in range(2) for j in range(2)]
    got = worker.branch(batch, 2, 2, seeds)
    want = branch_trajectories(tiny, batch, 2, 2, seeds, small_settings, neg)
    torch.testing.assert_close(got.latents, want.latents, atol=1e-6, rtol=1e-5)
    assert got.meta == want.meta and got.seeds.tolist() == seeds


def test_a_sampler_that_forgot_its_weights_loads_the_next_ones_of_the_same_version(tiny_folder, recorded):
    """After an in-run restore the kept samplers forget their weights (actors/roles.py
    stop_core_roles): the restored learner's version N is loaded even though the sampler held a
    version N before (weights the restored learner may not remake bit for bit)."""
    from diffrlhf.learner.lora import flat_lora_state, flatten_lora_state

    batch, _ = recorded
    cfg = load_config("tiny", overrides=[f"model.name={tiny_folder}", "model.device=cpu", "sample.num_steps=6",
                                         "sample.resolution=32", "system.torch_threads=2"])
    worker = SamplerWorker(cfg)
    start = flat_lora_state(worker.components.unet).to_state_dict()
    other = flatten_lora_state({k: v + 0.5 for k, v in start.items()})
    worker.branch(batch, 2, 1, [1, 2], weights=(3, flatten_lora_state(start)))
    worker.branch(batch, 2, 1, [1, 2], weights=(3, other))  # the same version: not loaded again
    assert all(torch.equal(v, start[k]) for k, v in flat_lora_state(worker.components.unet).to_state_dict().items())
    worker.forget_weights()
    worker.branch(batch, 2, 1, [1, 2], weights=(3, other))
    assert all(torch.equal(v, start[k] + 0.5) for k, v in flat_lora_state(worker.components.unet).to_state_dict().items())


@pytest.mark.slow  # 12 s: the bench command end to end (opt-in, like the other bench smoke runs); its parts are tested above
def test_variance_bench_quick(tmp_path):
    res = variance.main(["--quick", "--trajectories", "3", "--branches", "2", "--reward", "jpeg_compressibility",
                         "--out", str(tmp_path)])["jpeg_compressibility"]
    saved = json.loads((tmp_path / "variance_jpeg_compressibility.json").read_text())
    assert (tmp_path / "variance_jpeg_compressibility.png").exists() and (tmp_path / "variance_jpeg_compressibility.md").exists()
    a = saved["analysis"]
    assert np.array(saved["rewards_grid"]).shape == (3, res["setup"]["num_steps"] + 1, 2)
    assert a["shares_sum"] == pytest.approx(a["var_prompt"], rel=1e-9, abs=1e-15)
    assert a["init_noise_share"] + a["steps_sum"] == pytest.approx(a["var_prompt"], rel=1e-9, abs=1e-15)
    assert set(a["correlation"]) >= {"latent_sq", "latent_abs", "ddim_std", "gaussian_early", "gaussian_mid", "gaussian_late"}
    for s, w in a["profiles_scaled"].items():
        assert sum(w) == pytest.approx(a["steps_sum"], rel=1e-6, abs=1e-12), s
    # --reanalyse: the same analysis from the saved file alone (no sampling)
    again = variance.main(["--reanalyse", str(tmp_path / "variance_jpeg_compressibility.json")])
    assert next(iter(again.values()))["analysis"]["step_shares"] == a["step_shares"]


def test_probe_noise_is_perfect_for_the_whole_grid_and_worse_for_a_small_probe():
    """research/bench/variance.py probe_noise: a sub-grid that is the whole grid gives r = 1 and no
    deviation; a small probe of a noisy additive process (step shares known) agrees less on average."""
    from research.bench.variance import probe_noise

    rng = np.random.default_rng(0)
    s = np.array([2.0, 1.5, 1.0, 0.5, 0.25, 0.1])
    p, m, t = 40, 6, len(s)
    shared = rng.normal(size=(p, 1, 1, t)) * s
    fresh = rng.normal(size=(p, t, m, t)) * s
    keep = (np.arange(t)[None, :] < np.arange(t)[:, None])[None, :, None, :]
    steps = np.where(keep, shared, fresh).sum(-1)
    grid = np.concatenate([np.zeros((p, 1, m)), steps], axis=1)  # a FRESH level first, as the bench saves it
    rows = probe_noise(grid, sizes=((p, m), (3, 2), (p + 1, m)), draws=50)
    assert [(r["P"], r["M"]) for r in rows] == [(p, m), (3, 2)]  # a size beyond the grid is skipped
    whole, small = rows
    assert whole["r_mean"] == pytest.approx(1.0) and whole["mean_abs_dev"] == pytest.approx(0.0, abs=1e-12)
    assert small["r_mean"] < 0.99 and small["mean_abs_dev"] > 0.05 and small["queries"] == 3 * t * 2
