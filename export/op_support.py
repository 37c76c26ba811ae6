"""Sparse routing in ops TensorRT 10 takes, and a check of an ONNX file against what it refuses.

The fused sparse V-MoE layers (``softmoe_models.sparse_moe``) export to TopK, GatherElements,
ScatterElements, CumSum, Clip and ScatterND; Tokens Choice's routed experts to a Slice of
data-dependent length per expert (starts and ends computed in the graph, which TensorRT 10's
Slice takes as tensors), two Gemms on constant weights, Concat and ConstantOfShape. Of the forms the exporter writes for them, TensorRT
10's ONNX parser (onnx-tensorrt ``onnxOpImporters.cpp`` and ``docs/operators.md``, 10.0 to 10.15)
refuses one, lists no kernel for the types of three more, and documents no order for the ties of
the fifth; ``sparse_ops_for_tensorrt`` rewrites each into an equivalent that it takes, with the
same results in ONNX Runtime (every export is verified after):

* ``ScatterND(reduction='add')`` (Experts Choice adds each expert's outputs into the tokens it
  took, ``index_add_``): the importer raises "ScatterND with reduction is not supported". Written
  as ``ScatterElements(axis=0, reduction='add')`` with the row indices broadcast over the width,
  which the importer hands to TensorRT's standard ``ScatterElements`` plugin (libnvinfer_plugin;
  ``build_engine`` registers it); fp16/bf16 graphs add in float32 (ONNX Runtime's CPU kernel has
  no fp16 add). The plugin adds with atomics on the GPU: a token taken by three or more experts
  may differ in the last bit between runs (as torch's CUDA ``index_add_``).
* ``CumSum`` on integers (Tokens Choice numbers each expert's claims, and sorts the kept claims of
  the batch by expert): the support matrix lists FP32, FP16 and BF16 only. Cast to float32,
  summed, cast back. Exact: in a sparse graph every integer cumulative sum counts routing claims,
  of one group or of the batch, so each partial sum is at most batch x tokens x K (25,216 for
  K=2 at 197 tokens and a batch of 64), far below 2**24.
* ``TopK`` on integers (Tokens Choice sorts claims by expert, and relies on equal experts keeping
  claim order): ONNX says equal values come out lower index first, TensorRT documents no order for
  ties. The keys are made unique, ``value * n + position`` (``n - 1 - position`` when largest), so
  any correct TopK gives ONNX's order; the values output, when used, is gathered from the input.
* ``Clip`` on integers (Tokens Choice clamps slot and claim positions): FP32, FP16 and BF16 only
  in the matrix. Written as ``Max`` then ``Min``, which take INT32 and INT64. Exact.
* ``ScatterElements`` on booleans (the routing graph marks which (token, expert) pairs were
  dispatched): FP32, FP16, BF16, INT32 and INT64 only. Scattered as INT32, cast back. Exact.

Float TopKs (gates: each token's top-K experts, each expert's top-C tokens, the batch-priority
order) are left alone: exact ties there need equal float gates, and no known input gives them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# Ops TensorRT 10's ONNX parser does not import (onnx-tensorrt docs/operators.md, "N" in 10.0..10.15)
# that an exporter could plausibly write; anything outside the default domain is refused as well.
UNSUPPORTED_OPS = frozenset({
    "BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr", "BitwiseXor", "Bernoulli", "CenterCropPad", "Col2Im",
    "Compress", "ConcatFromSequence", "ConvInteger", "DFT", "Det", "DynamicQuantizeLinear", "ImageDecoder",
    "MatMulInteger", "MaxRoiPool", "MaxUnpool", "MelWeightMatrix", "Multinomial", "NegativeLogLikelihoodLoss",
    "Optional", "OptionalGetElement", "OptionalHasElement", "QLinearConv", "QLinearMatMul", "RegexFullMatch",
    "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase", "SequenceInsert", "SequenceLength",
    "SequenceMap", "SoftmaxCrossEntropyLoss", "SplitToSequence", "StringConcat", "StringNormalizer", "StringSplit",
    "TfIdfVectorizer", "Unique",
})
TOPK_MAX_K = 3840  # docs/operators.md: "`K` input must be less than 3840"
FLOAT_TYPES = ("FLOAT", "FLOAT16", "BFLOAT16")
INT_TYPES = ("INT32", "INT64")
_NUMBERS = (*FLOAT_TYPES, *INT_TYPES)
_ANY = (*_NUMBERS, "BOOL")
# The types TensorRT 10 imports for the ops these graphs hold (docs/operators.md, 10.0..10.15;
# FP8/INT8/INT4 only through quantization, left out). Checked on the data input: input 0, or for
# Where its first value input. An op not listed here is not type-checked.
INPUT_TYPES: dict[str, tuple[str, ...]] = {
    **{op: _NUMBERS for op in ("Add", "Sub", "Mul", "Div", "Mod", "Neg", "Max", "Min", "Sum", "Equal", "Less",
                               "Greater", "LessOrEqual", "GreaterOrEqual", "TopK", "ScatterElements", "ScatterND",
                               "Scatter", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean", "ReduceProd", "Range",
                               "ArgMax", "ArgMin", "Abs", "Sign", "Pow")},
    **{op: FLOAT_TYPES for op in ("CumSum", "Clip", "Softmax", "LogSoftmax", "Log", "Exp", "Sqrt", "Reciprocal",
                                  "Tanh", "Erf", "MatMul", "Gemm", "Conv", "LayerNormalization", "Floor", "Ceil",
                                  "Round")},
    **{op: _ANY for op in ("Gather", "GatherElements", "GatherND", "Where", "Expand", "Reshape", "Concat",
                           "Transpose", "Slice", "Squeeze", "Unsqueeze", "Identity", "Tile", "Flatten", "Split",
                           "OneHot")},
    **{op: ("BOOL",) for op in ("Not", "And", "Or", "Xor")},
    "Cast": (*_ANY, "UINT8"),
}


# ------------------------------------------------------------------ the rewrite (onnx_ir, at export)


def sparse_ops_for_tensorrt(graph) -> dict[str, int]:
    """Rewrite the five forms of the module docstring in an ``onnx_ir`` graph, in place.

    Returns:
        How many of each were rewritten: ``scatter_nd``, ``int_cumsum``, ``int_topk``,
        ``int_clip``, ``bool_scatter``.
    """
    counts = {"scatter_nd": 0, "int_cumsum": 0, "int_topk": 0, "int_clip": 0, "bool_scatter": 0}
    for node in list(graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "ScatterND" and _scatter_nd_rows(graph, node):
            counts["scatter_nd"] += 1
        elif node.op_type == "CumSum" and _int_cumsum(graph, node):
            counts["int_cumsum"] += 1
        elif node.op_type == "TopK" and _int_topk(graph, node):
            counts["int_topk"] += 1
        elif node.op_type == "Clip" and _int_clip(graph, node):
            counts["int_clip"] += 1
    for node in list(graph):  # after the ScatterND rewrite, which writes ScatterElements
        if node.domain in ("", "ai.onnx") and node.op_type == "ScatterElements" and _bool_scatter(graph, node):
            counts["bool_scatter"] += 1
    return counts


def _prefix(node) -> str:
    """A name for what a rewrite adds: the node's name, or its first output's when it has none."""
    return node.name or f"{node.op_type}_{node.outputs[0].name}"


def _const(graph, name: str, array) -> Any:
    # onnx_ir: heavy, out of this module's import (the server reads it, via export.onnx)
    import onnx_ir as ir

    value = ir.Value(name=name, const_value=ir.tensor(array))
    graph.register_initializer(value)
    return value


def replace_node(graph, node, new_nodes: list, result) -> None:
    """Insert ``new_nodes`` before ``node``, let ``result`` take the place of its first output."""
    # onnx_ir: heavy, out of this module's import (the server reads it, via export.onnx)
    import onnx_ir as ir

    graph.insert_before(node, new_nodes)
    old = node.outputs[0]
    result.shape, result.dtype = old.shape, old.dtype
    name = old.name
    ir.convenience.replace_all_uses_with(old, result, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    result.name = name


def _scatter_nd_rows(graph, node) -> bool:
    """``ScatterND(data (N, ...), indices (R, 1), updates (R, ...), reduction)`` with a reduction
    -> ``ScatterElements(data, Expand(indices, Shape(updates)), updates, axis=0, reduction)``."""
    # onnx_ir: heavy, out of this module's import (the server reads it, via export.onnx)
    import onnx_ir as ir

    reduction = node.attributes.get_string("reduction", "none")
    if reduction == "none" or len(node.inputs) != 3:
        return False
    data, indices, updates = node.inputs
    if data is None or indices is None or updates is None or data.shape is None or indices.shape is None:
        return False
    rank = len(data.shape)
    if len(indices.shape) != 2 or indices.shape[1] != 1 or rank < 2:
        return False
    shape = ir.Node("", "Shape", [updates], name=f"{_prefix(node)}__updates_shape")
    nodes = [shape]
    rows = indices
    if rank > 2:  # (R, 1) -> (R, 1, ..., 1), one axis per data axis
        target = _const(graph, f"{_prefix(node)}__rows_shape", np.array([-1] + [1] * (rank - 1), np.int64))
        reshape = ir.Node("", "Reshape", [indices, target], name=f"{_prefix(node)}__rows")
        nodes.append(reshape)
        rows = reshape.outputs[0]
    expand = ir.Node("", "Expand", [rows, shape.outputs[0]], name=f"{_prefix(node)}__indices")
    nodes.append(expand)
    low = _dtype_name(data) in ("FLOAT16", "BFLOAT16")
    if low:  # reduced in float32: ONNX Runtime's CPU ScatterElements has no fp16 add (and fp32 sums are closer)
        casts = [ir.Node("", "Cast", [v], attributes={"to": ir.AttrInt64("to", ir.DataType.FLOAT)},
                         name=f"{_prefix(node)}__{what}_f32") for v, what in ((data, "data"), (updates, "updates"))]
        nodes += casts
        data, updates = casts[0].outputs[0], casts[1].outputs[0]
    scatter = ir.Node("", "ScatterElements", [data, expand.outputs[0], updates],
                      attributes={"axis": ir.AttrInt64("axis", 0), "reduction": ir.AttrString("reduction", reduction)},
                      name=f"{_prefix(node)}__elements")
    nodes.append(scatter)
    result = scatter.outputs[0]
    if low:
        back = ir.Node("", "Cast", [result], attributes={"to": ir.AttrInt64("to", node.inputs[0].dtype)},
                       name=f"{_prefix(node)}__back")
        nodes.append(back)
        result = back.outputs[0]
    replace_node(graph, node, nodes, result)
    return True


def _dtype_name(value) -> str | None:
    return None if value is None or value.dtype is None else value.dtype.name


def _int_cumsum(graph, node) -> bool:
    """Integer ``CumSum`` -> Cast(float32), ``CumSum``, Cast back (exact: partial sums are counts)."""
    # onnx_ir: heavy, out of this module's import (the server reads it, via export.onnx)
    import onnx_ir as ir

    x, axis = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    kind = _dtype_name(x)
    if kind not in INT_TYPES or axis is None:
        return False
    if x.shape is not None and any(isinstance(d, int) and d >= 2**24 for d in x.shape):
        return False  # a sum that long could pass 2**24: leave it (the check then names it)
    to_float = ir.Node("", "Cast", [x], attributes={"to": ir.AttrInt64("to", ir.DataType.FLOAT)},
                       name=f"{_prefix(node)}__to_float")
    flags = {k: ir.AttrInt64(k, node.attributes.get_int(k, 0)) for k in ("exclusive", "reverse")}
    cumsum = ir.Node("", "CumSum", [to_float.outputs[0], axis], attributes=flags, name=f"{_prefix(node)}__float")
    back = ir.Node("", "Cast", [cumsum.outputs[0]], attributes={"to": ir.AttrInt64("to", x.dtype)},
                   name=f"{_prefix(node)}__to_int")
    replace_node(graph, node, [to_float, cumsum, back], back.outputs[0])
    return True


def _int_topk(graph, node) -> bool:
    """Integer ``TopK`` along an axis of static length n -> TopK on ``x * n + position`` (unique keys)."""
    # onnx_ir: heavy, out of this module's import (the server reads it, via export.onnx)
    import onnx_ir as ir

    x = node.inputs[0]
    if _dtype_name(x) not in INT_TYPES or x.shape is None or len(node.inputs) < 2:
        return False
    rank = len(x.shape)
    axis = node.attributes.get_int("axis", -1) % rank
    n = x.shape[axis]
    if not isinstance(n, int) or n < 1:
        return False
    largest = node.attributes.get_int("largest", 1)
    position = np.arange(n, dtype=np.int64)
    order = (n - 1 - position) if largest else position  # among equal values, the lower index wins
    ties = _const(graph, f"{_prefix(node)}__tie_order", order.reshape([n] + [1] * (rank - 1 - axis)))
    scale = _const(graph, f"{_prefix(node)}__n", np.array(n, np.int64))
    new: list = []
    x64 = x
    if _dtype_name(x) != "INT64":
        cast = ir.Node("", "Cast", [x], attributes={"to": ir.AttrInt64("to", ir.DataType.INT64)},
                       name=f"{_prefix(node)}__i64")
        new.append(cast)
        x64 = cast.outputs[0]
    mul = ir.Node("", "Mul", [x64, scale], name=f"{_prefix(node)}__scaled")
    key = ir.Node("", "Add", [mul.outputs[0], ties], name=f"{_prefix(node)}__keys")
    flags = {"axis": ir.AttrInt64("axis", axis), "largest": ir.AttrInt64("largest", largest),
             "sorted": ir.AttrInt64("sorted", node.attributes.get_int("sorted", 1))}
    topk = ir.Node("", "TopK", [key.outputs[0], node.inputs[1]], attributes=flags, num_outputs=2,
                   name=f"{_prefix(node)}__unique")
    new += [mul, key, topk]
    values, indices = node.outputs
    values_new = None
    if values.uses() or values in graph.outputs:
        gather = ir.Node("", "GatherElements", [x, topk.outputs[1]], attributes={"axis": ir.AttrInt64("axis", axis)},
                         name=f"{_prefix(node)}__values")
        new.append(gather)
        values_new = gather.outputs[0]
    graph.insert_before(node, new)
    for old, result in ((indices, topk.outputs[1]), (values, values_new)):
        if result is None:
            continue
        result.shape, result.dtype = old.shape, old.dtype
        name = old.name
        ir.convenience.replace_all_uses_with(old, result, replace_graph_outputs=True)
        result.name = name
    graph.remove(node, safe=True)
    return True


def _int_clip(graph, node) -> bool:
    """Integer ``Clip(x, lo, hi)`` -> ``Min(Max(x, lo), hi)`` (an absent bound is skipped)."""
    # onnx_ir: heavy, out of this module's import (the server reads it, via export.onnx)
    import onnx_ir as ir

    x = node.inputs[0]
    if _dtype_name(x) not in INT_TYPES:
        return False
    bounds = list(node.inputs[1:]) + [None] * (3 - len(node.inputs))
    new, result = [], x
    for op, bound in (("Max", bounds[0]), ("Min", bounds[1])):
        if bound is not None:
            step = ir.Node("", op, [result, bound], name=f"{_prefix(node)}__{op.lower()}")
            new.append(step)
            result = step.outputs[0]
    if not new:  # no bounds: an identity
        new = [ir.Node("", "Identity", [x], name=f"{_prefix(node)}__identity")]
        result = new[0].outputs[0]
    replace_node(graph, node, new, result)
    return True


def _bool_scatter(graph, node) -> bool:
    """``ScatterElements`` on BOOL data -> the same on INT32, cast back to BOOL."""
    # onnx_ir: heavy, out of this module's import (the server reads it, via export.onnx)
    import onnx_ir as ir

    if len(node.inputs) != 3 or _dtype_name(node.inputs[0]) != "BOOL":
        return False
    data, indices, updates = node.inputs
    as_int = [ir.Node("", "Cast", [v], attributes={"to": ir.AttrInt64("to", ir.DataType.INT32)},
                      name=f"{_prefix(node)}__{what}_i32") for v, what in ((data, "data"), (updates, "updates"))]
    reduction = node.attributes.get_string("reduction", "none")
    scatter = ir.Node("", "ScatterElements", [as_int[0].outputs[0], indices, as_int[1].outputs[0]],
                      attributes={"axis": ir.AttrInt64("axis", node.attributes.get_int("axis", 0)),
                                  "reduction": ir.AttrString("reduction", reduction)},
                      name=f"{_prefix(node)}__i32")
    back = ir.Node("", "Cast", [scatter.outputs[0]], attributes={"to": ir.AttrInt64("to", ir.DataType.BOOL)},
                   name=f"{_prefix(node)}__bool")
    replace_node(graph, node, [*as_int, scatter, back], back.outputs[0])
    return True


# ------------------------------------------------------------------ the check (onnx, before a build)


def tensorrt_problems(path: str | Path) -> list[str]:
    """What TensorRT 10's ONNX parser would refuse in the graph at ``path``, one line per node
    (empty: nothing known). Reads the graph without its weights; types come from ONNX shape
    inference. Known from onnx-tensorrt 10.0..10.15: ops it does not import (``UNSUPPORTED_OPS``,
    other domains), ``ScatterND`` with a reduction, ``CumSum`` on anything but FP32/FP16/BF16,
    ``TopK`` unsorted or with a constant K of 3840 or more."""
    # onnx: heavy, out of this module's import (the server reads it, via export.onnx)
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - types are a bonus; op and attribute checks still run
        pass
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.input,
                                                             *model.graph.output]}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    constants = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t
    problems = []

    def type_name(name: str) -> str:
        return onnx.TensorProto.DataType.Name(types.get(name, 0))

    def attr(node, name, default):
        for a in node.attribute:
            if a.name == name:
                return onnx.helper.get_attribute_value(a)
        return default

    def walk(nodes) -> None:
        for node in nodes:
            where = f"{node.op_type} node {node.name or node.output[0]!r}"
            for a in node.attribute:  # subgraphs (If, Loop) are imported node by node
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g.node)
            if node.domain not in ("", "ai.onnx"):
                problems.append(f"{where}: domain {node.domain!r} (TensorRT imports the default ONNX domain only)")
            elif node.op_type in UNSUPPORTED_OPS:
                problems.append(f"{where}: not imported by TensorRT 10's ONNX parser")
            elif node.op_type == "ScatterND" and attr(node, "reduction", b"none") not in (b"none", "none"):
                problems.append(f"{where}: ScatterND with reduction is not supported (write ScatterElements)")
            elif (allowed := INPUT_TYPES.get(node.op_type)) and node.input:
                data = node.input[1] if node.op_type == "Where" and len(node.input) > 1 else node.input[0]
                kind = type_name(data)
                if kind != "UNDEFINED" and kind not in allowed:
                    problems.append(f"{where}: {node.op_type} on {kind} (TensorRT 10: {', '.join(allowed)})")
            if node.op_type == "TopK":
                if attr(node, "sorted", 1) != 1:
                    problems.append(f"{where}: TopK must be sorted for TensorRT")
                k = constants.get(node.input[1]) if len(node.input) > 1 else None
                if k is not None and int(onnx.numpy_helper.to_array(k).max()) >= TOPK_MAX_K:
                    problems.append(f"{where}: K >= {TOPK_MAX_K} (TensorRT's TopK limit)")

    walk(model.graph.node)
    for fn in model.functions:
        walk(fn.node)
    return problems


def tensorrt_plugins(path: str | Path) -> list[str]:
    """TensorRT standard plugins the graph at ``path`` needs (``ScatterElements`` with a reduction)."""
    # onnx: heavy, out of this module's import (the server reads it, via export.onnx)
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    needed = set()
    for node in model.graph.node:
        if node.op_type == "ScatterElements" and any(
                a.name == "reduction" and onnx.helper.get_attribute_value(a) not in (b"none", "none")
                for a in node.attribute):
            needed.add("ScatterElements")
    return sorted(needed)
