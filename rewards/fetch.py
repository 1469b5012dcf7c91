"""Explicit download of reward weights (`diffrlhf fetch-weights NAME`). Runs never call this: a
missing file during a run raises MissingWeightsError instead.

Without `dest`, files go where the rewards look by default (the Hugging Face cache for hub files,
~/.cache/diffrlhf/<name>/ for the rest). With `dest`, everything lands in that folder and the
returned spec points at it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from pathlib import Path

from ._weights import cache_dir


class FetchError(RuntimeError):
    pass


def _hub(repo: str, filename: str, dest: str | None) -> str:
    try:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(repo, filename, local_dir=dest) if dest else hf_hub_download(repo, filename)
    except Exception as e:
        raise FetchError(
            f"could not download {filename!r} from the Hugging Face repo {repo!r}: {type(e).__name__}: {e}\n"
            f"This machine may have no route to huggingface.co. Fetch it on a connected machine "
            f"(huggingface-cli download {repo} {filename}) and copy it here, then pass its path in the reward spec."
        ) from e


def _hub_snapshot(repo: str, dest: str | None, allow: list[str]) -> str:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo, local_dir=dest, allow_patterns=allow)
    except Exception as e:
        raise FetchError(f"could not download {repo!r} ({', '.join(allow)}) from the Hugging Face hub: "
                         f"{type(e).__name__}: {e}") from e


def _url(url: str, path: Path, timeout: float = 60.0) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".part")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r, open(tmp, "wb") as f:
            while chunk := r.read(1 << 20):
                f.write(chunk)
    except Exception as e:
        tmp.unlink(missing_ok=True)
        raise FetchError(f"could not download {url} to {path}: {type(e).__name__}: {e}\n"
                         f"Download it on a connected machine and copy it to {path}.") from e
    os.replace(tmp, path)  # atomic: a half-written file is never mistaken for weights
    return str(path)


def fetch_weights(name: str, dest: str | None = None, version: str = "v2.1") -> dict:
    """Download what reward `name` needs. Returns a reward spec that uses the fetched files."""
    if name in ("jpeg_compressibility", "jpeg_incompressibility"):
        return {"name": name}  # nothing to fetch
    if name == "aesthetic":
        from .aesthetic import DEFAULT_CLIP, WEIGHTS_FILE, WEIGHTS_URL

        mlp = _url(WEIGHTS_URL, Path(dest or cache_dir() / "aesthetic") / WEIGHTS_FILE)
        clip = _hub_snapshot(DEFAULT_CLIP, os.path.join(dest, "clip-vit-large-patch14") if dest else None,
                             ["config.json", "*.safetensors", "preprocessor_config.json"])
        return {"name": "aesthetic", "weights": mlp, "clip_model": clip if dest else DEFAULT_CLIP}
    if name in ("imagereward", "imagereward_pkg"):
        from .imagereward import HF_REPO, WEIGHTS_FILE

        w = _hub(HF_REPO, WEIGHTS_FILE, dest)
        _hub(HF_REPO, "med_config.json", dest)  # next to the checkpoint: both loaders read it there
        tok = _hub_snapshot("bert-base-uncased", os.path.join(dest, "bert-base-uncased") if dest else None,
                            ["vocab.txt", "tokenizer_config.json", "config.json"])
        return {"name": name, "weights": w, **({"tokenizer": tok} if dest else {})}
    if name in ("hpsv2", "hpsv2_pkg"):
        from .hpsv2 import HF_REPO, VERSION_FILES

        if version not in VERSION_FILES:
            raise ValueError(f"version must be one of {list(VERSION_FILES)}")
        w = _hub(HF_REPO, VERSION_FILES[version], dest)
        return {"name": name, "weights": w, "version": version}
    raise ValueError(f"no weights to fetch for reward {name!r}")


def main(argv=None) -> int:
    """`python -m diffrlhf.rewards.fetch NAME [--dest DIR] [--version v2.1]` (what the CLI wraps)."""

    p = argparse.ArgumentParser(prog="diffrlhf fetch-weights")
    p.add_argument("name")
    p.add_argument("--dest", default=None)
    p.add_argument("--version", default="v2.1", help="hpsv2 only: v2.0 or v2.1")
    a = p.parse_args(argv)
    try:
        spec = fetch_weights(a.name, a.dest, a.version)
    except FetchError as e:
        print(f"fetch-weights: {e}", file=sys.stderr)
        return 1
    print(json.dumps(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
