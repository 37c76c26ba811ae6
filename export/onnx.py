"""Export a model package to ONNX with the Soft MoE routing fused, then prove it.

The exported graph comes from the fused path of ``softmoe_models.soft_moe``: the slot matrix
``scale * normalize(mu)`` is a constant, logits are one MatMul shared by two Softmax nodes,
dispatch and combine are two MatMuls, experts are per-expert 2-D MatMuls (``per-expert``, fastest
in ONNX Runtime CPU, which prepacks constant 2-D weights) or one 3-D batched MatMul per
projection (``batched``, the compact form for GPUs and TensorRT). No ``Einsum`` node survives;
the exporter refuses to write a graph that has one.

Sparse V-MoE packages (Tokens Choice, Experts Choice) export the fused path of
``softmoe_models.sparse_moe``: TopK routing, gathers into per-expert buffers, batched expert
matmuls, gathers (or, Experts Choice, a scatter-add) back, with no tokens x experts x capacity
tensor; five of the exporter's forms are rewritten into ones TensorRT 10 takes
(``export.op_support``). ``sparse_dispatch="einsum"`` exports vmoe's einsum reference instead,
with its one-hot dispatch and combine tensors and ``Einsum`` nodes: for benchmarks only
(``loadtests/sparse_bench.py``), never what a server loads.

Every export is verified: ONNX Runtime runs the written file on fixed inputs at two batch sizes
and the result is compared with PyTorch; over the precision's tolerance the export fails. A
sparse graph that routed a near-tie the other way is compared with PyTorch routed on the graph's
own gates instead, its gates held to PyTorch's (``export.sparse_verify``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.export import Dim

from softmoe_models.config import Precision
from softmoe_models.package import Package, load_model, read_package
from softmoe_models.soft_moe import configure_routing
from softmoe_models.sparse_moe import configure_sparse_routing, sparse_moe_layers

from .errors import ExportError
from . import binding, cache, sparse_verify
from .graphs import Graph, example_inputs, graphs_for
from .op_support import sparse_ops_for_tensorrt
from .runtime import ort_session

ExpertsForm = Literal["per-expert", "batched"]
# Sparse V-MoE layers: "fused" (served: Tokens Choice runs each expert over the claims it kept,
# Experts Choice over its C tokens), "capacity" (Tokens Choice's experts over their whole capacity
# buffers, the fused form before; bench only) or vmoe's einsums (bench only).
SparseDispatch = Literal["fused", "capacity", "einsum"]
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SUPPORTED_OPSETS = range(18, 24)  # what the dynamo exporter and onnxscript's torchlib emit
DEFAULT_OPSET = 20  # Gelu(approximate='tanh') exists from 20
TWO_GB = 2**31
METADATA_PREFIX = "softmoe."


def tolerance(precision: str, reference_max: float) -> float:
    """Max abs error allowed vs PyTorch float32: fp32 1e-4 absolute; fp16/bf16 relative."""
    if precision == "fp32":
        return 1e-4
    rel = 1e-2 if precision == "fp16" else 5e-2
    return rel * max(1.0, reference_max)


@dataclass
class Verification:
    batch: int
    output: str
    max_abs_err: float
    tol: float
    # Sparse graphs that routed a near-tie the other way (export.sparse_verify): max_abs_err is then
    # against PyTorch routed on the graph's gates, own_routing_err against PyTorch's own routing,
    # and gate_err how far the graph's gates were from those PyTorch computed (held to gate_tol).
    own_routing_err: float | None = None
    gate_err: float | None = None
    gate_tol: float | None = None
    # bfloat16 dispatch (bf16_tolerance): the dispatcher's whole effect on this output (PyTorch with
    # bfloat16 against float32 dispatch), and the graph's distance from the float32-dispatch output,
    # which must exceed its distance from the bfloat16 one (the graph rounds as the mode does).
    bf16_effect: float | None = None
    fp32_dispatch_err: float | None = None

    @property
    def rounds_as_the_mode(self) -> bool:
        # where the effect is within the float32 tolerance the two modes cannot be told apart
        return (self.bf16_effect is None or self.bf16_effect <= self.tol - 2 * self.bf16_effect
                or self.max_abs_err < self.fp32_dispatch_err)

    @property
    def ok(self) -> bool:
        gates_ok = self.gate_err is None or self.gate_err <= self.gate_tol
        return self.max_abs_err <= self.tol and gates_ok and self.rounds_as_the_mode

    def _tol(self) -> str:
        if self.bf16_effect is None:
            return f"tol {self.tol:.0e}"
        return (f"tol {self.tol:.2e}: 1e-04 + 2 x the bf16 dispatch's effect {self.bf16_effect:.2e}; "
                f"{self.fp32_dispatch_err:.2e} from float32 dispatch")

    def line(self) -> str:
        flag = "ok" if self.ok else "FAILED"
        if self.own_routing_err is None:
            return f"verify {self.output} batch {self.batch}: max abs err {self.max_abs_err:.2e} ({self._tol()}) {flag}"
        return (f"verify {self.output} batch {self.batch}: max abs err {self.own_routing_err:.2e} against PyTorch's own "
                f"routing (a near-tie routed the other way), {self.max_abs_err:.2e} against PyTorch routed on the "
                f"graph's gates, which are within {self.gate_err:.1e} of PyTorch's ({self._tol()}, gates "
                f"{self.gate_tol:.0e}) {flag}")


@dataclass
class ExportedFile:
    role: str
    path: Path
    external_data: Path | None
    ops: dict[str, int]
    verification: list[Verification] = field(default_factory=list)


def graph_metadata(pkg: Package, role: str, precision: str, experts: str, graph: Graph, digest: str,
              model=None, sparse_dispatch: str | None = None) -> dict[str, str]:
    meta = {
        "format": "softmoe-onnx/1",
        "kind": pkg.kind,
        "graph": role,
        "variant": pkg.meta.get("variant") or "",
        "precision": precision,
        "experts_form": experts,
        "inputs": json.dumps([s.name for s in graph.inputs]),
        "outputs": json.dumps(graph.outputs),
        "package_config": json.dumps(pkg.meta, sort_keys=True),
        "preprocess": json.dumps(pkg.meta.get("preprocess")),
        "weights_blake3": digest,  # the package digest the export cache keys the graph by
    }
    if sparse_dispatch is not None:  # sparse V-MoE graphs only
        meta["sparse_dispatch"] = sparse_dispatch
    if pkg.labels is not None:
        meta["labels"] = json.dumps(pkg.labels)
    if model is not None and hasattr(model, "logit_scale"):
        meta["logit_scale"] = repr(float(model.logit_scale))
        meta["logit_bias"] = repr(float(model.logit_bias))
    profile = pkg.routing_profile() if role == "routing" else None
    if profile is not None:  # the drift reference travels with the graph that serves the statistics
        meta["routing_profile"] = json.dumps(profile, sort_keys=True)
    tok = pkg.tokenizer_path
    if tok is not None and role in ("text", "two-tower"):
        meta["tokenizer_b64"] = base64.b64encode(tok.read_bytes()).decode()
    return {METADATA_PREFIX + k: v for k, v in meta.items()}


def weights_digest(pkg: Package, known: str | None = None) -> str:
    """The BLAKE3 digest of the package's ``model.safetensors`` (``export.cache.file_digest``, the
    one a cache key holds as the package's): ``known`` where the caller has just computed it for
    that key, since hashing gigabytes again would be most of a binding's time."""
    return known or cache.file_digest(pkg.path / "model.safetensors")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The ``softmoe.*`` metadata of an exported file (without loading its weights)."""
    # onnx: heavy; the server imports this module and loads onnx only when it reads a file
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    out: dict[str, Any] = {}
    for prop in model.metadata_props:
        if prop.key.startswith(METADATA_PREFIX):
            key = prop.key[len(METADATA_PREFIX):]
            out[key] = json.loads(prop.value) if key in ("package_config", "preprocess", "labels", "inputs", "outputs",
                                                              "routing_profile") else prop.value
    return out


def op_inventory(path: str | Path) -> dict[str, int]:
    """Count of every op type in the graph, functions and subgraphs included."""
    # onnx: heavy, out of this module's import (the server imports it)
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    counts: dict[str, int] = {}

    def walk(nodes) -> None:
        for node in nodes:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g.node)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        walk(g.node)

    walk(model.graph.node)
    for fn in model.functions:
        walk(fn.node)
    return counts


def export_one(graph: Graph, path: Path, opset: int, dynamic: bool, metadata: dict[str, str], external: bool | None,
               sparse: bool = False) -> Path | None:
    """Run the dynamo exporter for one graph; returns the external data file, if any. ``sparse``:
    the graph routes sparse V-MoE layers (``op_support.sparse_ops_for_tensorrt`` runs on it)."""
    args = tuple(_trace_inputs(graph))
    dims: dict[str, Any] = {}
    symbols: dict[str, Any] = {}
    for spec in graph.inputs:
        axes = {}
        for i, d in enumerate(spec.shape):
            if isinstance(d, str) and dynamic:
                axes[i] = symbols.setdefault(d, Dim(d, min=1, max=4096))
        dims[spec.name] = axes
    # onnx_ir and onnxscript: heavy, only an export needs them (the server imports this module)
    from . import graph_passes

    with warnings.catch_warnings(), _quiet_torch_logs():
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                graph.module, args, dynamo=True, opset_version=opset, optimize=False,
                custom_translation_table=_custom_translations() if sparse else None,
                input_names=[s.name for s in graph.inputs], output_names=graph.outputs,
                dynamic_shapes=dims if dynamic else None, verbose=False, report=False,
            )
        except Exception as e:  # the exporter raises many types; report one line
            raise ExportError(f"torch.onnx export of the {graph.role} graph failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
        graph_passes.tidy(program.model)
    graph_passes.fold_constant_gathers(program.model.graph)
    graph_passes.token_means_as_matmuls(program.model.graph)
    if sparse:
        sparse_ops_for_tensorrt(program.model.graph)
    for key, value in metadata.items():
        program.model.metadata_props[key] = value
    program.model.graph.name = f"softmoe_{graph.role.replace('-', '_')}"
    size = sum(v.const_value.nbytes for v in program.model.graph.initializers.values() if v.const_value is not None)
    use_external = size >= TWO_GB - (64 << 20) if external is None else external
    data = path.with_name(path.name + ".data")
    if data.exists():
        data.unlink()
    program.save(str(path), external_data=use_external)
    return data if use_external and data.exists() else None


def _custom_translations() -> dict:
    """``softmoe::routed_experts`` (``softmoe_models.sparse_moe``), written out per expert: rows
    ``(A, d)`` sorted by expert and the rows per expert ``count (E,)`` -> expert e's rows
    ``Slice(rows, start[e], end[e])`` (``end = CumSum(count)``, ``start = end - count``) through
    ``Gemm(W1[e], b1[e])``, ``Gelu(tanh)``, ``Gemm(W2[e], b2[e])`` (each weight a Gather of the stacked
    constant, which ``graph_passes.fold_constant_gathers`` turns into a 2-D constant that ONNX Runtime
    prepacks), bfloat16 Casts where the layer dispatches in bfloat16, then ``Concat`` of the
    experts' rows and zeros for the rest (the dropped claims). An expert with no row runs GEMMs of
    no row."""
    # onnx: heavy, out of this module's import (the server imports it)
    import onnx
    # onnxscript: heavy, only an export of sparse layers needs it
    from onnxscript import opset20 as op

    def routed_experts(rows, count, w1, b1, w2, b2, bf16: bool = False):
        dtype = int(rows.dtype)
        end = op.CumSum(count, op.Constant(value_int=0))
        start = op.Sub(end, count)
        axis0 = op.Constant(value_ints=[0])
        outs = []
        for e in range(w1.shape[0]):
            i, j = op.Constant(value_ints=[e]), op.Constant(value_ints=[e + 1])
            seg = op.Slice(rows, op.Slice(start, i, j), op.Slice(end, i, j), axis0)
            at = op.Constant(value_int=e)
            h = op.Gemm(seg, op.Gather(w1, at, axis=0), op.Gather(b1, at, axis=0))
            h = op.Gemm(op.Gelu(h, approximate="tanh"), op.Gather(w2, at, axis=0), op.Gather(b2, at, axis=0))
            if bf16:
                h = op.Cast(op.Cast(h, to=onnx.TensorProto.BFLOAT16), to=dtype)
            outs.append(h)
        shape = op.Shape(rows)
        total = op.Slice(end, op.Constant(value_ints=[-1]), op.Constant(value_ints=[2**62]))
        rest = op.Concat(op.Sub(op.Slice(shape, axis0, op.Constant(value_ints=[1])), total),
                         op.Slice(shape, op.Constant(value_ints=[1]), op.Constant(value_ints=[2])), axis=0)
        zeros = op.Cast(op.ConstantOfShape(rest), to=dtype)  # Cast, not CastLike: TensorRT 10 imports Cast
        return op.Concat(*outs, zeros, axis=0)

    return {torch.ops.softmoe.routed_experts.default: routed_experts}


@contextlib.contextmanager
def _quiet_torch_logs():
    """The exporter logs a warning per optional torchvision op it skips, and its onnx_ir and
    onnxscript passes a line per initializer they fold (~50 KB per graph under the server's INFO
    logging); keep the CLI and the server log clean."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnx_ir", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _trace_inputs(graph: Graph) -> list[torch.Tensor]:
    """Example inputs for tracing: batch 2 (a batch of 1 risks 0/1 specialisation)."""

    ex = example_inputs(graph, batch=2)
    return [ex[s.name] for s in graph.inputs]


