"""Timestep selection (learner/timesteps.py): exact inclusion probabilities, the importance
correction that keeps `weighted` unbiased (checked on the tiny UNet's real gradients), what the
update trains and counts, and the config's checks."""
import pytest
import torch

from diffrlhf.deploy.config import ConfigError, load_config
from diffrlhf.learner import update as update_module
from diffrlhf.learner.loss import ppo_clipped_loss
from diffrlhf.learner.timesteps import SELECTIONS, inclusion_probabilities, num_trained_steps, select_timesteps, systematic_sample
from diffrlhf.learner.update import PolicyLearner, UpdateSettings
from diffrlhf.learner.weighting import timestep_weights
from diffrlhf.policy.sampler import sample_trajectories


def test_inclusion_probabilities_sum_to_k_and_cap_at_one():
    w = torch.tensor([1.0, 2.0, 3.0, 2.0])
    pi = inclusion_probabilities(w, 2)
    torch.testing.assert_close(pi, torch.tensor([0.25, 0.5, 0.75, 0.5], dtype=torch.float64))
    # One weight too big for proportionality: it is capped at 1 and the rest share k - 1.
    pi = inclusion_probabilities(torch.tensor([10.0, 1.0, 1.0, 2.0]), 2)
    torch.testing.assert_close(pi, torch.tensor([1.0, 0.25, 0.25, 0.5], dtype=torch.float64))
    # Capping can cascade: after the first cap a second weight exceeds 1.
    pi = inclusion_probabilities(torch.tensor([100.0, 10.0, 1.0, 1.0]), 3)
    torch.testing.assert_close(pi, torch.tensor([1.0, 1.0, 0.5, 0.5], dtype=torch.float64))
    # Zero weights are never drawn, and k shrinks to the positive ones.
    assert inclusion_probabilities(torch.tensor([0.0, 1.0, 0.0, 3.0]), 3).tolist() == [0.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="positive"):
        inclusion_probabilities(torch.zeros(3), 1)


def test_systematic_sampling_hits_every_inclusion_probability():
    pi = inclusion_probabilities(torch.tensor([0.2, 1.0, 3.0, 0.5, 2.0, 0.3]), 3)
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.zeros(6, dtype=torch.float64)
    for _ in range(n):
        picks = systematic_sample(pi, gen)
        assert len(picks) == 3 and len(set(picks.tolist())) == 3  # k distinct steps every time
        counts[picks] += 1
    se = (pi * (1 - pi) / n).sqrt().clamp(min=1e-3)
    assert ((counts / n - pi).abs() / se).max() < 4.5, (counts / n, pi)


def test_random_and_all_are_ddpos_draws_and_top_and_window_are_what_they_say():
    w = torch.tensor([0.5, 2.0, 1.0, 0.1, 1.4, 0.9])
    steps, coef = select_timesteps("random", w, 3, 2, torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)
    assert steps.tolist() == torch.stack([torch.randperm(6, generator=gen) for _ in range(3)])[:, :2].tolist()
    assert (coef == 1).all()
    full, _ = select_timesteps("all", w, 3, 6, torch.Generator().manual_seed(5))
    again, _ = select_timesteps("random", w, 3, 6, torch.Generator().manual_seed(5))
    assert torch.equal(full, again)  # `all` is `random` at fraction 1: the same draws, the same order
    with pytest.raises(ValueError, match="timestep_fraction must be 1"):
        select_timesteps("all", w, 3, 2, torch.Generator())
    top, coef = select_timesteps("top", w, 2, 3, torch.Generator())
    assert top.tolist() == [[1, 2, 4], [1, 2, 4]] and (coef == 1).all()
    # The window slides from the first steps to the last over training, k consecutive steps.
    starts = [select_timesteps("window", w, 1, 2, torch.Generator(), progress=p)[0][0].tolist() for p in (0, 0.2, 0.5, 0.8, 1.0)]
    assert starts == [[0, 1], [1, 2], [2, 3], [4, 5], [4, 5]]
    with pytest.raises(ValueError, match="choose one of " + ", ".join(SELECTIONS)):
        select_timesteps("greedy", w, 1, 1, torch.Generator())


