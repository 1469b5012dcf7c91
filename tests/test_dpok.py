"""DPOK (Fan et al. 2023): the per-step KL to the pretrained model, its place in the update, its config.

The KL is checked against independent references: torch.distributions for the closed form, and for the
update's gradient a second copy of the base UNet (no LoRA) with diffusers' own DDIM step for the means.
"""
import copy
import math

import pytest
import torch

from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.deploy.config import ConfigError, load_config
from diffrlhf.learner.lora import adapter_disabled, lora_tensors
from diffrlhf.learner.algorithms.dpok import dpok_loss
from diffrlhf.learner.loss import gaussian_kl_equal_std, ppo_clipped_loss
from diffrlhf.learner.update import ALGORITHMS, PolicyLearner, UpdateSettings
from diffrlhf.policy.ddim import guided_noise_pred
from diffrlhf.policy.sampler import sample_trajectories


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(tiny, settings, n=4, **kw):
    s = UpdateSettings(eta=settings.eta, guidance_scale=settings.guidance_scale, **kw)
    learner = PolicyLearner(tiny, s, lora_rank=4, seed=0)
    batch = sample_trajectories(tiny, ["a red circle", "a blue square"] * (n // 2), list(range(n)), settings, 0,
                                list(range(n)), learner.negative_embeds)
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])[:n]
    return learner, batch


@torch.no_grad()
def move_lora(unet, scale: float, seed: int = 1) -> None:
    """Set every lora_B to `scale` times a fixed random direction (lora_A stays at its init)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in lora_tensors(unet).items():
        if "lora_B" in name:
            p.copy_(scale * torch.randn(p.shape, generator=g))


def step_kl(learner, batch, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(KL [B] at chain step `step`, the policy's mean, the pretrained mean) for every row."""
    z, ts, nxt = batch.latents[:, step], batch.timesteps[:, step], batch.latents[:, step + 1]
    mean_pre = learner.pretrained_step_mean(z, ts, batch.prompt_embeds)
    with torch.no_grad():
        _, mean, std = learner.step(z, ts, nxt, batch.prompt_embeds)
    return gaussian_kl_equal_std(mean, mean_pre, std), mean, mean_pre


# ----------------------------------------------------------------------------- (a) the closed form