def _verify_providers(precision: str) -> list[str]:
    """Execution providers to verify on; bf16 needs one with bf16 kernels (not ORT's CPU EP)."""
    if precision != "bf16":
        return ["CPUExecutionProvider"]
    try:  # onnxruntime: an optional extra; whether it imports is part of the answer
        import onnxruntime as ort

        available = ort.get_available_providers()
    except ImportError:
        available = []
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider"]
    raise ExportError(
        "a bf16 ONNX graph cannot be verified here: ONNX Runtime's CPU provider has no bf16 kernels "
        "(install onnxruntime-gpu on a CUDA machine). Use --precision fp16, or build a bf16 TensorRT "
        "engine with `softmoe export tensorrt --precision bf16`, which starts from the fp32 graph"
    )


def bf16_tolerance(base: float, effect: float) -> float:
    """The bound for an output of a graph whose MoE layers dispatch in bfloat16 (vmoe's
    ``Bfloat16Dispatcher``: the tokens entering the experts and the expert outputs leaving them
    rounded to bfloat16), given ``effect``, the largest difference on that output between PyTorch
    with bfloat16 and with float32 dispatch (the rounding's whole effect), and ``base``, the
    float32 tolerance.

    Derivation. Rounding to bfloat16 (8 significant bits) moves a float32 value x to the nearer
    of its two bfloat16 neighbours. ONNX Runtime and PyTorch compute x with other kernels, float32
    noise apart; where x lies within that noise of the midpoint of its neighbours, the two round
    it to different neighbours. At the midpoint each rounding error is half the gap, so the two
    results differ by the gap: twice the rounding error either commits there. A graph that rounds
    some values the other way is therefore, to first order, at most twice the rounding's effect
    from PyTorch (every value flipped; in practice a few), plus the float32 noise: ``base + 2 *
    effect``. Measured on vmoe_tc_e8k2 (cf 4.0, verify batch 4): 6.3e-4 off PyTorch, effect
    1.0e-3, bound 2.2e-3; the float32 bound, 1e-4, refused the graph.

    The bound alone would pass a graph that does not round at all (it is ``effect`` from PyTorch),
    so ``Verification.ok`` also asks the graph to be nearer PyTorch's bfloat16-dispatch output than
    its float32-dispatch one, wherever the effect is large enough to tell them apart."""
    return base + 2 * effect


