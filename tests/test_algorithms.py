"""Algorithms as parts (learner/algorithms/): the roles name none of them; a new one is a class,
registered, that runs by name with its own defaults (docs/algorithms.md's worked example)."""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from diffrlhf.actors.reference_loop import run_reference
from diffrlhf.deploy.config import load_config, resolve_config
from diffrlhf.learner import algorithms
from diffrlhf.learner.algorithms import base
from diffrlhf.learner.loss import ppo_clipped_loss

ROOT = Path(__file__).resolve().parents[1]


def _docstrings(tree) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def test_the_roles_code_names_no_algorithm():
    """The samplers (actors/, policy/), the buffer, the learner (outside learner/algorithms/) and
    the driver hold no algorithm-specific logic: no string, name or attribute in their code names
    one (comments and docstrings may say where a mechanism comes from)."""
    words = set(algorithms.names()) | {"b2_"}
    hits = []
    for layer in ("actors", "buffer", "policy", "learner"):
        for path in (ROOT / layer).rglob("*.py"):
            if "algorithms" in path.parts:
                continue
            tree = ast.parse(path.read_text())
            skip = _docstrings(tree)
            for node in ast.walk(tree):
                text = (node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
                        else node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None)
                if text and any(w in text.lower() for w in words):
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text[:60]!r}")
    assert hits == []


class PlainPG(base.Algorithm):
    """docs/algorithms.md's example: the policy gradient through the ratio, without the clip."""
    name = "plain_pg"
    defaults = {"advantage.mode": "batch"}

    def step_loss(self, ctx):
        return ppo_clipped_loss(ctx.logp, ctx.old, ctx.advantages[:, 0], None)


@pytest.fixture
def plain_pg():
    base.register(PlainPG)
    yield
    base._REGISTRY.pop("plain_pg")


def test_a_new_algorithm_is_a_registered_class_that_runs_by_name_with_its_defaults(plain_pg, tiny_folder):
    cfg, sources = resolve_config("tiny", None, [f"model.name={tiny_folder}", "algorithm.name=plain_pg", "sample.num_steps=4",
                                                 "sample.resolution=32", "sample.batch_size=4", "sample.batches_per_epoch=2",
                                                 "train.batch_size=4", "train.epochs=2", "prompts.train=simple_animals",
                                                 "train.clip_range=1e-6"])
    assert cfg.advantage.mode == "batch" and sources["advantage.mode"] == "algorithm plain_pg"
    records = run_reference(cfg, progress=False)
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)
    # no clip: the tiny clip_range above would clip DDPO's ratio on most rows; plain_pg ignores it
    ddpo = run_reference(load_config("tiny", overrides=[*(f"{k}={v}" for k, v in [("model.name", tiny_folder)]), "sample.num_steps=4",
                                                        "sample.resolution=32", "sample.batch_size=4", "sample.batches_per_epoch=2",
                                                        "train.batch_size=4", "train.epochs=2", "prompts.train=simple_animals",
                                                        "train.clip_range=1e-6", "advantage.mode=batch"]), progress=False)
    assert records[0]["reward_mean"] == ddpo[0]["reward_mean"]  # same samples before any update
    assert records[1]["reward_mean"] != ddpo[1]["reward_mean"]  # a different update


def test_registering_needs_a_unique_name():
    with pytest.raises(ValueError, match="unique name"):
        base.register(type("Again", (base.Algorithm,), {"name": "ddpo"}))
    with pytest.raises(ValueError, match="unknown algorithm 'nope'; choose one of ddpo, dpok, b2diffurl"):
        algorithms.get("nope")
