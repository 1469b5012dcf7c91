"""Prompt alignment on the tiny world: how well an image shows what its caption says, in [0, 1].

The caption is parsed with the tiny world's caption grammar (tinyworld/scenes.py, Scene.caption):

    ("a" | "two") [small | large] [plain | striped | checkered | noisy] <colour> <shape(s)>
        [on a (<colour> | gradient) background]

and every attribute it states (and that the reward is asked to score, `attributes`) gets a graded
score in [0, 1] from the image alone; the reward is their mean. A caption outside the grammar
raises UnparseableCaptionError naming it (never a silent 0).

The image is read the way the tiny world's own check reads it (scenes.colour_check: nearest
palette colour within 80 RGB), made soft:

- background: a plane per RGB channel fitted robustly to a 3 px band along the border (shapes keep
  >= 1 px from it), clipped to the band's colour range (a gradient's clipped corners); and any
  palette colour that holds >= 20% of the band is background wherever it is (the VAE draws a
  gradient as two flat regions). A pixel's foreground weight ramps 0 -> 1 as its distance from
  the background goes 40 -> 80 RGB;
- colour membership of a pixel: softmax over the 8 palette colours and a "none" class at 80 RGB of
  -d^2 / (2 * 25^2): ~1 within ~60 of a colour, 1/2 at 80 (palette_classes' radius);
- shapes: where the 3x3-averaged image is foreground and at least half way from the background to
  the shapes (90th percentile), holes filled; split into connected shapes on this mask eroded by
  1, 2, 3, 4, 6 or 8 px (the depth with the most cores of >= 1/10 of the largest: two blobs that
  touch or overlap come apart), grown back. Each shape's alpha matte: the projection of
  (pixel - background) on (its median colour - background), clipped to [0, 1];
- colour: the mean membership of the named colour over the foreground, weighted by the alpha
  matte, on the image averaged 5x5 within the foreground (noise and a texture's 0.75x second tone
  average out, as in the VAE): the fraction of shape pixels in the named colour;
- shape: for each shape type, the renderer's template of the same area at the shape's centroid
  (4x supersampled, blurred by 0.8, 1.7 or 3 px: the best) and its soft IoU with the matte;
  p(shape) = softmax(IoU / 0.03); score = the area-weighted mean p(named shape) over the shapes;
- count: with the shapes' areas a1 >= a2 >= a3 and q a ramp 0 -> 1 over 0.15 -> 0.5:
  two = q(a2/a1) * (1 - q(a3/a1)), one = 1 - q(a2/a1);
- size: the shapes' mean radius r (area over the fitted shapes' area constant) against the
  renderer's radii (one shape: small 10-12, large 17-21 px; two: 9-10 / 13-14): p(large) =
  sigmoid((r - b) / 0.75), b = 14.5 for one shape, 11.5 for two, interpolated by q(a2/a1);
- colour, shape, count, size and texture are multiplied by presence, a ramp 0 -> 1 as the largest
  shape's area goes 10 -> 40 px (no shape, no credit);
- background colour: the mean membership of the named colour over the background (weight
  1 - foreground); "gradient": a ramp 0 -> 1 as the background plane's colour range over the
  image goes 40 -> 100 RGB (the closest two palette colours are 121 apart);
- texture: on the shapes' interior, the fraction of horizontal and of vertical neighbour pairs that
  differ by < 12 RGB, (zmin, zmax), against each texture's value (plain (1, 1), striped (0.58, 1),
  checkered (0.71, 0.71), noisy (0, 0)): p = softmax(-d^2 / (2 * 0.1^2)). The tiny world's VAE does
  not draw texture (its reconstructions score at chance, research/results/alignment_check.md), so
  texture is scored only when asked for (`attributes`).

Images of another size are resized to 64 px first. The tiny world's vocabulary (palette, shapes,
textures, backgrounds) is defined here and tinyworld/scenes.py imports it (rewards sits below
tinyworld in the layers); the renderer's geometry is restated, and tests/test_alignment_reward.py
checks both against the renderer.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw


# ----------------------------------------------------------------------------- the tiny world's vocabulary

RES = 64
PALETTE = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 220, 40),
    "magenta": (210, 40, 190),
    "cyan": (30, 200, 210),
    "white": (240, 240, 240),
    "black": (20, 20, 20),
}
COLOURS = list(PALETTE)
SHAPES = ["circle", "square", "triangle", "star"]
PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles", "star": "stars"}
SHAPE_SIZES = ["small", "large"]
TEXTURES = ["plain", "striped", "checkered", "noisy"]
BACKGROUNDS = COLOURS + ["gradient"]
# The renderer's geometry (scenes._shape_mask): a square's half side is 0.85 r, a star's inner
# radius 0.45 r, a triangle's vertices at -90, 30, 150 degrees. Area = K[shape] * r^2.
SQUARE_HALF, STAR_INNER = 0.85, 0.45
AREA_K = {"circle": np.pi, "square": (2 * SQUARE_HALF) ** 2, "triangle": 3 * np.sqrt(3) / 4,
          "star": 10 * 0.5 * STAR_INNER * np.sin(np.deg2rad(36))}
SIZE_BOUNDARY = (14.5, 11.5)  # px radius between small and large: one shape (<= 12 | >= 17), two (<= 10 | >= 13)

ATTRIBUTES = ("colour", "shape", "count", "size", "texture", "background")
DEFAULT_ATTRIBUTES = ("colour", "shape", "count", "size", "background")

# ----------------------------------------------------------------------------- captions

_GRAMMAR = ('("a" | "two") [small | large] [plain | striped | checkered | noisy] <colour> <shape(s)> '
            '[on a (<colour> | gradient) background]')
_CAPTION_RE = re.compile(
    r"^(?P<count>a|two) (?:(?P<size>small|large) )?(?:(?P<texture>plain|striped|checkered|noisy) )?"
    rf"(?P<colour>{'|'.join(COLOURS)}) (?P<shape>{'|'.join(SHAPES + list(PLURAL.values()))})"
    rf"(?: on a (?P<background>{'|'.join(BACKGROUNDS)}) background)?$")


class UnparseableCaptionError(ValueError):
    """A prompt that the tiny world's caption grammar does not cover; names the caption."""

    def __init__(self, caption: str, why: str = ""):
        self.caption, self.why = caption, why
        super().__init__(f"tinyworld_alignment cannot parse caption {caption!r}{': ' + why if why else ''}; it scores "
                         f"tiny-world captions: {_GRAMMAR}, colours {', '.join(COLOURS)}, shapes {', '.join(SHAPES)} "
                         "(e.g. 'two small striped green squares on a blue background'; the prompt lists "
                         "tiny-world-train and tiny-world-eval)")

    def __reduce__(self):  # picklable: Ray re-raises it in the caller's process
        return (type(self), (self.caption, self.why))


