"""LoRA on the UNet's attention projections through peft, in diffusers' own save format."""
from __future__ import annotations

from pathlib import Path

import torch

# The attention projections DDPO trains; model.lora_targets / model.lora_rank default to these.
DEFAULT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
DEFAULT_RANK = 4


def add_lora(unet, rank: int = DEFAULT_RANK, alpha: float | None = None, targets=DEFAULT_TARGETS, seed: int = 0) -> None:
    """Attach a trainable LoRA adapter (peft) to `unet` in place; only its weights require grad.

    peft initialises lora_A randomly and lora_B to zero, so the adapter starts as the identity;
    we seed that init so every role builds the same starting adapter.
    """
    from peft import LoraConfig

    unet.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, init_lora_weights="gaussian", target_modules=list(targets)))
    # Keep trainable LoRA weights in fp32 even if the base model is fp16/bf16.
    for p in unet.parameters():
        if p.requires_grad:
            p.data = p.data.float()


def lora_parameters(unet) -> list[torch.nn.Parameter]:
    return [p for p in unet.parameters() if p.requires_grad]


def lora_state_dict(unet) -> dict[str, torch.Tensor]:
    """The adapter's tensors by parameter name (CPU copies): what the learner broadcasts."""
    return {n: p.detach().to("cpu", copy=True) for n, p in unet.named_parameters() if "lora_" in n}


@torch.no_grad()
def load_lora_state_dict(unet, state: dict[str, torch.Tensor]) -> None:
    """Copy broadcast adapter tensors into `unet` in place (exact; names must match)."""
    params = dict(unet.named_parameters())
    missing = [n for n in params if "lora_" in n and n not in state]
    unknown = [n for n in state if n not in params]
    if missing or unknown:
        raise KeyError(f"LoRA state does not match the model: missing {missing[:3]}..., unknown {unknown[:3]}...")
    for n, t in state.items():
        params[n].copy_(t.to(params[n].device, params[n].dtype))


def save_lora(unet, folder: str | Path) -> Path:
    """Save the adapter so that stock diffusers loads it: `pipe.load_lora_weights(folder)`."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(str(folder), unet_lora_layers=layers, safe_serialization=True)
    return folder
