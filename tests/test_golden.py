"""Fixed-seed numbers held: the reference loop's per-epoch records for each algorithm (and the
project's default method: hard-mined replay with latent_sq weighting), 2 epochs on the tiny random
model. A refactor (the key table, algorithms as parts, the driver) must keep them: rewards, losses,
KLs, gradient norms and what was trained.

The numbers live in tests/data/golden.json; after a change that is MEANT to alter results,
rewrite them with `GOLDEN_WRITE=1 python -m pytest tests/test_golden.py` and say why in the commit.
Compared to a relative 1e-6 (float summation order may differ across CPU instruction sets)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from diffrlhf.actors.reference_loop import run_reference
from diffrlhf.deploy.config import load_config

GOLDEN = Path(__file__).parent / "data" / "golden.json"
BASE = ["sample.num_steps=6", "sample.resolution=32", "sample.batch_size=4", "sample.batches_per_epoch=2",
        "train.batch_size=4", "train.epochs=2", "prompts.train=simple_animals"]
RUNS = {
    "ddpo": [],
    "dpok": ["algorithm.name=dpok", "algorithm.kl_coef=0.1"],
    # thresholds low enough that branch groups pass them: rows are trained (steps_trained > 0); every
    # key its own defaults set is given, so the config is the one these numbers were made with
    "b2diffurl": ["algorithm.name=b2diffurl", "train.timestep_selection=backward", "sample.samples_per_prompt=2",
                  "advantage.mode=group", "algorithm.b2_pos_threshold=0.1", "algorithm.b2_neg_threshold=-0.1",
                  "train.timestep_fraction=1"],
    "hardmine_latent_sq": ["replay.mode=hardmine", "replay.k=2", "weighting.scheme=latent_sq"],
}
HELD = ["reward_mean", "reward_std", "loss", "approx_kl", "clipfrac", "grad_norm", "kl_pretrained", "samples_trained",
        "steps_trained", "num_replayed", "optimizer_steps", "reward_queries"]


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("name", list(RUNS))
def test_the_reference_loop_keeps_its_numbers(name, golden, tiny_folder):
    cfg = load_config("tiny", overrides=[f"model.name={tiny_folder}", *BASE, *RUNS[name]])
    records = run_reference(cfg, progress=False)
    got = [{k: r[k] for k in HELD if k in r} for r in records]
    if os.environ.get("GOLDEN_WRITE"):
        data = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        GOLDEN.write_text(json.dumps({**data, name: got}, indent=1) + "\n")
        pytest.skip("golden numbers written")
    assert name in golden, f"no golden numbers for {name!r}: run with GOLDEN_WRITE=1"
    assert [sorted(r) for r in got] == [sorted(r) for r in golden[name]]
    for epoch, (g, want) in enumerate(zip(got, golden[name])):
        for k, v in want.items():
            assert g[k] == pytest.approx(v, rel=1e-6, abs=1e-12), f"{name} epoch {epoch} {k}: {g[k]} != {v}"
    if name == "b2diffurl":
        assert all(r["steps_trained"] > 0 for r in got)
