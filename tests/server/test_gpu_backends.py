"""The GPU code paths that can be exercised without a GPU.

No silent fallback: asked for cuda, a backend without CUDA refuses to start with one line naming
what is missing, including when ONNX Runtime claims the CUDA EP but the session really runs on the
CPU. Precision defaults, fp32 LayerNorm/softmax under bf16, fp16/bf16 parity logic on the CPU,
sticky CUDA errors vs out-of-memory, streaming weights onto a device.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from server.backends import cuda
from server.backends.cuda import DeviceUnavailableError, resolve_precision
from server.backends.onnxruntime_backend import OnnxRuntimeBackend
from server.backends.torch_backend import TorchBackend
from server.batching.batcher import FatalBackendError
from server.engine.models import ModelLoadError
from helpers.dtypes import Dtypes

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "server" / "default_models" / "digits"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal paths are not reachable")


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert text and "\n" not in text, repr(text)
    return text


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory) -> Path:
    """A classifier-shaped ONNX graph (pixel_values -> logits, pre_logits) with softmoe metadata."""
    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(192, 10)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["pixel_values"], ["pre_logits"], axis=1),
         helper.make_node("MatMul", ["pre_logits", "w"], ["logits"])],
        "tiny",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10]),
         helper.make_tensor_value_info("pre_logits", TensorProto.FLOAT, ["batch", 192])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    for k, v in {"softmoe.graph": "classifier", "softmoe.kind": "classifier", "softmoe.precision": "fp32"}.items():
        model.metadata_props.add(key=k, value=v)
    path = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    onnx.save(model, str(path))
    return path


def _pixels(n: int = 8) -> np.ndarray:
    return np.random.default_rng(1).uniform(-1, 1, (n, 3, 8, 8)).astype(np.float32)


# ------------------------------------------------------------------ torch: device and precision


@no_cuda
def test_torch_cuda_refused_without_cuda():
    with pytest.raises(DeviceUnavailableError) as e:
        TorchBackend(DIGITS, device="cuda")
    assert isinstance(e.value, ModelLoadError)  # the server's "does not start, one line" path
    assert "--device cuda" in _one_line(e.value)


def test_resolve_precision(monkeypatch):
    assert resolve_precision("torch", "cpu", "auto") == "fp32"
    assert resolve_precision("onnxruntime", "cuda", "auto") == "fp16"
    assert resolve_precision("tensorrt", "cuda", "auto") == "fp16"
    assert resolve_precision("torch", "cuda", "fp32") == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert resolve_precision("torch", "cuda", "auto") == "bf16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert resolve_precision("torch", "cuda", "auto") == "fp16"


def test_torch_describe_on_cpu():
    d = TorchBackend(DIGITS, precision="auto").describe()
    assert (d["backend"], d["device"], d["precision"], d["dtype"]) == ("torch", "cpu", "fp32", "float32")



@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_norms_and_softmax_in_fp32_under_low_precision(precision):
    backend = TorchBackend(DIGITS, precision=precision)
    assert next(backend.model.parameters()).dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    with Dtypes() as mode:
        out = backend.run("classify", {"pixel_values": _pixels()})
    names = {n for n, _ in mode.seen}
    assert {"layer_norm", "softmax", "rsqrt"} <= names, names
    assert all(dt == torch.float32 for _, dt in mode.seen), [s for s in mode.seen if s[1] != torch.float32]
    assert out["logits"].dtype == np.float32


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_low_precision_parity_on_heldout(precision):
    """The parity logic gpu-check applies on the GPU, run on the CPU: top-1 agreement and max error."""
    from loadtests.gpu_check import heldout, parity, run_fixed

    x, _ = heldout()
    ref = run_fixed(TorchBackend(DIGITS, precision="fp32"), x)
    result = parity(run_fixed(TorchBackend(DIGITS, precision=precision), x), ref, precision)
    assert result["ok"], result
    assert result["top1_agreement"] >= 0.999 and result["n"] == 360


def test_weights_streamed_to_a_device_equal_the_host_path():
    from softmoe_models.models import build_model
    from softmoe_models.package import load_model, load_weights, read_package

    pkg = read_package(DIGITS)
    host = load_model(DIGITS, dtype=torch.bfloat16).state_dict()
    streamed = build_model(pkg.config, device="meta")
    load_weights(pkg, streamed, device="cpu", dtype=torch.bfloat16)
    got = streamed.state_dict()
    assert all(got[k].dtype == host[k].dtype and torch.equal(got[k], host[k]) for k in host)


def test_check_module_device_names_the_stray_tensor():
    model = torch.nn.Linear(2, 2)
    model.register_buffer("stray", torch.empty(1, device="meta"))
    with pytest.raises(DeviceUnavailableError, match="buffer stray is on meta"):
        cuda.check_module_device(model, torch.device("cpu"))


# ------------------------------------------------------------------ torch: CUDA errors


def _raising(exc: BaseException):
    def module(*args):
        raise exc
    return module


@pytest.mark.parametrize("message", [
    "CUDA error: an illegal memory access was encountered",
    "CUDA error: device-side assert triggered",
    "CUDA error: unspecified launch failure",
    "CUDA error: uncorrectable ECC error encountered",
])
def test_sticky_cuda_errors_are_fatal(message):
    backend = TorchBackend(DIGITS)
    for exc in (RuntimeError(message), torch.AcceleratorError(message)):
        backend._modules["classify"] = dataclasses.replace(backend._modules["classify"], module=_raising(exc))
        with pytest.raises(FatalBackendError, match="CUDA context unusable") as e:
            backend.run("classify", {"pixel_values": _pixels()})
        _one_line(e.value)


def test_oom_and_other_errors_propagate_as_they_are():
    backend = TorchBackend(DIGITS)
    graph = backend._modules["classify"]
    backend._modules["classify"] = dataclasses.replace(graph, module=_raising(torch.cuda.OutOfMemoryError("CUDA out of memory.")))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        backend.run("classify", {"pixel_values": _pixels()})
    backend._modules["classify"] = dataclasses.replace(graph, module=_raising(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch") as e:
        backend.run("classify", {"pixel_values": _pixels()})
    assert not isinstance(e.value, FatalBackendError)


# ------------------------------------------------------------------ onnxruntime: providers


def test_ort_cpu_describe(tiny_onnx):
    d = OnnxRuntimeBackend([tiny_onnx]).describe()
    assert (d["backend"], d["device"], d["precision"]) == ("onnxruntime", "cpu", "fp32")
    assert d["providers"] == {"classify": ["CPUExecutionProvider"]}
    assert d["ort_spinning"] == "run"  # the default; what the session really got:
    opts = OnnxRuntimeBackend([tiny_onnx], spin="off").sessions["classify"].get_session_options()
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"


@no_cuda
def test_ort_cuda_refused_with_the_cpu_package(tiny_onnx):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed")
    with pytest.raises(DeviceUnavailableError) as e:
        OnnxRuntimeBackend([tiny_onnx], device="cuda")
    msg = _one_line(e.value)
    assert "CUDAExecutionProvider" in msg and "onnxruntime-gpu" in msg


@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider' is not in available")
def test_ort_cuda_claimed_but_cpu_session_is_refused(tiny_onnx, monkeypatch):
    """get_available_providers() lists the CUDA EP (compiled in), the session gets only the CPU EP
    (the library or the device is missing): the backend refuses, it never serves."""
    import onnxruntime as ort

    real = ort.get_available_providers()
    if "CUDAExecutionProvider" in real and torch.cuda.is_available():
        pytest.skip("a real CUDA EP would become active here")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *real])
    with pytest.raises(DeviceUnavailableError) as e:
        OnnxRuntimeBackend([tiny_onnx], device="cuda")
    msg = _one_line(e.value)  # the preflight's one-node probe session, before any real graph
    assert msg.startswith("--device cuda: CUDAExecutionProvider failed to load (")
    assert "active providers ['CPUExecutionProvider']" in msg
    # Behind the probe, every real session is checked too.
    monkeypatch.setattr(cuda, "ort_cuda_preflight", lambda ort: None)
    with pytest.raises(DeviceUnavailableError) as e:
        OnnxRuntimeBackend([tiny_onnx], device="cuda")
    assert _one_line(e.value).startswith("tiny.onnx: CUDAExecutionProvider failed to load (")


@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider' is not in available")
def test_ort_cuda_claimed_is_refused_before_export_and_quietly(tmp_path, monkeypatch, capfd):
    """With onnxruntime-gpu on a machine where its provider cannot load, `softmoe serve --device
    cuda` refuses before exporting anything into the cache, and ONNX Runtime's own log lines
    (library path, loader error, requirements URL) do not reach stderr: one line is the server's."""
    import onnxruntime as ort

    from server.run import StartupError, _prepare
    from server.settings import Settings

    real = ort.get_available_providers()
    if "CUDAExecutionProvider" in real and torch.cuda.is_available():
        pytest.skip("a real CUDA EP would become active here")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *real])
    capfd.readouterr()
    settings = Settings(backend="onnxruntime", device="cuda", precision="fp32", cache_dir=str(tmp_path))
    with pytest.raises(StartupError) as e:  # what `softmoe serve` runs before uvicorn: check, load, build
        _prepare(settings)
    assert _one_line(e.value).startswith("--device cuda: CUDAExecutionProvider failed to load (")
    assert not any(tmp_path.iterdir()), "it exported before checking the device"
    err = capfd.readouterr().err
    assert "onnxruntime" not in err.lower(), err



