"""What operators run the server with (issue 38): API keys on both doors, OpenTelemetry traces to a real
OTLP/HTTP receiver, JSON log lines from every process; checked as an outside check would, against
`softmoe serve` in its own process, and piece by piece in this one."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from helpers.live import free_port, live_server, stop_process, wait_until
from helpers.otlp import otlp_receiver
from server.api.keys import KeyFileError, Keys
from server.observability.logs import JsonFormatter
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
SEVEN = (ROOT / "docs" / "examples" / "seven.png").read_bytes()
_SCRIPT = Path(sys.executable).with_name("softmoe")
SOFTMOE = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "server"]
KEY = "k-7f3a9c-not-in-any-log"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("SOFTMOE_", "OTEL_"))}
    return {**env, **extra}


def traceparent(trace_id: str, span_id: str = "00f067aa0ba902b7") -> str:
    return f"00-{trace_id}-{span_id}-01"


def oip_inputs(meta: dict) -> list[dict]:
    """Zeros for every input of a model's OIP metadata (-1 dimensions as 1)."""
    out = []
    for t in meta["inputs"]:
        shape = [1 if d < 0 else d for d in t["shape"]]
        out.append({"name": t["name"], "datatype": t["datatype"], "shape": shape,
                    "data": [0] * int(np.prod(shape))})
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`softmoe serve --otlp-endpoint --api-key --log-format json --grpc-port` with a receiver."""
    log = tmp_path_factory.mktemp("ops") / "server.log"
    with otlp_receiver() as receiver:
        port, grpc_port = free_port(), free_port()
        proc = subprocess.Popen(
            [*SOFTMOE, "serve", "--port", str(port), "--grpc-port", str(grpc_port), "--otlp-endpoint", receiver.url,
             "--api-key", KEY, "--log-format", "json"],
            env=_env(OTEL_SERVICE_NAME="softmoe-under-test", OTEL_BSP_SCHEDULE_DELAY="100"),
            stdout=open(log, "w"), stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(f"{url}/v2/health/ready", 180, lambda: proc.poll() is None)
            yield {"url": url, "port": port, "grpc": f"127.0.0.1:{grpc_port}", "receiver": receiver, "log": log,
                   "proc": proc}
        finally:
            stop_process(proc, 60)


def test_requests_without_the_key_get_a_bearer_challenge_in_each_protocols_shape(served):
    url = served["url"]
    png = {"content-type": "image/png"}
    for headers, why in (({}, "needs an API key"), ({"authorization": "Bearer wrong"}, "not accepted"),
                         ({"authorization": f"Basic {KEY}"}, "not accepted")):
        r = httpx.post(f"{url}/v1/classify", content=SEVEN, headers={**png, **headers})
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), r.text
        assert r.json()["error"]["type"] == "unauthorized" and why in r.json()["error"]["message"]
        assert r.headers["x-request-id"]
    r = httpx.post(f"{url}/v2/models/digits/infer", json={"inputs": []})
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str)  # the OIP error shape
    for method, path in (("GET", "/v1/models"), ("GET", "/v2"), ("GET", "/v2/models/digits"),
                         ("GET", "/v2/models/digits/ready"), ("POST", "/v2/repository/index"),
                         ("POST", "/v2/repository/models/digits/load"), ("POST", "/v2/repository/models/digits/unload"),
                         ("POST", "/v1/embeddings"), ("POST", "/v1/routing")):
        assert httpx.request(method, f"{url}{path}").status_code == 401, path
    for path in ("/v2/health/live", "/v2/health/ready", "/metrics", "/", "/static/page.js"):
        assert httpx.get(f"{url}{path}").status_code == 200, path
    r = httpx.post(f"{url}/v1/classify", content=SEVEN, headers={**png, "authorization": f"bearer {KEY}"})
    assert r.status_code == 200 and r.json()["results"][0]["predictions"][0]["label"] == "7"
    metrics = httpx.get(f"{url}/metrics").text
    assert re.search(r'softmoe_responses_total\{status="401"\} ([1-9]\d*)\.0', metrics)
    assert re.search(r'softmoe_errors_total\{type="unauthorized"\} ([1-9]\d*)\.0', metrics)


def test_the_clients_send_the_key_unchanged(served):
    import openai
    import tritonclient.http as httpclient

    client = openai.OpenAI(base_url=f"{served['url']}/v1", api_key=KEY, max_retries=0, timeout=60.0,
                           http_client=openai.DefaultHttpxClient(trust_env=False))
    out = client.embeddings.create(model="digits-lit", input=["a seven"])
    assert len(out.data[0].embedding) > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served['url']}/v1", api_key="wrong", max_retries=0,
                      http_client=openai.DefaultHttpxClient(trust_env=False)).embeddings.create(
                          model="digits-lit", input=["a seven"])
    triton = httpclient.InferenceServerClient(url=f"127.0.0.1:{served['port']}", network_timeout=60.0)
    try:
        headers = {"Authorization": f"Bearer {KEY}"}
        meta = triton.get_model_metadata("digits", headers=headers)
        t = meta["inputs"][0]
        x = httpclient.InferInput(t["name"], [1, *[d for d in t["shape"][1:]]], t["datatype"])
        x.set_data_from_numpy(np.zeros([1, *t["shape"][1:]], dtype=np.float32))
        assert triton.infer("digits", [x], headers=headers).as_numpy("logits").shape[0] == 1
        assert triton.is_server_ready()  # readiness needs no key
        from tritonclient.utils import InferenceServerException

        with pytest.raises(InferenceServerException, match="API key"):
            triton.get_model_metadata("digits")
    finally:
        triton.close()


def test_a_traced_request_has_its_stage_spans_and_links_its_batch(served):
    receiver, url = served["receiver"], served["url"]
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = httpx.post(f"{url}/v1/classify", content=SEVEN, headers={
        "content-type": "image/png", "authorization": f"Bearer {KEY}", "traceparent": traceparent(trace_id)})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    want = {"POST /v1/classify", "decode", "preprocess", "queue", "inference", "postprocess"}
    spans = receiver.trace(trace_id, want)
    by_name = {s["name"]: s for s in spans}
    assert want <= set(by_name), sorted(by_name)
    server = by_name["POST /v1/classify"]
    assert server["parent"] == "00f067aa0ba902b7" and server["kind"] == 2  # SERVER, under the caller's span
    assert server["attributes"]["http.response.status_code"] == 200
    assert server["resource"]["service.name"] == "softmoe-under-test"  # OTEL_SERVICE_NAME
    for stage in ("decode", "preprocess", "queue", "inference", "postprocess"):
        span = by_name[stage]
        assert span["parent"] == server["span_id"]
        assert span["attributes"]["softmoe.model"] == "digits" and span["attributes"]["softmoe.request_id"] == rid
        assert server["start"] <= span["start"] <= span["end"] <= server["end"]
    order = [by_name[s]["start"] for s in ("decode", "preprocess", "queue", "inference", "postprocess")]
    assert order == sorted(order)
    inference = by_name["inference"]
    assert inference["attributes"]["softmoe.batch_size"] >= 1
    (link,) = inference["links"]  # the batch: its own span, linked, not a parent
    batch = [s for s in receiver.trace(link[0], {"batch"}) if s["span_id"] == link[1]]
    assert batch and batch[0]["name"] == "batch" and batch[0]["attributes"]["softmoe.batch_size"] >= 1
    assert batch[0]["trace_id"] != trace_id
    unsampled = "5bf92f3577b34da6a3ce929d0e0e4737"
    r = httpx.post(f"{url}/v1/classify", content=SEVEN, headers={
        "content-type": "image/png", "authorization": f"Bearer {KEY}",
        "traceparent": f"00-{unsampled}-00f067aa0ba902b7-00"})
    assert r.status_code == 200
    time.sleep(0.5)
    assert not receiver.trace(unsampled, set(), timeout=0)  # a parent that did not sample: nothing recorded


def test_grpc_needs_the_key_in_metadata_and_joins_the_callers_trace(served):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url=served["grpc"])
    try:
        assert client.is_server_live() and client.is_server_ready()  # the probes' RPCs stay open
        meta = client.get_model_metadata("digits", headers={"authorization": f"Bearer {KEY}"}, as_json=True)
        t = meta["inputs"][0]
        shape = [1, *[int(d) for d in t["shape"][1:]]]
        x = grpcclient.InferInput(t["name"], shape, t["datatype"])
        x.set_data_from_numpy(np.zeros(shape, dtype=np.float32))
        with pytest.raises(InferenceServerException) as refused:
            client.infer("digits", [x])
        assert "UNAUTHENTICATED" in str(refused.value.status())
        trace_id = "6bf92f3577b34da6a3ce929d0e0e4738"
        out = client.infer("digits", [x], headers={"authorization": f"Bearer {KEY}",
                                                   "traceparent": traceparent(trace_id, "10f067aa0ba902b7")})
        assert out.as_numpy("logits").shape[0] == 1
    finally:
        client.close()
    spans = served["receiver"].trace(trace_id, {"/inference.GRPCInferenceService/ModelInfer", "queue", "inference"})
    names = {s["name"] for s in spans}
    assert {"/inference.GRPCInferenceService/ModelInfer", "queue", "inference"} <= names, names
    server = next(s for s in spans if s["name"].endswith("ModelInfer"))
    assert server["parent"] == "10f067aa0ba902b7" and server["attributes"]["rpc.method"].endswith("ModelInfer")


def test_every_line_is_json_and_the_key_is_never_logged(served):
    url = served["url"]
    r = httpx.post(f"{url}/v1/classify", content=SEVEN, headers={"content-type": "image/png",
                                                                  "authorization": f"Bearer {KEY}"})
    rid = r.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while rid not in served["log"].read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    text = served["log"].read_text()
    lines = [json.loads(line) for line in text.splitlines()]  # every line one JSON object
    assert all({"timestamp", "level", "logger", "message"} <= set(line) for line in lines)
    assert any(line["logger"].startswith("uvicorn") for line in lines)  # uvicorn's own lines too
    mine = [line for line in lines if line.get("request_id") == rid and line["logger"] == "softmoe.access"]
    assert mine and mine[0]["method"] == "POST" and mine[0]["path"] == "/v1/classify" and mine[0]["status"] == 200
    assert mine[0]["model"] == "digits" and mine[0]["duration_ms"] > 0
    grpc_lines = [line for line in lines if line.get("rpc")]
    assert grpc_lines and all("status" in line for line in grpc_lines)
    assert KEY not in text


def test_tracing_off_imports_nothing_of_opentelemetrys_sdk():
    code = ("import sys; from server.http.app import create_app; from server.settings import Settings; "
            "import server.run, server.grpc_api.service; app = create_app(Settings()); "
            "assert app.state.tracing is None; "
            "assert not [m for m in sys.modules if m.startswith('opentelemetry.sdk')], 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), cwd=ROOT, timeout=120)


def test_an_unsampled_root_request_costs_no_span_and_a_callers_trace_is_still_joined(monkeypatch):
    """The flag's ratio draws for a request with no traceparent before any span exists; a caller's
    sampled traceparent is continued whatever the ratio; OTEL_TRACES_SAMPLER leaves it to the SDK."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from server.metrics import Metrics
    from server.observability.tracing import Tracing

    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    sampled = traceparent("4bf92f3577b34da6a3ce929d0e0e4736")  # the caller sampled it (flags 01)

    def spans(ratio: float, n: int) -> tuple[object, list]:
        """The span of a request joining the caller's trace, and of ``n`` root requests."""
        tracing = Tracing(Settings(trace_sample_ratio=ratio), Metrics(), InMemorySpanExporter())
        try:
            joined = tracing.begin("GET /x", sampled, None, time.perf_counter(), {})
            return joined, [tracing.begin("GET /x", None, None, time.perf_counter(), {}) for _ in range(n)]
        finally:
            tracing.provider.shutdown()

    joined, roots = spans(0.0, 200)
    assert joined.is_recording() and all(span is None for span in roots)
    joined, roots = spans(1.0, 50)
    assert joined.is_recording() and all(span.is_recording() for span in roots)
    kept = [span for span in spans(0.25, 4000)[1] if span is not None]
    assert 800 < len(kept) < 1200 and all(span.is_recording() for span in kept)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    joined, roots = spans(1.0, 20)
    assert not joined.is_recording() and all(span is not None and not span.is_recording() for span in roots)


