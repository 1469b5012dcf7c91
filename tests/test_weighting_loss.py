import pytest
import torch
from diffusers import DDIMScheduler

from diffrlhf.tinyworld.architecture import SD15_SCHEDULER_CONFIG
from diffrlhf.learner.loss import ppo_clipped_loss
from diffrlhf.learner.weighting import SCHEMES, timestep_weights

T = 20


@pytest.fixture()
def chain():
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(4, T + 1, 4, 8, 8, generator=g).cumsum(1)
    sched = DDIMScheduler(**SD15_SCHEDULER_CONFIG)
    sched.set_timesteps(T)
    return latents, sched.timesteps.repeat(4, 1), sched


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_has_mean_one(chain, scheme):
    latents, ts, sched = chain
    profile = torch.rand(T, generator=torch.Generator().manual_seed(1)).double() if scheme == "oracle" else None
    w = timestep_weights(scheme, latents, ts, sched, eta=1.0, profile=profile)
    assert w.shape == (T,)
    assert torch.all(w >= 0)
    assert float(w.mean()) == pytest.approx(1.0, abs=1e-6)


def test_uniform_is_exactly_one(chain):
    w = timestep_weights("uniform", *chain)
    assert torch.equal(w, torch.ones(T))


def test_latent_sq_and_abs_are_the_measured_changes(chain):
    latents, ts, sched = chain
    d = latents[:, 1:] - latents[:, :-1]
    sq = (d**2).mean(dim=(0, 2, 3, 4))
    torch.testing.assert_close(timestep_weights("latent_sq", latents, ts), (sq / sq.mean()).float())
    ab = d.abs().mean(dim=(0, 2, 3, 4))
    torch.testing.assert_close(timestep_weights("latent_abs", latents, ts), (ab / ab.mean()).float())
    # dynamic: a batch whose late steps move more weights late steps more
    moved = latents.clone()
    moved[:, -1] += 10
    assert timestep_weights("latent_sq", moved, ts)[-1] > timestep_weights("latent_sq", latents, ts)[-1]


def test_ddim_std_is_monotone_in_t(chain):
    latents, ts, sched = chain
    w = timestep_weights("ddim_std", latents, ts, sched, eta=1.0)
    # timesteps run from high t to low t, so the std must not increase along the chain
    assert torch.all(w[1:] <= w[:-1] + 1e-7)
    assert w[0] > w[-1]


def test_gaussian_focus(chain):
    latents, ts, sched = chain
    assert int(timestep_weights("gaussian_early", latents, ts).argmax()) == 0
    assert int(timestep_weights("gaussian_late", latents, ts).argmax()) == T - 1
    assert int(timestep_weights("gaussian_mid", latents, ts).argmax()) in (T // 2 - 1, T // 2)


def test_unknown_scheme(chain):
    with pytest.raises(ValueError, match="latent_sq"):
        timestep_weights("latent_cube", *chain)


def ddpo_loss_reference(log_prob, old, adv, clip_range, adv_clip_max):
    # ddpo-pytorch's train loop, transcribed
    advantages = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss))


def test_uniform_weighting_reproduces_ddpo_loss(chain):
    latents, ts, _ = chain
    g = torch.Generator().manual_seed(1)
    logp, old = torch.randn(16, generator=g) * 1e-3, torch.randn(16, generator=g) * 1e-3
    adv = torch.randn(16, generator=g) * 3
    steps = torch.randint(0, T, (16,), generator=g)
    w = timestep_weights("uniform", latents, ts)
    ours, info = ppo_clipped_loss(logp, old, w[steps] * adv.clamp(-5, 5), 1e-4)
    ref = ddpo_loss_reference(logp, old, adv, 1e-4, 5.0)
    assert torch.equal(ours, ref)
    # and a non-uniform scheme changes it
    w2 = timestep_weights("gaussian_early", latents, ts)
    other, _ = ppo_clipped_loss(logp, old, w2[steps] * adv.clamp(-5, 5), 1e-4)
    assert not torch.equal(other, ref)


def test_clipfrac_and_kl():
    logp = torch.tensor([0.0, 0.1, -0.1, 0.0])
    old = torch.zeros(4)
    _, info = ppo_clipped_loss(logp, old, torch.ones(4), 0.05)
    assert float(info["clipfrac"]) == pytest.approx(0.5)
    assert float(info["approx_kl"]) == pytest.approx(0.5 * (0.01 + 0.01) / 4)


def test_clipping_stops_gradient_beyond_range():
    old = torch.zeros(2)
    logp = torch.tensor([0.2, 0.2], requires_grad=True)
    loss, _ = ppo_clipped_loss(logp, old, torch.tensor([1.0, -1.0]), 0.1)
    loss.backward()
    # positive advantage, ratio above 1+eps: clipped, no gradient; negative advantage: unclipped side
    assert logp.grad[0] == 0 and logp.grad[1] != 0
