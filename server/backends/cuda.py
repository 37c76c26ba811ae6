"""What the backends do on CUDA: refuse to run anywhere but where asked, pick the precision,
switch off nondeterminism, and run torch modules on their own stream with pinned staging and one
CUDA graph per padded batch shape.

Nothing here falls back from GPU to CPU. A missing CUDA build, device, provider or library is a
``DeviceUnavailableError`` (a ``ModelLoadError``: the server does not start) whose one-line
message names what is missing.

Sources followed: PyTorch "CUDA semantics" (streams, pinned memory and ``non_blocking``, CUDA
graphs: warm up on a side stream, capture with ``torch.cuda.graph``, copy into the static input,
``replay()``, read the static output; "Reproducibility"), ONNX Runtime's CUDA Execution Provider
page (provider options, ``preload_dlls``, CUDA graphs with I/O binding) and its session options
(``use_deterministic_compute``, ``session.disable_cpu_ep_fallback``).
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from export.runtime import session_options, with_package_weights
from server.errors import ModelLoadError

from server.backends.base import FunctionSpec, Rows

CUDA_EP = "CUDAExecutionProvider"

# Messages of the CUDA errors that leave the context unusable ("sticky"): every later CUDA call
# in the process fails too, so the process must be restarted (cudaGetErrorString texts).
STICKY_CUDA_ERRORS = (
    "illegal memory access",  # cudaErrorIllegalAddress
    "device-side assert",  # cudaErrorAssert
    "unspecified launch failure",  # cudaErrorLaunchFailure
    "uncorrectable ecc error",  # cudaErrorECCUncorrectable
    "hardware stack error",  # cudaErrorHardwareStackError
    "illegal instruction",  # cudaErrorIllegalInstruction
    "misaligned address",  # cudaErrorMisalignedAddress
    "invalid program counter",  # cudaErrorInvalidPc
    "launch timed out",  # cudaErrorLaunchTimeout
    "operation not supported on global/shared address space",  # cudaErrorInvalidAddressSpace
)


class DeviceUnavailableError(ModelLoadError):
    """The requested device, provider or precision is not what the runtime really provides."""


# ------------------------------------------------------------------ precision


def resolve_precision(backend: str, device: str, precision: str) -> str:
    """``auto`` -> a concrete precision; anything else is returned as given.

    ``auto`` is fp32 on CPU. On CUDA: torch uses bf16 on GPUs with native bf16 (compute
    capability 8.0+: the precision vmoe checkpoints were trained and evaluated in, with fp32's
    range, so no fp16 overflow) and fp16 before that; ONNX Runtime and TensorRT use fp16 (their
    fp16 kernel coverage is complete, bf16 coverage is not).

    Args:
        backend: torch | onnxruntime | tensorrt.
        device: cpu | cuda.
        precision: auto | fp32 | fp16 | bf16.
    """
    if precision != "auto":
        return precision
    if device != "cuda":
        return "fp32"
    if backend != "torch":
        return "fp16"
    require_torch_cuda()
    major, _ = torch.cuda.get_device_capability()
    return "bf16" if major >= 8 else "fp16"


# ------------------------------------------------------------------ torch


def require_torch_cuda() -> torch.device:
    """The current CUDA device, or a one-line error saying why torch has none."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise DeviceUnavailableError(
                f"--device cuda: torch {torch.__version__} is a CPU-only build; install a CUDA build of torch"
            )
        raise DeviceUnavailableError(
            f"--device cuda: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
            "(driver missing, no GPU, or hidden by CUDA_VISIBLE_DEVICES); nvidia-smi shows what the driver sees"
        )
    return torch.device("cuda", torch.cuda.current_device())