def test_a_key_file_is_reread_and_export_failures_are_counted(tmp_path, monkeypatch):
    from server.http.app import create_app

    keys = tmp_path / "keys"
    keys.write_text("# rotated monthly\nfirst-key\n\n")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with otlp_receiver(fail=True) as refusing:
        settings = Settings(api_key_file=str(keys), otlp_endpoint=refusing.url, trace_sample_ratio=1.0, grpc_port=0)
        with live_server(create_app(settings)) as url:
            def classify(key):
                return httpx.post(f"{url}/v1/classify", content=SEVEN, timeout=30, headers={
                    "content-type": "image/png", "authorization": f"Bearer {key}"}).status_code

            assert classify("first-key") == 200 and classify("second-key") == 401
            keys.write_text("second-key\n")
            os.utime(keys, ns=(time.time_ns(), time.time_ns() + 10**9))
            time.sleep(1.1)
            assert classify("second-key") == 200 and classify("first-key") == 401
            keys.write_text("")  # an emptied file keeps the last good keys
            time.sleep(1.1)
            assert classify("second-key") == 200
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                m = re.search(r"softmoe_trace_export_failures_total ([\d.]+)", httpx.get(f"{url}/metrics").text)
                if float(m[1]) > 0:
                    break
                time.sleep(0.2)
            assert float(m[1]) > 0 and refusing.requests > 0


