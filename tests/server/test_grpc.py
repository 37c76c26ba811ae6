"""OIP v2 over gRPC against real `softmoe serve` processes on the built-in models (digits and
digits-lit), with the unchanged ``tritonclient.grpc`` client and the standard health stub.

``main``: default settings on free ports. ``tight``: one request in flight, a 3 s deadline and a
small message limit, for admission, slow senders and the size bound; it is also the one that gets
SIGTERM, last.
"""

from __future__ import annotations

import json
import queue
import re
import subprocess
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.images import b64, png
from helpers.live import free_port, stop_process, wait_until
from server.grpc_api import service as grpc_service

tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as triton_pb2  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

ROOT = grpc_service.__file__.rsplit("/server/", 1)[0]


class Served:
    def __init__(self, workdir, name: str, *flags: str) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.url, self.target = f"http://127.0.0.1:{self.port}", f"127.0.0.1:{self.grpc_port}"
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "w")
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--port", str(self.port), "--grpc-port", str(self.grpc_port),
             "--cache-dir", str(workdir / "cache"), "--log-level", "info", *flags],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while "listening on" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start (exit {self.proc.poll()}):\n{self.log()[-3000:]}")
            time.sleep(0.1)
        # the line comes just before uvicorn accepts: wait for HTTP to answer too
        wait_until(f"{self.url}/v2/health/ready", max(1.0, deadline - time.monotonic()),
                   lambda: self.proc.poll() is None)

    def client(self):
        return tritonclient_grpc.InferenceServerClient(self.target)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("grpc")
    started = {"main": Served(workdir, "main"),
               "tight": Served(workdir, "tight", "--max-in-flight", "1", "--request-timeout-s", "3",
                               "--max-body-bytes", "65536", "--drain-seconds", "3")}
    try:
        for s in started.values():
            s.wait()
        yield started
    finally:
        for s in started.values():
            stop_process(s.proc)
            s._log.close()


@pytest.fixture(scope="module")
def main(servers):
    return servers["main"]


def _pixels(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, 3, 8, 8)).astype(np.float32)


def _input(x: np.ndarray, name: str = "pixel_values", datatype: str = "FP32"):
    t = tritonclient_grpc.InferInput(name, list(x.shape), datatype)
    t.set_data_from_numpy(x)
    return t


def _http_oip(url: str, model: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------ the protocol itself


def _repeated(field) -> bool:
    flag = field.is_repeated  # a property in protobuf 6.33 (``label`` is deprecated)
    return flag() if callable(flag) else flag


def test_every_field_is_the_protocols_as_tritonclient_knows_it():
    """Wire compatibility: each message and field (name, number, type, label) and each method is
    what tritonclient's own compiled protocol has."""
    ours = grpc_service.messages()

    def fields(descriptor) -> dict:
        out = {f.name: (f.number, f.type, _repeated(f)) for f in descriptor.fields}
        for nested in descriptor.nested_types:
            out.update({f"{nested.name}.{k}": v for k, v in fields(nested).items()})
        return out

    for name, cls in ours.items():
        assert fields(cls.DESCRIPTOR) == fields(getattr(triton_pb2, name).DESCRIPTOR), name
    theirs = triton_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    ours_service = cls.DESCRIPTOR.file.services_by_name["GRPCInferenceService"]
    for method in ours_service.methods:
        other = theirs.methods_by_name[method.name]
        assert (method.input_type.name, method.output_type.name) == (other.input_type.name, other.output_type.name)
    assert cls.DESCRIPTOR.file.package == "inference"


def test_the_compiled_protocol_is_the_proto_file(tmp_path):
    """oip.binpb is what oip.proto compiles to (recompile with the command in oip.proto). protoc runs
    in a child: grpc_tools' own C++ protobuf and sentencepiece's abort a process that loads both."""
    import sys

    folder = f"{ROOT}/server/grpc_api"
    out = tmp_path / "oip.binpb"
    r = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{folder}", f"--descriptor_set_out={out}",
                        f"{folder}/oip.proto"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    shipped = descriptor_pb2.FileDescriptorSet.FromString(open(f"{folder}/oip.binpb", "rb").read())
    assert descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()) == shipped