def configure_torch_determinism() -> None:
    """Process-wide switches for bitwise-reproducible CUDA inference (PyTorch "Reproducibility").

    No TF32 (fp32 matmuls and convolutions stay IEEE fp32), no autotuned convolution choice,
    deterministic cuDNN algorithms, and reduced-precision matmul reductions off (fp16/bf16 split-K
    partial sums stay fp32).
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def check_module_device(module: torch.nn.Module, device: torch.device) -> None:
    """Every parameter and buffer of ``module`` really is on ``device``."""
    for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in items:
            if t.device != device:
                raise DeviceUnavailableError(f"{kind} {name} is on {t.device}, not on {device}")


def is_sticky_cuda_message(text: str) -> bool:
    """True if an error message reports a CUDA error that poisons the context."""
    text = text.lower()
    return any(s in text for s in STICKY_CUDA_ERRORS)


def is_sticky_cuda_error(exc: BaseException) -> bool:
    """True for torch CUDA errors that poison the context (the process must restart); never for OOM."""
    if isinstance(exc, torch.cuda.OutOfMemoryError) or not isinstance(exc, RuntimeError):
        return False
    return is_sticky_cuda_message(str(exc))


class _Captured:
    """One CUDA graph with its static input and output tensors (batch = the captured size)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[torch.Tensor], outputs: tuple[torch.Tensor, ...]) -> None:
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.batch = inputs[0].shape[0]


