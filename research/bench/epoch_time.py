"""Epoch time of two installs of diffrlhf side by side (issue 51: before and after the data-path
change), alternating runs on one machine so both see the same load.

    python -m research.bench.epoch_time --python before=/path/to/venv/bin/python after=python \
        [--epochs 6] [--repeats 3] [--out DIR]

Each run is `python -m diffrlhf.deploy.cli train --no-progress` of the tiny preset in its own
sandbox (HOME, caches, Ray's temp dir), runs alternating A B A B ...; per run the seconds per epoch
after the first (wall_s from its metrics.jsonl: (last - first) / (epochs - 1); the first epoch holds
the actors' start). Writes epoch_time.json and .md into research/results/data_path/ or --out.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from research.bench.common import log, machine, out_dir, sandbox_env, write_json


def one_run(python: str, epochs: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="drl-et-"))
    env = sandbox_env(tmp)
    env.pop("PYTHONPATH", None)
    try:
        subprocess.run([python, "-m", "diffrlhf.deploy.cli", "train", "--no-progress", f"train.epochs={epochs}",
                        f"run.out_dir={tmp / 'runs'}", "run.name=t"], env=env, cwd=tmp, check=True, capture_output=True, timeout=1800)
        walls = [json.loads(x)["wall_s"] for x in (tmp / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
        ckpt = (tmp / "runs" / "t" / "checkpoint" / "state.pt").stat().st_size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"s_per_epoch": (walls[-1] - walls[0]) / (len(walls) - 1), "wall_s": walls[-1], "checkpoint_bytes": ckpt}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", nargs=2, required=True, metavar="NAME=PYTHON")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    installs = dict(x.split("=", 1) for x in args.python)
    runs = {name: [] for name in installs}
    for r in range(args.repeats):
        for name, python in installs.items():
            runs[name].append(one_run(python, args.epochs))
            log("epoch_time", f"repeat {r} {name}: {runs[name][-1]['s_per_epoch']:.2f} s/epoch, checkpoint {runs[name][-1]['checkpoint_bytes']} B")
    (a, ra), (b, rb) = runs.items()
    ratios = [x["s_per_epoch"] / y["s_per_epoch"] for x, y in zip(rb, ra)]  # pairs run back to back
    summary = {name: {"median_s_per_epoch": float(np.median([x["s_per_epoch"] for x in rs])),
                      "checkpoint_bytes": rs[-1]["checkpoint_bytes"]} for name, rs in runs.items()}
    folder = out_dir("data_path", args.out)
    write_json(folder / "epoch_time.json", {"machine": machine(), "command": "python -m research.bench.epoch_time",
                                            "installs": installs, "epochs": args.epochs, "runs": runs, "summary": summary,
                                            f"ratio_{b}_over_{a}": ratios})
    md = [f"| install | median s per epoch (epochs 2-{args.epochs}, {args.repeats} runs) | checkpoint (MB) |", "| --- | --- | --- |"]
    md += [f"| {n} | {s['median_s_per_epoch']:.2f} | {s['checkpoint_bytes'] / 1e6:.2f} |" for n, s in summary.items()]
    md += ["", f"{b} / {a} per pair (run back to back): " + ", ".join(f"{x:.3f}" for x in ratios)]
    (folder / "epoch_time.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
