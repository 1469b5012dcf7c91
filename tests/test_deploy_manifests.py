"""The cluster manifests (deploy/k8s, deploy/ray_up, deploy/jobs) parse, have the structure KubeRay
and Ray's cluster launcher expect, and provide what the run config asks for: every actor of every
role (samplers, reward actors, learner, replay buffer) must find a pod / node with its CPUs, GPUs
and role resource ("sampler", "reward", "learner", "buffer") when the run sets
system.use_role_resources=true. A manifest that drifts from the sd15-ddpo preset (or from the
RayJob's own overrides) fails here. Fast: YAML and the config only (plus Ray's schema check)."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from diffrlhf.deploy.config import load_config

ROOT = Path(__file__).resolve().parents[1]
K8S, RAY_UP, JOBS = ROOT / "deploy" / "k8s", ROOT / "deploy" / "ray_up", ROOT / "deploy" / "jobs"
MANIFESTS = sorted([*K8S.glob("*.yaml"), *RAY_UP.glob("*.yaml"), *JOBS.glob("*.yaml")])
PRESET = "sd15-ddpo"  # what the cluster manifests are sized for
GROUPS = {"samplers": "sampler", "rewards": "reward", "learner": "learner"}  # KubeRay group -> role resource
ROLE_UNIT = 1.0  # role resource asked per actor; the driver asks less (a label), so 1 is the safe bound


def load_all(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_docs(kind: str) -> list[tuple[Path, dict]]:
    return [(p, d) for p in sorted(K8S.glob("*.yaml")) for d in load_all(p) if d.get("kind") == kind]


def cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def ray_resources_param(params: dict) -> dict:
    """rayStartParams.resources is KubeRay's quoted JSON: '"{\\"sampler\\": 1}"'."""
    raw = params.get("resources")
    if raw is None:
        return {}
    val = json.loads(raw)
    return json.loads(val) if isinstance(val, str) else val


def quantity(q) -> float:
    s = str(q)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def pod_resources(group: dict) -> dict:
    """The Ray resources one pod of a KubeRay group advertises (as KubeRay derives them)."""
    params = group.get("rayStartParams", {}) or {}
    c = group["template"]["spec"]["containers"][0]
    res = c.get("resources", {})
    lim, req = res.get("limits", {}) or {}, res.get("requests", {}) or {}
    out = {"CPU": quantity(params.get("num-cpus", lim.get("cpu", req.get("cpu", 0)))),
           "GPU": quantity(params.get("num-gpus", lim.get("nvidia.com/gpu", 0)))}
    out.update({k: float(v) for k, v in ray_resources_param(params).items()})
    return out


def demands(cfg) -> list[tuple[str, dict]]:
    """Every actor the driver starts, with the Ray resources it asks for."""
    s = cfg.system
    role = lambda r, cpu, gpu: (r, {"CPU": cpu, "GPU": gpu, r: ROLE_UNIT})  # noqa: E731
    return ([role("learner", s.learner_cpus, s.learner_gpus)] * s.num_learners + [role("buffer", 0.0, 0.0)]
            + [role("sampler", s.sampler_cpus, s.sampler_gpus)] * s.num_samplers
            + [role("reward", s.reward_cpus, s.reward_gpus)] * s.num_reward_actors)


def unplaced(cfg, nodes: list[dict]) -> list[str]:
    """First-fit the run's actors into the nodes (each a dict of free Ray resources); returns
    the roles that found no room (empty = the cluster fits the run)."""
    free = [dict(n) for n in nodes]
    missing = []
    for r, need in sorted(demands(cfg), key=lambda x: -(x[1]["GPU"] * 1000 + x[1]["CPU"])):
        for n in free:
            if all(n.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v > 0):
                for k, v in need.items():
                    n[k] = n.get(k, 0.0) - v
                break
        else:
            missing.append(r)
    return missing


def kuberay_nodes(spec: dict, use_max: bool) -> list[dict]:
    """Head + worker pods at maxReplicas (autoscaling) or replicas (fixed size)."""
    nodes = [{"CPU": quantity(spec["headGroupSpec"]["rayStartParams"].get("num-cpus", 0)),
              **ray_resources_param(spec["headGroupSpec"]["rayStartParams"])}]
    for g in spec["workerGroupSpecs"]:
        n = g["maxReplicas"] if use_max else g["replicas"]
        nodes += [pod_resources(g) for _ in range(n)]
    return nodes