class TorchCudaRunner:
    """Runs a module on one CUDA device from numpy and back.

    All work is issued on the runner's own stream. Inputs are staged in pinned host buffers (one per
    function, sized for ``max_batch`` rows) and copied with ``non_blocking=True``; outputs come back
    the same way. With ``cuda_graphs`` the first call at a batch size with no captured graph large
    enough captures one at that size (``warmup`` therefore captures the served shapes); smaller
    batches are zero-padded up to the smallest captured size, so at most one extra graph is ever
    captured after warm-up (at ``max_batch``).

    Args:
        device: the CUDA device.
        max_batch: the largest batch a call may carry.
        cuda_graphs: capture and replay CUDA graphs (else eager).
        pinned: stage through pinned host buffers (else pageable copies).
        warmup_iters: eager iterations on the stream before a capture (PyTorch's guide: warm up
            before capturing so lazy initialisation is not captured).
    """

    def __init__(self, device: torch.device, max_batch: int, *, cuda_graphs: bool = True, pinned: bool = True,
                 warmup_iters: int = 3) -> None:
        self.device, self.max_batch = device, max_batch
        self.cuda_graphs, self.pinned, self.warmup_iters = cuda_graphs, pinned, warmup_iters
        self.stream = torch.cuda.Stream(device=device)
        self.warming = False  # set by the backend's warmup(): capture at the exact warm-up sizes
        self._graphs: dict[str, list[_Captured]] = {}
        self._host_in: dict[str, list[torch.Tensor]] = {}
        self._host_out: dict[str, list[torch.Tensor]] = {}

    def captured_sizes(self, key: str) -> list[int]:
        return sorted(c.batch for c in self._graphs.get(key, []))

    def run(self, key: str, module: Callable[..., Any], arrays: list[np.ndarray]) -> list[np.ndarray]:
        """``module(*arrays)`` on the device; ``key`` names the function (buffers are per key)."""
        b = arrays[0].shape[0]
        if b > self.max_batch:
            raise ValueError(f"batch of {b} exceeds max_batch_size {self.max_batch}")
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.no_grad():
            host = self._stage_in(key, arrays)
            if self.cuda_graphs:
                outs = self._replay(key, module, host, b)
            else:
                dev = [h.to(self.device, non_blocking=self.pinned) for h in host]
                out = module(*dev)
                outs = tuple(o[:b] for o in (out if isinstance(out, tuple) else (out,)))
            results = self._stage_out(key, outs)
            self.stream.synchronize()
            # Pinned buffers are reused by the next call: hand out copies.
            return [r.numpy().copy() if self.pinned else r.numpy() for r in results]

    # -- staging

    def _stage_in(self, key: str, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        src = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        if not self.pinned:
            return src
        bufs = self._host_in.get(key)
        if bufs is None:
            bufs = [torch.empty((self.max_batch, *s.shape[1:]), dtype=s.dtype, pin_memory=True) for s in src]
            self._host_in[key] = bufs
        b = src[0].shape[0]
        for buf, s in zip(bufs, src):
            buf[:b].copy_(s)
        return [buf[:b] for buf in bufs]

    def _stage_out(self, key: str, outs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        if not self.pinned:
            return [o.to("cpu", copy=True) for o in outs]
        bufs = self._host_out.get(key)
        if bufs is None:
            bufs = [torch.empty((self.max_batch, *o.shape[1:]), dtype=o.dtype, pin_memory=True) for o in outs]
            self._host_out[key] = bufs
        b = outs[0].shape[0]
        for buf, o in zip(bufs, outs):
            buf[:b].copy_(o, non_blocking=True)
        return [buf[:b] for buf in bufs]

    # -- graphs

    def _replay(self, key: str, module: Callable[..., Any], host: list[torch.Tensor], b: int) -> tuple[torch.Tensor, ...]:
        fits = [c for c in self._graphs.get(key, []) if c.batch >= b]
        cap = min(fits, key=lambda c: c.batch) if fits else self._capture(key, module, host, b)
        for static, h in zip(cap.inputs, host):
            static[:b].copy_(h, non_blocking=self.pinned)
            if b < cap.batch:
                static[b:].zero_()  # padding rows: zeros, never a previous call's data
        cap.graph.replay()
        return tuple(o[:b] for o in cap.outputs)

    def _capture(self, key: str, module: Callable[..., Any], host: list[torch.Tensor], b: int) -> _Captured:
        # Warm-up captures the sizes it runs; on the request path a batch that no captured graph
        # fits captures at max_batch, so at most one graph per function is added after warm-up.
        size = b if self.warming else self.max_batch
        static = [torch.zeros((size, *h.shape[1:]), dtype=h.dtype, device=self.device) for h in host]
        for _ in range(self.warmup_iters):  # on self.stream (current), never the legacy default stream
            module(*static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            out = module(*static)
        cap = _Captured(graph, static, out if isinstance(out, tuple) else (out,))
        self._graphs.setdefault(key, []).append(cap)
        return cap

    def close(self) -> None:
        self._graphs.clear()
        self._host_in.clear()
        self._host_out.clear()


# ------------------------------------------------------------------ ONNX Runtime


def ort_cuda_provider_options(device_id: int = 0, cuda_graph: bool = False) -> dict[str, str]:
    """CUDA EP options for reproducible results across runs and replicas.

    ``use_tf32=0``: fp32 MatMul/Conv stay IEEE fp32 (the EP's default is 1). ``cudnn_conv_algo_search
    =DEFAULT``: the fixed IMPLICIT_PRECOMP_GEMM algorithm for the patch-embedding Conv instead of the
    EP's default EXHAUSTIVE benchmark, whose timing-based pick can differ between runs and replicas
    (HEURISTIC asks cuDNN's heuristics, which also vary with the cuDNN version).
    """
    opts = {"device_id": str(device_id), "use_tf32": "0", "cudnn_conv_algo_search": "DEFAULT",
            "do_copy_in_default_stream": "1"}
    if cuda_graph:
        opts["enable_cuda_graph"] = "1"
    return opts


ORT_DEFAULT_SEVERITY = 2  # ONNX Runtime's default logger level (warning), restored after a quiet step


@contextlib.contextmanager
def ort_quiet(ort: Any):
    """ONNX Runtime's default logger at fatal for the duration: a provider that fails to load logs
    several lines to stderr on its own (library path, loader error, requirements URL) before
    ``require_ort_provider`` says what is missing in one line, the only one the server prints."""
    ort.set_default_logger_severity(4)
    try:
        yield
    finally:
        ort.set_default_logger_severity(ORT_DEFAULT_SEVERITY)


def _probe_graph() -> bytes:
    """A one-node ONNX graph (y = x + x on float32 [1]): enough to make the CUDA EP load and run."""
    # onnx: heavy; only the CUDA probe needs it here
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "cuda_probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


_ort_cuda_probed = False  # the probe passed in this process


def ort_cuda_preflight(ort: Any) -> None:
    """Refuse, in one line and before any export, an onnxruntime that cannot run on CUDA here.

    Checks that the CUDA EP is compiled in, loads the CUDA/cuDNN libraries pip installed
    (``preload_dlls``, ORT >= 1.21), then creates a session of a one-node graph on the CUDA EP and
    runs it: a provider whose libraries, driver or device are missing leaves that session on the
    CPU (ORT logs and carries on), which ``require_ort_provider`` refuses. Called at start-up
    (``server.run.check_backend``, before any export) and by every CUDA backend; a probe that
    passed is not repeated in the process.
    """
    global _ort_cuda_probed
    if _ort_cuda_probed:
        return
    if CUDA_EP not in ort.get_available_providers():
        raise DeviceUnavailableError(
            f"--device cuda: onnxruntime {ort.__version__} has no {CUDA_EP} (this is the CPU package); "
            "install onnxruntime-gpu in its place: pip uninstall onnxruntime && pip install 'softmoe-serve[gpu]'"
        )
    preload = getattr(ort, "preload_dlls", None)
    with ort_quiet(ort):
        if preload is not None:
            try:
                preload()
            except OSError:
                pass  # what did not load is named by require_ort_provider below
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        try:
            probe = ort.InferenceSession(_probe_graph(), sess_options=opts,
                                         providers=[(CUDA_EP, ort_cuda_provider_options())], enable_fallback=0)
        except Exception as e:  # noqa: BLE001 - ORT raises several types
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise DeviceUnavailableError(f"--device cuda: onnxruntime could not create a {CUDA_EP} session: {first}") from None
        require_ort_provider(probe, "--device cuda")
        probe.run(None, {"x": np.ones(1, np.float32)})
    _ort_cuda_probed = True


def ort_cuda_session(path: str | Path, *, device_id: int = 0, cuda_graph: bool = False,
                     strict_placement: bool = False, threads: int | None = None,
                     weights: str | Path | None = None) -> Any:
    """An InferenceSession on the CUDA EP that cannot quietly become a CPU session.

    ``enable_fallback=0`` turns off the Python API's retry on CPU after an EP error. With
    ``strict_placement`` ORT refuses a graph any of whose nodes would run on the CPU EP
    (``session.disable_cpu_ep_fallback``). That includes the shape-computation nodes the CUDA EP
    leaves on the CPU on purpose, so it is off by default; the caller checks ``get_providers()``.
    ``weights``: the package's weights file a bound graph reads initializers from
    (``export.runtime.with_package_weights``).
    """
    # onnxruntime: an optional extra, loaded only when a session is made
    import onnxruntime as ort

    opts = session_options(threads)
    package = with_package_weights(opts, path, weights)
    opts.use_deterministic_compute = True
    if strict_placement:
        opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    providers = [(CUDA_EP, ort_cuda_provider_options(device_id, cuda_graph))]
    try:
        with ort_quiet(ort):
            session = ort.InferenceSession(str(path), sess_options=opts, providers=providers, enable_fallback=0)
        session.package_weights = package
        return session
    except Exception as e:  # noqa: BLE001 - ORT raises several types; one line names the file and cause
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise DeviceUnavailableError(f"{Path(path).name}: onnxruntime could not create a {CUDA_EP} session: {first}") from None


def require_ort_provider(session: Any, path: str | Path, provider: str = CUDA_EP) -> None:
    """Refuse a session in which ``provider`` is not among the providers really active."""
    active = session.get_providers()
    if provider in active:
        return
    raise DeviceUnavailableError(
        f"{Path(path).name}: {provider} failed to load ({_ort_cuda_load_error()}); active providers {active}. "
        "Install an onnxruntime-gpu matching this machine's CUDA and cuDNN major versions "
        "(the torch CUDA wheels' nvidia-* libraries serve it via onnxruntime.preload_dlls), or use --device cpu"
    )


class OrtCudaGraphRunner:
    """ONNX Runtime's CUDA-graph mode for one session: inputs and outputs bound once (I/O binding)
    to device buffers of one padded shape, ``batch`` rows; a call copies its rows in (zero rows
    pad the rest), replays, and copies its rows out. ORT captures the graph on the first runs.

    Args:
        ort: the onnxruntime module.
        session: a session created with ``enable_cuda_graph=1``.
        spec: the function's inputs and outputs.
        batch: the one batch size (the backend's max_batch_size).
        device_type: where the bound buffers live ("cuda"; "cpu" only to test the binding logic).
        device_id: the CUDA device.
    """

    def __init__(self, ort: Any, session: Any, spec: FunctionSpec, batch: int, *, device_type: str = "cuda",
                 device_id: int = 0) -> None:
        self.session, self.batch = session, batch
        self.binding = session.io_binding()
        self.inputs: dict[str, tuple[Any, np.dtype]] = {}
        self.outputs: dict[str, Any] = {}
        for s in spec.inputs:
            value = ort.OrtValue.ortvalue_from_shape_and_type((batch, *s.shape), s.dtype.type, device_type, device_id)
            self.binding.bind_ortvalue_input(s.name, value)
            self.inputs[s.name] = (value, s.dtype)
        shapes = {o.name: o.shape for o in session.get_outputs()}
        for name in spec.outputs:
            dims = shapes[name][1:]
            if not all(isinstance(d, int) for d in dims):
                raise DeviceUnavailableError(f"output {name} has symbolic dims {dims}: CUDA-graph mode needs fixed shapes")
            value = ort.OrtValue.ortvalue_from_shape_and_type((batch, *dims), np.float32, device_type, device_id)
            self.binding.bind_ortvalue_output(name, value)
            self.outputs[name] = value

    def __call__(self, rows: Rows) -> Rows:
        b = next(iter(rows.values())).shape[0]
        if b > self.batch:
            raise ValueError(f"batch of {b} exceeds the captured batch {self.batch}")
        for name, (value, dtype) in self.inputs.items():
            a = np.ascontiguousarray(rows[name], dtype=dtype)
            if b < self.batch:
                padded = np.zeros((self.batch, *a.shape[1:]), dtype)
                padded[:b] = a
                a = padded
            value.update_inplace(a)
        self.session.run_with_iobinding(self.binding)
        return {name: value.numpy()[:b].copy() for name, value in self.outputs.items()}


def _ort_cuda_load_error() -> str:
    """Why ORT's CUDA provider library does not load, as the dynamic loader says it (one line)."""
    try:  # onnxruntime: an optional extra; whether it imports is part of the answer
        import onnxruntime as ort

        capi = Path(ort.__file__).parent / "capi"
    except ImportError:
        return "onnxruntime is not importable"
    lib = capi / "libonnxruntime_providers_cuda.so"
    if not lib.is_file():
        return f"{lib.name} is not part of this onnxruntime package"
    try:
        shared = capi / "libonnxruntime_providers_shared.so"
        if shared.is_file():
            ctypes.CDLL(str(shared), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(lib))
    except OSError as e:
        text = " ".join(str(e).split())
        if "cannot open shared object file" in text:  # "libcublasLt.so.12: cannot open shared object file: ..."
            return f"{text.split(':')[0].strip()} not found?"
        return text[:200]
    return "the provider library loads; no usable CUDA device or driver?"
