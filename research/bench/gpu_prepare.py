"""Gather the wheels a lent GPU machine needs for the one-shot GPU run (issue 58), check the size.

    python -m research.bench.gpu_prepare [--dest .whl] [--limit-mib 64]

The GPU machines' image (/work/.library/device/KINDS.md) has Python 3.12 with torch, transformers,
peft, numpy, pillow, pyyaml, safetensors, huggingface-hub, regex, requests, filelock, psutil, tqdm,
matplotlib and pyarrow, and nothing can be fetched there. It lacks what MISSING lists: diffusers
(and its importlib_metadata), openai-clip (the CLIP vocabulary the tokenizer is built from, found
without importing the package) with ftfy and wcwidth, and this project. This downloads x86-64
CPython 3.12 wheels of those at the versions installed here, builds pure-Python wheels where only
an sdist exists (openai-clip) and of this project, into `dest` (ignored by git), checks that the
tree that travels (tracked and untracked-not-ignored files, plus `dest`) fits the limit, and prints
the command to run there.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# distribution -> why the GPU machine needs it
MISSING = {
    "diffusers": "the UNet, VAE and DDIM scheduler",
    "importlib_metadata": "a requirement of diffusers",
    "openai-clip": "the CLIP BPE vocabulary (rewards/clip_tokenizer.py)",
    "ftfy": "the CLIP tokenizer's text cleaning",
    "wcwidth": "a requirement of ftfy",
}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]


def pinned(name: str) -> str:
    return f"{name}=={importlib.metadata.version(name)}"


def download(spec: str, dest: Path) -> None:
    """A binary wheel for CPython 3.12 on x86-64, or, if there is only an sdist, a wheel built here
    (pure-Python packages only: the build is platform-independent)."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS], "-d", str(dest), spec]
    if subprocess.run(cmd, capture_output=True, text=True).returncode == 0:
        return
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), spec], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"no wheel for {spec}: {r.stderr.strip()[-500:]}")
    built = sorted(dest.glob(f"{spec.split('==')[0].replace('-', '_')}-*.whl"))
    if built and not built[-1].name.endswith("-none-any.whl"):
        raise SystemExit(f"{built[-1].name} was built for this machine, not the GPU machine's Python 3.12")


def travelling_bytes(dest: Path) -> dict:
    """What a device call sends: tracked and untracked-not-ignored files, plus the wheels."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    tree = sum((ROOT / f).stat().st_size for f in files if f and (ROOT / f).is_file())
    wheels = sum(p.stat().st_size for p in dest.glob("*.whl"))
    return {"tree": tree, "wheels": wheels, "total": tree + wheels}


def run_command(dest: Path) -> str:
    rel = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
    return (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site {rel}/*.whl "
            f"&& export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && python3 -m research.bench.gpu_oneshot --out $OUT")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m research.bench.gpu_prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=str(ROOT / ".whl"))
    ap.add_argument("--limit-mib", type=float, default=64.0)
    ap.add_argument("--skip-download", action="store_true", help="only size what is in dest")
    args = ap.parse_args(argv)
    dest = Path(args.dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    if not args.skip_download:
        for old in dest.glob("*.whl"):
            old.unlink()  # one version of each: two would stop the install there
        for name, why in MISSING.items():
            print(f"[gpu_prepare] {pinned(name)}: {why}", flush=True)
            download(pinned(name), dest)
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(ROOT)], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"building this project's wheel failed: {r.stderr.strip()[-500:]}")
    size = travelling_bytes(dest)
    mib = {k: v / 2**20 for k, v in size.items()}
    fits = mib["total"] <= args.limit_mib
    print(f"[gpu_prepare] wheels: {', '.join(sorted(p.name for p in dest.glob('*.whl')))}")
    print(f"[gpu_prepare] travels: tree {mib['tree']:.1f} MiB + wheels {mib['wheels']:.1f} MiB = {mib['total']:.1f} MiB "
          f"({'fits' if fits else 'OVER'} the {args.limit_mib:g} MiB limit)")
    print(f"[gpu_prepare] run there (carry {dest.name}):\n  {run_command(dest)}")
    if not fits:
        raise SystemExit(f"{mib['total']:.1f} MiB travels, over the {args.limit_mib:g} MiB limit")
    return {"mib": mib, "fits": fits, "command": run_command(dest)}


if __name__ == "__main__":
    main()
