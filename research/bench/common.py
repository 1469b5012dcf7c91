"""Helpers shared by the benchmark commands: output folders, machine facts, JSON, progress lines."""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"

# The --size tiny settings every command shares: the tiny random model, few steps, small images.
# Only for checking that a command works end to end; the numbers mean nothing.
TINY_OVERRIDES = [
    "model.name=tiny-random", "model.device=cpu", "sample.num_steps=3", "sample.resolution=32",
    "sample.batch_size=4", "sample.batches_per_epoch=1", "train.batch_size=4", "run.image_grid_every=0",
    "run.tensorboard=false",
]


def sandbox_env(tmp: Path, extra: tuple[tuple[str, str], ...] = ()) -> dict:
    """The environment for a CLI run in a fresh sandbox under tmp, as a new user's machine has it:
    HOME, the project's and HOME-based caches and Ray's temp dir (plus `extra` (variable, subfolder)
    pairs) in empty folders, offline, no usage stats."""
    env = dict(os.environ)
    for var, sub in [("HOME", "home"), ("DIFFRLHF_CACHE", "cache"), ("XDG_CACHE_HOME", "home/.cache"), ("RAY_TMPDIR", "ray"),
                     *extra]:
        (tmp / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(tmp / sub)
    env.update(HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    return env


def out_dir(name: str, out: str | Path | None) -> Path:
    path = Path(out) if out else RESULTS_DIR / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def log(tag: str, msg: str) -> None:
    """One progress line, flushed (long runs are watched through pipes and log files)."""
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine() -> dict:
    """What the numbers were measured on: shared machines skew timings, so record the load too."""

    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import ray

        info["ray"] = ray.__version__
    except ImportError:
        pass
    return info


def _jsonable(x):
    """NaN/inf are not JSON: store them as null so every reader can parse the files."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return _jsonable(x.item())
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(path: Path, data) -> Path:
    """Write atomically (tmp + rename): an interrupted long study never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(_jsonable(data), indent=1))
    tmp.replace(path)
    return path


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to n for a timed block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_report(folder: Path, stem: str, res: dict, md: str) -> dict:
    """A benchmark's result: <folder>/<stem>.json (the numbers) and <stem>.md (the table), printed."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / f"{stem}.json", res)
    (folder / f"{stem}.md").write_text(md)
    print(md)
    return res


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    return plt


def median(xs) -> float:
    return float(np.median(np.asarray(xs, dtype=np.float64)))


# ----------------------------------------------------------------------------- paired comparisons
# Student's t from the regularised incomplete beta function (Numerical Recipes' continued
# fraction), so a paired test needs no scipy (not a dependency of this project).


def _betacf(a: float, b: float, x: float) -> float:
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf2(t: float, df: float) -> float:
    """Two-sided tail probability P(|T| >= |t|) of Student's t with df degrees of freedom."""
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (p > 0.5), by bisection on t_sf2."""
    lo, hi = 0.0, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_sf2(mid, df) / 2 > 1 - p else (lo, mid)
    return (lo + hi) / 2


def paired_test(diffs) -> dict:
    """Per-seed differences (variant - baseline, same seed): mean, s.e., the 95% confidence
    interval and the two-sided p of a paired t-test (H0: mean difference 0), and how many seeds
    are above 0. None for the statistics with fewer than 2 seeds."""
    d = np.asarray(list(diffs), dtype=np.float64)
    out = {"n": int(d.size), "mean": float(d.mean()) if d.size else None, "above": int((d > 0).sum())}
    if d.size < 2:
        return {**out, "se": None, "ci95": None, "t": None, "p": None}
    se = float(d.std(ddof=1) / math.sqrt(d.size))
    df = d.size - 1
    half = t_quantile(0.975, df) * se
    t = out["mean"] / se if se > 0 else math.copysign(math.inf, out["mean"]) if out["mean"] else 0.0
    p = t_sf2(t, df) if math.isfinite(t) else 0.0
    return {**out, "se": se, "ci95": [out["mean"] - half, out["mean"] + half], "t": t, "p": p}