def test_weighted_selection_with_uniform_weights_needs_no_correction():
    steps, coef = select_timesteps("weighted", torch.ones(8), 4, 2, torch.Generator().manual_seed(1))
    torch.testing.assert_close(coef, torch.ones(4, 2))
    assert all(len(set(r)) == 2 for r in steps.tolist())


def _learner_and_batch(tiny, settings, **kw):
    s = UpdateSettings(eta=settings.eta, guidance_scale=settings.guidance_scale, lr=1e-3, batch_size=4, **kw)
    learner = PolicyLearner(tiny, s, lora_rank=4, seed=0)
    batch = sample_trajectories(tiny, ["a red circle", "a blue square"] * 2, list(range(4)), settings, 0, list(range(4)),
                                learner.negative_embeds)
    batch.advantages = torch.tensor([1.2, -0.7, 0.4, -1.0])
    return learner, batch


def _per_step_gradients(learner, batch, w, clip_range):
    """g[b, i]: the flat LoRA gradient of row b's clipped term at step i with advantage w_i * A_b, [B, T, P]."""
    learner._set_schedule(batch)
    out = torch.zeros(len(batch), batch.num_steps, sum(p.numel() for p in learner.params), dtype=torch.float64)
    for b in range(len(batch)):
        for i in range(batch.num_steps):
            r, t = torch.tensor([b]), torch.tensor([i])
            logp = learner.step_log_prob(batch.latents[r, t], batch.timesteps[r, t], batch.latents[r, t + 1], batch.prompt_embeds[r])
            loss, _ = ppo_clipped_loss(logp, batch.log_probs[r, t], w[t] * batch.advantages[r], clip_range)
            grads = torch.autograd.grad(loss, learner.params)
            out[b, i] = torch.cat([g.flatten() for g in grads]).double()
    return out


def test_weighted_selection_is_unbiased_for_the_all_steps_gradient(tiny, small_settings):
    """Over many draws, the mean gradient of `weighted` (with its correction) is the all-steps weighted
    gradient; without the correction it is not. The gradients are the tiny UNet's own, per row and step."""
    learner, batch = _learner_and_batch(tiny, small_settings)
    # Perturb the recorded log-probs so the ratios are not 1 and some terms are clipped: the
    # correction must hold for the clipped surrogate too (it is positively homogeneous in A).
    batch.log_probs = batch.log_probs + 0.02 * torch.randn(batch.log_probs.shape, generator=torch.Generator().manual_seed(3))
    w = timestep_weights("ddim_std", batch.latents, batch.timesteps, learner.c.scheduler, 1.0)
    assert w.max() / w.min() > 1.5  # weights far enough from uniform for the correction to matter
    g = _per_step_gradients(learner, batch, w, clip_range=0.01)
    full = g.mean(dim=(0, 1))
    # A draw's gradient is sum_{b,i} M[b, i] g[b, i] with M[b, i] = coef / (B k) where (b, i) was
    # drawn: draw the M's, and follow the gradient along 24 random directions (cheap, and as exacting).
    proj = g @ torch.randn(g.shape[-1], 24, generator=torch.Generator().manual_seed(4), dtype=torch.float64)  # [B, T, 24]
    b, k, n = len(batch), 2, 4_000  # at this n the uncorrected mean is ~70 s.e. off (measured), the corrected one ~2
    gen = torch.Generator().manual_seed(0)
    m_est, m_raw = torch.zeros(n, b, batch.num_steps, dtype=torch.float64), torch.zeros(n, b, batch.num_steps, dtype=torch.float64)
    for d in range(n):
        steps, coef = select_timesteps("weighted", w, b, k, gen)
        m_est[d].scatter_add_(1, steps, coef.double() / (b * k))
        m_raw[d].scatter_add_(1, steps, torch.full(steps.shape, 1.0 / (b * k), dtype=torch.float64))  # same draws, no correction
    for m, bound in ((m_est, "unbiased"), (m_raw, "biased")):
        est = torch.einsum("nbt,btp->np", m, proj)
        z = ((est.mean(0) - proj.mean((0, 1))) / (est.std(0) / n**0.5)).abs().max()  # proj.mean = full gradient, projected
        if bound == "unbiased":
            assert z < 4.5, z  # every direction within a few standard errors of the all-steps gradient
            whole = torch.einsum("bt,btp->p", m.mean(0), g)
            assert (whole - full).norm() / full.norm() < 0.05  # and the whole vector, to MC precision
        else:
            assert z > 10, z  # dropping the correction is detected


