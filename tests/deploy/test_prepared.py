"""deploy/overlays/cpu-prepared: a Job runs ``softmoe prepare`` into a shared volume and the
server pods start from it read-only, so no pod exports or proves at start. The Job must build
what the servers will look for: its container has the server's settings, image and resources."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.main import build_parser

from helpers.deploy import DEPLOY, by_kind, container, env_of, render
from helpers.live import free_port, stop_process, wait_until
from helpers.volumes import read_only, read_only_ok

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return render.build(DEPLOY / "overlays" / "cpu-prepared")


def job_container(docs: list[dict]) -> dict:
    (c,) = by_kind(docs, "Job")["spec"]["template"]["spec"]["containers"]
    return c


def test_the_job_prepares_what_the_servers_look_for(docs):
    server, job = container(docs), job_container(docs)
    assert job["args"] == ["prepare"] and server["args"][0] == "serve"
    assert build_parser().parse_args(job["args"]).func.__name__ == "cmd_prepare"
    # Every setting is part of some artifact's key: the same env, image and CPU (threads) as the server.
    assert {e["name"]: e["value"] for e in job["env"]} == env_of(docs)
    assert job["image"] == server["image"]
    assert job["resources"] == server["resources"]


def test_the_servers_read_the_jobs_volume_and_cannot_write_it(docs):
    pod = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    job_pod = by_kind(docs, "Job")["spec"]["template"]["spec"]
    claim = by_kind(docs, "PersistentVolumeClaim")
    cache = env_of(docs)["SOFTMOE_CACHE_DIR"]

    def cache_volume(spec: dict, c: dict) -> tuple[dict, dict]:
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == cache]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        return mount, volume

    mount, volume = cache_volume(pod, container(docs))
    assert mount["readOnly"] is True and set(volume) == {"name", "persistentVolumeClaim"}
    assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"], "readOnly": True}
    mount, volume = cache_volume(job_pod, job_container(docs))
    assert not mount.get("readOnly") and volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # pods on several nodes read it while the Job may write


@pytest.mark.timeout(600)
@pytest.mark.skipif(not read_only_ok(), reason="needs `unshare --mount --map-root-user` to mount a read-only volume")
def test_the_job_then_a_pod_for_real(docs, tmp_path):
    """The Job's container, then the server's on the cache as a read-only volume (their args and env;
    loopback and temporary directories instead of the pod's): the pod is ready within its startup
    probe's budget, and its start-up says it exported and proved nothing."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SOFTMOE_")}
    cache = tmp_path / "cache"
    exe = [str(BIN / "softmoe")] if (BIN / "softmoe").exists() else [sys.executable, "-m", "server"]

    def env(c: dict) -> dict[str, str]:
        out = {**base, **{e["name"]: e["value"] for e in c["env"]}}
        out.update(SOFTMOE_CACHE_DIR=str(cache), HOME=str(tmp_path / "home"), SOFTMOE_PORT=str(free_port()),
                   SOFTMOE_GRPC_PORT=str(free_port()))
        return out

    job = job_container(docs)
    done = subprocess.run([*exe, *job["args"]], env=env(job), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]

    c = container(docs)
    server_env = env(c)
    args = ["127.0.0.1" if a == "0.0.0.0" else a for a in c["args"]]
    startup = c["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(read_only(cache, [*exe, *args]), env=server_env, stdout=out, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        wait_until(f"http://127.0.0.1:{server_env['SOFTMOE_PORT']}{startup['httpGet']['path']}", budget,
                   lambda: proc.poll() is None)
        assert time.monotonic() - t0 < budget
        assert httpx.get(f"http://127.0.0.1:{server_env['SOFTMOE_PORT']}/v1/models", timeout=10).status_code == 200
    finally:
        stop_process(proc)
    text = log.read_text()
    lines = [x for x in text.splitlines() if "ready after" in x]
    assert lines and all("graphs from the cache, proofs from the cache" in x for x in lines), text[-3000:]
    assert "exporting" not in text and "proving them here" not in text, text[-3000:]
