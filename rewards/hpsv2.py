"""HPS v2 / v2.1 (tgxs002/HPSv2): an open_clip ViT-H-14 fine-tuned on human preferences. The score
is the cosine similarity of the L2-normalised image and prompt embeddings (no logit scale):
hpsv2.score computes diag(image_features @ text_features.T) on open_clip's normalised outputs.

- `HPSv2Scorer` (native, name "hpsv2"): transformers CLIPModel with ViT-H-14's shapes; the
  open_clip checkpoint (HPS_v2_compressed.pt / HPS_v2.1_compressed.pt, `state_dict`) is converted
  on load by `convert_open_clip_state_dict`. The checkpoint holds the whole model, so the
  laion2B base weights that `hpsv2.score` also downloads are not needed.
- `PackageHPSv2` (name "hpsv2_pkg"): the `hpsv2` package's open_clip fork; runs in its own
  environment (protobuf<4 and torchvision clash with the core; see rewards/README.md).

Preprocessing is HPSv2's validation transform (resize longest side to 224, bicubic on float
tensors, zero-pad to square, CLIP mean/std); tokenisation is open_clip's (77 tokens, pad 0).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

from ._weights import MissingWeightsError, find_weight_file
from .clip_tokenizer import EOT, SOT, load_clip_tokenizer, tokenize
from .preprocess import resize_longest_pad_preprocess

VERSION_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
HF_REPO = "xswu/HPSv2"

# open_clip "ViT-H-14": embed_dim 1024; vision width 1280, 32 layers, head width 80, patch 14;
# text width 1024, 16 heads, 24 layers, context 77, vocab 49408; GELU (not QuickGELU).
VIT_H_14 = dict(
    vision=dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120,
                patch_size=14, image_size=224, hidden_act="gelu", layer_norm_eps=1e-5),
    text=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
              max_position_embeddings=77, vocab_size=49408, hidden_act="gelu", layer_norm_eps=1e-5),
    projection_dim=1024,
)


def find_weights(weights=None, version: str = "v2.1") -> str:
    """The HPS checkpoint of `version` on this machine (MissingWeightsError if absent); nothing is loaded."""
    if version not in VERSION_FILES:
        raise ValueError(f"hpsv2 version must be one of {list(VERSION_FILES)}, got {version!r}")
    root = os.environ.get("HPS_ROOT") or os.path.expanduser("~/.cache/hpsv2")
    return find_weight_file("hpsv2", VERSION_FILES[version], explicit=weights, local_dirs=[root], hf_repos=[HF_REPO])


def build_clip(vision: dict | None = None, text: dict | None = None, projection_dim: int | None = None):
    from transformers import CLIPConfig, CLIPModel

    t = {**VIT_H_14["text"], **(text or {})}
    # Pool at the first EOT (open_clip pools at argmax(ids), which is the first EOT since EOT is
    # the largest id and padding is 0). eos_token_id != 2 selects that branch in transformers.
    t.update(eos_token_id=EOT, bos_token_id=SOT, pad_token_id=0)
    cfg = CLIPConfig(text_config=t, vision_config={**VIT_H_14["vision"], **(vision or {})},
                     projection_dim=projection_dim or VIT_H_14["projection_dim"])
    return CLIPModel(cfg).eval()


def _convert_block(prefix_in: str, prefix_out: str, sd: dict, out: dict, i: int):
    p, q = f"{prefix_in}.transformer.resblocks.{i}.", f"{prefix_out}.encoder.layers.{i}."
    w, b = sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"]
    for name, wi, bi in zip(("q_proj", "k_proj", "v_proj"), w.chunk(3, 0), b.chunk(3, 0)):
        out[q + f"self_attn.{name}.weight"], out[q + f"self_attn.{name}.bias"] = wi, bi
    for src, dst in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"),
                     ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
        out[q + f"{dst}.weight"], out[q + f"{dst}.bias"] = sd[p + f"{src}.weight"], sd[p + f"{src}.bias"]


def convert_open_clip_state_dict(sd: dict) -> dict:
    """open_clip CLIP (VisionTransformer + text transformer, no custom text tower) -> transformers
    CLIPModel. Projections are stored [width, embed] in open_clip and applied as x @ proj, so
    they become Linear weights by transposing."""
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    out = {}
    nv = 1 + max(int(k.split(".")[3]) for k in sd if k.startswith("visual.transformer.resblocks."))
    nt = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("transformer.resblocks."))
    out["vision_model.embeddings.class_embedding"] = sd["visual.class_embedding"]
    out["vision_model.embeddings.position_embedding.weight"] = sd["visual.positional_embedding"]
    out["vision_model.embeddings.patch_embedding.weight"] = sd["visual.conv1.weight"]
    for src, dst in (("visual.ln_pre", "vision_model.pre_layrnorm"), ("visual.ln_post", "vision_model.post_layernorm"),
                     ("ln_final", "text_model.final_layer_norm")):
        out[dst + ".weight"], out[dst + ".bias"] = sd[src + ".weight"], sd[src + ".bias"]
    for i in range(nv):
        _convert_block("visual", "vision_model", sd, out, i)
    # text tower keys have no "text." prefix in open_clip's plain CLIP class
    sd_text = {("text." + k if k.startswith("transformer.") else k): v for k, v in sd.items()}
    for i in range(nt):
        _convert_block("text", "text_model", sd_text, out, i)
    out["text_model.embeddings.token_embedding.weight"] = sd["token_embedding.weight"]
    out["text_model.embeddings.position_embedding.weight"] = sd["positional_embedding"]
    out["visual_projection.weight"] = sd["visual.proj"].t().contiguous()
    out["text_projection.weight"] = sd["text_projection"].t().contiguous()
    out["logit_scale"] = sd["logit_scale"]
    return out


class HPSv2Scorer:
    name = "hpsv2"

    def __init__(self, clip_model, device="cpu", dtype=torch.float32, tokenizer=None):
        self.model = clip_model.to(device=device, dtype=dtype).eval()
        self.tokenizer = tokenizer or load_clip_tokenizer()
        self.device, self.dtype = torch.device(device), dtype
        self.image_size = clip_model.config.vision_config.image_size
        self.context_length = clip_model.config.text_config.max_position_embeddings

    @classmethod
    def from_spec(cls, weights=None, version: str = "v2.1", device="cpu", dtype="float32"):
        path = find_weights(weights, version)
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        model = build_clip()
        model.load_state_dict(convert_open_clip_state_dict(ckpt.get("state_dict", ckpt)))
        return cls(model, device=device, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)

    def preprocess(self, images: np.ndarray) -> torch.Tensor:
        return resize_longest_pad_preprocess(images, self.image_size)

    def tokenize(self, prompts: list[str]) -> torch.Tensor:
        return tokenize(prompts, self.context_length, self.tokenizer)

    @staticmethod
    def _features(out) -> torch.Tensor:
        return out if isinstance(out, torch.Tensor) else out.pooler_output  # transformers 5 returns outputs

    @torch.no_grad()
    def score_tensors(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        img = self._features(self.model.get_image_features(pixel_values=pixel_values.to(self.device, self.dtype)))
        txt = self._features(self.model.get_text_features(input_ids=input_ids.to(self.device)))
        img = img / img.norm(dim=-1, keepdim=True)
        txt = txt / txt.norm(dim=-1, keepdim=True)
        return (img * txt).sum(-1).float()

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        if len(prompts) != len(images):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        return self.score_tensors(self.preprocess(images), self.tokenize(prompts)).cpu().numpy()


class PackageHPSv2:
    """The `hpsv2` package's model and transforms (its open_clip fork), batched. Runs in the venv
    `diffrlhf reward-env build hpsv2` makes (rewards/environments.py).

    Weights: `weights` or the HPS checkpoint of `version` from the cache when present; otherwise
    the package's ViT-H-14 on random weights (seeded by `seed`), said once in the actor's log."""

    name = "hpsv2_pkg"

    def __init__(self, weights=None, version: str = "v2.1", device="cpu", seed: int = 0):
        try:
            from hpsv2.src.open_clip import create_model_and_transforms, get_tokenizer
        except ImportError as e:
            raise ImportError(
                "reward 'hpsv2_pkg' needs the hpsv2 package, which does not install beside the core stack "
                "(protobuf<4 breaks Ray; open_clip needs torchvision). Run it in its own environment: "
                "`diffrlhf reward-env build hpsv2`, then reward.runtime_env=auto; or use the native 'hpsv2'."
            ) from e

        self._Image = Image
        root = os.environ.get("HPS_ROOT") or os.path.expanduser("~/.cache/hpsv2")
        try:
            path = find_weight_file("hpsv2", VERSION_FILES[version], explicit=weights, local_dirs=[root], hf_repos=[HF_REPO])
        except MissingWeightsError:
            if weights is not None:
                raise
            path = None
        # pretrained=None: the HPS checkpoint overwrites every weight, so the laion2B base
        # download that hpsv2.score performs is skipped.
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model, _, preprocess_val = create_model_and_transforms(
                "ViT-H-14", None, precision="fp32", device=device, jit=False, force_quick_gelu=False,
                force_custom_text=False, force_patch_dropout=False, force_image_size=None, pretrained_image=False,
                image_mean=None, image_std=None, light_augmentation=True, aug_cfg={}, output_dict=True,
                with_score_predictor=False, with_region_predictor=False)
        if path is not None:
            ckpt = torch.load(path, map_location=device)
            model.load_state_dict(ckpt["state_dict"])
        else:
            print(f"[reward hpsv2_pkg] no {VERSION_FILES[version]} on this node (fetch it with `diffrlhf fetch-weights hpsv2`): "
                  f"scoring with the package's ViT-H-14 on random weights (seed {seed})", flush=True)
        self.model, self.preprocess, self.tokenizer = model.eval(), preprocess_val, get_tokenizer("ViT-H-14")
        self.device = device
        self.random_weights = path is None

    @torch.no_grad()
    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        px = torch.stack([self.preprocess(self._Image.fromarray(im)) for im in images]).to(self.device)
        out = self.model(px, self.tokenizer(list(prompts)).to(self.device))
        return (out["image_features"] * out["text_features"]).sum(-1).float().cpu().numpy()