def entrypoint_config(entrypoint: str):
    """The config a `python -m diffrlhf.deploy.cli train ...` command line would run with."""
    argv = shlex.split(entrypoint)
    assert "diffrlhf.deploy.cli" in argv or "diffrlhf" in argv[:1], f"not a diffrlhf command: {entrypoint}"
    assert "train" in argv, entrypoint
    args = argv[argv.index("train") + 1:]
    preset, path, overrides, i = "tiny", None, [], 0
    while i < len(args):
        a = args[i]
        if a in ("--preset", "--config", "--resume"):
            if a == "--preset":
                preset = args[i + 1]
            elif a == "--config":
                path = args[i + 1]
            else:
                return None  # a resumed run's config lives in its run folder
            i += 2
            continue
        if not a.startswith("-"):
            overrides.append(a)
        i += 1
    if path and not (ROOT / path).exists():
        path = None  # an example file name in a README
    return load_config(preset, path, overrides)


def preset_cfg():
    return load_config(PRESET, overrides=["system.use_role_resources=true"])


# ----------------------------------------------------------------------------- all files


@pytest.mark.parametrize("path", MANIFESTS, ids=[str(p.relative_to(ROOT)) for p in MANIFESTS])
def test_manifest_parses(path):
    docs = load_all(path)
    assert docs and all(isinstance(d, dict) for d in docs), f"{path}: no YAML mappings"
    if path.parent == K8S:
        for d in docs:
            assert {"apiVersion", "kind", "metadata", "spec"} <= set(d), f"{path}: {d.get('kind')} lacks fields"
            assert d["metadata"].get("name")


def test_the_expected_manifests_exist():
    kinds = {d["kind"] for p in K8S.glob("*.yaml") for d in load_all(p)}
    assert {"RayCluster", "RayJob", "PersistentVolumeClaim"} <= kinds
    assert (RAY_UP / "cluster.yaml").exists() and (JOBS / "runtime_env.yaml").exists()


# ----------------------------------------------------------------------------- KubeRay


def ray_docs():
    docs = k8s_docs("RayCluster") + k8s_docs("RayJob")
    assert len(docs) >= 2
    return docs


@pytest.mark.parametrize("path,doc", ray_docs(), ids=lambda x: x.name if isinstance(x, Path) else x["kind"])
def test_kuberay_structure(path, doc):
    assert doc["apiVersion"] == "ray.io/v1"
    spec = cluster_spec(doc)
    dockerfile = (ROOT / "docker" / "Dockerfile.gpu").read_text()
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)", dockerfile, re.M).group(1)
    assert spec["rayVersion"] == ray_version, "rayVersion must equal the image's Ray (docker/Dockerfile.gpu)"
    assert spec.get("authOptions", {}).get("mode") == "token", "Ray 2.60 token auth via KubeRay authOptions"
    head = spec["headGroupSpec"]
    assert head["rayStartParams"].get("num-cpus") == "0", "no actors on the head"
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == set(GROUPS), f"worker groups {sorted(groups)} != {sorted(GROUPS)}"
    images = set()
    pvc_names = {d["metadata"]["name"] for _, d in k8s_docs("PersistentVolumeClaim")}
    for name, g in groups.items():
        assert g.get("minReplicas", 0) <= g["replicas"] <= g["maxReplicas"], f"{name}: min <= replicas <= max"
        res = ray_resources_param(g["rayStartParams"])
        assert res.get(GROUPS[name], 0) >= 1, f"group {name} must advertise the Ray resource {GROUPS[name]!r}"
        others = set(GROUPS.values()) - {GROUPS[name]}
        assert not others & set(res), f"group {name} advertises another role's resource: {res}"
    for tmpl in [head["template"]] + [g["template"] for g in groups.values()]:
        pod = tmpl["spec"]
        c = pod["containers"][0]
        images.add(c["image"])
        lim, req = c["resources"].get("limits", {}), c["resources"].get("requests", {})
        assert str(lim.get("nvidia.com/gpu", 0)) == str(req.get("nvidia.com/gpu", 0)), "GPU requests must equal limits"
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env.get("RAY_USAGE_STATS_ENABLED") == "0" and env.get("HF_HOME") == "/data/hf"
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        assert "/data" in mounts, "the HF cache / run folder volume is mounted at /data"
        vols = {v["name"]: v for v in pod.get("volumes", [])}
        claim = vols[mounts["/data"]].get("persistentVolumeClaim", {}).get("claimName")
        assert claim in pvc_names or "hostPath" in vols[mounts["/data"]], f"/data volume {claim!r} has no PVC manifest"
        if float(lim.get("nvidia.com/gpu", 0)) > 0:
            assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])), "GPU pods tolerate the GPU taint"
    assert len(images) == 1, f"one image for all Ray pods (same Ray/Python): {images}"


