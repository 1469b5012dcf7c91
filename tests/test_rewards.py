"""Reward functions: JPEG values, preprocessing, tokenisation, tiny-config learned models, spec
handling (custom callables, weighted sums, runtime envs) and the missing-weights error."""

import io
import re
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffrlhf.rewards import MissingWeightsError, build_reward, default_runtime_env, requirements
from diffrlhf.rewards import preprocess as pp

PARITY_DIR = Path(__file__).parent / "data" / "reward_parity"
MEAN = np.array(pp.CLIP_MEAN, dtype=np.float32)
STD = np.array(pp.CLIP_STD, dtype=np.float32)


def rand_images(n, h, w=None, seed=0):
    return np.random.RandomState(seed).randint(0, 256, size=(n, h, w or h, 3), dtype=np.uint8)


def smooth_images(n, h, seed=0):
    # low-frequency content so JPEG sizes differ clearly between images
    rs = np.random.RandomState(seed)
    small = rs.randint(0, 256, size=(n, 4, 4, 3), dtype=np.uint8)
    return np.stack([np.asarray(Image.fromarray(s).resize((h, h), Image.BILINEAR)) for s in small])


# ---------------------------------------------------------------- JPEG


def pil_jpeg_kb(im, quality=95):
    buf = io.BytesIO()
    Image.fromarray(im).save(buf, format="JPEG", quality=quality)
    return len(buf.getvalue()) / 1000.0


def test_jpeg_matches_direct_pil():
    ims = np.concatenate([rand_images(3, 64), smooth_images(3, 64)])
    inc = build_reward("jpeg_incompressibility")(ims, [""] * 6)
    com = build_reward({"name": "jpeg_compressibility"})(ims, [""] * 6)
    want = np.array([pil_jpeg_kb(im) for im in ims], dtype=np.float32)
    assert inc.dtype == np.float32 and inc.shape == (6,)
    np.testing.assert_allclose(inc, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(com, -want, rtol=0, atol=1e-6)
    assert inc[:3].min() > inc[3:].max()  # noise is less compressible than smooth images


def test_jpeg_quality_kwarg():
    ims = rand_images(2, 32)
    got = build_reward({"name": "jpeg_incompressibility", "quality": 50})(ims, ["", ""])
    np.testing.assert_allclose(got, [pil_jpeg_kb(im, 50) for im in ims], atol=1e-6)


def test_shuffled_jpeg_control_gives_each_image_another_images_reward():
    ims = np.concatenate([rand_images(2, 32), smooth_images(3, 32)])
    fn = build_reward("research.controls:ShuffledJpegCompressibility")
    got = fn(ims, [""] * 5)
    want = -np.array([pil_jpeg_kb(im) for im in ims], dtype=np.float32)
    np.testing.assert_allclose(got, want[[1, 2, 3, 4, 0]], atol=1e-6)  # image i scored as image i+1
    assert got.mean() == pytest.approx(want.mean(), abs=1e-6)  # the logged mean is still the samples' mean
    # An image's own reward does not depend on it: change image 0 and only image 4's reward moves.
    ims2 = ims.copy()
    ims2[0] = smooth_images(1, 32)[0]
    got2 = fn(ims2, [""] * 5)
    assert got2[0] == got[0] and np.array_equal(got2[1:4], got[1:4]) and got2[4] != got[4]
    with pytest.raises(ValueError, match="at least 2 images"):
        fn(ims[:1], [""])


# ---------------------------------------------------------------- preprocessing


def test_clip_preprocess_normalisation_by_hand():
    ims = rand_images(2, 224)
    got = pp.clip_preprocess(ims, 224).numpy()
    want = ((ims.astype(np.float32) / 255.0 - MEAN) / STD).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("rounding,top", [("floor", 57), ("round", 58)])
def test_clip_preprocess_resize_and_crop_pil_exact(rounding, top):
    # 303x200 -> shortest side 224 -> 339x224 (int(224*303/200)); 339-224=115 is odd, so the
    # transformers (floor: 57) and torchvision (round: 58) crop offsets differ.
    im = rand_images(1, 303, 200, seed=3)
    got = pp.clip_preprocess(im, 224, crop_rounding=rounding, backend="pil").numpy()[0]
    r = np.asarray(Image.fromarray(im[0]).resize((224, 339), Image.BICUBIC)).astype(np.float32)
    want = ((r[top : top + 224] / 255.0 - MEAN) / STD).transpose(2, 0, 1)
    assert got.shape == (3, 224, 224)
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("size", [64, 512])
def test_torch_resize_close_to_pil(size):
    ims = rand_images(2, size, seed=size)
    t = pp.resize(pp.to_nchw_float(ims), (224, 224), quantize=True)
    p = pp.pil_resize(ims, (224, 224))
    diff = (t - p).abs()
    assert diff.max().item() <= 2.0 and diff.mean().item() < 0.02


def test_hps_resize_longest_and_pad():
    im = rand_images(1, 50, 100, seed=1)  # H=50, W=100 -> 112x224, 56 rows of padding each side
    x = pp.resize_longest_pad_preprocess(im, 224)[0]
    assert x.shape == (3, 224, 224)
    pad_value = torch.tensor(-MEAN / STD).view(3, 1)
    assert torch.allclose(x[:, :56, :].reshape(3, -1), pad_value.expand(3, 56 * 224), atol=1e-6)
    assert torch.allclose(x[:, 168:, :].reshape(3, -1), pad_value.expand(3, 56 * 224), atol=1e-6)
    assert not torch.allclose(x[:, 56:168], pad_value.view(3, 1, 1).expand(3, 112, 224))
    ims = rand_images(2, 224)  # no resize: pure normalisation, no uint8 rounding anywhere
    np.testing.assert_allclose(pp.resize_longest_pad_preprocess(ims).numpy(),
                               ((ims / 255.0 - MEAN) / STD).transpose(0, 3, 1, 2), atol=1e-5)


def test_preprocess_rejects_non_uint8():
    with pytest.raises(ValueError, match="uint8"):
        pp.clip_preprocess(np.zeros((1, 8, 8, 3), np.float32))


# ---------------------------------------------------------------- tokenisation


def test_clip_tokenizer_ids_and_truncation():
    from diffrlhf.rewards.clip_tokenizer import EOT, SOT, tokenize

    ids = tokenize(["a photo of a cat", "A  Photo of a CAT", "word " * 100])
    assert ids.shape == (3, 77)
    assert ids[0, :8].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407, 0]  # OpenAI CLIP's ids
    assert ids[1].tolist() == ids[0].tolist()  # lower-cased, whitespace-cleaned
    assert ids[2, 0] == SOT and ids[2, -1] == EOT and (ids[2] != 0).all()


