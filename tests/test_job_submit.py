"""The way users start runs on a cluster, end to end: a Ray head started with `ray start --head`
(Ray 2.60 token authentication on), the tiny preset (one epoch) submitted with `ray job submit --runtime-env
deploy/jobs/runtime_env.yaml --working-dir .` exactly as deploy/jobs/README.md says, and the run
folder it writes checked against the reference loop run here in-process (same config, lag 0).
"""
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray")

from diffrlhf.deploy.config import load_config  # noqa: E402

pytestmark = pytest.mark.integration  # Ray clusters, CLI runs and installs in other processes (not in -m quick)

REPO = Path(__file__).resolve().parents[1]
RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
# The tiny preset, shortened; lag 0 so the reference loop gives the same numbers.
OVERRIDES = ["train.epochs=1", "sample.batches_per_epoch=1", "sample.num_steps=4", "system.max_policy_lag=0",
             "system.num_samplers=1", "run.image_grid_every=0", "run.tensorboard=false"]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A local head with its own token (RAY_AUTH_TOKEN, so nothing is written to ~/.ray), stopped
    by SIGTERM to `ray start --block`, which takes down every process it started (not `ray stop`,
    which would stop every Ray on the machine)."""
    if RAY is None:
        pytest.skip("the ray CLI is not installed beside this Python")
    tmp = tmp_path_factory.mktemp("head")
    # Ray's socket paths under --temp-dir must fit in 107 bytes; pytest's tmp paths can be longer
    # (e.g. under pytest-xdist's per-worker folders): a short folder beside the suite's sandbox.
    ray_tmp = Path(tempfile.mkdtemp(prefix="js-", dir=os.environ.get("RAY_TMPDIR")))
    gcs, dashboard, client, agent = free_ports(4)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    log = open(tmp / "head.log", "w")
    proc = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={gcs}", f"--dashboard-port={dashboard}",
                             "--dashboard-host=127.0.0.1", f"--ray-client-server-port={client}",
                             f"--dashboard-agent-listen-port={agent}", "--num-cpus=4", f"--temp-dir={ray_tmp}",
                             "--disable-usage-stats"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard}"
    deadline = time.time() + 240
    while True:  # the dashboard answers 401 (token auth) once it is up
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=5)
            break
        except urllib.error.HTTPError:
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"the Ray head did not come up:\n{(tmp / 'head.log').read_text()[-3000:]}")
            time.sleep(2)
    yield env, url
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


def submit(env, url, *args, timeout=900):
    return subprocess.run([RAY, "job", "submit", "--address", url, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_a_job_without_the_token_is_refused(head):
    env, url = head
    out = submit({**env, "RAY_AUTH_TOKEN": "not-the-token"}, url, "--", sys.executable, "-c", "print(1)", timeout=120)
    assert out.returncode != 0 and "token" in (out.stdout + out.stderr).lower()


def test_ray_job_submit_runs_the_tiny_preset_like_the_reference_loop(head, tmp_path, reference_like_actors):
    env, url = head
    out = submit(env, url, "--runtime-env", "deploy/jobs/runtime_env.yaml", "--working-dir", ".", "--",
                 sys.executable, "-m", "diffrlhf.deploy.cli", "train", "--preset", "tiny", *OVERRIDES,
                 f"run.out_dir={tmp_path}", "run.name=job")
    assert out.returncode == 0 and "succeeded" in out.stdout + out.stderr, (out.stdout + out.stderr)[-4000:]
    run = tmp_path / "job"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0]
    assert (run / "checkpoint" / "state.pt").exists() and (run / "lora" / "epoch_0001").is_dir()
    assert [r["reward_queries"] for r in records] == [8]

    reference = reference_like_actors(load_config("tiny", overrides=OVERRIDES))
    for a, b in zip(records, reference, strict=True):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-4)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5, rel=1e-3)