@contextlib.contextmanager
def _float32_dispatch(module: torch.nn.Module):
    """Every MoE layer of ``module`` that dispatches in bfloat16 dispatches in float32 inside."""
    layers = [m for m in module.modules() if getattr(m, "bf16_dispatch", False)]
    for layer in layers:
        layer.bf16_dispatch = False
    try:
        yield
    finally:
        for layer in layers:
            layer.bf16_dispatch = True


def verify(
    path: Path, graph: Graph, reference: Graph, precision: str, batches: tuple[int, ...], vocab: int,
    providers: list[str] | None = None, weights: Path | None = None,
) -> list[Verification]:
    """Run ``path`` in ONNX Runtime and compare with the float32 PyTorch ``reference``. MoE layers
    that dispatch in bfloat16 are held to ``bf16_tolerance``. A sparse graph's largest batch is also
    run with each image among other batch-mates: its outputs must be the same bits (an expert runs
    as many routed rows as the batch-mates send it; its GEMMs must give a row the same bits at any
    row count, which this proves on this machine and runtime, the ones the export cache keys).
    ``weights``: the package's weights file, for a bound graph that reads from it."""

    bf16 = any(getattr(m, "bf16_dispatch", False) for m in reference.module.modules())
    sparse = bool(sparse_moe_layers(reference.module))
    # a sparse graph's check among batch-mates proves the served kernels: a session set up as served
    session = ort_session(path, providers=providers, weights=weights, checking=not sparse)
    results = []
    for batch in batches:
        feeds = example_inputs(graph, batch, seed=batch, vocab=vocab)
        args = [feeds[s.name] for s in graph.inputs]
        with torch.no_grad():
            ref = reference.module(*args)
            if bf16:
                with _float32_dispatch(reference.module):
                    ref32 = reference.module(*args)
        refs = ref if isinstance(ref, tuple) else (ref,)
        refs32 = (ref32 if isinstance(ref32, tuple) else (ref32,)) if bf16 else (None,) * len(refs)
        try:
            outs = session.run(graph.outputs, {k: v.numpy() for k, v in feeds.items()})
        except Exception as e:
            raise ExportError(f"{path}: ONNX Runtime could not run the exported graph: {str(e).splitlines()[0][:300]}") from None
        checked = [_compare(batch, name, got, want.numpy(), precision, want32)
                   for name, got, want, want32 in zip(graph.outputs, outs, refs, refs32)]
        if any(not v.ok for v in checked) and sparse:
            checked = _routed_on_graph_gates(path, graph, reference, feeds, outs, checked, precision, providers, refs32,
                                             weights)
        results += checked
        if sparse and batch == max(batches) and batch > 1 and all(len(s.shape) and s.shape[0] == "batch"
                                                                  for s in graph.inputs):
            results += among_other_mates(session, graph, feeds, outs, vocab)
    return results