@dataclass(frozen=True)
class CaptionAttributes:
    """What a caption states; None where it says nothing."""

    colour: str
    shape: str
    count: int
    size: str | None = None
    texture: str | None = None
    background: str | None = None

    def stated(self) -> dict:
        return {k: getattr(self, k) for k in ATTRIBUTES if getattr(self, k) is not None}


def parse_caption(caption: str) -> CaptionAttributes:
    """The attributes a tiny-world caption states (case and surrounding or repeated spaces ignored,
    a final full stop allowed). Raises UnparseableCaptionError otherwise, also when number and
    noun disagree ("a red circles")."""
    text = " ".join(str(caption).lower().split()).rstrip(".")
    m = _CAPTION_RE.match(text)
    if not m:
        raise UnparseableCaptionError(caption)
    count = 2 if m["count"] == "two" else 1
    word = m["shape"]
    plural = word in PLURAL.values()
    if plural != (count == 2):
        raise UnparseableCaptionError(caption, f"'{m['count']}' with '{word}'")
    shape = next(s for s, p in PLURAL.items() if p == word) if plural else word
    return CaptionAttributes(m["colour"], shape, count, m["size"], m["texture"], m["background"])


def check_captions(captions: list[str]) -> None:
    """Raise UnparseableCaptionError if any caption is outside the grammar, naming the first and
    how many there are (for a run's preflight: a prompt list checked before anything starts)."""
    captions = list(captions)
    bad = []
    for c in captions:
        try:
            parse_caption(c)
        except UnparseableCaptionError as e:
            bad.append(e)
    if bad:
        why = [bad[0].why] if bad[0].why else []
        if len(bad) > 1:
            why.append(f"{len(bad)} of {len(captions)} captions cannot be parsed, also "
                       + ", ".join(repr(e.caption) for e in bad[1:4]) + (", ..." if len(bad) > 4 else ""))
        raise UnparseableCaptionError(bad[0].caption, "; ".join(why))


