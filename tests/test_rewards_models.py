"""ImageReward and HPSv2 native scorers against their reference implementations.

tests/data/reward_parity/*_reference.json hold scores computed by the upstream code (the
image-reward package; open_clip with HPSv2's validation transform) on tiny random models whose
weights are generated from the parameter names (make_reference.fill_value), so the checkpoints
are rebuilt here instead of stored. make_reference.py is the script that produced them.
"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from diffrlhf.rewards import build_reward

DATA = Path(__file__).parent / "data" / "reward_parity"
_spec = importlib.util.spec_from_file_location("make_reference", DATA / "make_reference.py")
ref_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref_mod)

PROMPTS5 = ["a photo of a cat", "a dog", "red horse", "blue", "astronaut riding a horse on mars"]


def rand_images(n, size, seed):
    return np.random.RandomState(seed).randint(0, 256, size=(n, size, size, 3), dtype=np.uint8)


def load_ref(name):
    return json.loads((DATA / f"{name}_reference.json").read_text())


def upstream_state_dict(ref):
    return {k: torch.from_numpy(ref_mod.fill_value(k, tuple(s))) for k, s in ref["shapes"].items()}


def ir_vision(ref):
    v = ref["vision"]
    return dict(hidden_size=v["embed_dim"], num_hidden_layers=v["depth"], num_attention_heads=v["num_heads"],
                intermediate_size=4 * v["embed_dim"], patch_size=v["patch_size"], image_size=v["img_size"])


@pytest.fixture(scope="module")
def ir_ref():
    return load_ref("imagereward")


@pytest.fixture(scope="module")
def hps_ref():
    return load_ref("hpsv2")


@pytest.fixture(scope="module")
def ir_scorers(ir_ref):
    from diffrlhf.rewards.imagereward import ImageRewardScorer, load_bert_tokenizer

    sd, tok = upstream_state_dict(ir_ref), load_bert_tokenizer(str(DATA))
    return {b: ImageRewardScorer.from_state_dict(sd, tok, vision=ir_vision(ir_ref), text=ir_ref["text"], resize=b)
            for b in ("pil", "torch")}


@pytest.fixture(scope="module")
def hps_scorer(hps_ref):
    from diffrlhf.rewards.hpsv2 import HPSv2Scorer, build_clip, convert_open_clip_state_dict

    v, t = hps_ref["vision"], hps_ref["text"]
    model = build_clip(
        vision=dict(hidden_size=v["width"], num_hidden_layers=v["layers"], num_attention_heads=v["width"] // v["head_width"],
                    intermediate_size=int(v["width"] * v["mlp_ratio"]), patch_size=v["patch_size"], image_size=v["image_size"]),
        text=dict(hidden_size=t["width"], num_hidden_layers=t["layers"], num_attention_heads=t["heads"],
                  intermediate_size=4 * t["width"], vocab_size=t["vocab_size"], max_position_embeddings=t["context_length"]),
        projection_dim=hps_ref["embed_dim"])
    model.load_state_dict(convert_open_clip_state_dict(upstream_state_dict(hps_ref)))  # strict: every key mapped
    return HPSv2Scorer(model)


# ---------------------------------------------------------------- parity with the upstream code


def test_imagereward_tokens_match_package(ir_ref):
    from diffrlhf.rewards.imagereward import load_bert_tokenizer, tokenize

    assert tokenize(load_bert_tokenizer(str(DATA)), ir_ref["prompts"]).input_ids.tolist() == ir_ref["input_ids"]


def test_imagereward_matches_package_pil_resize(ir_ref, ir_scorers):
    for (n, size, seed), want in zip(ir_ref["image_sets"], ir_ref["scores"]):
        got = ir_scorers["pil"](rand_images(n, size, seed), ir_ref["prompts"][:n])
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{size}px")


def test_imagereward_torch_resize_close_to_package(ir_ref, ir_scorers):
    # 224 px needs no resize (exact); other sizes differ by 1-2 uint8 levels at a few pixels.
    for (n, size, seed), want in zip(ir_ref["image_sets"], ir_ref["scores"]):
        got = ir_scorers["torch"](rand_images(n, size, seed), ir_ref["prompts"][:n])
        np.testing.assert_allclose(got, want, atol=1e-5 if size == 224 else 2e-3, err_msg=f"{size}px")


def test_hpsv2_tokens_match_open_clip(hps_ref, hps_scorer):
    assert hps_scorer.tokenize(hps_ref["prompts"]).tolist() == hps_ref["input_ids"]


def test_hpsv2_matches_open_clip(hps_ref, hps_scorer):
    for (n, size, seed), want in zip(hps_ref["image_sets"], hps_ref["scores"]):
        got = hps_scorer(rand_images(n, size, seed), hps_ref["prompts"][:n])
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{size}px")


def test_hpsv2_conversion_is_strict(hps_ref):
    from diffrlhf.rewards.hpsv2 import convert_open_clip_state_dict

    sd = upstream_state_dict(hps_ref)
    out = convert_open_clip_state_dict({"module." + k: v for k, v in sd.items()})  # DDP prefix tolerated
    assert torch.equal(out["visual_projection.weight"], sd["visual.proj"].t())
    q, k, v = sd["visual.transformer.resblocks.1.attn.in_proj_weight"].chunk(3)
    assert torch.equal(out["vision_model.encoder.layers.1.self_attn.k_proj.weight"], k)
    del sd["ln_final.weight"]
    with pytest.raises(KeyError):
        convert_open_clip_state_dict(sd)


# ---------------------------------------------------------------- batching and sensitivity


@pytest.mark.parametrize("which", ["imagereward", "hpsv2"])
def test_batching_and_sensitivity(which, ir_scorers, hps_scorer):
    fn = build_reward(ir_scorers["torch"] if which == "imagereward" else hps_scorer)
    ims = rand_images(5, 64, seed=7)
    batch = fn(ims, PROMPTS5)
    single = np.concatenate([fn(ims[i : i + 1], PROMPTS5[i : i + 1]) for i in range(5)])
    np.testing.assert_allclose(batch, single, atol=1e-5)
    assert batch.dtype == np.float32 and batch.shape == (5,)
    other = ims.copy()
    other[1] = 255 - other[1]
    assert abs(fn(other[1:2], PROMPTS5[1:2])[0] - batch[1]) > 1e-4  # image changes the score
    assert abs(fn(ims[1:2], ["a photo of a cat"])[0] - batch[1]) > 1e-4  # prompt-dependent


def test_imagereward_from_checkpoint_file(tmp_path, ir_ref):
    """The spec path: ImageReward.pt + med_config.json beside it + tokenizer folder."""
    torch.save(upstream_state_dict(ir_ref), tmp_path / "ImageReward.pt")
    (tmp_path / "med_config.json").write_text(json.dumps({**ir_ref["text"], "add_cross_attention": True}))
    fn = build_reward({"name": "imagereward", "weights": str(tmp_path / "ImageReward.pt"), "tokenizer": str(DATA),
                       "vision": ir_vision(ir_ref), "resize": "pil"})
    n, size, seed = ir_ref["image_sets"][1]
    np.testing.assert_allclose(fn(rand_images(n, size, seed), ir_ref["prompts"][:n]), ir_ref["scores"][1], atol=1e-5)


def test_reference_keys_are_imagereward_pt_layout(ir_ref):
    # the tiny upstream model was built as ImageReward's module tree: keys as in ImageReward.pt
    keys = ir_ref["shapes"].keys()
    assert "blip.visual_encoder.cls_token" in keys and "blip.text_encoder.encoder.layer.0.crossattention.self.key.weight" in keys
    assert "mlp.layers.7.weight" in keys
