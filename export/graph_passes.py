"""The rewrites an exported graph goes through before it is written (``export.onnx.export_one``).

``tidy`` stands where the exporter's own optimisation would (``torch.onnx.export(optimize=True)``,
onnxscript's ``optimize_ir``): it keeps that pass's constant folding, dead-node removal, constant
lifting, deduplication and naming, and leaves out its pattern rewriter (``RewritePass`` with the
default rules: Cast/Reshape/Transpose/Clip simplifications that ONNX Runtime's own graph
optimiser also makes). That rewriter matches every rule against every node on each of its passes,
which on a graph of hundreds of experts was most of an export (docs/benchmarks.md, coldstart).

``fold_constant_gathers`` and ``token_means_as_matmuls`` change what the graph computes in ways
the serving needs (prepackable expert weights; batch-invariant token means). ``only_outputs``
cuts an image model's plain graph out of its routing graph instead of tracing the model twice.

The server never imports this module: onnx_ir and onnxscript load with it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript import optimizer

from .op_support import replace_node


def tidy(model: ir.Model) -> None:
    """``model`` folded and cleaned in place as onnxscript's ``optimize_ir`` does (two rounds of
    constant folding and dead-code removal, then every constant lifted to an initializer,
    duplicates merged, common subexpressions shared, names fixed), without its rewrite rules."""
    optimizer.inline(model)
    for _ in range(2):
        folded = optimizer.fold_constants(model, onnx_shape_inference=True)
        removed = common_passes.RemoveUnusedNodesPass()(model)
        common_passes.RemoveUnusedFunctionsPass()(model)
        common_passes.RemoveUnusedOpsetsPass()(model)
        if not (folded.modified or removed.modified):
            break
    ir.passes.Sequential(
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    )(model)


def fold_constant_gathers(graph) -> int:
    """Replace ``Gather(initializer, constant index)`` by a sliced initializer.

    The per-expert form indexes the stacked ``(n, d, M)`` expert weights; left as Gathers, ONNX
    Runtime folds them at session creation, which took minutes for a 128-expert model and kept
    the stacked copy too. Sliced here, each expert is one 2-D constant that ONNX Runtime prepacks.
    """
    count = 0
    for node in list(graph):
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        data, index = node.inputs
        if data is None or index is None or not data.is_initializer() or index.const_value is None:
            continue
        axis = node.attributes.get_int("axis", 0)
        sliced = np.take(data.const_value.numpy(), index.const_value.numpy(), axis=axis)
        out = node.outputs[0]
        value = ir.Value(name=f"{data.name}__{'_'.join(map(str, np.atleast_1d(index.const_value.numpy())))}",
                         const_value=ir.tensor(np.ascontiguousarray(sliced)))
        graph.register_initializer(value)
        ir.convenience.replace_all_uses_with(out, value)
        graph.remove(node, safe=True)
        count += 1
    if count:
        for name, init in list(graph.initializers.items()):
            if not init.uses() and init not in graph.outputs:
                del graph.initializers[name]
    return count


def token_means_as_matmuls(graph) -> int:
    """Replace each fp32 ``ReduceMean`` over the token axis of a ``(batch, T, D)`` tensor (the
    ``gap`` pooling of the image and text towers) by ``MatMul`` with a constant ``(1, T)`` row of
    ``1/T``, then ``Squeeze``.

    Why: ONNX Runtime's CPU reduction merges the unit batch axis away, so at batch 1 it sums the
    tokens in another order than at any larger batch, and a lone image's pooled features differed
    in the last bit from the same image among batch-mates; strict determinism then could not run
    a lone request at batch shape 1 (``server.engine.proofs.prove_shapes`` refused it). A MatMul whose
    constant row is broadcast over the batch runs one identical GEMM per sequence whatever the
    batch. The result differs from the mean by rounding only (within every export tolerance;
    ``verify`` still checks it against PyTorch).
    """
    count = 0
    for node in list(graph):
        if node.op_type != "ReduceMean" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        x, axes = node.inputs
        if x is None or axes is None or axes.const_value is None or x.dtype != ir.DataType.FLOAT:
            continue
        shape = x.shape
        if shape is None or len(shape) != 3 or not isinstance(shape[1], int):
            continue
        if [int(a) % 3 for a in np.atleast_1d(axes.const_value.numpy())] != [1]:
            continue
        tokens, keepdims = shape[1], node.attributes.get_int("keepdims", 1)
        row = ir.Value(name=f"{node.name}__mean_row", const_value=ir.tensor(np.full((1, tokens), 1.0 / tokens, np.float32)))
        graph.register_initializer(row)
        matmul = ir.Node("", "MatMul", [row, x], name=f"{node.name}__matmul")
        new_nodes, result = [matmul], matmul.outputs[0]
        if not keepdims:
            axis = ir.Value(name=f"{node.name}__axis", const_value=ir.tensor(np.array([1], np.int64)))
            graph.register_initializer(axis)
            squeeze = ir.Node("", "Squeeze", [result, axis], name=f"{node.name}__squeeze")
            new_nodes.append(squeeze)
            result = squeeze.outputs[0]
        replace_node(graph, node, new_nodes, result)
        count += 1
    return count


def only_outputs(source: Path, out: Path, outputs: list[str], name: str, metadata: dict[str, str]) -> None:
    """The graph at ``source`` cut down to ``outputs`` (its first ones) and written to ``out`` beside
    it: the nodes, initializers and shape records those outputs need, nothing else; ``name`` the
    graph's name, ``metadata`` its metadata. External data stays where ``source`` points (the same
    relative file, read by both), so ``out`` must lie in ``source``'s directory.

    An image model's plain graph is its routing graph (``graphs.RoutingGraph``: the same forward
    pass with the routing kept as more outputs) without those outputs: cut from it, the plain graph
    costs no second trace of the model, and its nodes are the routing graph's, which the export
    verified."""
    model = onnx.load(str(source), load_external_data=False)
    graph = model.graph
    have = [o.name for o in graph.output]
    if have[:len(outputs)] != list(outputs):
        raise ValueError(f"{source}: outputs {have} do not start with {outputs}")
    needed = set(outputs)
    kept = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(_inputs_of(node))
    kept.reverse()
    keep_outputs = [o for o in graph.output if o.name in set(outputs)]
    keep_inits = [t for t in graph.initializer if t.name in needed]
    keep_info = [v for v in graph.value_info if v.name in needed]
    for field_, items in (("node", kept), ("output", keep_outputs), ("initializer", keep_inits),
                          ("value_info", keep_info)):
        copies = [type(x)() for x in items]
        for c, x in zip(copies, items):
            c.CopyFrom(x)
        graph.ClearField(field_)
        getattr(graph, field_).extend(copies)
    graph.name = name
    del model.metadata_props[:]
    for key, value in metadata.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save_model(model, str(out))


def _inputs_of(node) -> set[str]:
    """The names ``node`` reads, those its subgraphs (If, Loop, Scan) read from outside included."""
    names = {i for i in node.input if i}
    for attr in node.attribute:
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else
                    list(attr.graphs) if attr.type == onnx.AttributeProto.GRAPHS else []):
            for inner in sub.node:
                names |= _inputs_of(inner)
    return names
