"""Bad input as a user meets it: each case is `diffrlhf train ...` in its own process, in a sandbox
(empty HOME and caches, offline), timed from the command to its exit.

    python -m research.bench.bad_input [--out DIR] [--only SUBSTRING ...]

Per case: the exit code, seconds, the lines on stderr and the last one (the error), whether Ray
started (a session folder under the sandbox's RAY_TMPDIR) and whether a run folder was left.
Writes bad_input.json and bad_input.md into research/results/bad_input/ or --out.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from research.bench.common import log, machine, out_dir, sandbox_env, write_json

BAD_REWARDS = '''
import numpy as np

def nans(images, prompts):
    return np.full(len(images), np.nan)

def strings(images, prompts):
    return ["good"] * len(images)
'''

# (what the user did, the arguments after `diffrlhf train`); {tmp} is the sandbox
CASES = [
    ("unknown reward name", ["reward.spec=nonsense"]),
    ("custom reward module that does not import", ["reward.spec=no_such_module:score"]),
    ("custom reward returning strings", ["reward.spec=my_bad_reward:strings"]),
    ("custom reward, NaN for every image, with reward.nan_policy=drop", ["reward.spec=my_bad_reward:nans", "reward.nan_policy=drop"]),
    ("aesthetic reward without its weight file", ["reward.spec=aesthetic"]),
    ("package reward (imagereward) in a venv not built", ["reward.spec=imagereward_pkg", "reward.runtime_env=auto"]),
    ("prompt list that does not exist", ["prompts.train=/nonexistent.txt"]),
    ("model folder that does not exist", ["model.name={tmp}/no-model"]),
    ("unknown config key", ["train.lrr=0.01"]),
    ("value out of range", ["train.lr=-1"]),
    ("unknown algorithm", ["algorithm.name=ppo2"]),
    ("--config given a directory", ["--config", "{tmp}"]),
    ("--config with a YAML syntax error", ["--config", "{tmp}/bad.yaml"]),
    ("a GPU per sampler on a machine without one", ["system.sampler_gpus=1"]),
    ("--resume of a folder that is no run", ["--resume", "{tmp}/no-run"]),
]


def run_case(args: list[str], timeout_s: float = 300.0) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="drl-bad-"))
    env = sandbox_env(tmp, extra=(("HF_HOME", "hf"), ("DIFFRLHF_REWARD_ENVS", "envs")))
    env["PYTHONPATH"] = f"{tmp}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.pop("RAY_ADDRESS", None)
    (tmp / "my_bad_reward.py").write_text(BAD_REWARDS)
    (tmp / "bad.yaml").write_text("train:\n  lr: 0.1\n  epochs: [1, 2\n")
    argv = [a.replace("{tmp}", str(tmp)) for a in args]
    cmd = [sys.executable, "-m", "diffrlhf.deploy.cli", "train", "--no-progress", *argv, f"run.out_dir={tmp}/runs"]
    if "--resume" in argv:
        cmd = cmd[:-1]  # a resume takes its folder from --resume
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=tmp)
    wall = time.time() - t0
    err = [line for line in p.stderr.splitlines() if line.strip()]
    out = {"args": args, "exit": p.returncode, "seconds": round(wall, 1), "stderr_lines": len(err),
           "error": (err[-1] if err else "").replace(str(tmp), "<tmp>"),
           "ray_started": any((tmp / "ray").iterdir()), "run_folder_left": (tmp / "runs").exists() and any((tmp / "runs").iterdir())}
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| input | exit | seconds | Ray started | run folder left | stderr lines | the error (its last line) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        error = r["error"].replace("|", "\\|")
        error = error if len(error) <= 240 else error[:237] + "..."
        lines.append(f"| {r['what']} (`{' '.join(r['args'])}`) | {r['exit']} | {r['seconds']} | {'yes' if r['ray_started'] else 'no'} | "
                     f"{'yes' if r['run_folder_left'] else 'no'} | {r['stderr_lines']} | {error} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--only", nargs="*", help="cases whose description contains one of these")
    a = ap.parse_args(argv)
    out = out_dir("bad_input", a.out)
    rows = []
    for what, args in CASES:
        if a.only and not any(s in what for s in a.only):
            continue
        r = {"what": what, **run_case(args)}
        log("bad_input", f"{what}: exit {r['exit']} in {r['seconds']} s; {r['error'][:120]}")
        rows.append(r)
    result = {"machine": machine(), "command": "python -m research.bench.bad_input", "cases": rows}
    write_json(out / "bad_input.json", result)
    (out / "bad_input.md").write_text(table(rows))
    return result


if __name__ == "__main__":
    main()