def test_a_model_folders_tokenizer_is_loaded_once_per_process_until_its_files_change(tmp_path):
    """load_tokenizer_folder caches per folder and file identity: the same files give the same
    tokenizer object; a rewritten file gives a fresh load of the new content."""
    import json

    from diffrlhf.rewards.clip_tokenizer import load_tokenizer_folder, write_clip_tokenizer

    folder = write_clip_tokenizer(tmp_path / "tokenizer")
    first = load_tokenizer_folder(folder)
    assert load_tokenizer_folder(str(folder)) is first
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, do_lower_case=False)) + " ")
    again = load_tokenizer_folder(folder)
    assert again is not first and again("a cat").input_ids == first("a cat").input_ids


def test_bert_tokenizer_blip_conventions():
    parity_dir = PARITY_DIR
    from diffrlhf.rewards.imagereward import load_bert_tokenizer, tokenize

    tok = load_bert_tokenizer(str(parity_dir))
    vocab = (parity_dir / "vocab.txt").read_text().split()
    v = {w: i for i, w in enumerate(vocab)}
    t = tokenize(tok, ["A photo of a cat", "cat " * 50])
    assert t.input_ids.shape == (2, 35)
    first = [v["[CLS]"], v["a"], v["photo"], v["of"], v["a"], v["cat"], v["[SEP]"]]
    assert t.input_ids[0, :7].tolist() == first and (t.input_ids[0, 7:] == v["[PAD]"]).all()
    assert t.attention_mask[0].tolist() == [1] * 7 + [0] * 28
    assert t.input_ids[1, -1] == v["[SEP]"] and t.attention_mask[1].all()
    # BLIP adds [DEC] (bos) and [ENC] after the base vocabulary
    assert tok.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [len(vocab), len(vocab) + 1]


# ---------------------------------------------------------------- aesthetic (tiny CLIP)


@pytest.fixture(scope="module")
def tiny_aesthetic(tmp_path_factory):
    from transformers import CLIPConfig, CLIPModel

    from diffrlhf.rewards.aesthetic import AestheticMLP

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("aesthetic")
    clip = CLIPModel(CLIPConfig(
        text_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=64),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           image_size=224, patch_size=32),
        projection_dim=768)).eval()  # 768: the LAION MLP's input width
    clip.save_pretrained(d / "clip")
    mlp = AestheticMLP()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.2)
    mlp.eval()  # dropout off, as in the scorer
    torch.save(mlp.state_dict(), d / "mlp.pth")
    fn = build_reward({"name": "aesthetic", "weights": str(d / "mlp.pth"), "clip_model": str(d / "clip")})
    return fn, clip, mlp


