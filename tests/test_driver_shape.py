"""The driver reads as the epoch pipeline: placement, resuming, probes, Ray's errors and the local
Ray live in their own modules; every attribute of the driver is set first in __init__."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _self_targets(node) -> set[str]:
    out = set()
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def test_every_driver_attribute_is_set_first_in_init():
    tree = ast.parse((ROOT / "actors" / "driver.py").read_text())
    driver = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Driver")
    methods = {m.name: m for m in driver.body if isinstance(m, ast.FunctionDef)}
    in_init = _self_targets(methods["__init__"])
    elsewhere = {(name, a) for name, m in methods.items() if name != "__init__" for a in _self_targets(m) - in_init}
    assert elsewhere == set()


def test_the_driver_is_the_pipeline_and_at_most_400_lines():
    assert len((ROOT / "actors" / "driver.py").read_text().splitlines()) <= 400
    for module in ("placement", "resume", "probes", "ray_errors", "local_ray", "roles"):
        assert (ROOT / "actors" / f"{module}.py").exists()
