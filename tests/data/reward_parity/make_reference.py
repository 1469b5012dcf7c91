"""Reference scores for the reward parity tests (tests/test_rewards_parity.py).

Run in the package environments, not the core one:
  /tmp/ir-venv/bin/python make_reference.py imagereward   # image-reward 1.5, transformers 4.55, torch 2.14.1
  /tmp/oc-venv/bin/python make_reference.py hpsv2          # open_clip_torch 3.x, torchvision 0.29.1
It builds each upstream model with a tiny config, fills every weight from a seeded numpy stream
keyed by the parameter name (so the core-side test regenerates the identical checkpoint without
storing it), scores a few images with the upstream code path, and writes <name>_reference.json.
"""

import json
import os
import sys
import zlib

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on mars",
           "a red dog , painting in the style of van gogh , high quality , detailed , " * 3, "blue zebra"]


def fill_value(key, shape):
    """Deterministic weights from the parameter name: numpy's legacy RandomState is stream-stable
    across versions. Norm weights near 1, matrices ~1/sqrt(fan_in), the rest N(0, 0.1^2)."""
    rs = np.random.RandomState(zlib.crc32(key.encode()))
    x = np.asarray(rs.standard_normal(shape), dtype=np.float32)  # asarray: 0-d for logit_scale
    leaf = key.rsplit(".", 1)[-1]
    is_norm = any(s in key for s in ("norm", "ln_", "LayerNorm", "ln_final", "ln_pre", "ln_post"))
    if is_norm and leaf == "weight":
        return np.asarray(1.0 + 0.1 * x, dtype=np.float32)
    if len(shape) >= 2 and "embed" not in key and "embedding" not in key and key not in ("visual.proj", "text_projection"):
        return np.asarray(x / np.sqrt(np.prod(shape[1:])), dtype=np.float32)
    if key in ("visual.proj", "text_projection"):
        return np.asarray(x / np.sqrt(shape[0]), dtype=np.float32)
    return np.asarray(0.1 * x, dtype=np.float32)


def images(n, size, seed):
    return np.random.RandomState(seed).randint(0, 256, size=(n, size, size, 3), dtype=np.uint8)


IMAGE_SETS = [(4, 224, 0), (4, 64, 1), (4, 512, 2)]


def imagereward():
    import importlib

    importlib.import_module("ImageReward")
    IRm = sys.modules["ImageReward.ImageReward"]  # the module; the package re-exports a class of that name
    from ImageReward.models.BLIP.med import BertConfig, BertModel
    from ImageReward.models.BLIP.vit import VisionTransformer
    from PIL import Image
    from transformers import BertTokenizer

    tok = BertTokenizer.from_pretrained(HERE)
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    vision = dict(embed_dim=32, depth=2, num_heads=2, patch_size=16, img_size=224)
    text = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=64, layer_norm_eps=1e-12)
    model = IRm.ImageReward.__new__(IRm.ImageReward)
    torch.nn.Module.__init__(model)
    model.device = "cpu"
    model.blip = torch.nn.Module()
    model.blip.visual_encoder = VisionTransformer(**vision)
    cfg = BertConfig(**text, hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                     add_cross_attention=True, pad_token_id=0, type_vocab_size=2)
    cfg.encoder_width = vision["embed_dim"]
    model.blip.text_encoder = BertModel(config=cfg, add_pooling_layer=False)
    model.blip.tokenizer = tok
    model.preprocess = IRm._transform(224)
    model.mlp = IRm.MLP(text["hidden_size"])
    model.mean, model.std = 0.16717362830052426, 1.0333394966054072
    sd = model.state_dict()
    shapes = {}
    for k, v in sd.items():
        if k.endswith("position_ids"):
            continue
        shapes[k] = list(v.shape)
        v.copy_(torch.from_numpy(fill_value(k, tuple(v.shape))))
    model.eval()
    scores = []
    for n, size, seed in IMAGE_SETS:
        ims = images(n, size, seed)
        # the package's public per-item API
        scores.append([float(model.score(PROMPTS[i], Image.fromarray(ims[i]))) for i in range(n)])
    ids = [tok(p, padding="max_length", truncation=True, max_length=35).input_ids for p in PROMPTS]
    return {"vision": vision, "text": text, "shapes": shapes, "image_sets": IMAGE_SETS, "prompts": PROMPTS,
            "scores": scores, "input_ids": ids}


def hpsv2():
    import open_clip
    import torchvision.transforms.functional as TF
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    vision = dict(layers=2, width=32, head_width=16, patch_size=14, image_size=224, mlp_ratio=4.0)
    text = dict(context_length=77, vocab_size=49408, width=32, heads=2, layers=2)
    model = CLIP(embed_dim=16, vision_cfg=CLIPVisionCfg(**vision), text_cfg=CLIPTextCfg(**text), quick_gelu=False)
    shapes = {}
    for k, v in model.state_dict().items():
        if k == "attn_mask" or k.endswith(".attn_mask"):
            continue
        shapes[k] = list(v.shape)
        v.copy_(torch.from_numpy(fill_value(k, tuple(v.shape))))
    model.eval()
    mean = torch.tensor((0.48145466, 0.4578275, 0.40821073)).view(3, 1, 1)
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(3, 1, 1)

    def hps_val_transform(im):
        # HPSv2's fork of open_clip, image_transform(is_train=False, resize_longest_max=True):
        # ToTensor -> ResizeMaxSize(224) (tensor bicubic resize, zero pad) -> Normalize.
        x = TF.to_tensor(im)
        h, w = x.shape[1:]
        scale = 224 / float(max(h, w))
        if scale != 1.0:
            nh, nw = round(h * scale), round(w * scale)
            x = TF.resize(x, [nh, nw], TF.InterpolationMode.BICUBIC)
            ph, pw = 224 - nh, 224 - nw
            x = TF.pad(x, padding=[pw // 2, ph // 2, pw - pw // 2, ph - ph // 2], fill=0)
        return (x - mean) / std

    tok_ids = open_clip.tokenize(PROMPTS)
    scores = []
    with torch.no_grad():
        for n, size, seed in IMAGE_SETS:
            ims = images(n, size, seed)
            px = torch.stack([hps_val_transform(im) for im in ims])
            out = model(px, tok_ids[:n])
            f_i, f_t = out[0], out[1]  # CLIP.forward returns normalised features
            scores.append(torch.diagonal(f_i @ f_t.T).tolist())
    return {"vision": vision, "text": text, "embed_dim": 16, "shapes": shapes, "image_sets": IMAGE_SETS,
            "prompts": PROMPTS, "scores": scores, "input_ids": tok_ids.tolist(),
            "versions": {"open_clip": open_clip.__version__, "torch": torch.__version__}}


if __name__ == "__main__":
    name = sys.argv[1]
    res = {"imagereward": imagereward, "hpsv2": hpsv2}[name]()
    res.setdefault("versions", {"torch": torch.__version__})
    with open(os.path.join(HERE, f"{name}_reference.json"), "w") as f:
        json.dump(res, f)
    print(name, res["scores"])