def test_keys_are_compared_with_every_key_in_constant_time(monkeypatch, tmp_path):
    import hmac

    f = tmp_path / "keys"
    f.write_text("a\nb\nc\n")
    ring = Keys(Settings(api_key="flag-key", api_key_file=str(f)))
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda x, y: calls.append(1) or real(x, y))
    assert ring.accepts("Bearer flag-key") and len(calls) == 4  # no early exit on the first match
    assert not ring.accepts("Bearer ") and not ring.accepts(None) and not ring.accepts("flag-key")
    assert ring.accepts(b"BEARER c")
    assert Keys(Settings()).accepts(None)  # no key configured: open
    with pytest.raises(KeyFileError, match="holds no key"):
        (tmp_path / "empty").write_text("# nothing\n")
        Keys(Settings(api_key_file=str(tmp_path / "empty")))
    assert "flag-key" not in repr(Settings(api_key="flag-key")) + str(Settings(api_key="flag-key").model_dump())


def test_json_lines_carry_the_request_fields_and_the_traceback():
    formatter = JsonFormatter()
    record = logging.LogRecord("softmoe.access", logging.INFO, __file__, 1, "POST %s %d", ("/v1/classify", 200), None)
    record.__dict__.update(method="POST", path="/v1/classify", status=200, request_id="r1", model="digits",
                           duration_ms=1.5, trace_id=None)
    line = json.loads(formatter.format(record))
    assert line["message"] == "POST /v1/classify 200" and line["level"] == "INFO" and line["request_id"] == "r1"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["timestamp"]) and "trace_id" not in line
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    out = formatter.format(failed)
    assert "\n" not in out and "ValueError: boom" in json.loads(out)["exception"]


@pytest.mark.parametrize("flags, needle", [
    (["--api-key-file", "/nonexistent/keys"], "--api-key-file /nonexistent/keys: cannot read it"),
    (["--otlp-endpoint", "collector:4318"], "--otlp-endpoint collector:4318: expected an http:// or https:// URL"),
])
def test_operations_flags_fail_at_start_with_one_line(flags, needle):
    r = subprocess.run([*SOFTMOE, "serve", "--grpc-port", "0", "--log-format", "json", *flags], capture_output=True,
                       text=True, timeout=120, env=_env())
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {needle}"), r.stderr
    assert all(json.loads(line)["level"] == "ERROR" for line in r.stdout.splitlines()), r.stdout
