"""The package a user installs is whole: a wheel built from the checkout's files (and from each
Dockerfile's build stage, replayed without a Docker engine), installed non-editable and used from a
folder outside the checkout, imports every module, loads every preset, finds the DDPO band, writes
the embedded model as a folder stock diffusers loads, and runs one epoch of the reference loop.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from test_docker import DOCKER, copy_sources, dockerignore_patterns, ignored, parse_dockerfile

ROOT = Path(__file__).resolve().parents[1]
MAIN_DOCKERFILES = [DOCKER / "Dockerfile.cpu", DOCKER / "Dockerfile.gpu"]

pytestmark = pytest.mark.integration  # Ray clusters, CLI runs and installs in other processes (not in -m quick)

# Run in the installed copy, from a folder outside the checkout: everything a run reads must come
# from the package (module files, presets, prompts, the tiny world's weights, the band).
CHECK = r"""
import importlib, json, sys, zipfile
from pathlib import Path
wheel, checkout = sys.argv[1], Path(sys.argv[2])
names = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")]
modules = [n[:-3].replace("/", ".").removesuffix(".__init__") for n in names]
for m in modules:
    mod = importlib.import_module(m)
    assert checkout not in Path(mod.__file__).resolve().parents, f"{m} imported from the checkout: {mod.__file__}"
from diffrlhf.deploy.baseline import ddpo_band
from diffrlhf.deploy.config import load_config, presets
from diffrlhf.rewards import requirements

loaded = {p: load_config(p).model.name for p in presets()}
band = ddpo_band(load_config("tiny"))
print(json.dumps({"modules": len(modules), "presets": loaded, "band_seeds": band and len(band["seeds"]),
                  "research": any(m.startswith("research") for m in modules),
                  "reward_envs": {n: len(requirements(n)) for n in ("imagereward_pkg", "hpsv2_pkg")}}))
"""


def _tracked_tree(dst: Path) -> Path:
    """The checkout's files as a clean clone has them (tracked, and new files git does not ignore)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    return dst


def _build_and_install(src: Path, tmp: Path) -> tuple[Path, Path]:
    wheels, target = tmp / "wheels", tmp / "site"
    run = dict(capture_output=True, text=True, timeout=300)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)], **run)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = wheels.glob("diffrlhf-*.whl")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)], **run)
    assert r.returncode == 0, r.stderr[-2000:]
    return wheel, target


def _installed_env(target: Path, tmp: Path) -> dict:
    # PYTHONPATH puts the installed copy ahead of the editable install; the cache is fresh, so the
    # embedded model is assembled from the wheel's files.
    return {**os.environ, "PYTHONPATH": str(target), "DIFFRLHF_CACHE": str(tmp / "cache"), "PYTHONSAFEPATH": "1"}


def _check_installed(wheel: Path, target: Path, tmp: Path) -> dict:
    outside = tmp / "elsewhere"
    outside.mkdir(exist_ok=True)
    r = subprocess.run([sys.executable, "-c", CHECK, str(wheel), str(ROOT)], cwd=outside, env=_installed_env(target, tmp),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    from diffrlhf.deploy.config import load_config, presets

    assert got["presets"] == {p: load_config(p).model.name for p in presets()}  # the checkout's presets, every one
    assert got["band_seeds"] and got["band_seeds"] >= 3, "the DDPO band's data is missing from the wheel"
    assert not got["research"], "the wheel ships the lab"
    assert all(got["reward_envs"].values()), "the reward environments' requirement files are missing from the wheel"
    return got


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    wheel, target = _build_and_install(_tracked_tree(tmp / "checkout"), tmp)
    return wheel, target, tmp


def test_the_wheel_carries_everything_a_run_reads(installed):
    wheel, target, tmp = installed
    got = _check_installed(wheel, target, tmp)
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if "/results/" in n or n.startswith("research")]
    assert got["modules"] == len([p for p in (target / "diffrlhf").rglob("*.py")])


