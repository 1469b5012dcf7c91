"""Helpers shared by the benchmark commands: output folders, machine facts, JSON, progress lines."""
from __future__ import annotations

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


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    return plt


def median(xs) -> float:
    return float(np.median(np.asarray(xs, dtype=np.float64)))
