"""deploy/kserve/: softmoe-serve as a KServe ServingRuntime and an InferenceService on it. No KServe
here, so: both validate against the committed minimal CRD schemas (deploy/schemas, strict: a
misspelt field fails), the runtime's container validates as a core/v1 Container (kubernetes-validate,
strict, in a Pod), its args are a `softmoe serve` command our own parser takes, its ports, probes and
image agree with the server and with deploy/base, and the InferenceService names the runtime and a
format it serves."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from helpers.deploy import DEPLOY
from helpers.live import free_port, stop_process, wait_until
from helpers.volumes import read_only, read_only_ok
from server.cli import settings_from_args
from server.main import build_parser

KSERVE = DEPLOY / "kserve"
DIGITS = Path(__file__).resolve().parents[2] / "server" / "default_models" / "digits"
SCHEMAS = DEPLOY / "schemas"
RUNTIME_SCHEMA = "servingruntime.serving.kserve.io-v1alpha1.schema.json"
ISVC_SCHEMA = "inferenceservice.serving.kserve.io-v1beta1.schema.json"


def load(name: str) -> dict:
    return yaml.safe_load((KSERVE / name).read_text())


def validator(name: str) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def runtime_settings(runtime: dict, isvc: dict):
    """The runtime container's args as KServe runs them ({{.Name}}: the InferenceService's name),
    through `softmoe serve`'s parser, environment as the container sets it (literal values)."""
    (c,) = runtime["spec"]["containers"]
    argv = [a.replace("{{.Name}}", isvc["metadata"]["name"]) for a in c["args"]]
    assert argv[0] == "serve"
    args = build_parser().parse_args(argv)
    assert args.func.__name__ == "cmd_serve"
    return settings_from_args(args)


def test_both_validate_against_the_committed_schemas_and_reject_typos():
    runtime, isvc = load("servingruntime.yaml"), load("inferenceservice.yaml")
    v_rt, v_is = validator(RUNTIME_SCHEMA), validator(ISVC_SCHEMA)
    v_rt.validate(runtime)
    v_is.validate(isvc)
    mutations_rt = [lambda d: d["spec"].update(protocolVersion=d["spec"].pop("protocolVersions")),
                    lambda d: d["spec"]["protocolVersions"].append("v3"),
                    lambda d: d["spec"]["supportedModelFormats"][0].update(autoselect=True),
                    lambda d: d.update(apiVersion="serving.kserve.io/v1beta1")]
    mutations_is = [lambda d: d["spec"]["predictor"]["model"].update(storageURI="pvc://x/y"),
                    lambda d: d["spec"]["predictor"]["model"].update(storageUri="/models/digits"),
                    lambda d: d["spec"]["predictor"].update(minReplica=1),
                    lambda d: d.update(kind="InferenceServices")]
    for v, doc, mutations in ((v_rt, runtime, mutations_rt), (v_is, isvc, mutations_is)):
        for mutate in mutations:
            bad = copy.deepcopy(doc)
            mutate(bad)
            assert list(v.iter_errors(bad)), f"schema accepted a broken document: {mutate}"
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # why the committed schemas exist
        kubernetes_validate.validate(runtime, "1.30.0", strict=True)


