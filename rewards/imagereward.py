"""ImageReward (THUDM/ImageReward, v1.0): BLIP ViT-L/16 at 224 px encodes the image; a BERT-base
text encoder with cross-attention to the image tokens reads the prompt; the [CLS] feature goes
through a 5-layer linear MLP; the score is (mlp - 0.16717362830052426) / 1.0333394966054072.

Two implementations:
- `ImageRewardScorer` (native, name "imagereward"): the same network rebuilt from transformers'
  BlipVisionModel + BlipTextModel, with ImageReward.pt's state dict converted on load. Runs in
  the core environment.
- `PackageImageReward` (name "imagereward_pkg"): calls the `image-reward` package's model. That
  package needs transformers 4.55 / timm 0.6.13 / torchvision, so it runs in its own environment
  (Ray runtime_env, see rewards/README.md and default_runtime_env).

Behaviour follows ImageReward/ImageReward.py `score`: the prompt is tokenised with BLIP's BERT
tokenizer (bert-base-uncased + [DEC] and [ENC] special tokens), padded to 35 tokens, and
input_ids[:,0] stays [CLS] (inference does not swap in [ENC]); image attention mask is all ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from PIL import Image

from ._weights import MissingWeightsError, find_weight_file, hf_cached_file
from .aesthetic import AestheticMLP
from .preprocess import clip_preprocess

WEIGHTS_FILE = "ImageReward.pt"
HF_REPO = "THUDM/ImageReward"
SCORE_MEAN = 0.16717362830052426
SCORE_STD = 1.0333394966054072
MAX_TEXT_LEN = 35

# BLIP "large" vision tower (blip_pretrain.py, vit='large': ViT-L/16, 24 layers, width 1024).
VISION_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                    patch_size=16, image_size=224, layer_norm_eps=1e-6, hidden_act="gelu")
# med_config.json of ImageReward (BERT-base, vocab 30522 + [DEC] + [ENC]); encoder_width is set
# to the vision width by BLIP_Pretrain.
MED_CONFIG = dict(vocab_size=30524, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, max_position_embeddings=512, layer_norm_eps=1e-12,
                  hidden_act="gelu", pad_token_id=0)


def build_blip(vision: dict | None = None, text: dict | None = None):
    """BlipVisionModel + BlipTextModel with ImageReward's shapes (override for tiny tests)."""
    from transformers import BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    vcfg = BlipVisionConfig(**{**VISION_LARGE, **(vision or {})})
    tkw = {**MED_CONFIG, **(text or {})}
    tkw.setdefault("encoder_hidden_size", vcfg.hidden_size)
    # transformers only builds the cross-attention blocks when config.is_decoder is set; the
    # forward pass is then called with is_decoder=False (bidirectional self-attention), which is
    # BLIP's mode='multimodal' that ImageReward uses.
    tcfg = BlipTextConfig(**tkw, is_decoder=True, use_cache=False, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    return BlipVisionModel(vcfg).eval(), BlipTextModel(tcfg, add_pooling_layer=False).eval()


def convert_state_dict(sd: dict) -> tuple[dict, dict, dict]:
    """ImageReward.pt (keys blip.visual_encoder.* timm-style ViT, blip.text_encoder.* BLIP med
    BERT, mlp.layers.*) -> (BlipVisionModel, BlipTextModel, AestheticMLP-shaped) state dicts."""
    vis, txt, mlp = {}, {}, {}
    vmap = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.qkv": "self_attn.qkv",
            "attn.proj": "self_attn.projection", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
    for k, v in sd.items():
        if k.startswith("blip.visual_encoder."):
            k = k[len("blip.visual_encoder."):]
            if k == "cls_token":
                vis["embeddings.class_embedding"] = v
            elif k == "pos_embed":
                vis["embeddings.position_embedding"] = v
            elif k.startswith("patch_embed.proj."):
                vis["embeddings.patch_embedding." + k.split(".")[-1]] = v
            elif k.startswith("norm."):
                vis["post_layernorm." + k.split(".")[-1]] = v
            elif k.startswith("blocks."):
                _, i, rest = k.split(".", 2)
                stem, leaf = rest.rsplit(".", 1)
                vis[f"encoder.layers.{i}.{vmap[stem]}.{leaf}"] = v
        elif k.startswith("blip.text_encoder."):
            k = k[len("blip.text_encoder."):]
            # BLIP's med.py is the source transformers' BlipText was ported from: names agree.
            # Its position_ids buffer and (unused) pooler are not part of the model here.
            if k.startswith(("embeddings.position_ids", "pooler.")):
                continue
            txt[k] = v
        elif k.startswith("mlp."):
            mlp[k[len("mlp."):]] = v
    return vis, txt, mlp


def find_weights(weights=None) -> str:
    """ImageReward.pt on this machine (MissingWeightsError if absent); nothing is loaded."""
    return find_weight_file("imagereward", WEIGHTS_FILE, explicit=weights, local_dirs=["~/.cache/ImageReward"],
                            hf_repos=[HF_REPO])


def load_bert_tokenizer(tokenizer: str | None = None):
    """BLIP's tokenizer: bert-base-uncased plus bos [DEC] and additional [ENC] (ids 30522, 30523).
    `tokenizer` is a folder with vocab.txt (or a vocab.txt path) or a hub id already in the HF
    cache. transformers 5 ignores BertTokenizer(vocab_file=...), so we always go through
    from_pretrained(folder)."""
    from transformers import BertTokenizer

    src = tokenizer or "bert-base-uncased"
    p = Path(src).expanduser()
    if p.is_file():
        p = p.parent
    if p.is_dir():
        tok = BertTokenizer.from_pretrained(str(p))
    else:
        searched: list[str] = []
        vocab = hf_cached_file(src, "vocab.txt", searched)
        if vocab is None:
            raise MissingWeightsError("imagereward", f"{src}/vocab.txt (BERT tokenizer)", searched,
                                      hint="pass {'tokenizer': '/folder/with/vocab.txt'} in the spec")
        tok = BertTokenizer.from_pretrained(os.path.dirname(vocab))
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tok


def tokenize(tok, prompts: list[str], max_length: int = MAX_TEXT_LEN):
    return tok(list(prompts), padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")


class ImageRewardScorer:
    name = "imagereward"

    def __init__(self, vision, text, mlp: nn.Module, tokenizer, device="cpu", dtype=torch.float32, resize="torch"):
        self.vision = vision.to(device=device, dtype=dtype).eval()
        self.text = text.to(device=device, dtype=dtype).eval()
        self.mlp = mlp.to(device=device).float().eval()  # the head runs in fp32, as upstream (.float())
        self.tokenizer = tokenizer
        self.device, self.dtype = torch.device(device), dtype
        self.image_size = vision.config.image_size
        self.resize = resize  # "torch" (batched) or "pil" (bit-exact with the package's PIL transform)

    @classmethod
    def from_state_dict(cls, sd: dict, tokenizer, vision: dict | None = None, text: dict | None = None,
                        device="cpu", dtype=torch.float32, resize="torch"):
        """Build from an ImageReward.pt-format state dict; `vision`/`text` override the BLIP-large
        / med_config shapes (tests use tiny ones)."""
        vis, txt = build_blip(vision, text)
        v_sd, t_sd, m_sd = convert_state_dict(sd)
        vis.load_state_dict(v_sd)
        txt.load_state_dict(t_sd)
        mlp = AestheticMLP(txt.config.hidden_size)  # same layer list as ImageReward's MLP
        mlp.load_state_dict(m_sd)
        return cls(vis, txt, mlp, tokenizer, device=device, dtype=dtype, resize=resize)

    @classmethod
    def from_spec(cls, weights=None, tokenizer=None, med_config=None, vision=None, device="cpu", dtype="float32",
                  resize="torch"):
        path = find_weights(weights)
        text = None
        cfg_path = med_config or os.path.join(os.path.dirname(path), "med_config.json")
        if os.path.isfile(cfg_path):  # honour a shipped med_config.json; defaults equal ImageReward's
            with open(cfg_path) as f:
                mc = json.load(f)
            text = {k: mc[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "intermediate_size", "max_position_embeddings", "layer_norm_eps") if k in mc}
        sd = torch.load(path, map_location="cpu", weights_only=True)
        dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return cls.from_state_dict(sd, load_bert_tokenizer(tokenizer), vision=vision, text=text, device=device, dtype=dt,
                                   resize=resize)

    def preprocess(self, images: np.ndarray) -> torch.Tensor:
        # torchvision Resize(224, BICUBIC) + CenterCrop(224) on a PIL image, then CLIP mean/std.
        return clip_preprocess(images, self.image_size, crop_rounding="round", backend=self.resize)

    @torch.no_grad()
    def score_tensors(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        image_embeds = self.vision(pixel_values=pixel_values.to(self.device, self.dtype)).last_hidden_state
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
        out = self.text(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                        encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts, is_decoder=False)
        feat = out.last_hidden_state[:, 0, :].float()
        return ((self.mlp(feat) - SCORE_MEAN) / SCORE_STD).squeeze(1)

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        if len(prompts) != len(images):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        t = tokenize(self.tokenizer, prompts)
        return self.score_tensors(self.preprocess(images), t.input_ids, t.attention_mask).cpu().numpy()


class PackageImageReward:
    """The `image-reward` package's own model, batched the way its `score` computes one item. Runs
    in the venv `diffrlhf reward-env build imagereward` makes (rewards/environments.py), which holds
    the offline files the package fetches from the hub (med_config.json, the BERT vocabulary).

    Weights: `weights` or ImageReward.pt from the cache when present; otherwise the package's own
    model with random weights (seeded by `seed`; the MLP head re-initialised, since the package's
    init scores every image the same), said once in the actor's log."""

    name = "imagereward_pkg"

    def __init__(self, weights=None, device="cpu", download_root=None, seed: int = 0):
        try:
            import ImageReward as RM  # noqa: N813
            from ImageReward.ImageReward import ImageReward as RewardModel
        except ImportError as e:
            raise ImportError(
                "reward 'imagereward_pkg' needs the image-reward package, which does not install beside the core "
                "stack. Run this reward in its own environment: `diffrlhf reward-env build imagereward`, then "
                "reward.runtime_env=auto; or use the native 'imagereward'."
            ) from e
        from .environments import share_dir

        self._Image = Image
        root = download_root or os.path.expanduser("~/.cache/ImageReward")
        share = share_dir()
        med_config = str(share / "med_config.json") if (share / "med_config.json").is_file() else None
        try:
            path = find_weight_file("imagereward", WEIGHTS_FILE, explicit=weights, local_dirs=[root], hf_repos=[HF_REPO])
        except MissingWeightsError:
            if weights is not None:
                raise
            path = None
        # BLIP's init_tokenizer asks for 'bert-base-uncased' by name: from `share` it finds the
        # vocabulary the builder put there; HF_HUB_OFFLINE=1 (default_runtime_env) keeps the rest local.
        cwd = os.getcwd()
        os.chdir(share if share.is_dir() else cwd)
        try:
            if path is not None:
                self.model = RM.load(path, device=device, download_root=root, med_config=med_config).eval()
            else:
                with torch.random.fork_rng():
                    torch.manual_seed(seed)
                    model = RewardModel(med_config=med_config, device=device)
                    for layer in model.mlp.layers:
                        if isinstance(layer, nn.Linear):
                            layer.reset_parameters()
                self.model = model.to(device).eval()
                print(f"[reward imagereward_pkg] no {WEIGHTS_FILE} on this node (fetch it with `diffrlhf fetch-weights imagereward`): "
                      f"scoring with the package's model on random weights (seed {seed})", flush=True)
        finally:
            os.chdir(cwd)
        self.device = device
        self.random_weights = path is None

    @torch.no_grad()
    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        m = self.model
        px = torch.stack([m.preprocess(self._Image.fromarray(im)) for im in images]).to(self.device)
        t = m.blip.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=MAX_TEXT_LEN,
                             return_tensors="pt").to(self.device)
        emb = m.blip.visual_encoder(px)
        atts = torch.ones(emb.shape[:-1], dtype=torch.long, device=self.device)
        out = m.blip.text_encoder(t.input_ids, attention_mask=t.attention_mask, encoder_hidden_states=emb,
                                  encoder_attention_mask=atts, return_dict=True)
        r = (m.mlp(out.last_hidden_state[:, 0, :].float()) - m.mean) / m.std
        return r.squeeze(1).float().cpu().numpy()