# ----------------------------------------------------------------------------- reading an image

_PAL = np.array(list(PALETTE.values()), np.float32)
_PAL_SQ = (_PAL ** 2).sum(-1)
NONE_DIST = 80.0     # palette_classes' max_dist: further than this from every colour is "none"
COLOUR_SIGMA = 25.0
FG_RAMP = (40.0, 80.0)
SHAPE_TAU = 0.03
MIN_SHAPE_PX = 4.0   # smaller connected blobs are ignored
COLOUR_WINDOW = 5    # px: the shape's colour is read on its image averaged over this window (texture averages out)
ERODE = (1, 2, 3, 4, 6, 8)  # px: shapes are separated on the foreground eroded by one of these
BG_SHARE = 0.2      # a palette colour on this share of the border band is background everywhere
BLURS = (0.8, 1.7, 3.0)  # px: the shape templates are blurred by these (0.8: the 3x3 average the alpha is read on; more: the VAE)


def colour_membership(pixels: np.ndarray) -> np.ndarray:
    """[..., 3] RGB (0..255) -> [..., 9]: soft membership of each palette colour (COLOURS order) and
    of "none" (last), softmax of -d^2 / (2 sigma^2) with "none" at distance NONE_DIST."""
    x = pixels.reshape(-1, 3).astype(np.float32)
    d2 = np.empty((len(x), len(_PAL) + 1), np.float32)
    # |x - p|^2 = |x|^2 - 2 x.p + |p|^2; the |x|^2 term is the same for every colour but not for "none"
    d2[:, :-1] = _PAL_SQ - 2 * x @ _PAL.T
    d2[:, -1] = NONE_DIST ** 2 - (x * x).sum(-1)
    logit = d2 * (-1 / (2 * COLOUR_SIGMA ** 2))
    logit -= logit.max(-1, keepdims=True)
    e = np.exp(logit)
    e /= e.sum(-1, keepdims=True)
    return e.reshape(pixels.shape[:-1] + (len(_PAL) + 1,))


def _ramp(x, lo, hi):
    return np.clip((np.asarray(x, np.float64) - lo) / (hi - lo), 0.0, 1.0)