def among_other_mates(session, graph: Graph, feeds: dict[str, torch.Tensor], outs, vocab: int
                       ) -> list[Verification]:
    """Each image of the batch at its place among other batch-mates (fresh random rows), the batch
    size unchanged: per output, the largest difference from its rows among the first mates
    (tolerance 0: the same bits). The routed rows each expert runs change with the mates; the
    shapes of the call do not (padded shapes against each other are the server's start-up proof)."""

    n = next(iter(feeds.values())).shape[0]
    others = example_inputs(graph, n, seed=1000 + n, vocab=vocab)
    worst = [0.0] * len(graph.outputs)
    for i in range(n):
        mixed = {k: torch.cat([others[k][:i], v[i:i + 1], others[k][i + 1:]]).numpy() for k, v in feeds.items()}
        got = session.run(graph.outputs, mixed)
        for j, (a, b) in enumerate(zip(got, outs)):
            if not np.array_equal(a[i:i + 1], b[i:i + 1]):
                diff = float(np.abs(a[i:i + 1].astype("float64") - b[i:i + 1]).max())
                worst[j] = max(worst[j], diff if diff > 0 else float("inf"))
    return [Verification(n, f"{name} (each image among other batch-mates)", err, 0.0)
            for name, err in zip(graph.outputs, worst)]