def test_aesthetic_state_dict_keys_match_published_file():
    from diffrlhf.rewards.aesthetic import AestheticMLP

    keys = set(AestheticMLP().state_dict())
    assert keys == {f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")}


def test_aesthetic_equals_clipmodel_pipeline(tiny_aesthetic):
    fn, clip, mlp = tiny_aesthetic
    ims = rand_images(3, 224, seed=5)
    px = torch.from_numpy(((ims / 255.0 - MEAN) / STD).transpose(0, 3, 1, 2).astype(np.float32))
    with torch.no_grad():
        emb = clip.get_image_features(pixel_values=px)
        emb = emb if isinstance(emb, torch.Tensor) else emb.pooler_output
        want = mlp(emb / emb.norm(dim=-1, keepdim=True)).squeeze(1).numpy()
    np.testing.assert_allclose(fn(ims, [""] * 3), want, atol=1e-5)


def test_aesthetic_batching_and_sensitivity(tiny_aesthetic):
    fn = tiny_aesthetic[0]
    ims = rand_images(5, 64, seed=6)
    batch = fn(ims, ["x"] * 5)
    single = np.concatenate([fn(ims[i : i + 1], ["x"]) for i in range(5)])
    np.testing.assert_allclose(batch, single, atol=1e-5)
    assert batch.dtype == np.float32 and np.ptp(batch) > 1e-4
    other = ims.copy()
    other[0] = 255 - other[0]
    assert abs(fn(other[:1], ["x"])[0] - batch[0]) > 1e-4
    np.testing.assert_allclose(fn(ims[:2], ["x", "completely different"]), batch[:2], atol=1e-5)  # prompt-free


# ---------------------------------------------------------------- missing weights


@pytest.fixture
def empty_caches(tmp_path, monkeypatch):
    import diffrlhf.rewards._weights as w

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HPS_ROOT", raising=False)
    monkeypatch.setenv("DIFFRLHF_CACHE", str(tmp_path / "dcache"))
    return tmp_path


@pytest.mark.parametrize("name,filename,looked", [
    ("aesthetic", "sac+logos+ava1-l14-linearMSE.pth", ".cache/ImageReward"),
    ("imagereward", "ImageReward.pt", "THUDM/ImageReward"),
    ("hpsv2", "HPS_v2.1_compressed.pt", ".cache/hpsv2"),
])
def test_missing_weights_message(empty_caches, name, filename, looked):
    with pytest.raises(MissingWeightsError) as ei:
        build_reward(name)
    msg = str(ei.value)
    assert isinstance(ei.value, FileNotFoundError)
    assert filename in msg and looked in msg and str(empty_caches / "dcache" / name) in msg
    assert f"diffrlhf fetch-weights {name}" in msg


def test_missing_explicit_path_is_not_silently_replaced(empty_caches, tmp_path):
    # even with the file present in a default cache, a wrong explicit path must fail
    (empty_caches / "dcache" / "aesthetic").mkdir(parents=True)
    (empty_caches / "dcache" / "aesthetic" / "sac+logos+ava1-l14-linearMSE.pth").write_bytes(b"x")
    with pytest.raises(MissingWeightsError, match="nope/x.pth"):
        build_reward({"name": "aesthetic", "weights": str(tmp_path / "nope" / "x.pth")})


def test_missing_clip_model_is_missing_weights(tmp_path, empty_caches):
    from diffrlhf.rewards.aesthetic import AestheticMLP

    torch.save(AestheticMLP().state_dict(), tmp_path / "m.pth")
    with pytest.raises(MissingWeightsError, match="openai/clip-vit-large-patch14"):
        build_reward({"name": "aesthetic", "weights": str(tmp_path / "m.pth")})


def test_package_reward_says_how_to_run_it():
    import importlib.util

    if importlib.util.find_spec("ImageReward") or importlib.util.find_spec("hpsv2"):
        pytest.skip("a reward package is installed in this environment")
    for name in ("imagereward_pkg", "hpsv2_pkg"):
        with pytest.raises(ImportError, match="runtime_env"):
            build_reward(name)


# ---------------------------------------------------------------- custom callables and weighted sums


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "my_custom_reward.py").write_text(textwrap.dedent("""
        import numpy as np

        def brightness(images, prompts):
            return images.reshape(len(images), -1).mean(axis=1) / 255.0

        def make_scaled(scale=1.0):
            return lambda images, prompts: scale * np.array([len(p) for p in prompts], dtype=np.float32)

        class PromptLength:
            def __init__(self, offset=0.0):
                self.offset = offset
            def __call__(self, images, prompts):
                return np.array([len(p) + self.offset for p in prompts])

        def wrong_length(images, prompts):
            return np.zeros(len(images) + 1)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_custom_reward"
    sys.modules.pop("my_custom_reward", None)


def test_custom_import_rules(custom_module):
    ims = rand_images(3, 16)
    prompts = ["a", "bb", "ccc"]
    f = build_reward(f"{custom_module}:brightness")  # plain function, no kwargs: is the reward
    np.testing.assert_allclose(f(ims, prompts), ims.reshape(3, -1).mean(1) / 255.0, rtol=1e-6)
    assert f(ims, prompts).dtype == np.float32
    g = build_reward({"name": f"{custom_module}:make_scaled", "scale": 2.0})  # kwargs: factory
    np.testing.assert_allclose(g(ims, prompts), [2, 4, 6])
    h = build_reward({"name": f"{custom_module}:PromptLength", "offset": 0.5})  # class: instantiated
    np.testing.assert_allclose(h(ims, prompts), [1.5, 2.5, 3.5])
    h0 = build_reward(f"{custom_module}:PromptLength")  # class without kwargs: still instantiated
    np.testing.assert_allclose(h0(ims, prompts), [1, 2, 3])


def test_custom_errors(custom_module):
    with pytest.raises(ImportError, match="no attribute"):
        build_reward(f"{custom_module}:nothing_here")
    with pytest.raises(ImportError, match="cannot import module"):
        build_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="returned 4 values for 3 images"):
        build_reward(f"{custom_module}:wrong_length")(rand_images(3, 8), ["", "", ""])
    with pytest.raises(ValueError, match="unknown reward"):
        build_reward("not_a_reward")


def test_weighted_sum_equals_hand_sum(custom_module):
    ims = np.concatenate([rand_images(2, 32), smooth_images(2, 32)])
    prompts = ["a", "bb", "ccc", "dddd"]
    spec = {"name": "weighted_sum", "terms": [
        {"name": "jpeg_incompressibility", "weight": 0.5},
        {"name": f"{custom_module}:PromptLength", "offset": 1.0, "weight": -2.0},
        "jpeg_compressibility",  # weight 1 by default
    ]}
    fn = build_reward(spec)
    kb = np.array([pil_jpeg_kb(im) for im in ims])
    want = 0.5 * kb - 2.0 * (np.array([1, 2, 3, 4]) + 1.0) - kb
    np.testing.assert_allclose(fn(ims, prompts), want, atol=1e-5)
    comps = fn.components(ims, prompts)
    assert list(comps) == ["jpeg_incompressibility", f"{custom_module}:PromptLength", "jpeg_compressibility"]


# ---------------------------------------------------------------- runtime envs


def test_default_runtime_env(monkeypatch, tmp_path):
    from diffrlhf.rewards.environments import RewardEnvError

    monkeypatch.setenv("DIFFRLHF_REWARD_ENVS", str(tmp_path))
    for native in ("jpeg_compressibility", "aesthetic", "imagereward", "hpsv2", {"name": "aesthetic", "weights": "x"}):
        assert default_runtime_env(native) is None
    assert "image-reward==1.5" in requirements("imagereward_pkg") and "transformers==4.55.4" in requirements("imagereward_pkg")
    env = default_runtime_env("hpsv2_pkg", python="/v/bin/python")
    assert env["py_executable"] == "/v/bin/python" and env["env_vars"]["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(RewardEnvError, match="diffrlhf reward-env build hpsv2"):
        default_runtime_env("hpsv2_pkg")
    ws = {"name": "weighted_sum", "terms": [{"name": "jpeg_compressibility", "weight": 1},
                                            {"name": "imagereward_pkg", "weight": 2}]}
    assert default_runtime_env(ws, python="/v/bin/python")["py_executable"] == "/v/bin/python"


# ---------------------------------------------------------------- check_spec: a spec checked without building it


@pytest.mark.parametrize("spec, words", [
    ("nonsense", ["unknown reward 'nonsense'", "jpeg_compressibility", "package.module:callable"]),
    ({"name": "jpeg_compressibility", "qualty": 90}, ["'qualty'", "it takes: quality"]),
    ({"name": "aesthetic", "clip": "x"}, ["'clip'", "clip_model"]),
    ({"name": "hpsv2", "version": "v3"}, ["v2.0", "v2.1", "'v3'"]),
    ({"name": "weighted_sum"}, ["terms", "non-empty"]),
    ({"name": "weighted_sum", "terms": ["jpeg_compressibility", {"name": "nonsense", "weight": 2}]}, ["term 1", "'nonsense'"]),
    ({"name": "weighted_sum", "terms": [{"name": "jpeg_compressibility", "weight": "high"}]}, ["term 0", "weight 'high'"]),
    ("no_such_module_xyz:fn", ["cannot import module 'no_such_module_xyz'", "PYTHONPATH"]),
    (["a", "list"], ["name or a dict"]),
])
def test_check_spec_names_what_is_wrong(spec, words, empty_caches):
    from diffrlhf.rewards import RewardSpecError, check_spec

    with pytest.raises(RewardSpecError) as e:
        check_spec(spec)
    for w in words:
        assert w in str(e.value)


@pytest.fixture
def custom_signatures(tmp_path, monkeypatch):
    (tmp_path / "my_signatures.py").write_text(textwrap.dedent("""
        def one_arg(images):
            return images
        def make(scale):
            return lambda images, prompts: scale
        class NotCallable:
            pass
        class NeedsArg:
            def __init__(self, path):
                self.path = path
            def __call__(self, images, prompts):
                return [0.0] * len(images)
        VALUE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_signatures"
    sys.modules.pop("my_signatures", None)


def test_check_spec_custom_callables_follow_the_import_rule(custom_module, custom_signatures):
    from diffrlhf.rewards import RewardSpecError, check_spec

    m, s = custom_module, custom_signatures
    for ok in (f"{m}:brightness", {"name": f"{m}:make_scaled", "scale": 2.0}, f"{m}:PromptLength",
               {"name": f"{m}:PromptLength", "offset": 1.0}, {"name": f"{s}:NeedsArg", "path": "x"}):
        check_spec(ok)
    for bad, words in [
        (f"{s}:one_arg", ["(images, prompts)"]),
        (f"{s}:make", ["(images, prompts)"]),  # a factory without its kwargs is taken as the reward itself
        ({"name": f"{s}:make", "scael": 2}, ["factory", "scael"]),
        (f"{s}:NotCallable", ["not callable", "__call__"]),
        (f"{s}:NeedsArg", ["class", "path"]),
        (f"{s}:VALUE", ["int", "not a callable"]),
        (f"{s}:nothing", ["no attribute"]),
    ]:
        with pytest.raises(RewardSpecError) as e:
            check_spec(bad)
        assert all(w in str(e.value) for w in words), (bad, str(e.value))


@pytest.mark.parametrize("name,filename", [("aesthetic", "sac+logos+ava1-l14-linearMSE.pth"),
                                           ("imagereward", "ImageReward.pt"), ("hpsv2", "HPS_v2.1_compressed.pt")])
def test_check_spec_finds_missing_weights_without_loading_a_model(empty_caches, name, filename):
    from diffrlhf.rewards import check_spec

    with pytest.raises(MissingWeightsError) as e:
        check_spec(name)
    assert filename in str(e.value) and f"diffrlhf fetch-weights {name}" in str(e.value)
    with pytest.raises(MissingWeightsError, match=re.escape(filename)):  # inside a weighted_sum too
        check_spec({"name": "weighted_sum", "terms": [{"name": name, "weight": 1.0}]})
    # A file where the lookup finds it passes, though it is no model: nothing was loaded.
    (empty_caches / "dcache" / name).mkdir(parents=True)
    (empty_caches / "dcache" / name / filename).write_bytes(b"not a model")
    if name == "aesthetic":  # its CLIP is looked up too, then found as a local folder
        with pytest.raises(MissingWeightsError, match="openai/clip-vit-large-patch14"):
            check_spec(name)
        (empty_caches / "clip").mkdir()
        check_spec({"name": name, "clip_model": str(empty_caches / "clip")})
    else:
        check_spec(name)


def test_check_spec_local_false_skips_files_and_modules(empty_caches):
    from diffrlhf.rewards import RewardSpecError, check_spec

    check_spec("aesthetic", local=False)
    check_spec("no_such_module_xyz:fn", local=False)
    with pytest.raises(RewardSpecError, match="qualty"):
        check_spec({"name": "jpeg_compressibility", "qualty": 1}, local=False)


def test_nan_message_names_the_config_key():
    from diffrlhf.rewards import NonFiniteRewardError
    from diffrlhf.rewards.serving import RewardServer

    srv = RewardServer(lambda images, prompts: np.full(len(images), np.nan), nan_policy="raise")
    with pytest.raises(NonFiniteRewardError, match="reward.nan_policy=drop"):
        srv.score([0], rand_images(1, 8), ["p"])