def test_the_runtime_container_is_a_valid_pod_container():
    runtime = load("servingruntime.yaml")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "softmoe-serve"},
           "spec": {"containers": runtime["spec"]["containers"], "volumes": runtime["spec"]["volumes"]}}
    kubernetes_validate.validate(pod, "1.30.0", strict=True)
    bad = copy.deepcopy(pod)
    bad["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 8081
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.30.0", strict=True)


def test_the_runtime_serves_oip_on_its_declared_ports_with_the_servers_probes():
    runtime, isvc = load("servingruntime.yaml"), load("inferenceservice.yaml")
    settings = runtime_settings(runtime, isvc)
    (c,) = runtime["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http1": settings.port, "h2c": settings.grpc_port}  # KServe's names for HTTP/1 and gRPC
    assert settings.host == "0.0.0.0" and settings.log_format == "json"
    assert settings.models == [f"{isvc['metadata']['name']}=/mnt/models"]  # KServe's storage initializer's path
    assert set(runtime["spec"]["protocolVersions"]) == {"v2", "grpc-v2"}
    assert c["name"] == "kserve-container"
    assert c["startupProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": settings.port}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": settings.port}
    assert c["readinessProbe"]["grpc"]["port"] == settings.grpc_port  # grpc.health.v1 follows readiness
    annotations = runtime["spec"]["annotations"]
    assert (annotations["prometheus.kserve.io/port"], annotations["prometheus.kserve.io/path"]) == (
        str(settings.port), "/metrics")
    key = next(e for e in c["env"] if e["name"] == "SOFTMOE_API_KEY")
    assert key["valueFrom"]["secretKeyRef"]["optional"] is True  # no Secret: served without keys
    deployment = yaml.safe_load((DEPLOY / "base" / "deployment.yaml").read_text())
    (base,) = deployment["spec"]["template"]["spec"]["containers"]
    assert c["image"] == base["image"]  # deploy/images' CPU target, as deploy/base runs it
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    cache = next(e["value"] for e in c["env"] if e["name"] == "SOFTMOE_CACHE_DIR")
    assert cache in mounts


def test_the_inferenceservice_uses_the_runtime_and_a_format_it_serves():
    runtime, isvc = load("servingruntime.yaml"), load("inferenceservice.yaml")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {(f["name"], f.get("version")) for f in runtime["spec"]["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"].get("version")) in formats
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"  # both ports


def test_the_modelcar_form_validates_and_names_a_cache_inside_the_image():
    isvc = load("inferenceservice-modelcar.yaml")
    validator(ISVC_SCHEMA).validate(isvc)
    model = isvc["spec"]["predictor"]["model"]
    assert model["storageUri"].startswith("oci://")  # KServe's modelcar: the image's /models at /mnt/models
    env = {e["name"]: e["value"] for e in model["env"]}
    assert env["SOFTMOE_CACHE_DIR"].startswith("/mnt/models/.")  # inside the image, a folder the package ignores
    plain = load("inferenceservice.yaml")["spec"]["predictor"]["model"]
    assert {k: v for k, v in model.items() if k not in ("storageUri", "env")} == \
        {k: v for k, v in plain.items() if k != "storageUri"}


@pytest.mark.timeout(600)
@pytest.mark.skipif(not read_only_ok(), reason="needs `unshare --mount --map-root-user` to mount a read-only volume")
def test_a_modelcar_pod_for_real(tmp_path):
    """A modelcar's /models as the image build makes it (the package, then `softmoe prepare` with the
    runtime's flags into its .softmoe-cache), mounted read-only as KServe mounts it: the runtime's
    container is ready without exporting or proving."""
    runtime, isvc = load("servingruntime.yaml"), load("inferenceservice-modelcar.yaml")
    (c,) = runtime["spec"]["containers"]
    models = tmp_path / "models"
    shutil.copytree(DIGITS, models)
    ports = {"8080": str(free_port()), "8081": str(free_port())}
    argv = [ports.get(a, a).replace("{{.Name}}", isvc["metadata"]["name"]).replace("/mnt/models", str(models))
            for a in c["args"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOFTMOE_")}
    env.update({e["name"]: e["value"] for e in c["env"] if "value" in e})
    env.update({e["name"]: e["value"].replace("/mnt/models", str(models)) for e in isvc["spec"]["predictor"]["model"]["env"]})
    env["HOME"] = str(tmp_path / "home")
    exe = [sys.executable, "-m", "server"]
    built = subprocess.run([*exe, "prepare", *argv[1:]], env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:] + built.stdout[-3000:]

    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(read_only(models, [*exe, *argv]), env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        probe = c["startupProbe"]
        wait_until(f"http://127.0.0.1:{ports['8080']}{probe['httpGet']['path']}",
                   probe["periodSeconds"] * probe["failureThreshold"], lambda: proc.poll() is None)
    finally:
        stop_process(proc)
    text = log.read_text()
    assert "graphs from the cache, proofs from the cache" in text, text[-3000:]
    assert "exporting" not in text and "proving them here" not in text, text[-3000:]