def test_closed_form_kl_and_its_gradient_match_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mu_a = torch.randn(3, 4, 8, 8, generator=g, dtype=torch.float64)
    mu_b = torch.randn(3, 4, 8, 8, generator=g, dtype=torch.float64)
    std = torch.tensor([0.3, 1.0, 0.05], dtype=torch.float64).reshape(3, 1, 1, 1)
    a1 = mu_a.clone().requires_grad_(True)
    kl = gaussian_kl_equal_std(a1, mu_b, std)
    a2 = mu_a.clone().requires_grad_(True)
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(a2, std.expand_as(a2)),
                                            torch.distributions.Normal(mu_b, std.expand_as(mu_b))).sum(dim=(1, 2, 3))
    assert kl.shape == (3,)
    torch.testing.assert_close(kl, ref, rtol=1e-12, atol=0)
    weights = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)  # a weighted sum: one gradient per row
    (grad,) = torch.autograd.grad((weights * kl).sum(), a1)
    (ref_grad,) = torch.autograd.grad((weights * ref).sum(), a2)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, weights.reshape(3, 1, 1, 1) * (mu_a - mu_b) / std**2)  # by hand
    # equal means: zero; symmetric in the means
    assert torch.equal(gaussian_kl_equal_std(mu_a, mu_a, std), torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(gaussian_kl_equal_std(mu_b, mu_a, std), kl.detach())


def test_dpok_loss_with_no_kl_and_unit_scale_is_ddpos_loss():
    g = torch.Generator().manual_seed(2)
    logp, old = torch.randn(8, generator=g) * 1e-2, torch.randn(8, generator=g) * 1e-2
    adv, kl = torch.randn(8, generator=g), torch.rand(8, generator=g)
    ref, _ = ppo_clipped_loss(logp, old, adv, 1e-2)
    loss, info = dpok_loss(logp, old, adv, 1e-2, kl, kl_coef=0.0, reward_scale=1.0)
    assert torch.equal(loss, ref) and info["kl_pretrained"] == kl.mean()
    loss, _ = dpok_loss(logp, old, adv, 1e-2, kl, kl_coef=0.3, reward_scale=2.0, kl_weights=torch.full((8,), 0.5))
    torch.testing.assert_close(loss, ppo_clipped_loss(logp, old, 2.0 * adv, 1e-2)[0] + 0.3 * (0.5 * kl).mean())


# ----------------------------------------------------------------------------- (b) zero at the LoRA's init


def test_kl_is_zero_at_the_lora_init_and_grows_with_the_move(tiny, small_settings):
    learner, batch = make(tiny, small_settings)
    assert all(torch.count_nonzero(p) == 0 for n, p in lora_tensors(tiny.unet).items() if "lora_B" in n)
    base_means = []
    for step in (0, 3, 5):
        kl, mean, mean_pre = step_kl(learner, batch, step)
        assert torch.equal(mean, mean_pre) and torch.equal(kl, torch.zeros(4)), step  # exactly, not nearly
        base_means.append(mean_pre)
    flags = {n: p.requires_grad for n, p in lora_tensors(tiny.unet).items()}
    assert all(flags.values())
    kls = []
    for scale in (1e-3, 1e-2, 1e-1):
        move_lora(tiny.unet, scale)
        kl = torch.stack([step_kl(learner, batch, step)[0] for step in (0, 3, 5)])
        assert (kl > 0).all(), (scale, kl)
        kls.append(kl.mean().item())
        # the pretrained mean does not depend on the LoRA, and bypassing it leaves it as it was
        for step, ref in zip((0, 3, 5), base_means):
            z, ts = batch.latents[:, step], batch.timesteps[:, step]
            torch.testing.assert_close(learner.pretrained_step_mean(z, ts, batch.prompt_embeds), ref, rtol=0, atol=1e-6)
        assert {n: p.requires_grad for n, p in lora_tensors(tiny.unet).items()} == flags
    assert kls[0] < kls[1] < kls[2], kls
    # a small move: the KL is quadratic in it (x10 the move, ~x100 the KL)
    assert 30 < kls[1] / kls[0] < 300, kls


# ----------------------------------------------------------------------------- (c) the update


def _captured_update(learner, batch, **settings):
    """Run one update from the learner's current state with `settings`; return (LoRA after, gradients
    of every optimizer step before clipping, stats). The learner's state is restored afterwards."""
    state = copy.deepcopy(learner.state_dict())
    saved = {k: getattr(learner.s, k) for k in settings}
    for k, v in settings.items():
        setattr(learner.s, k, v)
    grads, step = [], learner._optimizer_step

    def capture(scale=1.0):
        grads.append([p.grad.clone() for p in learner.params])
        return step(scale)

    learner._optimizer_step = capture
    try:
        stats = learner.update(TrajectoryBatch.from_ipc_bytes(batch.to_ipc_bytes()))
        after = learner.lora_state()
    finally:
        del learner._optimizer_step
        for k, v in saved.items():
            setattr(learner.s, k, v)
        learner.load_state_dict(state)
    return after, grads, stats


def test_dpok_update_without_kl_is_ddpos_and_the_kl_gradient_is_the_kls(tiny, tiny_folder, small_settings):
    from diffusers import DDIMScheduler

    from diffrlhf.policy.models import load_components

    learner, batch = make(tiny, small_settings, lr=1e-2, clip_range=1e-2, max_grad_norm=1e9, batch_size=4,
                          timestep_selection="all", weighting="ddim_std")
    move_lora(tiny.unet, 3e-2)  # away from the init, where the KL and its gradient vanish
    ddpo, g_ddpo, s_ddpo = _captured_update(learner, batch)
    plain, g_plain, s_plain = _captured_update(learner, batch, algorithm="dpok", kl_coef=0.0, reward_scale=1.0)
    assert all(torch.equal(plain[n], ddpo[n]) for n in ddpo), "dpok with kl_coef=0, reward_scale=1 must be DDPO's step"
    assert all(torch.equal(a, b) for a, b in zip(g_plain[0], g_ddpo[0]))
    assert "kl_pretrained" not in s_ddpo and s_plain["kl_pretrained"] > 0
    assert s_ddpo["learner_forward_passes"] == 0 and s_plain["learner_forward_passes"] == s_plain["learner_passes"] == 4 * 6
    beta = 0.5
    reg, g_reg, s_reg = _captured_update(learner, batch, algorithm="dpok", kl_coef=beta, reward_scale=1.0)
    assert any(not torch.equal(reg[n], ddpo[n]) for n in ddpo)
    assert s_reg["optimizer_steps"] == 1 and s_reg["kl_pretrained"] == pytest.approx(s_plain["kl_pretrained"], rel=1e-6)
    kl_grad = [(a - b) / beta for a, b in zip(g_reg[0], g_plain[0])]

    # Independent reference: the base model as a second UNet (no LoRA), diffusers' DDIM step for both
    # means (zero noise), torch.distributions' KL; the update's mean over rows and the T steps.
    base = load_components(str(tiny_folder))
    sched = DDIMScheduler(**dict(tiny.scheduler.config))
    sched.set_timesteps(batch.num_steps)
    neg = learner.negative_embeds

    def objective():
        total = 0.0
        for i in range(batch.num_steps):
            z, t = batch.latents[:, i], batch.timesteps[0, i]
            eps = guided_noise_pred(tiny.unet, z, batch.timesteps[:, i], batch.prompt_embeds, neg, small_settings.guidance_scale)
            with torch.no_grad():
                eps_pre = guided_noise_pred(base.unet, z, batch.timesteps[:, i], batch.prompt_embeds, neg,
                                            small_settings.guidance_scale)
            zero = torch.zeros_like(z)
            mean = sched.step(eps, t, z, eta=small_settings.eta, variance_noise=zero).prev_sample
            mean_pre = sched.step(eps_pre, t, z, eta=small_settings.eta, variance_noise=zero).prev_sample
            prev_t = int(t) - sched.config.num_train_timesteps // batch.num_steps  # < 0 at the last step: alpha_bar[0]
            std = small_settings.eta * math.sqrt(float(sched._get_variance(int(t), prev_t)))
            p, q = torch.distributions.Normal(mean, std), torch.distributions.Normal(mean_pre, std)
            total = total + torch.distributions.kl_divergence(p, q).sum(dim=(1, 2, 3)).mean()
        return total / batch.num_steps

    tiny.unet.train()
    obj = objective()
    ref_grad = torch.autograd.grad(obj, learner.params)
    tiny.unet.eval()
    assert float(obj.detach()) == pytest.approx(s_plain["kl_pretrained"], rel=1e-4)
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(kl_grad, ref_grad))
    den = sum(float(b.pow(2).sum()) for b in ref_grad)
    assert den > 0 and math.sqrt(num / den) < 1e-3, math.sqrt(num / den)

    # ... and a central finite difference of the same objective along a random LoRA direction, in float64
    # (in float32 the objective's rounding swamps a difference this small)
    tiny.unet.double(), base.unet.double()
    batch = batch.with_(latents=batch.latents.double(), prompt_embeds=batch.prompt_embeds.double())
    neg = neg.double()
    g = torch.Generator().manual_seed(3)
    d = [torch.randn(p.shape, generator=g) for p in learner.params]
    h = 1e-3 / math.sqrt(sum(float(x.pow(2).sum()) for x in d))

    def shifted(sign):
        with torch.no_grad():
            for p, x in zip(learner.params, d):
                p.add_(sign * h * x.double())
            val = float(objective())
            for p, x in zip(learner.params, d):
                p.sub_(sign * h * x.double())
        return val

    fd = (shifted(1) - shifted(-1)) / (2 * h)
    directional = sum(float((a * x).sum()) for a, x in zip(kl_grad, d))
    assert fd == pytest.approx(directional, rel=2e-3), (fd, directional)