def _compare(batch: int, name: str, got, want, precision: str, want32=None) -> Verification:
    err = float(abs(got.astype("float64") - want).max()) if got.shape == want.shape else float("inf")
    tol = tolerance(precision, float(abs(want).max()))
    if want32 is None:
        return Verification(batch, name, err, tol)
    want32 = want32.numpy()
    effect = float(abs(want.astype("float64") - want32).max())
    err32 = float(abs(got.astype("float64") - want32).max()) if got.shape == want32.shape else float("inf")
    return Verification(batch, name, err, bf16_tolerance(tol, effect), bf16_effect=effect, fp32_dispatch_err=err32)


def _routed_on_graph_gates(path: Path, graph: Graph, reference: Graph, feeds: dict[str, torch.Tensor], outs,
                           checked: list[Verification], precision: str, providers: list[str] | None,
                           refs32: tuple = (), weights: Path | None = None) -> list[Verification]:
    """A sparse graph off PyTorch: PyTorch again, routed on the graph's own gates
    (``export.sparse_verify``); ``checked`` as it was when the graph's gates cannot be read."""

    layers = sparse_moe_layers(reference.module)
    names = sparse_verify.gate_values(path)
    if len(names) != len(layers):
        return checked
    gates = sparse_verify.graph_gates(path, {k: v.numpy() for k, v in feeds.items()}, names, providers, weights)
    own_gap: list[float] = []
    with torch.no_grad(), sparse_verify.routed_on(layers, gates, own_gap):
        ref = reference.module(*[feeds[s.name] for s in graph.inputs])
    refs = ref if isinstance(ref, tuple) else (ref,)
    gate_err, gate_tol = max(own_gap), tolerance(precision, 1.0)
    out = []
    for before, got, want, want32 in zip(checked, outs, refs, refs32 or (None,) * len(refs)):
        v = _compare(before.batch, before.output, got, want.numpy(), precision, want32)
        out.append(Verification(v.batch, v.output, v.max_abs_err, v.tol, before.max_abs_err, gate_err, gate_tol,
                                v.bf16_effect, v.fp32_dispatch_err))
    return out


def _out_paths(out: Path, roles: list[str]) -> dict[str, Path]:
    """``M.onnx`` for the main graph; two-tower towers as ``M.image.onnx`` and ``M.text.onnx``."""
    stem = out.name[: -len(".onnx")] if out.name.endswith(".onnx") else out.name
    paths = {}
    for role in roles:
        name = f"{stem}.onnx" if role in ("classifier", "two-tower", "encoder") else f"{stem}.{role}.onnx"
        paths[role] = out.with_name(name)
    return paths


