"""tinyworld_alignment: a graded prompt-alignment reward on the tiny world (rewards/tinyworld_alignment.py).

The main property: a rendered scene scores higher against its own caption than against every
caption that changes one attribute, for every attribute type, on many random scenes. A scorer that
ignores an attribute ties there and fails (checked below by dropping each attribute in turn)."""
import numpy as np
import pytest
from PIL import Image

from diffrlhf.policy.prompts import load_prompts
from diffrlhf.rewards import REWARD_NAMES, build_reward, check_prompts, check_spec
from diffrlhf.rewards import tinyworld_alignment as ta
from diffrlhf.tinyworld import scenes as tw

VALUES = {"colour": tw.COLOURS, "shape": tw.SHAPES, "count": tw.COUNTS, "size": tw.SHAPE_SIZES,
          "texture": tw.TEXTURES, "background": tw.BACKGROUNDS}


def _scenes(n, seed):
    rng = np.random.default_rng(seed)
    scenes = [tw.random_scene(rng, "heldout" if i % 3 == 0 else "train") for i in range(n)]
    return scenes, np.stack([tw.render(s, rng) for s in scenes])


@pytest.fixture(scope="module")
def rendered():
    """60 random scenes (both splits, every texture and background kind) and their readings."""
    scenes, images = _scenes(60, seed=11)
    full = ta.TinyWorldAlignment(attributes=ta.ATTRIBUTES)
    return scenes, images, [full.read(im) for im in images]


def _caption_attrs(scene: tw.Scene, **change) -> ta.CaptionAttributes:
    d = dict(colour=scene.colour, shape=scene.shape, count=scene.count, size=scene.size,
             texture=None if scene.texture == "plain" else scene.texture, background=scene.background)
    d.update(change)
    return ta.CaptionAttributes(**d)


def _violations(reward: ta.TinyWorldAlignment, scenes, readings, attributes) -> list[str]:
    """Each (scene, attribute, other value) where the changed caption does not score strictly below
    the scene's own caption."""
    bad = []
    for s, rd in zip(scenes, readings):
        own = reward.score_reading(rd, _caption_attrs(s))
        for attr in attributes:
            true = s.texture if attr == "texture" else getattr(s, attr)
            for v in VALUES[attr]:
                if v == true or (attr == "texture" and v == "plain"):  # "plain" is never said: Scene.caption drops it
                    continue
                other = reward.score_reading(rd, _caption_attrs(s, **{attr: v}))
                if not other < own:
                    bad.append(f"{s.caption()} | {attr}={v}: {other:.4f} >= {own:.4f}")
    return bad


def test_own_caption_beats_every_one_attribute_change(rendered):
    scenes, _, readings = rendered
    reward = ta.TinyWorldAlignment(attributes=ta.ATTRIBUTES)
    bad = _violations(reward, scenes, readings, list(VALUES))
    assert not bad, f"{len(bad)} changed captions not below the own caption:\n" + "\n".join(bad[:10])
    # The default reward (texture off: the tiny world's VAE does not draw it) likewise, on the rest.
    default = ta.TinyWorldAlignment()
    assert "texture" not in default.attributes
    assert not _violations(default, scenes, readings, [a for a in VALUES if a != "texture"])


def test_short_captions_as_the_study_uses_them(rendered):
    """The RL prompt lists state colour, shape and count only ("two red circles")."""
    scenes, _, readings = rendered
    reward = ta.TinyWorldAlignment()
    for s, rd in zip(scenes, readings):
        short = ta.parse_caption(s.caption(False, False, False))
        own = reward.score_reading(rd, short)
        for attr in ("colour", "shape", "count"):
            for v in VALUES[attr]:
                if v != getattr(s, attr):
                    other = reward.score_reading(rd, ta.CaptionAttributes(**{**short.__dict__, attr: v}))
                    assert other < own, (s, attr, v, other, own)