def test_ort_python_fallback_session_is_refused(tiny_onnx, monkeypatch):
    """Whatever path produced a CPU-only session (e.g. the Python API's retry on CPU), it is refused."""
    import onnxruntime as ort

    real_session = ort.InferenceSession

    class FellBack:
        def __init__(self, path, sess_options=None, providers=None, **kwargs):
            assert kwargs.get("enable_fallback") == 0  # the retry on CPU is switched off
            assert [p[0] for p in providers] == ["CUDAExecutionProvider"]  # only the CUDA EP is asked for
            assert sess_options.use_deterministic_compute
            self._s = real_session(str(path), providers=["CPUExecutionProvider"])

        def __getattr__(self, name):
            return getattr(self._s, name)

    monkeypatch.setattr(cuda, "ort_cuda_preflight", lambda ort: None)
    monkeypatch.setattr(ort, "InferenceSession", FellBack)
    with pytest.raises(DeviceUnavailableError, match="CUDAExecutionProvider failed to load"):
        OnnxRuntimeBackend([tiny_onnx], device="cuda")


def test_ort_session_creation_error_is_one_line(tiny_onnx, monkeypatch):
    import onnxruntime as ort

    def boom(*a, **k):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : CUDA failure 35: CUDA driver version is insufficient\nmore")

    monkeypatch.setattr(cuda, "ort_cuda_preflight", lambda ort: None)
    monkeypatch.setattr(ort, "InferenceSession", boom)
    with pytest.raises(DeviceUnavailableError) as e:
        OnnxRuntimeBackend([tiny_onnx], device="cuda")
    assert "driver version is insufficient" in _one_line(e.value)