def export_onnx(
    package: str | Path,
    out: str | Path | None = None,
    *,
    opset: int = DEFAULT_OPSET,
    dynamic_batch: bool = True,
    precision: Precision = "fp32",
    experts: ExpertsForm = "per-expert",
    towers: Literal["both", "combined", "split"] = "both",
    external_data: bool | None = None,
    verify_batches: tuple[int, ...] = (1, 4),
    routing: bool = False,
    sparse_dispatch: SparseDispatch = "fused",
    structure_out: str | Path | None = None,
    bound_out: str | Path | None = None,
    known_digest: str | None = None,
    log=print,
) -> list[ExportedFile]:
    """Export ``package`` to ONNX and verify it; returns what was written.

    Args:
        package: model package directory.
        out: output ``.onnx`` path (default ``PACKAGE/model.onnx``).
        opset: ONNX opset, 18..23.
        dynamic_batch: symbolic batch dimension (default) or the fixed trace batch.
        precision: compute precision inside the graph; I/O stays float32, the Soft MoE
            normalisation and softmaxes stay float32.
        experts: ``per-expert`` 2-D MatMuls or ``batched`` 3-D MatMuls.
        towers: two-tower only: the combined graph, the per-tower graphs, or both.
        external_data: force weights into ``<file>.data`` (default: only past 2 GB).
        verify_batches: batch sizes ONNX Runtime is checked at (static batch: the trace batch).
        routing: also write ``M.routing.onnx``: the image graph's outputs plus every Soft MoE
            layer's dispatch and combine weights and statistics (``export.graphs.RoutingGraph``;
            sparse V-MoE layers: ``SparseRoutingGraph``; image models with MoE layers only). The
            plain graphs are the same either way.
        sparse_dispatch: sparse V-MoE packages only: ``fused`` (gathers, no tokens x experts x
            capacity tensor: what is served) or ``einsum`` (vmoe's reference einsums, Einsum nodes
            allowed: for benchmarks that compare the two, never served).
        structure_out: also write the graphs as structure there (``write_structure_entry``),
            for ``bind_onnx`` to bind other packages' weights into.
        bound_out: with ``structure_out``, also write the graphs bound to the package's own weights
            file there (``write_structure_entry``), where the structure is bindable.
        known_digest: the weights file's ``cache.file_digest`` where the caller has it (``weights_digest``).
        log: where progress lines go.

    Raises:
        ExportError: bad arguments, exporter failure, an Einsum in the graph (unless
            ``sparse_dispatch="einsum"``), failed verification.
    """
    prep = _prepared(package, opset, precision, experts, towers, routing, sparse_dispatch, out)
    pkg, model, reference_graphs, export_model, graphs, paths = prep
    sparse = bool(sparse_moe_layers(model))
    providers = _verify_providers(precision)
    digest = weights_digest(pkg, known_digest)  # once: the weights file can be gigabytes
    vocab = getattr(getattr(model.cfg, "text", None), "vocab_size", 2)
    batches = verify_batches if dynamic_batch else (2,)

    written: dict[str, ExportedFile] = {}
    for role in sorted(graphs, key=lambda r: r != "routing"):  # a routing graph first: its plain one is cut from it
        graph, path = graphs[role], paths[role]
        t0 = time.perf_counter()
        meta = graph_metadata(pkg, role, precision, experts, graph, digest, model, sparse_dispatch if sparse else None)
        routing_file = written.get("routing")
        if routing_file is not None and graphs["routing"].module.plain is graph.module:
            written[role] = _cut_from_routing(routing_file, graph, path, meta, log)
            continue
        data = export_one(graph, path, opset, dynamic_batch, meta, external_data, sparse)
        ops = op_inventory(path)
        if "Einsum" in ops and sparse_dispatch != "einsum":
            path.unlink(missing_ok=True)
            raise ExportError(f"{path}: the exported graph contains {ops['Einsum']} Einsum node(s); refusing to write it")
        _check(path)
        form = f", {sparse_dispatch} sparse dispatch" if sparse else ""
        log(f"wrote {path} ({role}, opset {opset}, {precision}, experts {experts}{form}, {sum(ops.values())} nodes, "
            f"{'external data ' + data.name if data else 'weights inline'}, {time.perf_counter() - t0:.1f}s)")
        results = _verified(path, data, graph, reference_graphs[role], precision, batches, vocab, providers, log)
        written[role] = ExportedFile(role, path, data, ops, results)
    files = [written[role] for role in graphs]
    if structure_out is not None:
        write_structure_entry(files, export_model, Path(structure_out),
                              Path(bound_out) if bound_out is not None else None, pkg.path / "model.safetensors")
    return files


def _cut_from_routing(routing: ExportedFile, graph: Graph, path: Path, metadata: dict[str, str], log) -> ExportedFile:
    """The plain image graph ``graph`` as its exported and verified routing graph cut down to the
    plain outputs (``graph_passes.only_outputs``), written to ``path``; it reads the routing graph's
    external data. Its verification is the routing graph's on those outputs: the same nodes on the
    same initializers."""
    # onnx_ir and onnxscript: heavy, only an export needs them (the server imports this module)
    from . import graph_passes

    graph_passes.only_outputs(routing.path, path, graph.outputs, f"softmoe_{graph.role.replace('-', '_')}", metadata)
    _check(path)
    ops = op_inventory(path)
    log(f"wrote {path} ({graph.role}, cut from {routing.path.name}: {sum(ops.values())} nodes, "
        f"{'external data ' + routing.external_data.name if routing.external_data else 'weights inline'})")
    results = [v for v in routing.verification if v.output.split(" ")[0] in graph.outputs]
    return ExportedFile(graph.role, path, routing.external_data, ops, results)


def _verified(path: Path, data: Path | None, graph: Graph, reference: Graph, precision: str, batches: tuple[int, ...],
              vocab: int, providers: list[str] | None, log, what: str = "verification failed",
              weights: Path | None = None) -> list[Verification]:
    """``verify``'s results for a written graph, each logged; a graph that fails is removed (its
    external data too) and raised as ``ExportError`` naming ``what`` and the first failure."""
    results = verify(path, graph, reference, precision, batches, vocab, providers, weights)
    for r in results:
        log(r.line())
    failed = [r for r in results if not r.ok]
    if failed:
        path.unlink(missing_ok=True)
        if data:
            data.unlink(missing_ok=True)
        raise ExportError(f"{path}: {what} ({failed[0].line()}); the file was removed")
    return results