def test_the_update_trains_the_selected_steps_with_their_coefficients(tiny, small_settings, monkeypatch):
    """One optimizer step's gradient equals the mean over the selected (row, step) pairs of
    coef * per-step gradient: the update applies the selection it drew, and nothing else."""
    learner, batch = _learner_and_batch(tiny, small_settings, timestep_selection="weighted", timestep_fraction=0.5,
                                        weighting="ddim_std", clip_range=0.01)
    w = timestep_weights("ddim_std", batch.latents, batch.timesteps, learner.c.scheduler, 1.0)
    g = _per_step_gradients(learner, batch, w, clip_range=0.01)
    drawn, grads = [], []
    real_select = update_module.select_timesteps
    monkeypatch.setattr(update_module, "select_timesteps", lambda *a, **kw: drawn.append(real_select(*a, **kw)) or drawn[-1])
    monkeypatch.setattr(PolicyLearner, "_optimizer_step",
                        lambda self, scale=1.0: grads.append(torch.cat([p.grad.flatten() for p in self.params]).double()) or 0.0)
    stats = learner.update(batch)
    (steps, coef), = drawn
    assert (coef != 1).any()  # the correction is in play
    expected = (coef.double().unsqueeze(-1) * g[torch.arange(4).unsqueeze(1), steps]).mean(dim=(0, 1))
    rel = ((grads[0] - expected).norm() / expected.norm()).item()
    wrong = (g[torch.arange(4).unsqueeze(1), steps].mean(dim=(0, 1)) - expected).norm() / expected.norm()
    assert rel < 1e-4 < wrong, (rel, wrong)  # float32 batched vs one-row UNet calls differ at ~1e-6
    assert stats["steps_trained"] == 3 and stats["learner_passes"] == 4 * 3 and stats["learner_calls"] == 3


@pytest.mark.parametrize("selection", SELECTIONS)
def test_every_selection_trains_with_replay_and_counts_its_passes(tiny, small_settings, selection):
    fraction = 1.0 if selection == "all" else 0.5
    learner, batch = _learner_and_batch(tiny, small_settings, timestep_selection=selection, timestep_fraction=fraction,
                                        weighting="latent_sq", logprob_mode="recompute", inner_epochs=2, total_epochs=4)
    batch.replayed = torch.tensor([False, True, False, True])
    before = {n: t.clone() for n, t in learner.lora_state().items()}
    stats = learner.update(batch)
    k = num_trained_steps(6, fraction)
    assert stats["steps_trained"] == k and stats["learner_passes"] == 2 * 4 * k  # 2 inner epochs x 4 rows x k steps
    assert stats["learner_calls"] == 2 * k and stats["learner_forward_passes"] == 2 * 6  # 2 replayed rows recomputed
    assert stats["learner_s"] > 0 and stats["learner_passes_total"] == stats["learner_passes"]
    assert any(not torch.equal(before[n], t) for n, t in learner.lora_state().items())
    first = stats["learner_passes"]
    stats = learner.update(batch)  # `backward` trains more steps at progress 1/4 (k = 3 + floor(4/4) = 4), the others the same
    assert stats["learner_passes"] == 2 * 4 * (k + (selection == "backward"))
    assert stats["learner_passes_total"] == first + stats["learner_passes"]
    state = learner.state_dict()
    learner.passes_total = 0
    learner.load_state_dict(state)
    assert learner.passes_total == first + stats["learner_passes"]  # resumes keep the compute axis


def test_config_names_the_fix_for_all_with_a_fraction():
    assert load_config(None, overrides=["train.timestep_selection=weighted", "train.timestep_fraction=0.25"]).train.timestep_selection == "weighted"
    with pytest.raises(ConfigError, match="timestep_fraction.*must be 1 with train.timestep_selection=all"):
        load_config(None, overrides=["train.timestep_selection=all", "train.timestep_fraction=0.5"])
    with pytest.raises(ConfigError, match="choose one of " + ", ".join(SELECTIONS)):
        load_config(None, overrides=["train.timestep_selection=best"])
