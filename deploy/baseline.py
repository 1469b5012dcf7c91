"""The committed DDPO baseline a run is compared with, and the run's own gain.

    band = ddpo_band(cfg)           # None when no committed DDPO run was made with this run's settings
    print(summary_line(records, band))

The band comes from the sample-efficiency study's DDPO runs (uniform weights, no replay;
research/results/<study>/runs/<reward>/uniform__none/seed<N>.json, made with the single-process
reference loop, gathered into the package file ddpo_baselines.json). A committed run counts only if its config equals this run's on everything that
changes what is learned: model (with the tiny world's weights digest), sample, prompts, reward,
advantage and train, except train.epochs (no schedule depends on it: the first n epochs of a longer
run are an n-epoch run). Ignored: weighting, replay and train.timestep_selection/_fraction (the axes
compared), system and run (where and
how it runs, not what), model.device and reward.runtime_env (the same computation elsewhere) and the
preset's name. Any other difference, including a key one side lacks, means no band: a band from
other settings would be a different experiment.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from diffrlhf.deploy.config import flatten
from diffrlhf.tinyworld import weights as tiny_world_weights

# The band's data, one small package file written from the study's runs by
# `python -m research.bench.baselines` (the product never reads the study's folders).
BASELINES_FILE = Path(__file__).resolve().parent / "ddpo_baselines.json"
COMPARED = ("model", "sample", "prompts", "reward", "advantage", "train")
# Also ignored: which timesteps are trained and what share (an axis compared, like weighting: a run that
# trains a quarter of the steps is measured against DDPO's all-steps band).
IGNORED = {"train.epochs", "model.device", "reward.runtime_env", "train.timestep_selection", "train.timestep_fraction"}


def identity(config: dict) -> dict:
    """The flat keys that must match, with the tiny world's weights digest added as the study records it
    (as JSON gives them back: tuples are lists)."""
    d = {s: dict(config.get(s) or {}) for s in COMPARED}
    if d["model"].get("name") == "tiny-world" and "weights_sha256" not in d["model"]:
        d["model"]["weights_sha256"] = tiny_world_weights.recorded_digest()[:16]
    return json.loads(json.dumps({k: v for k, v in flatten(d).items() if k not in IGNORED}))


def baselines_from_runs(results_dir: str | Path) -> list[dict]:
    """One entry per distinct settings among the DDPO runs (uniform weights, no replay) of the study
    folders under results_dir: {"identity", "study", "seeds", "queries", "rewards" [seed][epoch]}.

    If several study folders ran the same settings, the one with the most seeds wins (then the first
    by name), so seeds of two studies are never mixed. Epochs are cut to the shortest run.
    """
    groups: dict[tuple, list[dict]] = {}
    for path in sorted(Path(results_dir).glob("*/runs/*/uniform__none/seed*.json")):
        run = json.loads(path.read_text())
        if run.get("records"):
            ident = identity(run["config"])
            groups.setdefault((json.dumps(ident, sort_keys=True), path.parents[3].name), []).append(run)
    best: dict[str, tuple[str, list[dict]]] = {}
    for (key, study), runs in groups.items():  # sorted by path: ties go to the first study name
        if key not in best or len(runs) > len(best[key][1]):
            best[key] = (study, runs)
    out = []
    for key, (study, runs) in best.items():
        n = min(len(r["records"]) for r in runs)
        out.append({"identity": json.loads(key), "study": study, "seeds": [r["seed"] for r in runs],
                    "queries": [rec["reward_queries"] for rec in runs[0]["records"][:n]],
                    "rewards": [[rec["reward_mean"] for rec in r["records"][:n]] for r in runs]})
    return out


def load_baselines(path: str | Path = BASELINES_FILE) -> list[dict]:
    path = Path(path)
    return json.loads(path.read_text())["baselines"] if path.exists() else []


def ddpo_band(config, baselines: list[dict] | None = None) -> dict | None:
    """Per-epoch DDPO reward across the matching seeds against reward queries: the [seed, epoch] rewards
    and their mean, min, max and s.d. over seeds.

    config: a Config or its to_dict(); baselines: entries of baselines_from_runs (default: the
    package's file). None when no baseline was run with this config's settings.
    """
    config = config if isinstance(config, dict) else config.to_dict()
    want = identity(config)
    match = [b for b in (load_baselines() if baselines is None else baselines) if b["identity"] == want]
    if not match:
        return None
    b = match[0]
    y, n = np.array(b["rewards"], dtype=np.float64), len(b["queries"])
    return {
        "queries": np.array(b["queries"]),
        "rewards": y, "mean": y.mean(0), "min": y.min(0), "max": y.max(0),
        "sd": y.std(0, ddof=1) if len(y) > 1 else np.zeros(n),
        "seeds": list(b["seeds"]), "study": b["study"],
        "label": f"DDPO baseline: committed {b['study']}, {len(y)} seed{'s' * (len(y) > 1)} (reference loop), min..max",
    }


def gain_summary(records: list[dict], last: int = 3) -> dict | None:
    """The run's final `last`-epoch mean minus its first epoch's mean, in reward units and in s.e.

    s.e. of the gain = sqrt(se_first^2 + se_last^2), se_last = sqrt(sum of the last epochs' se^2) / k
    (epochs' samples are independent draws, so their errors add in quadrature). The last epochs never
    include the first: with fewer than last + 1 epochs, k = epochs - 1. None for fewer than 2 epochs.
    """
    if len(records) < 2:
        return None
    tail = records[-min(last, len(records) - 1):]
    first, first_se = records[0]["reward_mean"], records[0]["reward_se"]
    final = float(np.mean([r["reward_mean"] for r in tail]))
    final_se = math.sqrt(sum(r["reward_se"] ** 2 for r in tail)) / len(tail)
    gain = final - first
    se = math.sqrt(first_se ** 2 + final_se ** 2)
    return {"first": first, "first_se": first_se, "final": final, "final_se": final_se, "epochs_averaged": len(tail),
            "gain": gain, "gain_se": se, "gain_in_se": gain / se if se > 0 else math.nan}


def summary_line(records: list[dict], band: dict | None = None) -> str | None:
    """One line for the end of a run: its gain, and DDPO's final mean at the same reward queries."""
    g = gain_summary(records)
    if g is None:
        return None
    k = g["epochs_averaged"]
    line = (f"reward {g['first']:.3f} ± {g['first_se']:.3f} (epoch 0) -> {g['final']:.3f} ± {g['final_se']:.3f} "
            f"(mean of last {k}); gain {g['gain']:+.3f} = {g['gain_in_se']:.1f} s.e.")
    if band is not None:
        q = records[-1]["reward_queries"]
        at = np.nonzero(band["queries"] <= q)[0]
        if len(at) > k and band["queries"][at[-1]] == q:  # the baseline ran this far: compare like with like
            per_seed = band["rewards"][:, at[-1] - k + 1: at[-1] + 1].mean(1)
            line += (f"; DDPO at {q} queries (committed {band['study']}, {len(per_seed)} seeds, same mean): "
                     f"{per_seed.mean():.3f} (seeds {per_seed.min():.3f}..{per_seed.max():.3f})")
    return line
