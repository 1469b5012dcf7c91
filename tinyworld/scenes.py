"""The tiny world's data: a procedural captioned image set, its split, and the automatic colour check.

Images are 64 px pictures of coloured shapes (circle, square, triangle, star; one or two; small or
large; plain, striped, checkered or noisy) on a plain-colour or gradient background, rendered with
numpy/PIL from a seed (no download). Captions name what was drawn, e.g. "two small striped green
squares on a blue background". Textures matter for RL: plain shapes compress well as JPEG, noisy and
striped ones do not, so compressibility rewards have room to move in both directions.

The split is by (colour, shape) pair: HELDOUT_PAIRS never appear in training images, so held-out
captions test composition of words the model has seen only in other combinations.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from diffrlhf.rewards.tinyworld_alignment import (BACKGROUNDS, COLOURS, PALETTE, PLURAL, RES, SHAPE_SIZES, SHAPES,  # noqa: F401
                                                TEXTURES)

# The vocabulary is stated once, in the reward that reads it (rewards sits below tinyworld in the
# layers, so the renderer imports it from there). Its palette is the corners of the RGB cube: a blend
# of two of them (a shape's antialiased edge, a blurry sample) is read as one of the two or as
# neither, never as a third (RESULTS.md, "What does the tiny world learn...?").
COUNTS = [1, 2]
# (colour, shape) pairs never drawn in training: one per colour, each shape twice.
HELDOUT_PAIRS = {
    ("red", "triangle"), ("green", "square"), ("blue", "star"), ("yellow", "circle"),
    ("magenta", "triangle"), ("cyan", "square"), ("white", "star"), ("black", "circle"),
}


@dataclass(frozen=True)
class Scene:
    """What one image shows; the caption may mention only part of it."""

    colour: str
    shape: str
    size: str
    count: int
    texture: str
    background: str  # a colour name or "gradient"

    def caption(self, mention_size=True, mention_texture=True, mention_background=True) -> str:
        words = ["two" if self.count == 2 else "a"]
        if mention_size:
            words.append(self.size)
        if mention_texture and self.texture != "plain":
            words.append(self.texture)
        words.append(self.colour)
        words.append(PLURAL[self.shape] if self.count == 2 else self.shape)
        text = " ".join(words)
        if mention_background:
            text += f" on a {self.background} background"
        return text

    @property
    def heldout(self) -> bool:
        return (self.colour, self.shape) in HELDOUT_PAIRS


def random_scene(rng: np.random.Generator, split: str = "train") -> Scene:
    """A random scene from the train or held-out part (split by (colour, shape) pair)."""
    while True:
        colour = COLOURS[rng.integers(len(COLOURS))]
        shape = SHAPES[rng.integers(len(SHAPES))]
        if ((colour, shape) in HELDOUT_PAIRS) == (split == "heldout"):
            break
    # The background never has the shape's colour, or the shape would vanish.
    bgs = [b for b in BACKGROUNDS if b != colour]
    return Scene(
        colour=colour,
        shape=shape,
        size=SHAPE_SIZES[rng.integers(2)],
        count=COUNTS[rng.integers(2)],
        texture=TEXTURES[rng.integers(len(TEXTURES))],
        background=bgs[rng.integers(len(bgs))],
    )


# ----------------------------------------------------------------------------- rendering


def _shape_polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    if shape == "triangle":
        return [(cx + r * np.cos(a), cy + r * np.sin(a)) for a in np.deg2rad([-90, 30, 150])]
    if shape == "star":
        pts = []
        for k in range(10):
            rr = r if k % 2 == 0 else 0.45 * r
            a = np.deg2rad(-90 + 36 * k)
            pts.append((cx + rr * np.cos(a), cy + rr * np.sin(a)))
        return pts
    return None


def _shape_mask(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """Float mask in [0, 1], antialiased by drawing at 4x and averaging down."""
    ss = 4
    # Radii in px: even a small shape spans 2-3 cells of the 8x8 latent grid (a cell is 8 px), so
    # its colour survives the autoencoder.
    if scene.size == "large":
        r = rng.uniform(17, 21) if scene.count == 1 else rng.uniform(13, 14)
    else:
        r = rng.uniform(10, 12) if scene.count == 1 else rng.uniform(9, 10)
    # Centres: one anywhere it fits; two side by side (left/right or top/bottom) so they don't overlap.
    if scene.count == 1:
        centres = [tuple(rng.uniform(r + 1, RES - r - 1, size=2))]
    else:
        if rng.random() < 0.5:
            a = (rng.uniform(r + 1, RES / 2 - r), rng.uniform(r + 1, RES - r - 1))
            b = (rng.uniform(RES / 2 + r, RES - r - 1), rng.uniform(r + 1, RES - r - 1))
        else:
            a = (rng.uniform(r + 1, RES - r - 1), rng.uniform(r + 1, RES / 2 - r))
            b = (rng.uniform(r + 1, RES - r - 1), rng.uniform(RES / 2 + r, RES - r - 1))
        centres = [a, b]
    img = Image.new("L", (RES * ss, RES * ss), 0)
    draw = ImageDraw.Draw(img)
    for cx, cy in centres:
        cx, cy, rs = cx * ss, cy * ss, r * ss
        if scene.shape == "circle":
            draw.ellipse([cx - rs, cy - rs, cx + rs, cy + rs], fill=255)
        elif scene.shape == "square":
            h = rs * 0.85  # a square of "radius" r looks bigger than a circle; shrink to similar area
            draw.rectangle([cx - h, cy - h, cx + h, cy + h], fill=255)
        else:
            draw.polygon(_shape_polygon(scene.shape, cx, cy, rs), fill=255)
    m = np.asarray(img, dtype=np.float32) / 255.0
    return m.reshape(RES, ss, RES, ss).mean(axis=(1, 3))


def texture_shade(colour: str) -> np.ndarray:
    """The second tone of striped/checkered fills: a darker (or, for black, lighter) shade of the
    colour, close enough that the texture's average (what an 8x-downsampling VAE keeps of a fine
    pattern) is still nearest to the named palette colour."""
    c = np.array(PALETTE[colour], dtype=np.float32)
    return c * 0.75 if colour != "black" else c + 45


def _texture(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """The shape's fill [H, W, 3] in 0..255: its colour, alternated with a darker shade or noised."""
    c = np.array(PALETTE[scene.colour], dtype=np.float32)
    shade = texture_shade(scene.colour)
    yy, xx = np.mgrid[0:RES, 0:RES]
    if scene.texture == "plain":
        sel = np.zeros((RES, RES), bool)
    elif scene.texture == "striped":
        period = int(rng.choice([4, 6]))
        coord = xx if rng.random() < 0.5 else yy
        sel = (coord // (period // 2)) % 2 == 1
    elif scene.texture == "checkered":
        cell = int(rng.choice([3, 4]))
        sel = ((xx // cell) + (yy // cell)) % 2 == 1
    else:  # noisy: per-pixel noise, the least JPEG-compressible
        return np.clip(c + rng.normal(0, 45, size=(RES, RES, 3)), 0, 255).astype(np.float32)
    return np.where(sel[..., None], shade, c).astype(np.float32)


def _background(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    if scene.background != "gradient":
        return np.broadcast_to(np.array(PALETTE[scene.background], np.float32), (RES, RES, 3))
    # A linear blend between two palette colours other than the shape's, in a random direction.
    others = [c for c in COLOURS if c != scene.colour]
    i, j = rng.choice(len(others), size=2, replace=False)
    c0, c1 = np.array(PALETTE[others[i]], np.float32), np.array(PALETTE[others[j]], np.float32)
    ang = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:RES, 0:RES] / (RES - 1) - 0.5
    t = np.clip(xx * np.cos(ang) + yy * np.sin(ang) + 0.5, 0, 1)[..., None]
    return c0 * (1 - t) + c1 * t


def render(scene: Scene, rng: np.random.Generator, with_mask: bool = False):
    """uint8 [64, 64, 3] image of the scene (and, if with_mask, its float shape mask [64, 64]).

    Placement and texture phases come from rng.
    """
    mask = _shape_mask(scene, rng)
    img = _background(scene, rng) * (1 - mask[..., None]) + _texture(scene, rng) * mask[..., None]
    img = np.clip(img + 0.5, 0, 255).astype(np.uint8)
    return (img, mask) if with_mask else img


def make_dataset(n: int, seed: int = 0, split: str = "train", p_mention: float = 0.7, return_masks: bool = False):
    """n (image, caption, scene) triples, deterministic for (n, seed, split); with return_masks
    also the shape masks as uint8 [n, 64, 64] (255 = shape), which pretraining uses to weight
    the VAE's loss towards the shapes.

    Colour and shape are always named; size, texture and background each with probability
    p_mention, so short prompts ("a red circle") are in-distribution too.
    """
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    images = np.empty((n, RES, RES, 3), np.uint8)
    masks = np.empty((n, RES, RES), np.uint8)
    captions, scenes = [], []
    for i in range(n):
        s = random_scene(rng, split)
        m = rng.random(3) < p_mention
        captions.append(s.caption(*m))
        scenes.append(s)
        images[i], mask = render(s, rng, with_mask=True)
        masks[i] = np.round(mask * 255).astype(np.uint8)
    return (images, captions, scenes, masks) if return_masks else (images, captions, scenes)


def captions(split: str = "train") -> list[str]:
    """RL prompt lists: "a red circle", "two red circles", ... for the split's (colour, shape) pairs.

    Size, texture and background are left open, so a reward (e.g. JPEG compressibility: plain
    texture, flat background) has room to move the images without leaving the caption.
    """
    out = []
    for colour in COLOURS:
        for shape in SHAPES:
            if ((colour, shape) in HELDOUT_PAIRS) != (split == "heldout"):
                continue
            for count in COUNTS:
                s = Scene(colour, shape, "small", count, "plain", "white")
                out.append(s.caption(mention_size=False, mention_texture=False, mention_background=False))
    return out


def eval_scenes(split: str, n: int, seed: int = 123) -> list[Scene]:
    """Fully specified plain-background scenes for the colour check (background colour is checkable)."""
    rng = np.random.default_rng([seed, 7])
    out = []
    while len(out) < n:
        s = random_scene(rng, split)
        if s.background != "gradient":
            out.append(s)
    return out


# ----------------------------------------------------------------------------- automatic colour check


def palette_classes(img: np.ndarray, max_dist: float = 80.0) -> np.ndarray:
    """Per-pixel index of the nearest palette colour, -1 where none is within max_dist (RGB)."""
    pal = np.array(list(PALETTE.values()), np.float32)
    d = np.linalg.norm(img.astype(np.float32)[..., None, :] - pal, axis=-1)
    cls = d.argmin(-1)
    cls[d.min(-1) > max_dist] = -1
    return cls


def _hue_degrees(rgb: np.ndarray) -> np.ndarray:
    """Hue in degrees [0, 360) of float RGB [..., 3] (the HSV hue; 0 where the pixel is grey)."""
    r, g, b = np.moveaxis(rgb, -1, 0)
    mx, mn = rgb.max(-1), rgb.min(-1)
    c = np.where(mx > mn, mx - mn, 1.0)
    h = np.where(mx == r, ((g - b) / c) % 6, np.where(mx == g, (b - r) / c + 2, (r - g) / c + 4))
    return np.where(mx > mn, h * 60.0, 0.0)


_CHROMATIC = [c for c in COLOURS if c not in ("white", "black")]
_PALETTE_HUES = _hue_degrees(np.array([PALETTE[c] for c in _CHROMATIC], np.float32) / 255.0)


def colour_name_classes(img: np.ndarray, min_chroma: float = 0.2) -> np.ndarray:
    """Per-pixel index (into COLOURS) of the colour a person would name, ignoring brightness.

    Pixels with chroma (max - min of RGB in 0..1) below min_chroma are white or black by their
    brightness; the rest take the palette colour of nearest hue. So dark green is "green", which
    palette_classes' RGB distance calls "black". A diagnostic beside the strict palette check.
    """
    rgb = img.astype(np.float32) / 255.0
    mx, mn = rgb.max(-1), rgb.min(-1)
    d = np.abs(_hue_degrees(rgb)[..., None] - _PALETTE_HUES)
    chromatic = np.array([COLOURS.index(c) for c in _CHROMATIC])[np.minimum(d, 360 - d).argmin(-1)]
    grey = np.where(mx > 0.5, COLOURS.index("white"), COLOURS.index("black"))
    return np.where(mx - mn < min_chroma, grey, chromatic)


def colour_check(img: np.ndarray, scene: Scene, classify=palette_classes) -> tuple[bool, bool]:
    """(shape colour right, background colour right) for an image generated from scene's caption.

    The background must be the most frequent palette colour; the shape colour must be the most
    frequent palette colour among the rest and cover at least 1% of the image. Fits this data: the
    shape's shades are darker versions of its colour, the background is one flat colour.
    classify maps an image to per-pixel colour indices (-1: none): palette_classes (strict RGB
    distance, the headline check) or colour_name_classes (hue; brightness ignored).
    """
    cls = classify(img)
    counts = np.bincount(cls[cls >= 0].ravel(), minlength=len(PALETTE))
    bg_i, fg_i = COLOURS.index(scene.background), COLOURS.index(scene.colour)
    bg_ok = bool(counts.argmax() == bg_i)
    rest = counts.copy()
    rest[bg_i] = -1
    fg_ok = bool(rest.argmax() == fg_i and counts[fg_i] >= 0.01 * img.shape[0] * img.shape[1])
    return fg_ok, bg_ok
