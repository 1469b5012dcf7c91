"""The key table (diffrlhf.keys): every key declared once, with validation, docs and README derived
from it; every preset key declared; every declared key read by some role; no private helper
imported across modules; `config show` names each value's source."""
from __future__ import annotations

import ast
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from diffrlhf.deploy.config import PRESET_DIR, ConfigError, flatten, keys_table, load_config, presets, resolve_config, show_config
from diffrlhf.keys import KEYS, ROLES, KeyValueError, check

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("deploy", "actors", "learner", "policy", "tinyworld", "rewards", "buffer", "keys")


def test_every_key_of_every_preset_is_declared():
    for name in presets():
        keys = set(flatten(yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text()) or {}))
        assert keys - {"preset"} <= set(KEYS), (name, sorted(keys - set(KEYS)))
        load_config(name)  # and validates


def test_every_declared_key_is_read_by_some_role():
    """A key is read where `<section>.<leaf>` is accessed (cfg.train.lr) or a module that reads
    `cfg.<section>` also reads `.<leaf>`. A key nothing reads is dead: remove it."""
    sources = [p.read_text() for layer in PACKAGE if layer != "keys" for p in (ROOT / layer).rglob("*.py")
               if p != ROOT / "deploy" / "config.py"]
    dead = [name for name, k in KEYS.items()
            if not any(f".{k.section}.{k.leaf}" in src or (re.search(rf"cfg\.{k.section}\b", src) and re.search(rf"\.{re.escape(k.leaf)}\b", src))
                       for src in sources)]
    assert dead == []
    assert all(k.roles and set(k.roles) <= set(ROLES) for k in KEYS.values())


def test_no_module_imports_another_modules_private_helper():
    bad = []
    for layer in PACKAGE:
        for path in (ROOT / layer).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("diffrlhf")):
                    bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []


def _outside(k):
    """A value just outside each declared bound, and the bound itself (allowed)."""
    if k.choices is not None:
        return [("not-a-choice", False)] + [(c, True) for c in k.choices]
    cases = []
    step = 1 if k.type is int else 1e-9
    if k.at_least is not None:
        cases += [(k.at_least, True), (k.at_least - step, False)]
    if k.above is not None:
        cases += [(k.above, False), (k.above + (1 if k.type is int else 1e-6), True)]
    if k.at_most is not None:
        cases += [(k.at_most, True), (k.at_most + 1e-6, False)]
    if k.multiple_of is not None:
        cases += [(k.multiple_of * 2, True), (k.multiple_of * 2 + 1, False), (0, False)]
    if k.excluded is not None:
        cases += [(k.excluded, False)]
    return cases


@pytest.mark.parametrize("name", [n for n, k in KEYS.items() if _outside(k)])
def test_each_declared_bound_is_what_the_config_refuses(name):
    """The check, the message and the config's validation are the one declaration: each bound
    refuses the value just past it and takes the bound itself."""
    k = KEYS[name]
    for value, ok in _outside(k):
        assert (k.problem(value) is None) == ok, (name, value)
        if not ok:
            with pytest.raises(KeyValueError, match=re.escape(f"config key {name!r}: value {value!r}")):
                check(name, value)


def test_the_messages_say_what_is_allowed():
    with pytest.raises(ConfigError, match=r"'train.timestep_fraction': value 1.5 is out of range; must be in \(0, 1\]$"):
        load_config(None, overrides=["train.timestep_fraction=1.5"])
    with pytest.raises(ConfigError, match=r"'recast.alpha': value 1.0 is out of range; must be > 0 and != 1 \(1 is the KL limit"):
        load_config(None, overrides=["recast.alpha=1"])
    with pytest.raises(ConfigError, match=r"'sample.resolution': value 60 is out of range; must be a multiple of 8$"):
        load_config(None, overrides=["sample.resolution=60"])
    with pytest.raises(ConfigError, match=r"'replay.mode': value 'x' is not allowed; choose one of none, hardmine, random$"):
        load_config(None, overrides=["replay.mode=x"])


def test_defaults_are_the_tables():
    flat = flatten(load_config(None).to_dict())
    assert {k: flat[k] for k in KEYS} == {k: v.default for k, v in KEYS.items()}


def test_readme_embeds_the_keys_command_output():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- keys:start[^\n]*-->\n(.*?)<!-- keys:end -->", readme, re.S)
    assert block, "README has no keys block"
    done = subprocess.run([sys.executable, "-m", "diffrlhf.deploy.cli", "config", "keys"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == keys_table()
    assert block.group(1) == keys_table(), "README's key table differs from `diffrlhf config keys`: paste its output"
    assert len(keys_table().splitlines()) == 2 + len(KEYS)


def test_show_names_each_values_source(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train: {lr: 0.02, epochs: 3}\n")
    cfg, sources = resolve_config("tiny", f, ["train.epochs=5"])
    assert (sources["train.lr"], sources["train.epochs"], sources["model.dtype"]) == (f"file {f}", "override", "default")
    assert sources["weighting.scheme"] == "preset tiny" and cfg.train.epochs == 5
    text = show_config(cfg, sources)
    assert re.search(r"^  epochs: +5 +# override$", text, re.M)
    assert re.search(rf"^  lr: +0.02 +# file {re.escape(str(f))}$", text, re.M)
    assert len([ln for ln in text.splitlines() if ln.startswith("  ")]) == len(KEYS)
    assert not math.isnan(cfg.train.lr)
