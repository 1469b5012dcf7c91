"""A run's resumable state on disk, written so that a crash or a damaged file never costs the run.

    run_dir/checkpoint/state.pt        the newest checkpoint (torch.save of the driver's state dict)
    run_dir/checkpoint/manifest.json   sha256 and size of state.pt, epochs done, time
    run_dir/checkpoint.prev/           the one before it, kept as the fallback
    run_dir/checkpoint.tmp/            a save in progress (complete once its manifest is written)

A save writes checkpoint.tmp/ in full (state.pt, then the manifest, each fsynced), then rotates:
checkpoint/ -> checkpoint.prev/, checkpoint.tmp/ -> checkpoint/. A crash at any step leaves a
complete, verifiable checkpoint behind. A load verifies the sha256 and that torch reads the file,
and falls back to the next usable copy, saying which and why.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

CURRENT, PREVIOUS, TMP = "checkpoint", "checkpoint.prev", "checkpoint.tmp"
STATE, MANIFEST = "state.pt", "manifest.json"
# The checkpoint format, in the manifest. 1: torch.save's default pickle protocol 2, which writes a
# bytes object (the buffer's Arrow batches) as latin-1 text, 1.5x its size; 2: protocol 4, bytes as
# they are. A format-1 checkpoint loads unchanged (pickle reads both); a newer one is refused.
FORMAT = 2
PICKLE_PROTOCOL = 4


class CheckpointError(RuntimeError):
    """No usable checkpoint: names every path tried, what is wrong with it, and what to do."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _damage(folder: Path) -> str | None:
    """Why folder's state.pt cannot be trusted (checked against its manifest), or None if it matches.
    A folder without a manifest (a run saved before manifests existed) is left to torch.load."""
    state, manifest = folder / STATE, folder / MANIFEST
    if not state.is_file():
        return f"{state} is missing"
    if not manifest.is_file():
        return None
    try:
        m = json.loads(manifest.read_text())
        want_size, want_sha = int(m["bytes"]), str(m["sha256"])
    except (ValueError, KeyError, TypeError) as e:
        return f"its manifest {manifest} is unreadable ({type(e).__name__})"
    fmt = m.get("format", 1)
    if not isinstance(fmt, int) or fmt > FORMAT:
        return f"{state} is checkpoint format {fmt}, newer than this diffrlhf reads (formats 1 to {FORMAT}): upgrade diffrlhf to resume it"
    size = state.stat().st_size
    if size != want_size:
        return f"{state} has {size} bytes, its manifest says {want_size} (truncated or overwritten)"
    if _sha256(state) != want_sha:
        return f"{state} does not match the sha256 in its manifest (corrupted)"
    return None


def save_checkpoint(run_dir: str | Path, state: dict) -> Path:
    """Write `state` as run_dir/checkpoint/state.pt, keeping the previous checkpoint as
    checkpoint.prev/. Returns the path of the new state.pt."""
    run_dir = Path(run_dir)
    tmp, cur, prev = run_dir / TMP, run_dir / CURRENT, run_dir / PREVIOUS
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_synced(tmp / STATE, lambda f: torch.save(state, f, pickle_protocol=PICKLE_PROTOCOL))
    manifest = {"format": FORMAT, "sha256": _sha256(tmp / STATE), "bytes": (tmp / STATE).stat().st_size,
                "epochs_done": state.get("counters", {}).get("epochs_done"),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    # The manifest is written last: a tmp/ with a manifest that matches is a complete save.
    _write_synced(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    _fsync_dir(tmp)
    if cur.exists():
        why = _damage(cur)
        if why is None:  # the current one becomes the fallback; a damaged one is not worth keeping
            shutil.rmtree(prev, ignore_errors=True)
            cur.rename(prev)
        else:
            print(f"[diffrlhf] warning: discarding the damaged checkpoint {cur} ({why}); keeping {prev}", file=sys.stderr)
            shutil.rmtree(cur)
    tmp.rename(cur)
    _fsync_dir(run_dir)
    return cur / STATE


def checkpoint_candidates(run_dir: str | Path) -> list[Path]:
    """The folders a resume tries, newest first. checkpoint.tmp/ counts only while checkpoint/ is
    absent (a crash between the two renames of a save): its manifest then proves it complete."""
    run_dir = Path(run_dir)
    first = [run_dir / CURRENT] if (run_dir / CURRENT).exists() else [run_dir / TMP] if (run_dir / TMP / MANIFEST).exists() else []
    return first + [run_dir / PREVIOUS]


def latest_checkpoint(run_dir: str | Path) -> tuple[Path, int | None] | None:
    """(state.pt, epochs done) of the newest checkpoint on disk, not verified (for messages), or None."""
    for folder in checkpoint_candidates(run_dir):
        if (folder / STATE).is_file():
            try:
                epochs = json.loads((folder / MANIFEST).read_text()).get("epochs_done")
            except (OSError, ValueError):
                epochs = None
            return folder / STATE, epochs
    return None


def load_checkpoint(run_dir: str | Path, log=None) -> dict:
    """The newest usable checkpoint's state. Each candidate is verified (sha256 against its
    manifest, then torch.load); a damaged one is skipped with a message naming it and the one used.
    Nothing in run_dir is changed. Raises CheckpointError naming every path tried when none works."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    run_dir = Path(run_dir)
    tried: list[str] = []
    for folder in checkpoint_candidates(run_dir):
        if not folder.exists():
            continue
        why = _damage(folder)
        if why is None:
            try:
                state = torch.load(folder / STATE, map_location="cpu", weights_only=False)
                if not isinstance(state, dict):
                    raise TypeError(f"holds a {type(state).__name__}, not a state dict")
            except Exception as e:  # a truncated zip, a pickle error: all mean "unusable"
                why = f"torch cannot read {folder / STATE}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if why is None:
            if tried:
                log(f"[diffrlhf] warning: checkpoint unusable: {'; '.join(tried)}. Resuming from {folder / STATE} "
                    f"(epoch {state.get('counters', {}).get('epochs_done', '?')}) instead.")
            return state
        tried.append(why)
    if not tried:
        raise CheckpointError(
            f"no checkpoint in {run_dir} (looked for {run_dir / CURRENT / STATE} and {run_dir / PREVIOUS / STATE}): "
            f"the run stopped before its first save (run.save_every). Start a new run instead.")
    raise CheckpointError(
        f"no usable checkpoint in {run_dir}: {'; '.join(tried)}. Nothing was changed. Copy a good state.pt "
        f"(with its manifest.json, or without one) into {run_dir / CURRENT}/, or start a new run.")