def test_reward_scale_scales_the_advantage(tiny, small_settings):
    learner, batch = make(tiny, small_settings, lr=1e-2, clip_range=None, max_grad_norm=1e9, batch_size=4,
                          timestep_fraction=0.5)
    _, g1, _ = _captured_update(learner, batch, algorithm="dpok", kl_coef=0.0, reward_scale=1.0)
    _, g3, _ = _captured_update(learner, batch, algorithm="dpok", kl_coef=0.0, reward_scale=3.0)
    scale = max(float(a.abs().max()) for a in g1[0])
    assert scale > 0
    for a, b in zip(g1[0], g3[0]):
        torch.testing.assert_close(b, 3.0 * a, rtol=1e-5, atol=1e-5 * scale)  # rounding of near-zero entries
    learner.s.algorithm = "ppo"  # the learner refuses a name the config would have refused
    with pytest.raises(ValueError, match="unknown algorithm 'ppo'; choose one of ddpo, dpok"):
        learner.update(batch)


# ----------------------------------------------------------------------------- (d) config


def test_algorithm_config_defaults_and_errors():
    cfg = load_config("tiny")
    assert cfg.algorithm.name == "ddpo" and ALGORITHMS[0] == "ddpo"
    assert (cfg.algorithm.kl_coef, cfg.algorithm.reward_scale) == (UpdateSettings().kl_coef, UpdateSettings().reward_scale)
    cfg = load_config("tiny", overrides=["algorithm.name=dpok", "algorithm.kl_coef=0.2", "algorithm.reward_scale=10"])
    assert (cfg.algorithm.name, cfg.algorithm.kl_coef, cfg.algorithm.reward_scale) == ("dpok", 0.2, 10.0)
    cases = {
        "algorithm.name=ppo": r"config key 'algorithm.name': value 'ppo' is not allowed; choose one of ddpo, dpok",
        "algorithm.kl_coef=-0.1": r"config key 'algorithm.kl_coef': value -0.1 is out of range; must be >= 0",
        "algorithm.reward_scale=0": r"config key 'algorithm.reward_scale': value 0.0 is out of range; must be > 0",
        "algorithm.reward_scale=-2": r"config key 'algorithm.reward_scale'.*must be > 0",
        "algorithm.kl_coef=lots": r"config key 'algorithm.kl_coef': value 'lots' is a str, expected float",
        "algorithm.beta=0.1": r"unknown config key 'algorithm.beta'; allowed here: b2_neg_threshold, b2_pos_threshold, kl_coef, name, reward_scale",
        "algorithm=dpok": r"config key 'algorithm' is a section",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config("tiny", overrides=[override])


# ----------------------------------------------------------------------------- (e) the reference loop


def test_reference_loop_with_dpok_records_a_finite_kl(tiny_folder):
    from diffrlhf.actors.reference_loop import run_reference

    cfg = load_config("tiny", overrides=[f"model.name={tiny_folder}", "sample.num_steps=3", "sample.resolution=32",
                                         "sample.batch_size=4", "sample.batches_per_epoch=2", "train.batch_size=4",
                                         "train.epochs=2", "prompts.train=simple_animals", "replay.mode=hardmine",
                                         "replay.k=2", "algorithm.name=dpok", "algorithm.kl_coef=0.1",
                                         "algorithm.reward_scale=2"])
    records = run_reference(cfg, progress=False)
    assert [r["num_replayed"] for r in records] == [0, 2]  # hard-mined replay combines with the KL term
    for r in records:
        assert math.isfinite(r["kl_pretrained"]) and r["kl_pretrained"] >= 0 and math.isfinite(r["loss"])
        assert r["learner_forward_passes"] == r["learner_passes"]  # one pretrained forward per trained (row, step)
    assert records[1]["kl_pretrained"] > 0  # the LoRA has moved after the first epoch's update