@pytest.mark.slow  # CI checks the same after the suite (.ci/run: a fresh venv from the wheel trains 2 epochs outside the checkout)
def test_the_installed_cli_runs_outside_the_checkout_and_its_base_model_loads_in_stock_diffusers(installed):
    wheel, target, tmp = installed
    outside = tmp / "run_here"
    outside.mkdir()
    env = _installed_env(target, tmp)
    r = subprocess.run([sys.executable, "-m", "diffrlhf.deploy.cli", "reference", "--no-progress", "run.out_dir=runs", "run.name=one",
                        "train.epochs=1", "sample.batches_per_epoch=1", "sample.batch_size=8", "train.batch_size=8",
                        "run.image_grid_every=0", "run.tensorboard=false"],
                       cwd=outside, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (outside / "runs" / "one" / "metrics.jsonl").exists() and (outside / "runs" / "one" / "reward_curve.png").exists()
    r = subprocess.run([sys.executable, "-m", "diffrlhf.deploy.cli", "base-model", "--out", "base"], cwd=outside, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    load = ("import sys; from diffusers import StableDiffusionPipeline; "
            "p = StableDiffusionPipeline.from_pretrained(sys.argv[1], safety_checker=None); "
            "print(p('a red circle', num_inference_steps=2, height=32, width=32, output_type='np').images.shape)")
    r = subprocess.run([sys.executable, "-c", load, str(outside / "base")], cwd=outside, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "(1, 32, 32, 3)" in r.stdout, r.stderr[-3000:]


def _replay_wheel_stage(dockerfile: Path, ctx: Path) -> Path:
    """Copy what the Dockerfile's `wheel` stage copies, honouring its .dockerignore, into ctx; return
    the folder its `pip wheel` builds from."""
    patterns = dockerignore_patterns(dockerfile)
    stage, src_dir = None, None
    for _, instr, args in parse_dockerfile(dockerfile):
        if instr == "FROM":
            stage = args.split()[-1] if " AS " in args.upper() else None
        elif stage == "wheel" and instr == "COPY":
            *srcs, dest = [w for w in args.split() if not w.startswith("--")]
            assert srcs == copy_sources(args) == ["."], f"{dockerfile.name}: the wheel stage copies the whole context"
            files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                   capture_output=True, check=True).stdout.decode().split("\0")
            for rel in filter(None, files):
                if (ROOT / rel).is_file() and not ignored(rel, patterns):
                    (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / rel, ctx / rel)
        elif stage == "wheel" and instr == "RUN":
            assert "pip wheel" in args and "--no-deps" in args, f"{dockerfile.name}: the wheel stage runs pip wheel"
            src_dir = args.split()[-1]
    assert src_dir == dest, f"{dockerfile.name}: pip wheel builds {src_dir}, the context went to {dest}"
    return ctx


@pytest.mark.parametrize("dockerfile", MAIN_DOCKERFILES, ids=lambda p: p.name)
def test_each_image_builds_the_wheel_from_its_context_and_installs_it(dockerfile, tmp_path):
    ctx = _replay_wheel_stage(dockerfile, tmp_path / "ctx")
    assert not (ctx / "research").exists(), "the image's context carries the lab"
    wheel, target = _build_and_install(ctx, tmp_path)
    _check_installed(wheel, target, tmp_path)
    final = [(i, a) for i, a in _final_stage(dockerfile)]
    assert any(i == "COPY" and "--from=wheel" in a for i, a in final), f"{dockerfile.name}: the image does not take the wheel"
    assert any(i == "RUN" and "diffrlhf-*.whl" in a for i, a in final), f"{dockerfile.name}: the image does not install the wheel"


def _final_stage(dockerfile: Path):
    steps = parse_dockerfile(dockerfile)
    last = max(i for i, (_, instr, _) in enumerate(steps) if instr == "FROM")
    return [(instr, args) for _, instr, args in steps[last + 1:]]
