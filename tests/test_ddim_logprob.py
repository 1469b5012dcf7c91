"""The DDIM policy step against independent references: diffusers' scheduler and torch.distributions."""
import pytest
import torch
from diffusers import DDIMScheduler

from diffrlhf.policy.ddim import ddim_std, ddim_step_with_logprob
from diffrlhf.tinyworld.architecture import SD15_SCHEDULER_CONFIG


@pytest.fixture()
def sched():
    s = DDIMScheduler(**SD15_SCHEDULER_CONFIG)
    s.set_timesteps(20)
    return s


@pytest.mark.parametrize("step_index", [0, 7, 19])
@pytest.mark.parametrize("eta", [0.5, 1.0])
def test_step_matches_diffusers_and_normal_logprob(sched, step_index, eta):
    g = torch.Generator().manual_seed(step_index)
    x = torch.randn(3, 4, 8, 8, generator=g)
    eps = torch.randn(3, 4, 8, 8, generator=g)
    noise = torch.randn(3, 4, 8, 8, generator=g)
    t = sched.timesteps[step_index]
    prev, logp, mean, std = ddim_step_with_logprob(sched, eps, t, x, eta, noise=noise)
    # diffusers' own step with the same noise gives the same sample (mean + std * noise)
    ref_prev = sched.step(eps, t, x, eta=eta, variance_noise=noise).prev_sample
    torch.testing.assert_close(prev, ref_prev, atol=1e-5, rtol=1e-5)
    ref_mean = sched.step(eps, t, x, eta=eta, variance_noise=torch.zeros_like(noise)).prev_sample
    prev_t = t - 1000 // 20
    ref_std = eta * sched._get_variance(t, prev_t) ** 0.5 if prev_t >= 0 else None
    if ref_std is not None:
        torch.testing.assert_close(std.flatten().double(), torch.full((3,), float(ref_std), dtype=torch.float64), atol=1e-7, rtol=1e-6)
    # log-prob equals torch.distributions.Normal's on diffusers' mean and our std (mean over elements)
    ref_logp = torch.distributions.Normal(ref_mean.double(), std.double()).log_prob(prev.double()).mean(dim=(1, 2, 3))
    assert (logp.double() - ref_logp).abs().max() < 1e-5


def test_scoring_recorded_transition_gives_same_logprob(sched):
    g = torch.Generator().manual_seed(0)
    x, eps, noise = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    t = sched.timesteps[5]
    prev, logp, _, _ = ddim_step_with_logprob(sched, eps, t, x, 1.0, noise=noise)
    _, logp2, _, _ = ddim_step_with_logprob(sched, eps, t, x, 1.0, prev_sample=prev)
    assert (torch.exp(logp2 - logp) - 1).abs().max() < 1e-6
    # and a different transition has a different log-prob
    _, logp3, _, _ = ddim_step_with_logprob(sched, eps, t, x, 1.0, prev_sample=prev + 0.5)
    assert (logp3 < logp2).all()


def test_last_step_uses_alpha_bar_zero(sched):
    t = sched.timesteps[-1]  # 1 for SD1.5's steps_offset=1
    std = ddim_std(sched, t, 1.0)
    a_t, a0 = sched.alphas_cumprod[t].double(), sched.alphas_cumprod[0].double()
    expected = ((1 - a0) / (1 - a_t) * (1 - a_t / a0)).sqrt()
    assert float(std) == pytest.approx(float(expected), rel=1e-9)
    assert std > 0


def test_eta_zero_rejected(sched):
    x = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match="eta"):
        ddim_step_with_logprob(sched, x, sched.timesteps[0], x, 0.0, noise=x)
