"""Sampling SD trajectories with per-step latents and log-probs (the sampler role's work).

Randomness is per trajectory: the initial noise and every step's noise come from a generator
seeded with that trajectory's seed, so a trajectory is reproducible whatever batch it is in, on
whichever sampler (this is what lets the distributed run match the reference loop, and a retried
batch reproduce the one that was lost).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.keys import default
from diffrlhf.policy.ddim import ddim_step_with_logprob, guided_noise_pred


@dataclass(frozen=True)
class SamplingSettings:
    """How a trajectory is sampled (the sample.* keys; defaults declared in diffrlhf.keys)."""

    num_steps: int = default("sample.num_steps")
    eta: float = default("sample.eta")
    guidance_scale: float = default("sample.guidance_scale")
    resolution: int = default("sample.resolution")
    negative_prompt: str = default("sample.negative_prompt")

    def meta(self) -> dict:
        return dict(num_steps=self.num_steps, eta=self.eta, guidance_scale=self.guidance_scale,
                    resolution=self.resolution, negative_prompt=self.negative_prompt)


def gaussian_noise(generators: list[torch.Generator], shape, device, dtype) -> torch.Tensor:
    return torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]).to(device, dtype)


@torch.no_grad()
def run_chain(components, z: torch.Tensor, timesteps, prompt_embeds: torch.Tensor, negative_embeds: torch.Tensor,
              settings: SamplingSettings, gens: list[torch.Generator]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The DDIM chain from z through `timesteps` (a tail of the scheduler's, set for settings.num_steps):
    the latents after each step and each step's log-prob. Each step's noise is drawn from the row's
    generator, in step order. The one denoising loop: full samples and branches (policy/branching.py) run it."""
    unet, scheduler = components.unet, components.scheduler
    device, dtype = components.device, unet.dtype
    latent_shape = tuple(z.shape[1:])
    latents, logps = [], []
    for t in timesteps:
        eps = guided_noise_pred(unet, z, t.to(device), prompt_embeds, negative_embeds, settings.guidance_scale)
        z, logp, _, _ = ddim_step_with_logprob(scheduler, eps, t, z, settings.eta, noise=gaussian_noise(gens, latent_shape, device, dtype))
        latents.append(z)
        logps.append(logp)
    return latents, logps


@torch.no_grad()
def sample_trajectories(
    components,
    prompts: list[str],
    seeds: list[int],
    settings: SamplingSettings,
    policy_version: int,
    sample_ids: list[int],
    negative_embeds: torch.Tensor | None = None,
) -> TrajectoryBatch:
    """Run the DDIM chain for each prompt and record everything the learner needs."""
    if len(prompts) != len(seeds) or len(prompts) != len(sample_ids):
        raise ValueError(f"prompts ({len(prompts)}), seeds ({len(seeds)}) and sample_ids ({len(sample_ids)}) must match")
    unet, scheduler = components.unet, components.scheduler
    device, dtype = components.device, unet.dtype
    scheduler.set_timesteps(settings.num_steps, device="cpu")
    timesteps = scheduler.timesteps.clone()
    prompt_embeds = components.encode_prompts(prompts)
    if negative_embeds is None:
        negative_embeds = components.encode_prompts([settings.negative_prompt])
    gens = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]  # CPU generators: same noise on any device
    h = settings.resolution // components.vae_scale_factor
    latent_shape = (unet.config.in_channels, h, h)
    z = gaussian_noise(gens, latent_shape, device, dtype) * scheduler.init_noise_sigma
    steps, all_logp = run_chain(components, z, timesteps, prompt_embeds, negative_embeds, settings, gens)
    all_latents = [z] + steps
    z = all_latents[-1]
    images = components.decode_images(z)
    b = len(prompts)
    return TrajectoryBatch(
        prompts=list(prompts),
        latents=torch.stack(all_latents, dim=1).float().cpu(),
        timesteps=timesteps.long().unsqueeze(0).repeat(b, 1),
        log_probs=torch.stack(all_logp, dim=1).float().cpu(),
        prompt_embeds=prompt_embeds.float().cpu(),
        images=images,
        seeds=torch.as_tensor(seeds, dtype=torch.long),
        policy_version=torch.full((b,), int(policy_version), dtype=torch.long),
        sample_ids=torch.as_tensor(sample_ids, dtype=torch.long),
        meta=settings.meta(),
    )
