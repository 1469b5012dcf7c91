"""The package rewards' own environments (rewards/environments.py): what makes one usable, what
refuses it in one line, and that the reward role imports nothing a reward venv lacks. Building one
for real (minutes, network) is the opt-in `reward_env` tier: tests/test_reward_envs_built.py."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from diffrlhf.rewards import environments as envs


def fake_env(root, name, **versions):
    folder = envs.env_dir(name, root)
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").write_text("")
    for sub in envs.PROJECT_PACKAGES:
        (folder / "diffrlhf-project" / "diffrlhf" / sub).mkdir(parents=True)
    if versions:
        (folder / envs.MANIFEST).write_text(json.dumps(versions))
    return folder


CORE = {"python": "3.11", "ray": "2.60.0", "torch": "2.13.0+cpu"}


def test_check_accepts_a_complete_env_made_for_this_core(tmp_path):
    folder = fake_env(tmp_path, "imagereward", python="3.11", ray="2.60.0", torch="2.13.0+cpu")
    assert envs.check("imagereward", tmp_path, core=CORE) == folder / "bin" / "python"


@pytest.mark.parametrize("state, message", [
    ("missing", r"reward environment 'hpsv2' is not built \(.* does not exist\): build it with `diffrlhf reward-env build hpsv2`"),
    ("half", r"reward environment 'hpsv2' at .* is half-built \(no diffrlhf-reward-env.json\): build it with `diffrlhf reward-env build hpsv2`"),
    ("ray", r"reward environment 'hpsv2' at .* has ray 2.59.0 but this environment has ray 2.60.0: rebuild it with `diffrlhf reward-env build hpsv2`"),
    ("python", r"has python 3.10 but this environment has python 3.11: rebuild it"),
    ("old", r"was built by an older diffrlhf \(no link to keys\): rebuild it with `diffrlhf reward-env build hpsv2`"),
])
def test_check_refuses_in_one_line_naming_the_build_command(tmp_path, state, message):
    if state == "half":
        fake_env(tmp_path, "hpsv2")
    elif state == "ray":
        fake_env(tmp_path, "hpsv2", python="3.11", ray="2.59.0")
    elif state == "python":
        fake_env(tmp_path, "hpsv2", python="3.10", ray="2.60.0")
    elif state == "old":
        (fake_env(tmp_path, "hpsv2", python="3.11", ray="2.60.0") / "diffrlhf-project" / "diffrlhf" / "keys").rmdir()
    with pytest.raises(envs.RewardEnvError, match=message) as e:
        envs.check("hpsv2", tmp_path, core=CORE)
    assert "\n" not in str(e.value)


def test_the_variable_moves_the_envs_and_the_message_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv(envs.ENVS_VAR, str(tmp_path / "cluster"))
    assert envs.env_dir("hpsv2") == tmp_path / "cluster" / "hpsv2"
    with pytest.raises(envs.RewardEnvError, match=f"with {envs.ENVS_VAR}={tmp_path / 'cluster'}"):
        envs.check("hpsv2")


def test_torchvision_pairs_with_its_torch_release():
    assert envs.torchvision_for("2.13.0+cpu") == "0.28.0"
    assert envs.torchvision_for("2.14.1") == "0.29.1"
    with pytest.raises(envs.RewardEnvError, match="no torchvision pairing"):
        envs.torchvision_for("3.0.0")


def test_each_env_serves_a_package_reward_and_pins_no_torch_of_its_own():
    """torch, torchvision and Ray come from the core's versions (the builder adds them): a pin in a
    requirements file would pull another torch build beside the core's."""
    assert {e.reward for e in envs.ENVS.values()} == {"imagereward_pkg", "hpsv2_pkg"}
    for env in envs.ENVS.values():
        names = [ln.split("=")[0].split("<")[0].split(">")[0].strip() for ln in envs.requirement_lines(env)]
        assert not {"torch", "torchvision", "ray"} & set(names), names


def test_the_project_links_reach_every_subpackage(tmp_path):
    parent = envs._project_links(tmp_path)
    code = "import diffrlhf.rewards.environments as m, diffrlhf.actors.role; print(m.__file__)"
    done = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {str(parent)!r}); sys.path.extend({sys.path[1:]!r}); {code}"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert os.path.realpath(done.stdout.strip()) == os.path.realpath(envs.__file__)
    assert sorted(p.name for p in (parent / "diffrlhf").iterdir()) == sorted(envs.PROJECT_PACKAGES)
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    packages = re.search(r"^packages = \[(.*)\]$", pyproject, re.M).group(1)
    assert sorted(re.findall(r'"diffrlhf\.(\w+)"', packages)) == sorted(envs.PROJECT_PACKAGES)


def test_the_reward_role_imports_nothing_a_reward_venv_lacks():
    """The reward actor runs in image-reward's or hpsv2's venv: no diffusers, peft, the core's
    transformers, or the run's Config (its module imports every role)."""
    code = ("import sys, pickle, diffrlhf.actors.reward_worker as m; from diffrlhf.deploy.config import load_config;"
            "blob = pickle.dumps(m.RewardRoleConfig.of(load_config(None)));"
            "[sys.modules.pop(k) for k in list(sys.modules) if k.startswith(('diffrlhf', 'diffusers', 'transformers', 'peft', 'yaml'))];"
            "pickle.loads(blob); import diffrlhf.actors.reward_worker;"
            "print(sorted({k.split('.')[0] for k in sys.modules if k.split('.')[0] in ('diffusers', 'transformers', 'peft', 'yaml')}),"
            "sorted(k for k in sys.modules if k.startswith('diffrlhf.') and k.split('.')[1] not in ('actors', 'rewards', 'keys')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "[]"], done.stdout


def test_a_package_reward_without_its_venv_is_refused_before_ray_in_one_line(capsys, tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    from diffrlhf.deploy.cli import main

    monkeypatch.setenv(envs.ENVS_VAR, str(tmp_path / "envs"))
    monkeypatch.delenv("DIFFRLHF_REWARD_PYTHON", raising=False)
    ray.shutdown()
    fake_env(tmp_path / "envs", "hpsv2")  # half-built: no manifest
    for spec, name, state in (("imagereward_pkg", "imagereward", "is not built"), ("hpsv2_pkg", "hpsv2", "is half-built")):
        code = main(["train", f"reward.spec={spec}", "reward.runtime_env=auto", f"run.out_dir={tmp_path}"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert f"reward.runtime_env=auto for reward '{spec}'" in err and state in err and f"`diffrlhf reward-env build {name}`" in err
    assert not ray.is_initialized() and not (tmp_path / "envs" / "imagereward").exists()
    code = main(["reward-env", "check", "hpsv2"])
    assert code == 2 and "half-built" in capsys.readouterr().err