class _ActiveCuda:
    """A real CPU session that reports the CUDA EP active (what a working GPU session reports)."""

    def __init__(self, path, fail_with: str | None = None, **kwargs):
        import onnxruntime as ort

        self._s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.fail_with = fail_with

    def get_providers(self):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def get_provider_options(self):
        return {"CUDAExecutionProvider": {"device_id": "0"}, "CPUExecutionProvider": {}}

    def run(self, *args, **kwargs):
        if self.fail_with:
            raise RuntimeError(self.fail_with)
        return self._s.run(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._s, name)


def test_ort_cuda_describe_reports_active_provider_and_device(tiny_onnx, monkeypatch):
    monkeypatch.setattr(cuda, "ort_cuda_preflight", lambda ort: None)
    monkeypatch.setattr(cuda, "ort_cuda_session", lambda path, **k: _ActiveCuda(path))
    backend = OnnxRuntimeBackend([tiny_onnx], device="cuda")
    d = backend.describe()
    assert (d["device"], d["precision"], d["cuda_graph"]) == ("cuda:0", "fp32", False)
    assert d["providers"] == {"classify": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
    assert backend.run("classify", {"pixel_values": _pixels()})["logits"].shape == (8, 10)


def test_ort_sticky_cuda_error_is_fatal(tiny_onnx, monkeypatch):
    monkeypatch.setattr(cuda, "ort_cuda_preflight", lambda ort: None)
    monkeypatch.setattr(cuda, "ort_cuda_session", lambda path, **k: _ActiveCuda(
        path, fail_with="[ONNXRuntimeError] : 1 : FAIL : CUDA failure 700: an illegal memory access was encountered"))
    backend = OnnxRuntimeBackend([tiny_onnx], device="cuda")
    with pytest.raises(FatalBackendError):
        backend.run("classify", {"pixel_values": _pixels()})


def test_ort_cuda_provider_options_are_deterministic():
    opts = cuda.ort_cuda_provider_options(device_id=1)
    assert opts == {"device_id": "1", "use_tf32": "0", "cudnn_conv_algo_search": "DEFAULT", "do_copy_in_default_stream": "1"}
    assert cuda.ort_cuda_provider_options(cuda_graph=True)["enable_cuda_graph"] == "1"


def test_ort_graph_runner_pads_to_its_one_shape(tiny_onnx):
    """The I/O-binding runner of CUDA-graph mode, with its buffers on the CPU: rows in, padded to
    the bound shape, the same rows out, bitwise what a plain run of the padded batch gives."""
    import onnxruntime as ort

    backend = OnnxRuntimeBackend([tiny_onnx])
    sess = backend.sessions["classify"]
    runner = cuda.OrtCudaGraphRunner(ort, sess, backend.functions["classify"], 8, device_type="cpu")
    x = _pixels(3)
    got = runner({"pixel_values": x})
    padded = np.zeros((8, 3, 8, 8), np.float32)
    padded[:3] = x
    want = dict(zip(["logits", "pre_logits"], sess.run(["logits", "pre_logits"], {"pixel_values": padded})))
    assert got.keys() == want.keys()
    for k in got:
        assert got[k].shape[0] == 3 and got[k].tobytes() == want[k][:3].tobytes()
    with pytest.raises(ValueError, match="exceeds"):
        runner({"pixel_values": _pixels(9)})


def test_load_error_diagnosis_is_one_line():
    _one_line(RuntimeError(cuda._ort_cuda_load_error()))