# ------------------------------------------------------------------ tritonclient.grpc, unchanged


def test_health_readiness_and_metadata_match_http(main):
    c = main.client()
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("digits") and c.is_model_ready("digits-lit")
    meta = c.get_server_metadata()
    assert meta.name == "softmoe-serve"
    assert set(meta.extensions) == {"binary_tensor_data", "classification", "model_repository"}
    for model in ("digits", "digits-lit"):
        grpc_meta = c.get_model_metadata(model, as_json=True)
        http_meta = httpx.get(f"{main.url}/v2/models/{model}", timeout=10).json()
        assert grpc_meta["name"] == model and grpc_meta["versions"] == ["1"]
        for side in ("inputs", "outputs"):
            assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in grpc_meta[side]] == \
                   [(t["name"], t["datatype"], t["shape"]) for t in http_meta[side]]
    names = {m.name for m in c.get_model_repository_index().models}
    assert names == {"digits", "digits-lit"}


def test_standard_health_check_is_serving(main):
    with grpc.insecure_channel(main.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_infer_with_raw_tensors_is_bitwise_http(main):
    x = _pixels(5, seed=1)
    r = main.client().infer("digits", [_input(x)], outputs=[tritonclient_grpc.InferRequestedOutput("logits"),
                                                           tritonclient_grpc.InferRequestedOutput("pre_logits")],
                            request_id="req-7", headers={"x-request-id": "abc-123"})
    body = _http_oip(main.url, "digits", {"inputs": [{"name": "pixel_values", "shape": list(x.shape), "datatype": "FP32",
                                                       "data": x.reshape(-1).tolist()}]})
    http = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in body["outputs"]}
    for name in ("logits", "pre_logits"):
        assert np.array_equal(r.as_numpy(name), http[name]), name
    assert r.get_response().id == "req-7" and r.get_response().model_version == "1"