def _prepared(package, opset: int, precision: str, experts: str, towers: str, routing: bool, sparse_dispatch: str,
              out) -> tuple:
    """What an export and a binding both start from: the package, its float32 reference model and
    graphs, the module exported (``precision``, the experts' form, the sparse dispatch), its graphs
    and their output paths."""
    if opset not in SUPPORTED_OPSETS:
        raise ExportError(f"unsupported opset {opset}: use {SUPPORTED_OPSETS.start}..{SUPPORTED_OPSETS.stop - 1}")
    if precision not in DTYPES:
        raise ExportError(f"unknown precision {precision!r}: use fp32, fp16 or bf16")
    if experts not in ("per-expert", "batched"):
        raise ExportError(f"unknown experts form {experts!r}: use per-expert or batched")
    if sparse_dispatch not in ("fused", "capacity", "einsum"):
        raise ExportError(f"unknown sparse dispatch {sparse_dispatch!r}: use fused, capacity or einsum")
    _verify_providers(precision)
    package = Path(package)
    if not package.exists():
        raise ExportError(f"model package not found: {package}")
    pkg = read_package(package)
    out = Path(out) if out is not None else package / "model.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[precision]

    model = load_model(package, fused=True)
    reference_graphs = graphs_for(model, torch.float32)
    export_model = model if precision == "fp32" else load_model(package, fused=True, dtype=dtype)
    configure_routing(export_model, experts_form="batched" if experts == "batched" else "per_expert")
    sparse = bool(sparse_moe_layers(model))
    if sparse_dispatch != "fused" and not sparse:
        raise ExportError(f"sparse_dispatch={sparse_dispatch!r} is for sparse V-MoE packages; {package} has none")
    # The routed form's experts as one GEMM per expert over exactly its rows (row_block 0): ONNX
    # Runtime's GEMMs give a row the same bits at any row count (verified below, per image).
    configure_sparse_routing(export_model, fused=sparse_dispatch != "einsum", row_block=0,
                             tokens_form="capacity" if sparse_dispatch == "capacity" else "routed")
    graphs = graphs_for(export_model, dtype)
    if not routing:
        graphs.pop("routing", None)
    if "two-tower" in graphs:
        keep = {"both": ["two-tower", "image", "text"], "combined": ["two-tower"], "split": ["image", "text"]}[towers]
        graphs = {k: v for k, v in graphs.items() if k in keep or k == "routing"}
    return pkg, model, reference_graphs, export_model, graphs, _out_paths(out, list(graphs))


def write_structure_entry(written: list[ExportedFile], module: torch.nn.Module, out: Path,
                          bound_out: Path | None = None, weights: Path | None = None) -> None:
    """The exported graphs as structure (``export.binding``) into ``out``: each graph without its
    weight data and ``recipe.json`` (per file, its recipe; or why it cannot be bound). With
    ``bound_out``, the same graphs bound there (``binding.Binder``) to the package's weights file
    ``weights`` they were exported from: the values they were verified with, read from the
    package instead of copied (each package range is compared with the exported tensor, and a
    derived one is the tensor the recipe matched by value); where that fails, none is written."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = binding.model_tensors(module)
    found = binding.recipes_for([f.path for f in written], tensors)
    recipes: dict[str, dict] = {}
    for f in written:
        recipe, why = found[f.path]
        if recipe is None:
            recipes = {"unbindable": why}
            break
        binding.write_structure(f.path, recipe, out / f.path.name)
        recipes[f.path.name] = {"role": f.role, "steps": recipe}
    if "unbindable" in recipes:
        for f in written:
            (out / f.path.name).unlink(missing_ok=True)
    elif bound_out is not None:
        binder = binding.Binder(weights, bound_out / derived_name(written[0].path))
        try:
            for f in written:
                binder.bind(out / f.path.name, recipes[f.path.name]["steps"], tensors, bound_out / f.path.name, {},
                            found=True)
        except ExportError:  # the exported graphs, as written, are what is served then
            for f in written:
                (bound_out / f.path.name).unlink(missing_ok=True)
            binder.derived.unlink(missing_ok=True)
        finally:
            binder.close()
    binding.write_recipe(recipes, out / binding.RECIPE)


def derived_name(graph: Path) -> str:
    """``M.derived.data``, the tensors bound graphs ``M*.onnx`` hold beside the package's weights."""
    return f"{graph.name.split('.')[0]}.derived.data"


