"""`softmoe serve`: flags generated from Settings (none can be missing from --help), flag > env >
default, and every start-up error is one stderr line ``error: ...`` with exit status 2."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import typing
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from server.cli import env_of, flag_of
from server.engine.defaults import SHIPPED
from server.settings import Settings
from server.main import build_parser

_SCRIPT = Path(sys.executable).with_name("softmoe")
SOFTMOE = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "server"]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SOFTMOE_")}
    return {**env, "SOFTMOE_GRPC_PORT": "0", **extra}  # no test takes the well-known gRPC port


def softmoe(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*SOFTMOE, *args], capture_output=True, text=True, timeout=timeout, env=env or _clean_env())


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The process failed the way a start-up error must: exit 2, one stderr line, no traceback."""
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


# ---------------------------------------------------------------- flags from Settings


def test_help_lists_every_settings_field():
    r = softmoe("serve", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # undo argparse's line wrapping
    for name, field in Settings.model_fields.items():
        assert f"{flag_of(name)} " in text, f"Settings.{name} has no {flag_of(name)} flag"
        assert f"[env {env_of(name)}]" in text, f"{flag_of(name)}: help does not name {env_of(name)}"
        if field.annotation is bool:
            assert f"--no-{name.replace('_', '-')}" in text
        if typing.get_origin(field.annotation) is typing.Literal:
            assert "{" + ",".join(typing.get_args(field.annotation)) + "}" in text
        if field.description:
            assert " ".join(field.description.split())[:30] in text
    assert "--model [NAME=]PKG" in text  # the repeatable short form of --models


def test_flag_beats_env_beats_default(monkeypatch):
    for key in [k for k in os.environ if k.upper().startswith("SOFTMOE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SOFTMOE_PORT", "9001")
    monkeypatch.setenv("SOFTMOE_MAX_QUEUE", "7")
    monkeypatch.setenv("SOFTMOE_STRICT_DETERMINISM", "false")
    monkeypatch.setenv("SOFTMOE_WARMUP", "false")
    args = build_parser().parse_args(
        ["serve", "--port", "9002", "--strict-determinism", "--model", "a=/x", "--models", "b", "--max-text-chars", "12"])
    from server.cli import settings_from_args

    s = settings_from_args(args)
    assert s.port == 9002  # flag over env
    assert s.strict_determinism is True  # flag over env (bool)
    assert s.max_queue == 7 and s.warmup is False  # env over default
    assert s.max_batch_size == Settings.model_fields["max_batch_size"].default  # default
    assert s.models == ["a=/x", "b"] and s.max_text_chars == 12
    s = settings_from_args(build_parser().parse_args(["serve", "--no-warmup", "--backend", "onnxruntime"]))
    assert s.warmup is False and s.backend == "onnxruntime" and s.port == 9001


def test_invalid_values_name_the_flag_or_the_env_var():
    line = one_error_line(softmoe("serve", "--port", "70000"))
    assert line == "error: --port: Input should be less than or equal to 65535"
    line = one_error_line(softmoe("serve", env=_clean_env(SOFTMOE_PORT="70000")))
    assert line == "error: SOFTMOE_PORT: Input should be less than or equal to 65535"
    line = one_error_line(softmoe("serve", "--backend", "jax"))
    assert line.startswith("error: --backend: Input should be 'auto', 'torch', 'onnxruntime' or 'tensorrt'")
    assert "--prot" in one_error_line(softmoe("serve", "--prot", "1"))
    assert one_error_line(softmoe("serve", "--models", "[x")).startswith("error: --models: ")
    line = one_error_line(softmoe("serve", env=_clean_env(SOFTMOE_MODELS="a,b")))
    assert line.startswith("error: SOFTMOE_MODELS: cannot parse")


# ---------------------------------------------------------------- start-up errors


@pytest.fixture()
def digits(tmp_path) -> Path:
    """A copy of the shipped digits package to break."""
    pkg = tmp_path / "digits"
    shutil.copytree(SHIPPED / "digits", pkg)
    return pkg


@pytest.mark.parametrize("keep", [0.5, 4], ids=["half", "header"])
def test_truncated_weights(digits, keep):
    weights = digits / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(int(size * keep) if keep < 1 else int(keep))
    line = one_error_line(softmoe("serve", "--model", str(digits), "--port", "0"))
    assert str(weights) in line


def test_missing_path(tmp_path):
    line = one_error_line(softmoe("serve", "--model", f"x={tmp_path / 'nope'}", "--port", "0"))
    assert "not found" in line and "nope" in line


def test_bad_config_json(digits):
    (digits / "config.json").write_text('{"format": "softmoe-package", ')
    line = one_error_line(softmoe("serve", "--model", str(digits), "--port", "0"))
    assert "config.json" in line and "invalid JSON" in line


def test_two_models_with_one_name(digits):
    line = one_error_line(softmoe("serve", "--model", f"a={digits}", "--model", f"a={SHIPPED / 'digits'}", "--port", "0"))
    assert "share the name a" in line


def test_jpeg_draft_names_a_served_model(digits):
    line = one_error_line(softmoe("serve", "--model", f"a={digits}", "--jpeg-draft", "b", "--port", "0",
                                  "--backend", "torch"))
    assert "--jpeg-draft b" in line and "served: a" in line


def test_jpeg_draft_is_opt_in_per_model():
    """Off unless asked for; ``--jpeg-draft NAME`` turns it on for that model only, ``*`` for all."""
    from types import SimpleNamespace

    from server.engine.models import ModelLoadError, check_jpeg_draft, jpeg_draft
    from softmoe_models.preprocess import PreprocessConfig

    def models():
        return [SimpleNamespace(name="a", preprocess=PreprocessConfig(8)), SimpleNamespace(name="b", preprocess=PreprocessConfig(8)),
                SimpleNamespace(name="t", preprocess=None)]

    def opened(names):
        ms = models()
        for m in ms:  # as load_served_model applies it to each model it opens
            jpeg_draft(m, names)
        return ms

    assert [m.preprocess.jpeg_draft for m in opened([])[:2]] == [False, False]
    assert [m.preprocess.jpeg_draft for m in opened(["b"])[:2]] == [False, True]
    ms = opened(["*"])
    assert [m.preprocess.jpeg_draft for m in ms[:2]] == [True, True] and ms[2].preprocess is None
    with pytest.raises(ModelLoadError, match="takes no images"):
        opened(["t"])
    check_jpeg_draft(models(), ["*", "a"])
    with pytest.raises(ModelLoadError, match="no served model has that name"):
        check_jpeg_draft(models(), ["c"])


def test_jpeg_draft_also_when_the_app_loads_its_own_models():
    """create_app without models loads them in its lifespan: --jpeg-draft applies there too."""
    from fastapi.testclient import TestClient

    from server.http.app import create_app
    from server.settings import Settings

    app = create_app(Settings(models=[f"d={SHIPPED / 'digits'}"], jpeg_draft=["d"], backend="torch"))
    with TestClient(app) as client:
        assert client.get("/v2/models/d").json()["parameters"]["jpeg_draft"] is True


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_gpu_jpeg_decode_without_cuda():
    line = one_error_line(softmoe("serve", "--decode-device", "cuda", "--port", "0"))
    assert "--decode-device cuda needs a CUDA device" in line


def test_cuda_without_onnxruntime_gpu(tmp_path):
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
    if ort is not None and {"CUDAExecutionProvider", "TensorrtExecutionProvider"} & set(ort.get_available_providers()):
        pytest.skip("onnxruntime-gpu is installed here")
    r = softmoe("serve", "--backend", "onnxruntime", "--device", "cuda", "--port", "0", "--cache-dir", str(tmp_path))
    line = one_error_line(r)
    assert "onnxruntime-gpu" in line or "pip install" in line
    assert not any(tmp_path.iterdir()), "it exported before checking the device"


def test_cuda_without_a_cuda_device():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    line = one_error_line(softmoe("serve", "--device", "cuda", "--port", "0"))
    assert "CUDA device" in line


def test_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_error_line(softmoe("serve", "--host", "127.0.0.1", "--port", str(port)))
    assert f"127.0.0.1:{port}" in line and "in use" in line


def test_lifespan_failure_is_a_startup_error():
    """A failure in the app's lifespan (e.g. warm-up) is ours to report, not a uvicorn traceback."""
    import uvicorn
    from fastapi import FastAPI

    from server import run

    @asynccontextmanager
    async def lifespan(app):
        raise RuntimeError("warm-up failed: boom")
        yield

    app = FastAPI(lifespan=lifespan)
    server = run.DrainingServer(uvicorn.Config(app, lifespan="off"), drain_seconds=0)
    sock = run.bind_socket("127.0.0.1", 0)
    try:
        with pytest.raises(run.StartupError, match="start-up failed: RuntimeError: warm-up failed: boom"):
            asyncio.run(run._serve(server, sock))
    finally:
        sock.close()
    assert not server.started


def test_the_listening_line_comes_once_the_socket_takes_connections(monkeypatch):
    """"listening on" is what tools wait for: a client that connects at that line is not refused
    (the socket listens before the line, not when uvicorn gets to it)."""
    import socket

    import uvicorn
    from fastapi import FastAPI

    from server import run

    @asynccontextmanager
    async def lifespan(app):
        yield

    async def no_grpc(*a, **k):
        return None

    async def served(*a, **k):  # uvicorn's serving itself is not what is tested
        return None

    seen = {}
    real_info = run.log.info

    def info(message, *args, **kw):
        if message.startswith("listening on"):
            with socket.socket() as client:
                seen["connect"] = client.connect_ex(sock.getsockname()[:2])
        return real_info(message, *args, **kw)

    server = run.DrainingServer(uvicorn.Config(FastAPI(lifespan=lifespan), lifespan="off"), drain_seconds=0)
    sock = run.bind_socket("127.0.0.1", 0)
    monkeypatch.setattr(run, "_start_grpc", no_grpc)
    monkeypatch.setattr(server, "serve", served)
    monkeypatch.setattr(run.log, "info", info)
    try:
        asyncio.run(run._serve(server, sock))
    finally:
        sock.close()
    assert seen == {"connect": 0}


def test_serves_on_uvloop_and_httptools_without_access_log(tmp_path):
    """uvloop and httptools are what uvicorn picks (locked dependencies); the start line says so,
    and no per-request access line is logged (the server's own metrics and request ids stand in)."""
    import httpx

    from helpers.live import free_port, wait_until

    port = free_port()
    log = tmp_path / "server.log"
    proc = subprocess.Popen([*SOFTMOE, "serve", "--port", str(port), "--log-level", "info"], env=_clean_env(),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(f"{url}/v2/health/ready", 180, lambda: proc.poll() is None)
        png = (Path(__file__).resolve().parents[2] / "docs" / "examples" / "seven.png").read_bytes()
        r = httpx.post(f"{url}/v1/classify", content=png, headers={"content-type": "image/png"}, timeout=30)
        assert r.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = log.read_text()
    assert re.search(r"\(event loop uvloop\.Loop, http httptools, heads within 10 s and 65536 bytes, at most \d+ "
                     r"connections\)", text), text[-2000:]
    assert "/v1/classify HTTP/1.1" not in text, text[-2000:]