def test_kuberay_cluster_fits_the_preset():
    cfg = preset_cfg()
    for path, doc in ray_docs():
        spec = cluster_spec(doc)
        autoscale = bool(spec.get("enableInTreeAutoscaling"))
        missing = unplaced(cfg, kuberay_nodes(spec, use_max=autoscale))
        assert not missing, f"{path.name}: no room for {missing} of preset {PRESET}"
        # every GPU-sized group can hold at least one of its actors per pod
        for g in spec["workerGroupSpecs"]:
            r, pod = GROUPS[g["groupName"]], pod_resources(g)
            need = {"sampler": (cfg.system.sampler_cpus, cfg.system.sampler_gpus), "reward": (cfg.system.reward_cpus, cfg.system.reward_gpus),
                    "learner": (cfg.system.learner_cpus, cfg.system.learner_gpus)}[r]
            assert pod["CPU"] >= need[0] and pod["GPU"] >= need[1], f"{path.name}: a {g['groupName']} pod ({pod}) < one {r} {need}"


def test_rayjob_runs_the_main_entrypoint_and_fits_it():
    (path, job), = k8s_docs("RayJob")
    spec = job["spec"]
    ep = spec["entrypoint"]
    assert ep.split()[:3] == ["python", "-m", "diffrlhf.deploy.cli"], ep
    assert f"--preset {PRESET}" in ep and "system.use_role_resources=true" in ep
    assert spec.get("shutdownAfterJobFinishes") is True and spec.get("ttlSecondsAfterFinished", 0) > 0
    assert spec.get("submissionMode", "K8sJobMode") in ("K8sJobMode", "HTTPMode", "SidecarMode")
    cfg = entrypoint_config(ep)
    assert cfg.system.use_role_resources is True
    assert cfg.run.out_dir.startswith("/data/"), "runs must land on the shared volume"
    rc = spec["rayClusterSpec"]
    assert not unplaced(cfg, kuberay_nodes(rc, use_max=bool(rc.get("enableInTreeAutoscaling"))))
    # it starts at the size the job needs (no waiting for the autoscaler)
    assert not unplaced(cfg, kuberay_nodes(rc, use_max=False)), "initial replicas do not fit the RayJob's run"


def test_drift_is_detected():
    """The checks above are not vacuous: more samplers than the manifest allows, or a bigger
    learner than its pod, fail."""
    (_, doc), = k8s_docs("RayCluster")
    spec = cluster_spec(doc)
    samplers = next(g for g in spec["workerGroupSpecs"] if g["groupName"] == "samplers")
    nodes = kuberay_nodes(spec, use_max=True)
    too_many = load_config(PRESET, overrides=[f"system.num_samplers={samplers['maxReplicas'] + 1}"])
    assert "sampler" in unplaced(too_many, nodes)
    assert "learner" in unplaced(load_config(PRESET, overrides=["system.learner_gpus=2"]), nodes)
    assert "reward" in unplaced(load_config(PRESET, overrides=["system.reward_gpus=1"]), nodes)  # reward pods are CPU-only
    learners = next(g for g in spec["workerGroupSpecs"] if g["groupName"] == "learner")
    assert "learner" in unplaced(load_config(PRESET, overrides=["train.batch_size=8", f"system.num_learners={learners['maxReplicas'] + 1}"]), nodes)
    no_role = [{k: v for k, v in n.items() if k != "buffer"} for n in nodes]
    assert "buffer" in unplaced(preset_cfg(), no_role)


# ----------------------------------------------------------------------------- ray up


def ray_up_cfg() -> dict:
    (cfg,) = load_all(RAY_UP / "cluster.yaml")
    return cfg


def test_ray_up_config_is_valid_for_ray():
    pytest.importorskip("jsonschema")
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(ray_up_cfg()))


