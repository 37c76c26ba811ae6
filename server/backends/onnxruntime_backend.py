"""ONNX Runtime backend: loads exported .onnx files (exporting the package first if needed).

Execution providers: the CPU EP on ``device='cpu'``; on ``device='cuda'`` the CUDA EP alone, with
deterministic options, checked after each session is created against the providers ORT really
made active: a session without it stops the server (no silent CPU fallback). TensorRT is served
by its own backend.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from export import binding, cache
from export import onnx as exporter
from export.errors import ExportError
from export.onnx import read_metadata
from export.phases import phase
from export.runtime import ort_session, structure_digest

from softmoe_models.routing import OUTPUTS as SOFT_ROUTING_OUTPUTS
from softmoe_models.sparse_routing import OUTPUTS as SPARSE_ROUTING_OUTPUTS

from server.backends.base import ROUTING, FunctionSpec, InputSpec, Rows, all_functions, warm
from server.backends import cuda
from server.backends.failures import FatalBackendError

ROLE_TO_FN = {"classifier": "classify", "image": "image", "text": "text", "encoder": "encoder", "routing": ROUTING}


def cache_root(cache_dir: str) -> Path:
    """``cache_dir``, else ``$SOFTMOE_CACHE_DIR``, else ``$XDG_CACHE_HOME/softmoe-serve`` or ``~/.cache/softmoe-serve``."""
    return cache.default_root(cache_dir)


# Bumped whenever the exported graph changes for the same inputs (e.g. LayerNorm held in fp32 under
# fp16): the cache key covers the exporter's code, not only its version number.
# 3: token means (gap pooling) as MatMuls, so batch shape 1 is provable (export/onnx.py).
# 4: sparse Tokens Choice computes the routed rows only, Experts Choice runs per-expert Gemms, every
#    sparse export is verified among other batch-mates, and bf16 dispatch is held to its bound.
# 5: the graphs of a structure are exported once and other packages' weights bound into them.
# 6: the graphs read their weights from the package's own file (export.weights_file).
# 7: the exporter's pattern rewriter left out (export.graph_passes.tidy).
GRAPH_FORMAT = 7

# Packages whose weights are at least this large are exported in a child process: all of them, so
# that a first start ends where a cached one does. Exporting in the server's own process left it
# larger for its whole life: the exporter's imports and buffers stay in the allocator's arenas
# (digits: 487 MB resident after a first start, 296 MB after a cached one; soft-s16-e128, 3.5 GB of
# weights: about 4 GB more). The child costs a first start a few seconds of imports.
# loadtests/export_memory.py compares the two ways by setting it.
EXPORT_IN_CHILD_BYTES = 0
# Packages whose weights are at least this large are exported or bound at a lower CPU priority:
# beside served batches as load work (``export.runtime.lower_for_load``: nice 5 on one CPU),
# otherwise at nice 19. A new version of a large model binds for CPU-seconds or exports for
# minutes, which a server that serves meanwhile cannot give from all its batches' time. A small
# one exports in seconds of CPU at the server's priority: at nice 19 those seconds wait for CPU a
# busy server never leaves (digits, 12 CPU-seconds: a reload under 16 closed-loop clients took
# 244 s at nice 19).
LOW_PRIORITY_EXPORT_BYTES = 256 * 2**20
# Packages whose weights are at least this large have their weights bound in a child process too
# (export.binding: the module and the graph's proto held at once); a small one's binding is a
# fraction of a child's imports and runs in the server's process.
BIND_IN_CHILD_BYTES = LOW_PRIORITY_EXPORT_BYTES
ROUTING_OUTPUTS = frozenset(SOFT_ROUTING_OUTPUTS) | frozenset(SPARSE_ROUTING_OUTPUTS)  # a routing graph's, after the plain ones


def exported_files(package: Path, cache_dir: str, precision: str, log=print, device: str = "cpu",
                   routing: bool = True, beside_batches: bool = False) -> list[Path]:
    """The package's ONNX graphs (split towers), exported and verified once per key, then reused.
    With ``routing``, the entry also holds ``model.routing.onnx`` (image models with Soft MoE
    layers), which is not listed: ``OnnxRuntimeBackend`` finds it beside the graph it extends.

    The key covers every input of the export: the package's files (config.json included), the
    exporter's and ONNX Runtime's versions, opset, precision, expert form, towers, the verified
    batch sizes and the device that verified it. The entry is built in a temp dir under a file
    lock, published whole, and hash-checked at every start (``export.cache``): a corrupt or
    partial entry is rebuilt, never served.

    An entry's graphs come from the structure of the package (``cache.package_structure``; its own
    entry under ``onnx-structure``): the first package of a structure is exported and its graphs
    kept without their weights (``export.binding``); every other package of it has its weights
    bound into them and verified against PyTorch (``export.onnx.bind_onnx``), in seconds where an
    export takes minutes. A binding that fails verification is logged and the package exported.

    The entry holds no copy of the package's weights: its graphs read them from the package's
    ``model.safetensors`` (``export.weights_file``; hashed here with the package), and the entry
    keeps only the tensors that file does not hold as the graphs take them (transposed ones) in
    ``model.derived.data``. A session of these graphs is given that file (``OnnxRuntimeBackend``'s
    ``weights``, ``export.runtime.ort_session``'s).

    ``beside_batches``: the process serves batches meanwhile; the package's weights are hashed,
    and a child that binds or exports a large package runs, as load work
    (``export.runtime.lower_for_load``).
    """
    # onnxruntime: an optional extra; the engine imports this module whatever the backend
    import onnxruntime

    # Per-expert matmuls win on CPU only; on GPU one batched matmul over the stacked experts
    # (docs: soft-moe-performance.md).
    experts = "batched" if device == "cuda" else "per-expert"
    settings = dict(opset=exporter.DEFAULT_OPSET, precision=precision, experts=experts, towers="split",
                    dynamic_batch=True, verify_batches=(1, 4), routing=routing)
    digests = cache.package_digests(package, load=beside_batches)
    inputs = {
        "artifact": "onnx",
        "graph_format": GRAPH_FORMAT,
        "package": digests,
        "exporter": cache.versions("softmoe-serve", "torch", "onnxscript", "onnx-ir", "onnx"),
        "runtime": {"name": "onnxruntime", "version": onnxruntime.__version__},
        # export_onnx verifies bf16 graphs on the CUDA provider, everything else on the CPU
        "device": cache.cuda_identity() if precision == "bf16" else cache.cpu_identity(),
        **{k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()},
    }

    # The same graphs for every package of this structure (export.binding): exported once, then
    # each new package's weights are bound into them and verified.
    structure_inputs = {**inputs, "artifact": "onnx-structure", "package": cache.package_structure(package)}
    structure_root, structure_key = cache_root(cache_dir) / "onnx-structure", cache.cache_key(structure_inputs)

    # The weights' digest, just computed for the key, is the one the graphs' metadata carries.
    known = {**settings, "known_digest": digests["model.safetensors"]}

    def build(tmp: Path) -> list[str]:
        child = _weight_bytes(package) >= EXPORT_IN_CHILD_BYTES
        found = cache.lookup(structure_root, structure_key, log=log)
        if found is not None and found.meta.get("bindable"):
            names = _bound(package, found.path, tmp, known, log, beside_batches)
            if names is not None:
                return names
        elif found is not None:
            log(f"{found.path}: {found.meta.get('why')}; exporting")
        started = time.perf_counter()
        log(f"exporting {package} to ONNX ({precision}, {experts} experts) and verifying it"
            + (" in a child process" if child else ""))
        scratch, staging = tmp / ".export", tmp / ".structure"  # the exported graphs, then their structure
        with phase("export"):
            if child:
                names = _in_child("export", package, scratch / "model.onnx", known, staging, bound=tmp,
                                  beside_batches=beside_batches)
            else:
                detail = logging.getLogger("softmoe.export").debug  # per-output verification lines
                files = exporter.export_onnx(package, scratch / "model.onnx", log=detail, structure_out=staging,
                                             bound_out=tmp, **known)  # raises unless verified
                names = [f.path.name for f in files]
        log(f"exported and verified in {time.perf_counter() - started:.1f} s")
        _publish_structure(structure_root, structure_key, staging, structure_inputs, log)
        bound = all((tmp / name).is_file() for name in names)  # the graphs as read from the package's weights
        for f in scratch.iterdir():
            if bound:
                f.unlink()
            else:  # an unbindable structure: the graphs as exported
                shutil.move(str(f), tmp / f.name)
        scratch.rmdir()
        return names

    try:
        entry = cache.build(cache_root(cache_dir) / "onnx", cache.cache_key(inputs), build, inputs=inputs, log=log)
    except cache.ReadOnlyCache as e:
        raise cache.ReadOnlyCache(f"{package}: {e}; prepare it where the cache is writable, with the same settings: "
                                  f"softmoe prepare --model {package} --cache-dir {cache_root(cache_dir)}") from None
    log(f"{'built' if entry.built else 'reusing'} {entry.path} (hash-checked)")
    return [entry.files[name] for name in entry.meta if not name.endswith(".routing.onnx")]


def _bound(package: Path, structure: Path, tmp: Path, settings: dict, log, beside_batches: bool = False
           ) -> list[str] | None:
    """The package's weights bound into the graphs of ``structure`` and verified, written into
    ``tmp`` (in a child process for a large package): the file names; None, with ``tmp`` emptied and
    the reason logged, where that fails and the package is to be exported instead."""
    started = time.perf_counter()
    log(f"binding {package}'s weights into {structure} (graphs of the same structure) and verifying them")
    try:
        with phase("bind"):
            names = _in_child("bind", package, tmp / "model.onnx", settings, structure, beside_batches=beside_batches) \
                if _weight_bytes(package) >= BIND_IN_CHILD_BYTES else \
                [f.path.name for f in exporter.bind_onnx(package, structure, tmp / "model.onnx",
                                                         log=logging.getLogger("softmoe.export").debug, **settings)]
    except ExportError as e:
        log(f"binding failed ({e}); exporting instead")
        for f in tmp.iterdir():
            f.unlink()
        return None
    log(f"bound and verified in {time.perf_counter() - started:.1f} s")
    return names


def _publish_structure(root: Path, key: str, staging: Path, inputs: dict, log) -> None:
    """The structure an export wrote into ``staging`` (``export.onnx.write_structure_entry``), as
    its own cache entry; ``staging`` is emptied and removed either way."""
    recipe = json.loads((staging / binding.RECIPE).read_text())
    why = recipe.get("unbindable")

    def move(tmp: Path) -> dict:
        for f in staging.iterdir():
            shutil.move(str(f), tmp / f.name)
        return {"bindable": why is None, "why": why or ""}

    try:
        cache.build(root, key, move, inputs=inputs, log=log)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _weight_bytes(package: Path) -> int:
    return sum(f.stat().st_size for f in Path(package).glob("*.safetensors"))


def _in_child(mode: str, package: Path, out: Path, settings: dict, structure: Path, bound: Path | None = None,
              beside_batches: bool = False) -> list[str]:
    """``export_onnx`` (``mode`` export, writing the structure into ``structure`` and the graphs
    bound to the package's weights into ``bound``) or ``bind_onnx``
    (``mode`` bind, from ``structure``) in a child interpreter (``python -c``, not multiprocessing,
    which would re-run an unguarded main script): its memory goes back to the OS when it exits.
    A large package's child runs at nice 19, or as load work ``beside_batches``
    (``LOW_PRIORITY_EXPORT_BYTES``). Returns the file names it wrote; its failure, or its death
    (killed for memory), is one ``ExportError``."""
    large = _weight_bytes(package) >= LOW_PRIORITY_EXPORT_BYTES
    args = json.dumps({"mode": mode, "package": str(package), "out": str(out), "settings": settings,
                       "nice": 19 if large and not beside_batches else 0, "load": large and beside_batches,
                       "structure": str(structure), "bound": str(bound) if bound else None})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # what this process imports
    r = subprocess.run([sys.executable, "-c", _CHILD, args], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, env=env)
    if r.returncode == 0:
        return json.loads(r.stdout.strip().splitlines()[-1])
    lines = r.stderr.strip().splitlines()
    why = lines[-1] if lines else ""
    if r.returncode < 0 or not why:
        why = f"the {mode} process died (exit status {r.returncode}; out of memory?)"
    raise ExportError(f"{'exporting' if mode == 'export' else 'binding'} {package} to ONNX: {why}")


# The child's side: export (or bind), verify, print the file names as JSON; any error is its last stderr line.
_CHILD = """
import json, os, sys
args = json.loads(sys.argv[1])
os.nice(args["nice"])
if args["load"]:
    from export.runtime import lower_for_load
    lower_for_load()
try:
    from export.onnx import bind_onnx, export_onnx
    if args["mode"] == "bind":
        files = bind_onnx(args["package"], args["structure"], args["out"], log=lambda *a: None, **args["settings"])
    else:
        files = export_onnx(args["package"], args["out"], log=lambda *a: None, structure_out=args["structure"],
                            bound_out=args["bound"], **args["settings"])
except Exception as e:
    print(f"{type(e).__name__}: {' '.join(str(e).split())}"[:500], file=sys.stderr)
    sys.exit(2)
print(json.dumps([f.path.name for f in files]))
"""


class OnnxRuntimeBackend:
    name = "onnxruntime"

    def __init__(self, files: list[Path], *, device: str = "cpu", max_batch_size: int = 8, threads: int = 0,
                 cuda_graph: bool = False, strict_placement: bool = False, routing: bool = True,
                 spin: str = "run", lone_threads: int = 0, background: bool = False,
                 weights: Path | None = None) -> None:
        """Sessions for ``files``. On cuda only the CUDA EP is requested (deterministic options,
        ``server.backends.cuda``) and every session must really have it active, else
        ``DeviceUnavailableError``: never served from CPU.

        Args:
            files: exported graphs (``softmoe.*`` metadata).
            device: cpu | cuda.
            max_batch_size: the largest batch ``run`` receives.
            threads: intra-op threads (0: the CPUs available).
            spin: on cpu, the intra-op threads' spin policy (``export.runtime.session_options``):
                ``run`` spins within a batch and sleeps after it, ``off`` never spins.
            cuda_graph: on cuda, ORT's CUDA-graph mode with I/O binding; calls are padded to
                ``max_batch_size`` (one captured shape per session).
            strict_placement: on cuda, refuse a graph with any node on the CPU EP.
            routing: also load the routing graph (``M.routing.onnx`` beside ``M.onnx`` or
                ``M.image.onnx``, or given in ``files``) as the routing function; its session
                serves the image function too (outside ORT's CUDA-graph mode).
            lone_threads: on cpu, wide lone calls (``--wide-lone-batches``): the intra-op threads
                of every session (0: ``threads``); the image function that has a routing graph may
                also run beside other calls on it (``narrow`` names it).
            background: on cpu, each session is set up as load work
                (``export.runtime.lower_for_load``), its intra-op threads at the caller's
                (``export.runtime.BackgroundBuiltSession``): the engine asks for it when it loads
                a model while it serves batches.
            weights: the package's ``model.safetensors``, which graphs ``exported_files`` bound
                read their initializers from (hash-checked by the caller).
        """
        # onnxruntime: an optional extra, loaded only by a backend that uses it
        import onnxruntime as ort

        if device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {device!r}: use cpu or cuda")
        if device == "cuda":
            cuda.ort_cuda_preflight(ort)
        # The cache entries of the graphs, held while this backend serves them: no process removes them.
        self._held = cache.hold([Path(f) for f in files])
        self.device, self.max_batch_size = device, max_batch_size
        self.spin = spin if device == "cpu" else None
        self.cuda_graph = cuda_graph and device == "cuda"
        self.sessions = {}
        self.functions: dict[str, FunctionSpec] = {}
        self.metadata: dict[str, dict] = {}
        self._graph_runners: dict = {}
        self._structure: str | None = None
        self._built: list[tuple[str, Path, int]] = []  # (function, file, intra-op threads) per session
        self.routing: FunctionSpec | None = None
        files = [Path(f) for f in files]
        given = list(files)  # the functions keep the order of their files
        # A graph with a routing sibling is served by the sibling's session, which computes the same
        # outputs and the routing ones besides: one copy of the weights per process, for about 2.5%
        # more per call (docs/design.md, "Weights held once"). Under ORT's CUDA-graph mode each graph
        # keeps its own session (one captured graph per session).
        partnered = {f: routing_sibling(f) for f in files if routing and routing_sibling(f) is not None}
        shared = bool(partnered) and not self.cuda_graph
        if routing:
            files = [f for f in files if not (shared and f in partnered)]
            files += [r for r in partnered.values() if r not in files]
        # Functions that run beside other calls under lone_threads: each image function with a routing graph.
        self.narrow: set[str] = set()
        sources: dict[str, Path] = {}  # function -> the file it was exported to
        for path in files:
            meta = read_metadata(path)
            fn = ROLE_TO_FN.get(meta.get("graph", ""))
            if fn is None or (fn == ROUTING and not routing):
                continue
            if device == "cuda":
                sess = cuda.ort_cuda_session(path, cuda_graph=self.cuda_graph, strict_placement=strict_placement,
                                             threads=threads or None, weights=weights)
                cuda.require_ort_provider(sess, path)
            else:
                n = threads if not lone_threads or path in partnered else lone_threads
                sess = ort_session(path, threads=n or None, providers=["CPUExecutionProvider"], spin=spin,
                                   background=background, weights=weights)
                if lone_threads and path in partnered:
                    self.narrow.add(fn)
            self._built.append((fn, path, threads if device == "cuda" else n))
            self._add(fn, sess, meta)
            sources[fn] = path
        for plain in partnered if shared else ():
            meta = read_metadata(plain)
            fn = ROLE_TO_FN.get(meta.get("graph", ""))
            if fn is not None and fn != ROUTING and ROUTING in self.sessions:
                self._add(fn, self.sessions[ROUTING], meta,
                          outputs=tuple(o for o in self.routing.outputs if o not in ROUTING_OUTPUTS))
                sources[fn] = plain
                if lone_threads:
                    self.narrow.add(fn)
        self.functions = dict(sorted(self.functions.items(),
                                     key=lambda kv: given.index(sources[kv[0]]) if sources[kv[0]] in given else len(given)))
        self._specs = all_functions(self)
        self.providers = {fn: s.get_providers() for fn, s in self.sessions.items()}
        self.precision = ",".join(sorted({m.get("precision", "fp32") for m in self.metadata.values()})) or "fp32"
        self.device_used = "cpu"
        if device == "cuda":
            ids = {s.get_provider_options().get(cuda.CUDA_EP, {}).get("device_id", "0") for s in self.sessions.values()}
            self.device_used = ",".join(f"cuda:{i}" for i in sorted(ids)) or "cuda"

    def _add(self, fn: str, sess, meta: dict, outputs: tuple[str, ...] | None = None) -> None:
        """Serve ``fn`` from ``sess``: all its outputs, or ``outputs`` of them."""
        self.sessions[fn] = sess
        self.metadata[fn] = meta
        inputs = tuple(
            InputSpec(i.name, tuple(int(d) for d in i.shape[1:]), np.dtype(np.int64 if "int64" in i.type else np.float32))
            for i in sess.get_inputs()
        )
        spec = FunctionSpec(inputs, outputs or tuple(o.name for o in sess.get_outputs()))
        if fn == ROUTING:
            self.routing = spec
        else:
            self.functions[fn] = spec

    def run(self, fn: str, inputs: Rows) -> Rows:
        try:
            if self.cuda_graph:
                runner = self._graph_runners.get(fn)
                if runner is None:
                    # onnxruntime: the optional extra (already loaded by __init__)
                    import onnxruntime as ort

                    runner = self._graph_runners[fn] = cuda.OrtCudaGraphRunner(ort, self.sessions[fn], self._specs[fn],
                                                                          self.max_batch_size)
                return runner(inputs)
            sess = self.sessions[fn]
            names = self._specs[fn].outputs
            outs = sess.run(list(names), {k: np.ascontiguousarray(v) for k, v in inputs.items()})
            return dict(zip(names, outs))
        except Exception as e:
            if self.device == "cuda" and cuda.is_sticky_cuda_message(str(e)):
                raise FatalBackendError(f"CUDA context unusable: {' '.join(str(e).split())[:300]}") from e
            raise

    def warmup(self, batch_sizes: list[int]) -> None:
        warm(self, batch_sizes)

    def structure(self) -> str:
        """What these sessions compute and how, the weights' values left out: each session's
        function, graph structure (``export.runtime.structure_digest``) and intra-op threads, the
        device, the spin policy, CUDA-graph mode and ONNX Runtime's version. Two backends with the
        same structure in one process run the same kernels on the same shapes."""
        if self._structure is None:
            # onnxruntime: the optional extra (already loaded by __init__)
            import onnxruntime as ort

            parts = [ort.__version__, self.device, str(self.spin), str(self.cuda_graph), *sorted(self.narrow)]
            parts += [f"{fn}:{structure_digest(path)}:{n}" for fn, path, n in self._built]
            parts += [f"{fn}={','.join(spec.outputs)}" for fn, spec in sorted(self.functions.items())]
            self._structure = cache.cache_key({"onnxruntime": parts})
        return self._structure

    def describe(self) -> dict:
        # onnxruntime: the optional extra (already loaded by __init__)
        import onnxruntime as ort

        out = {"backend": "onnxruntime", "device": self.device_used, "precision": self.precision,
               "providers": self.providers, "cuda_graph": self.cuda_graph, "onnxruntime": ort.__version__}
        if self.spin is not None:  # cpu: --ort-spinning
            out["ort_spinning"] = self.spin
        return out

    def close(self) -> None:
        self._graph_runners.clear()
        self.sessions.clear()
        for held in self._held:  # the entries may now be removed to make room
            held.release()


def routing_sibling(path: Path) -> Path | None:
    """``M.routing.onnx`` for ``M.onnx`` (a classifier) or ``M.image.onnx`` (an image tower), if it exists."""
    name = path.name
    for suffix in (".image.onnx", ".onnx"):
        if name.endswith(suffix) and not name.endswith((".routing.onnx", ".text.onnx")):
            sibling = path.with_name(f"{name[: -len(suffix)]}.routing.onnx")
            return sibling if sibling.is_file() else None
    return None