def bind_onnx(package: str | Path, structure: Path, out: str | Path, *, opset: int = DEFAULT_OPSET,
              dynamic_batch: bool = True, precision: Precision = "fp32", experts: ExpertsForm = "per-expert",
              towers: Literal["both", "combined", "split"] = "split", verify_batches: tuple[int, ...] = (1, 4),
              routing: bool = False, sparse_dispatch: SparseDispatch = "fused", known_digest: str | None = None,
              log=print) -> list[ExportedFile]:
    """``export_onnx``'s graphs for ``package`` without exporting: its weights bound into the
    structure another package of the same structure was exported to (``structure``: a directory
    ``write_structure_entry`` wrote), then verified against PyTorch on these weights as an
    export is (same batches, same tolerances, sparse graphs among other batch-mates). The graphs
    read most initializers from the package's ``model.safetensors`` (``export.weights_file``): a
    session of them is given that file; the rest are in ``M.derived.data`` beside them.
    ``known_digest``: the weights file's ``cache.file_digest`` where the caller has it.

    Raises:
        ExportError: the structure cannot be bound (its recipe says why, or a graph of another
            role or shape is asked for), or a bound graph fails verification (its files removed).
    """
    recipes = json.loads((Path(structure) / binding.RECIPE).read_text())
    if "unbindable" in recipes:
        raise ExportError(f"the structure cannot take other weights: {recipes['unbindable']}")
    prep = _prepared(package, opset, precision, experts, towers, routing, sparse_dispatch, out)
    pkg, model, reference_graphs, export_model, graphs, paths = prep
    sparse = bool(sparse_moe_layers(model))
    providers = _verify_providers(precision)
    by_role = {r["role"]: (name, r) for name, r in recipes.items()}
    if set(by_role) != set(graphs):
        raise ExportError(f"the structure holds graphs {sorted(by_role)}, this export needs {sorted(graphs)}")
    tensors = binding.model_tensors(export_model)
    digest = weights_digest(pkg, known_digest)
    weights = pkg.path / "model.safetensors"
    vocab = getattr(getattr(model.cfg, "text", None), "vocab_size", 2)
    batches = verify_batches if dynamic_batch else (2,)
    binder = binding.Binder(weights, next(iter(paths.values())).with_name(derived_name(next(iter(paths.values())))))
    try:
        for role, graph in graphs.items():
            meta = graph_metadata(pkg, role, precision, experts, graph, digest, model,
                                  sparse_dispatch if sparse else None)
            binder.bind(Path(structure) / by_role[role][0], by_role[role][1]["steps"], tensors, paths[role], meta)
    finally:
        binder.close()
    steps = {paths[role]: by_role[role][1]["steps"] for role in graphs}
    written: dict[str, ExportedFile] = {}
    try:
        for role in sorted(graphs, key=lambda r: r != "routing"):  # a routing graph first: it may vouch for its plain one
            path = paths[role]
            results = _within_routing(path, paths["routing"], steps, binder.bound, log) if "routing" in written \
                else None
            if results is None:
                results = _verified(path, None, graphs[role], reference_graphs[role], precision, batches, vocab,
                                    providers, log, what="the bound graph failed verification", weights=weights)
            written[role] = ExportedFile(role, path, None, op_inventory(path), results)
    except ExportError:
        for path in paths.values():
            path.unlink(missing_ok=True)
        binder.derived.unlink(missing_ok=True)
        raise
    return [written[role] for role in graphs]


def _within_routing(plain: Path, routing: Path, recipes: dict[Path, list[dict]], bound: dict[Path, Any], log
                    ) -> list[Verification] | None:
    """The bound ``plain`` graph vouched for by the bound ``routing`` graph, already verified
    against PyTorch, without a session of its own (``recipes``: each graph's binding steps;
    ``bound``: ``binding.Binder.bound``, the graphs as written). None unless each initializer the
    binding gave ``plain`` was found by an unambiguous recipe at export, and the routing graph holds
    one from the same recipe (the same tensor of the package, taken the same way) with the same
    type, shape and data: the same range of the same file. The routing graph is the plain graph's
    module with outputs added (``graphs.RoutingGraph``), exported and verified with it; what the
    binding changes is only those initializers, so the routing graph's verified outputs are the
    plain graph's on the very bytes the plain graph reads. A plain graph with a routing sibling is
    served from the sibling's session anyway (``OnnxRuntimeBackend``); this spares building and
    prepacking one more session of the weights."""

    def content(t) -> bytes:  # the tensor less its name: type, shape and where its bytes lie
        c = type(t)()
        c.CopyFrom(t)
        c.name = ""
        return c.SerializeToString(deterministic=True)

    def how(step: dict) -> tuple:
        return step["op"], step["source"], step.get("index")

    theirs = {t.name: t for t in bound[routing].graph.initializer}
    given = {how(step): content(theirs[step["name"]]) for step in recipes[routing] if step["name"] in theirs}
    mine = {t.name: t for t in bound[plain].graph.initializer}
    for step in recipes[plain]:
        if step.get("ambiguous") or given.get(how(step)) != content(mine[step["name"]]):
            return None
    log(f"verify {plain.name}: its {len(recipes[plain])} bound initializers are the verified {routing.name}'s, "
        f"from the same recipes, byte for byte")
    return [Verification(0, f"every bound initializer as {routing.name}'s", 0.0, 0.0)]


def _check(path: Path) -> None:
    # onnx: heavy, out of this module's import (the server imports it)
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=False)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"{path}: onnx.checker failed: {str(e).splitlines()[0]}") from None