def test_raw_output_contents_are_the_bytes_http_binary_sends(main):
    """One codec encodes both wires: each gRPC raw output is byte for byte HTTP binary's chunk."""
    x = _pixels(4, seed=4)
    head = json.dumps({"inputs": [{"name": "pixel_values", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "parameters": {"binary_data_output": True}}).encode()
    r = httpx.post(f"{main.url}/v2/models/digits/infer", content=head + x.tobytes(), timeout=30,
                   headers={"inference-header-content-length": str(len(head)),
                            "content-type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    chunks, at = {}, n
    for o in json.loads(r.content[:n])["outputs"]:
        size = o["parameters"]["binary_data_size"]
        chunks[o["name"]], at = r.content[at:at + size], at + size
    assert at == len(r.content) and set(chunks) == {"logits", "pre_logits"}
    g = main.client().infer("digits", [_input(x)]).get_response()
    raw = dict(zip([o.name for o in g.outputs], g.raw_output_contents))
    assert raw == chunks


def test_classification_is_the_http_extensions(main):
    x = _pixels(3, seed=2)
    r = main.client().infer("digits", [_input(x)], outputs=[tritonclient_grpc.InferRequestedOutput("logits", class_count=3)])
    body = _http_oip(main.url, "digits", {"inputs": [{"name": "pixel_values", "shape": list(x.shape), "datatype": "FP32",
                                                       "data": x.reshape(-1).tolist()}],
                                          "outputs": [{"name": "logits", "parameters": {"classification": 3}}]})
    got = r.as_numpy("logits")
    assert got.shape == (3, 3)
    assert [s.decode() for s in got.reshape(-1)] == body["outputs"][0]["data"]


def test_text_as_bytes_and_typed_contents(main):
    """BYTES text on the two-tower model equals /v1/embed; typed contents (no raw bytes) equal raw."""
    texts = ["a photo of a seven", "zero"]
    want = np.array(httpx.post(f"{main.url}/v1/embed", json={"model": "digits-lit", "texts": texts}, timeout=30)
                    .json()["text_embeddings"], np.float32)
    r = main.client().infer("digits-lit", [_input(np.array([t.encode() for t in texts], dtype=object), "text", "BYTES")])
    assert np.array_equal(r.as_numpy("text_embeds"), want)

    x = _pixels(2, seed=3)
    request = grpc_service.M["ModelInferRequest"](model_name="digits")
    t = request.inputs.add(name="pixel_values", datatype="FP32", shape=list(x.shape))
    t.contents.fp32_contents.extend(x.reshape(-1).tolist())
    with grpc.insecure_channel(main.target) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=grpc_service.M["ModelInferResponse"].FromString)
        typed = call(request, timeout=30)
    raw = main.client().infer("digits", [_input(x)])
    i = [o.name for o in typed.outputs].index("logits")
    assert np.array_equal(np.frombuffer(typed.raw_output_contents[i], "<f4").reshape(2, 10), raw.as_numpy("logits"))


@pytest.mark.parametrize("case, code, needle", [
    ("shape", grpc.StatusCode.INVALID_ARGUMENT, "expected [N, 3, 8, 8]"),
    ("datatype", grpc.StatusCode.INVALID_ARGUMENT, "must be FP32"),
    ("name", grpc.StatusCode.INVALID_ARGUMENT, "unexpected input 'x'"),
    ("model", grpc.StatusCode.NOT_FOUND, "'nope' is not served"),
    ("version", grpc.StatusCode.NOT_FOUND, "no version '7'"),
    ("output", grpc.StatusCode.INVALID_ARGUMENT, "not computed"),
    ("bytes", grpc.StatusCode.INVALID_ARGUMENT, "inputs.0.data.0: text is not Unicode"),
])
def test_bad_input_is_invalid_argument_naming_it(main, case, code, needle):
    c = main.client()
    x = _pixels(1)
    kwargs = {}
    inputs = [_input(x)]
    model = "digits"
    if case == "shape":
        inputs = [_input(np.zeros((1, 3, 4, 4), np.float32))]
    elif case == "datatype":
        inputs = [_input(x.astype(np.float64), datatype="FP64")]
    elif case == "name":
        inputs = [_input(x, name="x")]
    elif case == "model":
        model = "nope"
    elif case == "version":
        kwargs["model_version"] = "7"
    elif case == "output":
        kwargs["outputs"] = [tritonclient_grpc.InferRequestedOutput("nope")]
    elif case == "bytes":
        model = "digits-lit"
        inputs = [_input(np.array([b"\xff\xfe"], dtype=object), "text", "BYTES")]
    with pytest.raises(InferenceServerException) as e:
        c.infer(model, inputs, **kwargs)
    assert e.value.status() == str(code) and needle in e.value.message(), e.value


def test_raw_contents_that_do_not_fit_the_shape_are_refused(main):
    request = grpc_service.M["ModelInferRequest"](model_name="digits")
    request.inputs.add(name="pixel_values", datatype="FP32", shape=[1, 3, 8, 8])
    request.raw_input_contents.append(b"\0" * 100)
    with grpc.insecure_channel(main.target) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=grpc_service.M["ModelInferResponse"].FromString)
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "holds 100 bytes" in e.value.details()
        garbage = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as e:
            garbage(b"\xff\xff\xff", timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in e.value.details()


def test_request_ids_timings_and_metrics(main):
    x = _pixels(2, seed=4)
    with grpc.insecure_channel(main.target) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=grpc_service.M["ModelInferResponse"].FromString)
        request = grpc_service.M["ModelInferRequest"](model_name="digits")
        request.inputs.add(name="pixel_values", datatype="FP32", shape=list(x.shape))
        request.raw_input_contents.append(x.tobytes())
        _, done = call.with_call(request, timeout=30, metadata=(("x-request-id", "grpc-abc"),))
        trailing = dict(done.trailing_metadata())
        _, made = call.with_call(request, timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            call(grpc_service.M["ModelInferRequest"](model_name="nope"), timeout=30,
                 metadata=(("x-request-id", "grpc-nope"),))
    assert trailing["x-request-id"] == "grpc-abc"
    assert re.fullmatch("[0-9a-f]{32}", dict(made.trailing_metadata())["x-request-id"])
    assert dict(refused.value.trailing_metadata())["x-request-id"] == "grpc-nope"
    assert float(trailing["x-inference-time"]) >= 0 and float(trailing["x-queue-time"]) >= 0
    text = httpx.get(f"{main.url}/metrics", timeout=10).text
    assert re.search(r'softmoe_images_total\{endpoint="grpc_infer",model="digits"\} [1-9]', text), text
    assert 'endpoint="/inference.GRPCInferenceService/ModelInfer"' in text


# ------------------------------------------------------------------ limits, overload, drain


def _holding_call(target: str, release: threading.Event, result: queue.Queue) -> threading.Thread:
    """A ModelInfer whose message never comes until ``release``: it holds the one in-flight place."""

    def body():
        with grpc.insecure_channel(target) as channel:
            call = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer")

            def messages():
                release.wait(30)
                return
                yield

            try:
                call(messages(), timeout=30)
                result.put(None)
            except grpc.RpcError as e:
                result.put(e)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def _in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^softmoe_requests_in_flight (\S+)", text, re.M)[1])


def test_overload_is_resource_exhausted_and_a_slow_sender_times_out(servers):
    tight = servers["tight"]
    for _ in range(5):  # a holding call, alone on the server, until the door counts its place
        release, result = threading.Event(), queue.Queue()
        thread = _holding_call(tight.target, release, result)
        deadline = time.monotonic() + 20
        while _in_flight(tight.url) < 1 and result.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
        if _in_flight(tight.url) >= 1:
            break
        release.set()
    else:
        pytest.fail("the holding call never held the place")
    c = tight.client()
    with pytest.raises(InferenceServerException) as e:
        c.infer("digits", [_input(_pixels(1))])
    assert e.value.status() == str(grpc.StatusCode.RESOURCE_EXHAUSTED) and "1 requests in flight" in e.value.message()
    with grpc.insecure_channel(tight.target) as channel:  # health checks still pass while inference is full
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    error = result.get(timeout=20)  # the silent sender is cut at the 3 s deadline
    release.set()
    thread.join(10)
    assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
    assert "did not arrive" in error.details()
    assert c.infer("digits", [_input(_pixels(1))]).as_numpy("logits").shape == (1, 10)  # the place is free again


def test_a_message_over_the_body_limit_is_refused(servers):
    tight = servers["tight"]
    x = _pixels(400)  # 307 kB of raw FP32 against --max-body-bytes 65536
    with pytest.raises(InferenceServerException) as e:
        tight.client().infer("digits", [_input(x)])
    assert e.value.status() == str(grpc.StatusCode.RESOURCE_EXHAUSTED), e.value


def test_sigterm_drains_grpc_like_http(servers):
    """Last for ``tight``: after SIGTERM the health check turns NOT_SERVING and new calls get
    UNAVAILABLE with retry-after while the drain lasts; the process exits 0."""
    tight = servers["tight"]
    tight.proc.send_signal(15)
    with grpc.insecure_channel(tight.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 2.5
        while stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "still SERVING while draining"
            time.sleep(0.05)
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=lambda m: m.SerializeToString())
        request = grpc_service.M["ModelInferRequest"](model_name="digits")
        with pytest.raises(grpc.RpcError) as e:
            call.with_call(request, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
        assert dict(e.value.trailing_metadata())["retry-after"] == "5"
    assert tight.proc.wait(30) == 0


def test_grpc_port_in_use_is_one_line(tmp_path):
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "server", "serve", "--port", "0", "--grpc-port", str(port),
                            "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: --grpc-port: cannot listen on 127.0.0.1:{port}") and "0 turns gRPC off" in r.stderr


def test_defaults_are_tritons_port():
    from server.settings import Settings

    assert Settings.model_fields["grpc_port"].default == 8001