@pytest.mark.parametrize("dropped", list(VALUES))
def test_the_property_catches_an_ignored_attribute(rendered, dropped):
    """The check above is not vacuous: without any one attribute, its changes tie with the truth."""
    scenes, _, readings = rendered
    reward = ta.TinyWorldAlignment(attributes=[a for a in ta.ATTRIBUTES if a != dropped])
    bad = _violations(reward, scenes[:10], readings[:10], [dropped])
    changes = sum(len(VALUES[dropped]) - 1 - (dropped == "texture" and s.texture != "plain") for s in scenes[:10])
    assert len(bad) == changes


def test_the_reward_is_the_mean_of_its_attribute_scores_and_graded(rendered):
    scenes, images, readings = rendered
    fn = build_reward({"name": "tinyworld_alignment", "attributes": list(ta.ATTRIBUTES)})
    caps = [s.caption() for s in scenes[:8]]
    got = fn(images[:8], caps)
    comps = fn.components(images[:8], caps)
    assert got.dtype == np.float32 and got.shape == (8,)
    np.testing.assert_allclose(got, np.nanmean(np.stack(list(comps.values())), 0), atol=1e-6)
    want = [np.mean(list(ta.attribute_scores(rd, ta.parse_caption(c)).values())) for rd, c in zip(readings[:8], caps)]
    np.testing.assert_allclose(got, want, atol=1e-6)
    # Graded, not 0/1: a half-right caption lands in between.
    s = scenes[0]
    wrong_colour = next(c for c in tw.COLOURS if c not in (s.colour, s.background))
    half = fn(images[:1], [tw.Scene(wrong_colour, s.shape, s.size, s.count, s.texture, s.background).caption()])[0]
    assert 0.3 < half < got[0]


def test_scores_lie_in_0_1(rendered):
    scenes, images, _ = rendered
    fn = build_reward({"name": "tinyworld_alignment", "attributes": list(ta.ATTRIBUTES)})
    rs = np.random.RandomState(0)
    odd = [np.zeros((64, 64, 3), np.uint8), np.full((64, 64, 3), 255, np.uint8), rs.randint(0, 256, (64, 64, 3)).astype(np.uint8)]
    half = np.zeros((64, 64, 3), np.uint8)
    half[:, :32] = tw.PALETTE["red"]
    dot = np.zeros((64, 64, 3), np.uint8)
    dot[30:33, 30:33] = 255
    ims = np.concatenate([images[:12], np.stack(odd + [half, dot])])
    rng = np.random.default_rng(1)
    caps = [s.caption(*(rng.random(3) < 0.5)) for s in [tw.random_scene(rng) for _ in range(len(ims))]]  # mostly mismatched
    for c in (caps, [s.caption() for s in scenes[:12]] + caps[12:]):
        r = fn(ims, c)
        assert np.isfinite(r).all() and (r >= 0).all() and (r <= 1).all(), r
        for v in fn.components(ims, c).values():
            v = v[np.isfinite(v)]
            assert (v >= 0).all() and (v <= 1).all()
    # Other sizes are read at 64 px.
    big = np.asarray(Image.fromarray(images[0]).resize((256, 256), Image.NEAREST))
    assert abs(fn(big[None], [scenes[0].caption()])[0] - fn(images[:1], [scenes[0].caption()])[0]) < 0.1


# ----------------------------------------------------------------------------- captions


@pytest.mark.parametrize("caption, words", [
    ("a cat", []),
    ("", []),
    ("a red circles", ["'a' with 'circles'"]),
    ("two red circle", ["'two' with 'circle'"]),
    ("a purple circle", []),
    ("three red circles", []),
    ("a red circle on a blue sky", []),
    ("a circle", []),
    ("a striped small red circle", []),  # the grammar's order: size before texture
])
def test_unparseable_captions_raise_naming_the_caption(caption, words):
    with pytest.raises(ta.UnparseableCaptionError) as e:
        ta.parse_caption(caption)
    msg = str(e.value)
    assert repr(caption) in msg and "tiny-world captions" in msg
    for w in words:
        assert w in msg
    fn = build_reward("tinyworld_alignment")  # the reward raises too: never a silent 0
    ims = np.zeros((2, 64, 64, 3), np.uint8)
    with pytest.raises(ta.UnparseableCaptionError, match="cannot parse caption"):
        fn(ims, ["a red circle", caption])
    assert isinstance(e.value, ValueError)
    import pickle  # Ray carries the error from the reward actor to the driver

    assert str(pickle.loads(pickle.dumps(e.value))) == msg


