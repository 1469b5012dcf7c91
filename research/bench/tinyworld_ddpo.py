"""Does DDPO move JPEG compressibility on the tiny world? A ~10 minute CPU check with the core loop.

    python -m research.bench.tinyworld_ddpo [--epochs 20] [override ...]
    e.g. ... train.lr=0.01 train.clip_range=0.01

Runs the single-process reference loop (actors/reference_loop.py::run_reference) on the `tiny`
preset, then writes the reward curve (epoch mean +- standard error) and a summary: the gain of the
last three epochs' mean reward over the first three, in units of its standard error.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from diffrlhf.actors.reference_loop import run_reference
from research.bench.common import RESULTS_DIR, pyplot
from diffrlhf.deploy.config import load_config


def summarise(records: list[dict], k: int = 3) -> dict:
    r = np.array([x["reward_mean"] for x in records])
    se = np.array([x["reward_se"] for x in records])
    first, last = r[:k].mean(), r[-k:].mean()
    # SE of a difference of two means of k epoch means each (epochs are independent samples).
    se_diff = float(np.sqrt((se[:k] ** 2).sum() / k**2 + (se[-k:] ** 2).sum() / k**2))
    return dict(first_mean=float(first), last_mean=float(last), gain=float(last - first),
                se_of_gain=se_diff, gain_in_se=float((last - first) / se_diff) if se_diff > 0 else float("nan"),
                mean_epoch_se=float(se.mean()))


def plot(records: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    e = [x["epoch"] for x in records]
    r = np.array([x["reward_mean"] for x in records])
    se = np.array([x["reward_se"] for x in records])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.errorbar(e, r, yerr=se, fmt="o-", capsize=2, label="epoch mean +- s.e.")
    ax.set_xlabel("epoch")
    ax.set_ylabel("JPEG compressibility (-kB)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--results", type=Path, default=RESULTS_DIR / "tinyworld")
    ap.add_argument("overrides", nargs="*", help="config overrides, key.sub=value")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    cfg = load_config("tiny", overrides=[f"train.epochs={args.epochs}", "model.device=cpu", *args.overrides])
    t0 = time.time()
    records = run_reference(cfg)
    minutes = (time.time() - t0) / 60
    summary = summarise(records)
    summary.update(minutes=minutes, overrides=args.overrides, epochs=args.epochs,
                   lr=cfg.train.lr, clip_range=cfg.train.clip_range, samples_per_epoch=cfg.samples_per_epoch(),
                   date=time.strftime("%Y-%m-%d"))
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "ddpo_jpeg.json").write_text(json.dumps(dict(summary=summary, records=records), indent=2, default=float))
    plot(records, args.results / "ddpo_jpeg.png",
         f"DDPO on tiny-world, JPEG compressibility, lr {cfg.train.lr:g}, clip {cfg.train.clip_range:g}, "
         f"{cfg.samples_per_epoch()} samples/epoch ({minutes:.1f} min)")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