def test_ray_up_node_types_fit_the_preset():
    c = ray_up_cfg()
    types = c["available_node_types"]
    assert {"samplers", "rewards", "learner"} <= set(types) and c["head_node_type"] in types
    for name, role in GROUPS.items():
        assert types[name]["resources"].get(role, 0) >= 1, f"node type {name} must advertise {role!r}"
    assert types[c["head_node_type"]]["resources"].get("CPU") == 0, "no actors on the head"
    nodes = [dict(types[c["head_node_type"]]["resources"])]
    for name, t in types.items():
        if name != c["head_node_type"]:
            nodes += [dict(t["resources"]) for _ in range(t.get("max_workers", 0))]
    nodes = [{k: float(v) for k, v in n.items()} for n in nodes]
    assert not unplaced(preset_cfg(), nodes), f"ray up node types cannot host preset {PRESET}"
    assert sum(t.get("max_workers", 0) for n, t in types.items() if n != c["head_node_type"]) <= c["max_workers"]
    assert c["docker"]["image"] == cluster_spec(ray_docs()[0][1])["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    starts = " ".join(c["head_start_ray_commands"] + c["worker_start_ray_commands"])
    assert starts.count("RAY_AUTH_MODE=token") == 2


# ----------------------------------------------------------------------------- jobs

RUNTIME_ENV_KEYS = {"working_dir", "py_modules", "excludes", "pip", "uv", "conda", "env_vars", "container",
                    "image_uri", "py_executable", "config", "java_jars", "nsight", "worker_process_setup_hook"}


@pytest.mark.parametrize("path", sorted(JOBS.glob("*.yaml")), ids=lambda p: p.name)
def test_runtime_env_files(path):
    (env,) = load_all(path)
    assert set(env) <= RUNTIME_ENV_KEYS, f"unknown runtime_env keys: {set(env) - RUNTIME_ENV_KEYS}"
    assert all(isinstance(v, str) for v in env.get("env_vars", {}).values()), "Ray needs string env_vars"
    assert "runs/" in env.get("excludes", []), "run folders must not be uploaded with --working-dir"


def readme_commands() -> list[str]:
    text = (JOBS / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    cmds = []
    for b in blocks:
        joined = re.sub(r"\\\n\s*", " ", b)
        cmds += [ln.strip() for ln in joined.splitlines() if "diffrlhf.deploy.cli train" in ln]
    return cmds


def test_jobs_readme_commands_are_valid_runs():
    cmds = readme_commands()
    assert len(cmds) >= 3
    for cmd in cmds:
        assert "--runtime-env deploy/jobs/runtime_env.yaml" in cmd and "--working-dir ." in cmd, cmd
        assert "system.use_role_resources=true" in cmd, cmd
        ep = cmd.split(" -- ", 1)[1]
        cfg = entrypoint_config(ep)  # raises ConfigError on a wrong key/value
        if cfg is not None:
            assert cfg.run.out_dir.startswith("/data/"), cmd
    # the scaled example fits the shipped cluster at its autoscaling bounds
    scaled = [c for c in cmds if "system.num_samplers=" in c]
    assert scaled
    (_, doc), = k8s_docs("RayCluster")
    for cmd in scaled:
        cfg = entrypoint_config(cmd.split(" -- ", 1)[1])
        assert not unplaced(cfg, kuberay_nodes(cluster_spec(doc), use_max=True)), cmd


def test_the_learner_group_scales_to_its_pods_and_nodes():
    """A run with a learner group (system.num_learners = N) fits the KubeRay groups at maxReplicas
    and the ray up node types at max_workers, one GPU pod / node per rank."""
    for path, doc in ray_docs():
        spec = cluster_spec(doc)
        g = next(g for g in spec["workerGroupSpecs"] if g["groupName"] == "learner")
        assert g["maxReplicas"] >= 2, f"{path.name}: the learner group cannot grow beyond one rank"
        cfg = load_config(PRESET, overrides=["system.use_role_resources=true", f"system.num_learners={g['maxReplicas']}"])
        assert not unplaced(cfg, kuberay_nodes(spec, use_max=True)), f"{path.name}: no room for {g['maxReplicas']} learners"
    types = ray_up_cfg()["available_node_types"]
    n = types["learner"]["max_workers"]
    assert n >= 2
    nodes = [{k: float(v) for k, v in t["resources"].items()} for name, t in types.items() for _ in range(t.get("max_workers", 1))]
    assert not unplaced(load_config(PRESET, overrides=["system.use_role_resources=true", f"system.num_learners={n}"]), nodes)
    assert "learner" in unplaced(load_config(PRESET, overrides=["train.batch_size=8", f"system.num_learners={n + 1}"]), nodes)