def test_parse_round_trips_every_caption_the_tiny_world_writes():
    rng = np.random.default_rng(3)
    for split in ("train", "heldout"):
        for _ in range(300):
            s = tw.random_scene(rng, split)
            m = rng.random(3) < 0.5
            got = ta.parse_caption(s.caption(*m))
            assert (got.colour, got.shape, got.count) == (s.colour, s.shape, s.count)
            assert got.size == (s.size if m[0] else None)
            assert got.texture == (s.texture if m[1] and s.texture != "plain" else None)
            assert got.background == (s.background if m[2] else None)
    assert ta.parse_caption("  Two LARGE red Squares on a gradient background. ") == ta.CaptionAttributes(
        "red", "square", 2, "large", None, "gradient")


def test_the_study_prompt_lists_all_parse():
    """tiny-world-train: 48 captions of the training (colour, shape) pairs; tiny-world-eval: the 16
    of the 8 held-out pairs, unseen in pretraining."""
    train, heldout = load_prompts("tiny-world-train"), load_prompts("tiny-world-eval")
    assert len(train) == 48 and len(heldout) == 16
    for p in train + heldout:
        ta.parse_caption(p)
    pairs = {(c.colour, c.shape) for c in map(ta.parse_caption, heldout)}
    assert pairs == tw.HELDOUT_PAIRS and not pairs & {(c.colour, c.shape) for c in map(ta.parse_caption, train)}
    check_prompts("tinyworld_alignment", train + heldout)
    _, caps, _ = tw.make_dataset(200, seed=0)  # the pretraining captions too
    ta.check_captions(caps)


def test_prompt_lists_are_checked_before_a_run(tmp_path):
    from diffrlhf.deploy.config import load_config
    from diffrlhf.deploy.preflight import PromptInputError
    from diffrlhf.deploy.preflight import check_prompts as preflight_prompts

    with pytest.raises(ta.UnparseableCaptionError, match=r"'a cat'.*2 of 3 captions.*'two dogs'"):
        check_prompts({"name": "weighted_sum", "terms": [{"name": "tinyworld_alignment", "weight": 2}]},
                      ["a red circle", "a cat", "two dogs"])
    check_prompts("jpeg_compressibility", ["a cat"])  # rewards that do not read prompts: nothing to check
    (tmp_path / "p.txt").write_text("a red circle\nan astronaut riding a horse\n")
    preflight_prompts(load_config("tiny", overrides=["reward.spec=tinyworld_alignment"]))
    cfg = load_config("tiny", overrides=["reward.spec=tinyworld_alignment", f"prompts.train={tmp_path / 'p.txt'}"])
    with pytest.raises(PromptInputError, match=r"prompts\.train=.*p\.txt.*'an astronaut riding a horse'"):
        preflight_prompts(cfg)
    preflight_prompts(load_config("tiny", overrides=[f"prompts.train={tmp_path / 'p.txt'}"]))  # jpeg: fine


# ----------------------------------------------------------------------------- registry, control


def test_the_registry_builds_it_and_checks_its_kwargs():
    from diffrlhf.rewards import RewardSpecError

    assert "tinyworld_alignment" in REWARD_NAMES and not any("shuffled" in n for n in REWARD_NAMES)  # controls are research's
    for name in ("tinyworld_alignment", "research.controls:ShuffledTinyWorldAlignment"):
        check_spec(name)
        check_spec({"name": name, "attributes": ["colour", "count"]})
        assert build_reward(name).name == name
    with pytest.raises(RewardSpecError, match="attributes"):
        check_spec({"name": "tinyworld_alignment", "attribute": ["colour"]})
    with pytest.raises(ValueError, match="subset of colour, shape, count"):
        build_reward({"name": "tinyworld_alignment", "attributes": ["hue"]})
    with pytest.raises(ValueError, match="must include colour, shape or count"):
        build_reward({"name": "tinyworld_alignment", "attributes": ["size", "background"]})
    fn = build_reward({"name": "tinyworld_alignment", "attributes": ["colour"]})
    _, images = _scenes(2, seed=5)
    assert set(fn.components(images, ["a red circle", "a blue star"])) == {"colour"}