def _box(x: np.ndarray, k: int) -> np.ndarray:
    """k x k box sum (k odd) over the first two axes, edge-padded."""
    h, w = x.shape[:2]
    p = np.pad(x, [(k // 2, k // 2), (k // 2, k // 2)] + [(0, 0)] * (x.ndim - 2), mode="edge")
    c = np.cumsum(np.cumsum(p, 0, dtype=np.float64), 1)
    c = np.pad(c, [(1, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2))
    return (c[k:k + h, k:k + w] - c[:h, k:k + w] - c[k:k + h, :w] + c[:h, :w]).astype(np.float32)


def _label(b: np.ndarray) -> np.ndarray:
    """4-connected components of a bool mask: [H, W] int, 0 = background, 1..n by decreasing size.
    Row runs, joined where they touch vertically (union-find over the runs)."""
    h, w = b.shape
    n = h * w
    start = b.copy()
    start[:, 1:] &= ~b[:, :-1]
    run = np.maximum.accumulate(np.where(start, np.arange(n).reshape(h, w), -1), axis=1)  # a pixel's run start
    starts = np.flatnonzero(start).tolist()
    parent = dict(zip(starts, starts))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    v = b[:-1] & b[1:]
    for e in np.unique(run[:-1][v].astype(np.int64) * n + run[1:][v]).tolist():
        ra, rb = find(e // n), find(e % n)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    lut = np.zeros(n + 1, np.int64)
    lut[starts] = [find(x) + 1 for x in starts]
    out = np.where(b, lut[np.maximum(run, 0)], 0)
    _, inv = np.unique(np.concatenate([[0], out.ravel()]), return_inverse=True)  # 0 stays 0: the smallest
    return _by_size(inv[1:].reshape(h, w))


def _by_size(lab: np.ndarray) -> np.ndarray:
    """Relabel 1..n by decreasing pixel count (0 stays background)."""
    ids, counts = np.unique(lab[lab > 0], return_counts=True)
    rank = np.zeros(int(lab.max()) + 1, int)
    rank[ids[np.argsort(-counts, kind="stable")]] = np.arange(1, len(ids) + 1)
    return rank[lab]


def _shapes(b: np.ndarray) -> np.ndarray:
    """The shapes of a foreground mask, 1..n by size. Two shapes that touch along a seam or
    overlap a little are one component; eroded, they come apart. So: the mask eroded by each of
    ERODE px, the depth whose components include the most of at least a tenth of the largest
    (ties: the shallowest), its components grown back over the mask; what they do not reach (a
    speck the erosion removed) is a shape of its own. Holes are filled first."""
    out = _label(~b)  # fill holes (a noisy texture's dips): background is what reaches the border
    edge = np.unique(np.concatenate([out[0], out[-1], out[:, 0], out[:, -1]]))
    b = b | ((out > 0) & ~np.isin(out, edge))
    best, best_n = None, -1
    for k in ERODE:
        lab = _label(b & ~_dilate(~b, k))
        sizes = np.bincount(lab.ravel())[1:]
        n = int((sizes >= max(3, 0.1 * sizes.max())).sum()) if sizes.size else 0
        if n > best_n:
            best, best_n = lab, n
    lab = best
    for _ in range(RES):
        m = lab.copy()
        for src, dst in (((slice(None), slice(1, None)), (slice(None), slice(None, -1))),
                         ((slice(None), slice(None, -1)), (slice(None), slice(1, None))),
                         ((slice(1, None),), (slice(None, -1),)), ((slice(None, -1),), (slice(1, None),))):
            np.maximum(m[dst], np.where(b[dst] & (lab[dst] == 0), lab[src], 0), out=m[dst])
        if np.array_equal(m, lab):
            break
        lab = m
    rest = _label(b & (lab == 0))
    lab = np.where(rest > 0, rest + lab.max(), lab)
    return _by_size(lab)


def _dilate(b: np.ndarray, k: int) -> np.ndarray:
    for _ in range(k):
        d = b.copy()
        d[1:] |= b[:-1]
        d[:-1] |= b[1:]
        d[:, 1:] |= b[:, :-1]
        d[:, :-1] |= b[:, 1:]
        b = d
    return b


def template(shape: str, cx: float, cy: float, r: float, box: tuple[int, int, int, int], ss: int = 4) -> np.ndarray:
    """The renderer's antialiased mask of one shape (centre cx, cy and radius r in px), cut to
    box = (y0, y1, x0, x1)."""
    y0, y1, x0, x1 = box
    img = Image.new("L", ((x1 - x0) * ss, (y1 - y0) * ss), 0)
    draw = ImageDraw.Draw(img)
    cx, cy, rs = (cx - x0) * ss, (cy - y0) * ss, r * ss
    if shape == "circle":
        draw.ellipse([cx - rs, cy - rs, cx + rs, cy + rs], fill=255)
    elif shape == "square":
        h = rs * SQUARE_HALF
        draw.rectangle([cx - h, cy - h, cx + h, cy + h], fill=255)
    elif shape == "triangle":
        draw.polygon([(cx + rs * np.cos(a), cy + rs * np.sin(a)) for a in np.deg2rad([-90, 30, 150])], fill=255)
    else:
        draw.polygon([(cx + (rs if k % 2 == 0 else STAR_INNER * rs) * np.cos(np.deg2rad(-90 + 36 * k)),
                       cy + (rs if k % 2 == 0 else STAR_INNER * rs) * np.sin(np.deg2rad(-90 + 36 * k))) for k in range(10)],
                     fill=255)
    m = np.asarray(img, np.float32) / 255.0
    return m.reshape(y1 - y0, ss, x1 - x0, ss).mean(axis=(1, 3))


def _soft_iou(a: np.ndarray, t: np.ndarray) -> float:
    return float(np.minimum(a, t).sum() / max(float(np.maximum(a, t).sum()), 1e-6))


def _blur(t: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian blur (zero outside the window) as two small matrix products."""
    if sigma <= 0:
        return t
    return _blur_matrix(t.shape[0], sigma) @ t @ _blur_matrix(t.shape[1], sigma).T


@functools.lru_cache(maxsize=512)
def _blur_matrix(n: int, sigma: float) -> np.ndarray:
    i = np.arange(n)
    g = np.exp(-((i[:, None] - i[None, :]) ** 2) / (2 * sigma ** 2)).astype(np.float32)
    return g / g.sum(1, keepdims=True)  # rows sum to 1: an edge-clipped window keeps its mass


def _background_plane(img: np.ndarray, band: int = 3) -> tuple[np.ndarray, float, np.ndarray]:
    """The background as a robust per-channel plane fitted to the border band, clipped to the
    band's colour range: [H, W, 3]; its colour range over the image (RGB distance); and the
    band's frequent palette colours [k, 3] (their mean there)."""
    h, w = img.shape[:2]
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    ring = np.zeros((h, w), bool)
    ring[:band], ring[-band:], ring[:, :band], ring[:, -band:] = True, True, True, True
    X = np.stack([np.ones(ring.sum(), np.float32), xx[ring] / w - 0.5, yy[ring] / h - 0.5], 1)
    Y = img[ring]
    keep = np.ones(len(Y), bool)
    for _ in range(3):  # drop what the plane does not explain (a shape touching the border, artefacts)
        coef = np.linalg.lstsq(X[keep], Y[keep], rcond=None)[0]
        res = np.linalg.norm(Y - X @ coef, axis=1)
        new = res < max(30.0, 3.0 * float(np.median(res[keep])))
        if new.sum() < 0.3 * len(Y) or np.array_equal(new, keep):
            break
        keep = new
    lo, hi = Y[keep].min(0), Y[keep].max(0)
    full = np.stack([np.ones(h * w, np.float32), xx.ravel() / w - 0.5, yy.ravel() / h - 0.5], 1) @ coef
    plane = np.clip(full, lo, hi).reshape(h, w, 3)
    corners = plane[[0, 0, -1, -1], [0, -1, 0, -1]]
    spread = max(float(np.linalg.norm(a - b)) for a in corners for b in corners)
    # The border's frequent colours: a palette colour held by >= BG_SHARE of the band is
    # background wherever it is (a gradient that the VAE draws as two flat regions, not a plane).
    cls = colour_membership(Y).argmax(-1)
    frequent = [Y[cls == c].mean(0) for c in range(len(_PAL)) if (cls == c).mean() >= BG_SHARE]
    return plane, spread, np.array(frequent, np.float32).reshape(-1, 3)


@dataclass
class ImageReading:
    """What the scorer reads from one image, independent of any caption."""

    fg: np.ndarray               # [H, W] foreground weight in [0, 1]
    colour_fg: np.ndarray        # [9] foreground-weighted mean membership (COLOURS + none)
    colour_bg: np.ndarray        # [9] background-weighted mean membership
    bg_spread: float             # the background plane's colour range (RGB distance)
    areas: list                  # soft areas of the shapes, decreasing
    shape_p: list                # per shape: {shape: p}
    radii: list                  # per shape: radius (px) from its area and best-fitting shapes
    texture_p: dict | None       # {texture: p} over the shapes' interiors; None if too few pixels
    fg_area: float               # the foreground weight summed (px)


def read_image(image: np.ndarray, textures: bool = True) -> ImageReading:
    """Read a uint8 [H, W, 3] image (resized to 64 px if needed)."""
    if image.shape[:2] != (RES, RES):
        image = np.asarray(Image.fromarray(image).resize((RES, RES), Image.BILINEAR))
    img = image.astype(np.float32)
    plane, spread, frequent = _background_plane(img)
    dist = np.linalg.norm(img - plane, axis=-1)
    for c in frequent:
        dist = np.minimum(dist, np.linalg.norm(img - c, axis=-1))
    fg = _ramp(dist, *FG_RAMP).astype(np.float32)
    fg_sum = float(fg.sum())
    bg_w = 1.0 - fg
    colour_bg = (colour_membership(img) * bg_w[..., None]).sum((0, 1)) / max(float(bg_w.sum()), 1e-6)

    # Shapes are cut where the image is at least half way from the background to the shapes'
    # colour (90th percentile of the distance): at a fixed distance, contrasty neighbours would touch.
    # Read 3x3-averaged (a texture's tones and noise average out).
    soft = _box(img, 3) / 9.0
    dsoft = np.linalg.norm(soft - plane, axis=-1)
    for c in frequent:
        dsoft = np.minimum(dsoft, np.linalg.norm(soft - c, axis=-1))
    strong = dsoft[fg >= 0.99]
    half = 0.5 * float(np.percentile(strong, 90)) if strong.size >= 10 else 0.0
    labels = _shapes((fg > 0.5) & (dsoft >= max(half, FG_RAMP[0])))
    alpha_all = np.zeros_like(fg)
    areas, shape_p, radii, interiors = [], [], [], []
    taken = np.zeros_like(fg, bool)
    for k in range(1, min(int(labels.max()), 4) + 1):
        comp = labels == k
        # Alpha matte of this shape: the projection of (pixel - background) on (its colour - background).
        near = _dilate(comp, 2) & ~taken & ((labels == 0) | comp)
        core = comp & (fg >= 0.99)
        diff = np.median(soft[core if core.sum() >= 3 else comp], axis=0) - plane
        alpha = np.where(near, np.clip(((soft - plane) * diff).sum(-1) / np.maximum((diff ** 2).sum(-1), 1.0), 0, 1), 0)
        area = float(alpha.sum())
        if area < MIN_SHAPE_PX:
            break
        taken |= near
        alpha_all = np.maximum(alpha_all, alpha)
        ys, xs = np.nonzero(near)
        y0, y1, x0, x1 = max(ys.min() - 6, 0), min(ys.max() + 7, RES), max(xs.min() - 6, 0), min(xs.max() + 7, RES)
        yy, xx = np.mgrid[y0:y1, x0:x1]
        a = alpha[y0:y1, x0:x1]
        cy, cx = float((a * (yy + 0.5)).sum() / area), float((a * (xx + 0.5)).sum() / area)
        ious = {}
        for s in SHAPES:
            t = template(s, cx, cy, np.sqrt(area / AREA_K[s]), (y0, y1, x0, x1))
            ious[s] = max(_soft_iou(a, _blur(t, sigma)) for sigma in BLURS)
        logit = np.array([ious[s] for s in SHAPES]) / SHAPE_TAU
        p = np.exp(logit - logit.max())
        p /= p.sum()
        areas.append(area)
        shape_p.append(dict(zip(SHAPES, p.tolist())))
        radii.append(float(np.sqrt(area / float(np.dot(p, [AREA_K[s] for s in SHAPES])))))
        interiors.append(comp & ~_dilate(~comp, 1) & (fg >= 0.99))
    # The shapes' colour: membership on the image averaged over COLOUR_WINDOW within the
    # foreground, weighted by the alpha matte (an edge pixel that blends shape and background counts little).
    smooth = _box(img * fg[..., None], COLOUR_WINDOW) / np.maximum(_box(fg, COLOUR_WINDOW), 1e-6)[..., None]
    wgt = fg * alpha_all
    colour_fg = (colour_membership(smooth) * wgt[..., None]).sum((0, 1)) / max(float(wgt.sum()), 1e-6)
    texture_p = _texture(img, np.any(interiors, axis=0)) if textures and interiors else None
    return ImageReading(fg, colour_fg, colour_bg, spread, areas, shape_p, radii, texture_p, fg_sum)


TEXTURE_PROTOTYPES = {"plain": (1.0, 1.0), "striped": (0.58, 1.0), "checkered": (0.71, 0.71), "noisy": (0.0, 0.0)}


def _texture(img: np.ndarray, inside: np.ndarray, same: float = 12.0, sigma: float = 0.1, min_pairs: int = 12):
    z = []
    for axis in (1, 0):
        a = np.moveaxis(img, axis, 0)
        m = np.moveaxis(inside, axis, 0)
        pair = m[1:] & m[:-1]
        if pair.sum() < min_pairs:
            return None
        z.append(float((np.linalg.norm(a[1:] - a[:-1], axis=-1)[pair] < same).mean()))
    f = np.array([min(z), max(z)])
    logit = np.array([-((f - np.array(v)) ** 2).sum() / (2 * sigma ** 2) for v in TEXTURE_PROTOTYPES.values()])
    p = np.exp(logit - logit.max())
    return dict(zip(TEXTURE_PROTOTYPES, (p / p.sum()).tolist()))


def attribute_scores(reading: ImageReading, cap: CaptionAttributes, attributes=ATTRIBUTES) -> dict:
    """{attribute: score in [0, 1]} for each attribute the caption states that is in attributes."""
    out = {}
    a = reading.areas
    presence = float(_ramp(a[0], 10.0, 40.0)) if a else 0.0
    w = np.array(a) / sum(a) if a else np.zeros(0)
    stated = cap.stated()
    if "colour" in attributes:
        out["colour"] = presence * float(reading.colour_fg[COLOURS.index(cap.colour)])
    if "shape" in attributes:
        out["shape"] = presence * float(sum(wi * p[cap.shape] for wi, p in zip(w, reading.shape_p)))
    # How clearly the image shows a second (third) shape: the area ratio to the largest, 0.15 -> 0.5.
    q2 = float(_ramp(a[1] / a[0], 0.15, 0.5)) if len(a) > 1 else 0.0
    q3 = float(_ramp(a[2] / a[0], 0.15, 0.5)) if len(a) > 2 else 0.0
    if "count" in attributes:
        out["count"] = presence * (q2 * (1 - q3) if cap.count == 2 else 1 - q2)
    if "size" in attributes and "size" in stated:
        r = float(np.dot(w, reading.radii)) if a else 0.0
        # The renderer's radii (px): one shape small 10-12 / large 17-21, two shapes 9-10 / 13-14:
        # the boundary is 14.5 for one shape, 11.5 for two, as many as the image shows.
        boundary = SIZE_BOUNDARY[0] + q2 * (SIZE_BOUNDARY[1] - SIZE_BOUNDARY[0])
        p_large = 1.0 / (1.0 + np.exp(-(r - boundary) / 0.75))
        out["size"] = presence * float(p_large if cap.size == "large" else 1 - p_large)
    if "texture" in attributes and "texture" in stated:
        out["texture"] = presence * (reading.texture_p[cap.texture] if reading.texture_p else 0.0)
    if "background" in attributes and "background" in stated:
        if cap.background == "gradient":
            out["background"] = float(_ramp(reading.bg_spread, 40.0, 100.0))
        else:
            out["background"] = float(reading.colour_bg[COLOURS.index(cap.background)])
    return out


class TinyWorldAlignment:
    """The reward: the mean of the attribute scores of each image against its caption, in [0, 1].

    attributes: which stated attributes are scored (default: all but texture, which the tiny
    world's VAE does not draw); a caption's unstated ones are never scored."""

    name = "tinyworld_alignment"

    def __init__(self, attributes=DEFAULT_ATTRIBUTES):
        attributes = (attributes,) if isinstance(attributes, str) else tuple(attributes)
        bad = [x for x in attributes if x not in ATTRIBUTES]
        if bad or not attributes:
            raise ValueError(f"{self.name}: attributes must be a non-empty subset of {', '.join(ATTRIBUTES)}, got {list(attributes)}")
        if not {"colour", "shape", "count"} & set(attributes):
            # every caption states colour, shape and count; without one of them a caption may state nothing scored
            raise ValueError(f"{self.name}: attributes must include colour, shape or count (every caption states them), "
                             f"got {list(attributes)}")
        self.attributes = attributes

    check_prompts = staticmethod(check_captions)  # rewards.check_prompts: a prompt list checked before a run

    def read(self, image: np.ndarray) -> ImageReading:
        return read_image(np.asarray(image, np.uint8), textures="texture" in self.attributes)

    def score_reading(self, reading: ImageReading, caption: CaptionAttributes) -> float:
        """The reward of one read image against one parsed caption: the mean of its attribute scores."""
        return float(np.mean(list(attribute_scores(reading, caption, self.attributes).values())))

    def components(self, images: np.ndarray, prompts: list[str]) -> dict[str, np.ndarray]:
        """Each scored attribute's score per image, NaN where the caption does not state it."""
        caps = [parse_caption(p) for p in prompts]  # every caption first: an error before any work
        out = {k: np.full(len(images), np.nan, np.float32) for k in self.attributes}
        for i, (im, cap) in enumerate(zip(images, caps)):
            for k, v in attribute_scores(self.read(im), cap, self.attributes).items():
                out[k][i] = v
        return out

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        caps = [parse_caption(p) for p in prompts]  # every caption first: an error before any work
        return np.array([self.score_reading(self.read(im), cap) for im, cap in zip(images, caps)], np.float32)
