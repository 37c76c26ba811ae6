"""deploy/ray/rayjob-embed.yaml, the KubeRay RayJob of docs/deploy.md: it cannot run here (no
Kubernetes, no GPU, no KubeRay operator), so what can be checked is: its entrypoint, split as a shell
splits it, is a `softmoe embed` command our parser accepts, on Ray, on CUDA; every pod mounts the
volume the entrypoint's paths live on at the same path; each worker asks for one GPU and the head
for none (one model actor per GPU)."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from server.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "deploy" / "ray" / "rayjob-embed.yaml"


def test_rayjob_entrypoint_is_a_softmoe_embed_on_ray_and_cuda():
    doc = yaml.safe_load(JOB.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob")
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:2] == ["softmoe", "embed"]
    args = build_parser().parse_args(argv[1:])
    assert args.func.__name__ == "cmd_embed"
    assert (args.ray, args.device) == ("auto", "cuda")
    assert "{" in args.data and args.data.endswith(".tar")  # one argument: the command expands the range


def test_rayjob_pods_share_the_data_volume_and_ask_for_gpus():
    doc = yaml.safe_load(JOB.read_text())
    cluster = doc["spec"]["rayClusterSpec"]
    argv = shlex.split(doc["spec"]["entrypoint"])
    args = build_parser().parse_args(argv[1:])
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for c in pod["containers"] for m in c["volumeMounts"]}
        for path in (args.package, args.data, args.out):
            mount = next(m for m in mounts if path.startswith(m + "/"))
            assert claims[mounts[mount]] == "softmoe-embed-data"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert all(c["resources"]["limits"].get("nvidia.com/gpu") is None for c in head["template"]["spec"]["containers"])
    for group in cluster["workerGroupSpecs"]:
        for c in group["template"]["spec"]["containers"]:
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    images = {c["image"] for pod in pods for c in pod["containers"]}
    assert len(images) == 1  # one Ray version on every pod