def test_it_serves_through_the_reward_server():
    from diffrlhf.rewards.serving import RewardServer

    scenes, images = _scenes(5, seed=6)
    srv = RewardServer("tinyworld_alignment", batch_size=2)
    res = srv.score(list(range(5)), images, [s.caption() for s in scenes])
    np.testing.assert_allclose(res.rewards, build_reward("tinyworld_alignment")(images, [s.caption() for s in scenes]), atol=1e-6)
    assert srv.num_queries == 5 and (res.rewards > 0.5).all()


def test_the_shuffled_control_permutes_the_rewards():
    scenes, images = _scenes(5, seed=7)
    caps = [s.caption() for s in scenes]
    real = build_reward("tinyworld_alignment")(images, caps)
    fn = build_reward("research.controls:ShuffledTinyWorldAlignment")
    got = fn(images, caps)
    np.testing.assert_allclose(got, real[[1, 2, 3, 4, 0]], atol=1e-6)  # image i gets image i+1's reward (own caption)
    assert got.mean() == pytest.approx(real.mean(), abs=1e-6)
    # An image's reward does not depend on it: change image 0 and only image 4's reward moves.
    images2 = images.copy()
    images2[0] = 0
    got2 = fn(images2, caps)
    assert got2[0] == got[0] and np.array_equal(got2[1:4], got[1:4]) and got2[4] != got[4]
    with pytest.raises(ValueError, match="at least 2 images"):
        fn(images[:1], caps[:1])


# ----------------------------------------------------------------------------- the tiny world, restated


def test_vocabulary_and_geometry_equal_the_tiny_worlds():
    """rewards sits below tinyworld, so the scorer restates its vocabulary and shape geometry:
    they must equal scenes.py's (the template is the renderer's mask at the same centre and radius;
    the size boundaries separate the renderer's radii)."""
    assert ta.PALETTE == tw.PALETTE and ta.COLOURS == tw.COLOURS and ta.SHAPES == tw.SHAPES
    assert ta.PLURAL == tw.PLURAL and ta.SHAPE_SIZES == tw.SHAPE_SIZES and ta.TEXTURES == tw.TEXTURES
    assert ta.BACKGROUNDS == tw.BACKGROUNDS and ta.RES == tw.RES
    for i, shape in enumerate(tw.SHAPES * 2):
        size = tw.SHAPE_SIZES[i // 4]
        s = tw.Scene("red", shape, size, 1, "plain", "blue")
        rng = np.random.default_rng(i)
        _, mask = tw.render(s, rng, with_mask=True)
        rng = np.random.default_rng(i)  # the same draws: radius, then centre
        r = rng.uniform(17, 21) if size == "large" else rng.uniform(10, 12)
        cx, cy = rng.uniform(r + 1, tw.RES - r - 1, size=2)
        t = ta.template(shape, cx, cy, r, (0, tw.RES, 0, tw.RES))
        np.testing.assert_allclose(t, mask, atol=1e-6)
        # AREA_K is the exact area; PIL fills edge pixels inclusively (+2-5% on a small shape)
        assert ta.AREA_K[shape] * r * r <= mask.sum() <= 1.06 * ta.AREA_K[shape] * r * r
        assert (r > ta.SIZE_BOUNDARY[0]) == (size == "large")
    # Two shapes: small 9-10 px, large 13-14 px.
    assert 10 < ta.SIZE_BOUNDARY[1] < 13 and 12 < ta.SIZE_BOUNDARY[0] < 17
