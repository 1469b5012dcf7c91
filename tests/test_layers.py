"""The dependency direction, enforced: deploy -> actors -> learner -> policy -> tinyworld -> {rewards, buffer} -> keys.

Every `diffrlhf` import in the package (module-level and function-local alike) must point to the
same layer or one below it; rewards and buffer sit side by side at the bottom and import neither
each other nor anything above. A back-edge fails this test with the file, line and both layers.

A dependency on another layer must be visible at the top of the module. Function-local imports of
this project's code stay only inside one layer, for lazy loading of heavy modules (the reward
models, the tiny world's evaluation), and in the command-line entry point, whose commands load only
what they run (a config error answers without starting Ray or loading a model).
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Highest first. A layer may import itself and any layer with a larger index.
LAYERS = [("deploy",), ("actors",), ("learner",), ("policy",), ("tinyworld",), ("rewards", "buffer"), ("keys",)]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules():
    for layer in RANK:
        for path in sorted((ROOT / layer).rglob("*.py")):
            yield layer, path


def _diffrlhf_imports(tree, package: str = ""):
    """(line, target layer, at module level?) for each import of diffrlhf.<layer> or research;
    `package` (e.g. diffrlhf.rewards.sub) resolves relative imports."""
    top_level = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if package else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [module] + ([f"{module}.{a.name}" for a in node.names] if module == "diffrlhf" else [])
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if node.module == "diffrlhf" else [])
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "research":
                yield node.lineno, "research", id(node) in top_level
            elif parts[0] == "diffrlhf" and len(parts) > 1 and parts[1] in RANK:
                yield node.lineno, parts[1], id(node) in top_level


def _package(layer: str, path: Path) -> str:
    """The package a module's relative imports resolve against."""
    rel = path.relative_to(ROOT / layer).with_suffix("")
    return ".".join(["diffrlhf", layer, *rel.parts[:-1]])  # a module's own folder, __init__ or not


LAZY_ENTRY_POINTS = {"deploy/cli.py"}
# Third-party packages that may be imported inside a function, each for one reason. Anything else
# (numpy, pyarrow, PIL, yaml, the standard library, ...) is cheap and goes at the top of the module.
LAZY_THIRD_PARTY = {
    "matplotlib": "pictures only: about 1 s to import, and the Agg backend is chosen right before pyplot",
    "diffusers": "about 2 s to import: modules that only pass a model around stay light",
    "transformers": "about 2 s to import, likewise",
    "peft": "imports transformers; needed only when a LoRA is attached or saved",
    "ray": "only where a run uses Ray, and ray.util.metrics may be unavailable (then metrics are off)",
    "huggingface_hub": "only to look in the local Hugging Face cache for weights",
    "torch": "torch.utils.tensorboard only: optional, TensorBoard may be missing",
    "wandb": "optional (Weights & Biases logging when installed and configured)",
    "ftfy": "optional (the CLIP tokenizer's text cleaning)",
    "hpsv2": "optional package that runs in the reward actor's own environment",
    "ImageReward": "optional package that runs in the reward actor's own environment",
}


def test_every_layer_folder_is_checked():
    assert {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} == set(RANK) | {"research"}  # the lab: not a layer


def _back_edges(layer: str, path: Path, tree) -> list[str]:
    out = []
    for line, target, _ in _diffrlhf_imports(tree, _package(layer, path)):
        where = f"{path.relative_to(ROOT)}:{line}"
        if target == "research":
            out.append(f"{where} imports research/ (the lab): the product imports nothing from it")
        elif RANK[target] < RANK[layer] or (target != layer and RANK[target] == RANK[layer]):
            out.append(f"{where} imports diffrlhf.{target} (layer {RANK[target]}) from {layer} (layer {RANK[layer]})")
    return out


def _hidden(layer: str, path: Path, tree) -> list[str]:
    """A function-local import of another layer hides a dependency (61 of them once hid cycles)."""
    if str(path.relative_to(ROOT)) in LAZY_ENTRY_POINTS:
        return []
    return [f"{path.relative_to(ROOT)}:{line} imports diffrlhf.{target} inside a function; move it to the top"
            for line, target, at_top in _diffrlhf_imports(tree, _package(layer, path)) if not at_top and target not in (layer, "research")]


def _cheap_lazy(layer: str, path: Path, tree) -> list[str]:
    top = {id(n) for n in tree.body}
    bad = []
    for node in ast.walk(tree):
        if id(node) in top or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            continue  # its own package: covered by the layer checks
        root = (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name).split(".")[0]
        if root != "diffrlhf" and root not in LAZY_THIRD_PARTY:
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {root} inside a function; import it at the top")
    return bad


def _every_module(check) -> list[str]:
    return [f for layer, path in _modules() for f in check(layer, path, ast.parse(path.read_text(), filename=str(path)))]


def test_imports_point_down():
    found = _every_module(_back_edges)
    assert not found, "imports against the layer order " + " -> ".join("/".join(l) for l in LAYERS) + ":\n" + "\n".join(found)


def test_other_layers_are_imported_at_module_level():
    found = _every_module(_hidden)
    assert not found, "\n".join(found)


def test_function_local_imports_are_heavy_or_optional_packages():
    found = _every_module(_cheap_lazy)
    assert not found, "\n".join(found)


def test_the_check_catches_a_back_edge_and_a_hidden_import(tmp_path):
    """The checker itself: a policy module importing the learner, inside a function, is flagged twice."""
    src = "import torch\n\ndef f():\n    from diffrlhf.learner.update import PolicyLearner\n    return PolicyLearner\n"
    tree = ast.parse(src)
    found = list(_diffrlhf_imports(tree))
    assert found == [(4, "learner", False)]
    path = ROOT / "policy" / "x.py"
    assert _back_edges("policy", path, tree) and _hidden("policy", path, tree)
    # relative imports are resolved: `from ..learner import x` in policy/ is the same back-edge
    rel = ast.parse("from ..learner import update\nfrom .sampler import f\n")
    assert [t for _, t, _ in _diffrlhf_imports(rel, "diffrlhf.policy")] == ["learner", "policy"]
    assert len(_back_edges("policy", path, rel)) == 1
    # and the lab is never imported by the product
    lab = ast.parse("from research.controls import CONTROLS\n")
    assert "the lab" in _back_edges("rewards", ROOT / "rewards" / "x.py", lab)[0]
