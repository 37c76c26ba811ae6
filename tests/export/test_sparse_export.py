"""Sparse V-MoE packages exported as the server exports them: fused, checked, verified.

The golden tiny models of ``shared/golden/vmoe-sparse`` (Tokens Choice E8 K2, Tokens Choice E4 K1
with batch priority, Experts Choice E4; 17 tokens per image) at capacity factors 1.05 and 4.0, as
packages, exported by ``server.backends.onnxruntime_backend.exported_files`` (the server's own
path: ``export_onnx`` under ``export.cache``, published only once ONNX Runtime has verified every
graph against PyTorch), plain and routing graphs. Checked:

* no ``Einsum`` or ``OneHot`` node, and no tokens x experts x capacity tensor. The criterion, run
  on every intermediate value ONNX Runtime computes for a batch of 3: no value has three distinct
  axes of sizes (tokens, E, C), where tokens is S, K*S, B*S or B*K*S (S the tokens of one image).
  Values the exporter made inside self-attention (its node metadata names the module) are not
  counted: their (B, heads, S, S) scores match by size alone where heads = E and C = S (Experts
  Choice E4 at cf 4.0). vmoe's einsum form, exported for the benchmarks
  (``sparse_dispatch="einsum"``), has such values (its (G, S, E, C) dispatch and combine tensors):
  the criterion finds them there, so it can;
* every export verified (the cache's builder logs a line per output and batch, each ``ok``); where
  a sparse graph routes a near-tie the other way than PyTorch (float-level gates, measured on a
  random ec-s16-e128), verification compares with PyTorch routed on the graph's own gates
  (``export.sparse_verify``): a swapped pick at an expert's capacity passes, gates off PyTorch's or
  another decision rule still fail;
* outputs equal PyTorch's (fp32: the export tolerance, 1e-4) at batch sizes 1, 2, 3 and 8, the
  routing decisions (dropped choices, expert loads) exactly; an image's rows are bitwise the same
  whatever its 7 batch-mates are, and its routing the same alone as among them.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MODELS = ["vmoe_tc_e8k2", "vmoe_tc_bpr_e4k1", "vmoe_ec_e4"]
CFS = ["1.05", "4.0"]
TOL = 1e-4  # export.onnx.tolerance("fp32", ...)
EXACT = ("dropped", "expert_load", "dropped_choices")  # routing decisions: counts, equal exactly


def _golden_module():
    """tests/models/test_sparse_golden.py, which builds our torch model from a golden npz."""
    spec = importlib.util.spec_from_file_location("_sparse_golden_models", ROOT / "tests/models/test_sparse_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sparse_package(root: Path, name: str, cf: str) -> tuple[Path, np.ndarray]:
    """The golden model ``name`` at capacity factor ``cf`` as a package; and its 8 golden images (NCHW)."""
    from softmoe_models.package import save_package

    golden = _golden_module()
    data, _, model = golden._model(name, cf)
    pkg = save_package(model, model.cfg, root / f"{name}-cf{cf}", labels=[str(i) for i in range(model.cfg.num_classes)])
    return pkg, data["inputs/images"].transpose(0, 3, 1, 2).copy()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """Every golden model and capacity factor through the server's export cache (in this process:
    the child interpreter the server uses for big weights only moves the same call)."""
    from server.backends import onnxruntime_backend as ort_backend

    root = tmp_path_factory.mktemp("sparse-export")
    handler, logger = _Lines(), logging.getLogger("softmoe.export")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    out = {}
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ort_backend, "EXPORT_IN_CHILD_BYTES", 1 << 62)
            for name, cf in itertools.product(MODELS, CFS):
                pkg, images = sparse_package(root, name, cf)
                start = len(handler.lines)
                (plain,) = ort_backend.exported_files(pkg, str(root / "cache"), "fp32", log=lambda m: None)
                routing = ort_backend.routing_sibling(plain)
                out[(name, cf)] = {"package": pkg, "images": images, "plain": plain, "routing": routing,
                                   "verify": handler.lines[start:]}
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return out


CASES = [pytest.param(name, cf, id=f"{name}-cf{cf}") for name, cf in itertools.product(MODELS, CFS)]


# ------------------------------------------------------------------ the criterion


ATTENTION = "softmoe_models.layers.Attention"  # in a node's pkg.torch.onnx.class_hierarchy


def intermediates(path: Path, feeds: dict[str, np.ndarray], weights: Path) -> dict[str, np.ndarray]:
    """Every value the graph at ``path`` computes (node outputs) outside self-attention, run by
    ONNX Runtime on ``feeds``; ``weights``: the package's weights file a cached graph reads."""
    import onnx
    import onnxruntime as ort
    from export.weights_file import write_standalone

    with tempfile.TemporaryDirectory() as tmp:  # the graph with its data, for a session of a changed copy
        model = onnx.load(str(write_standalone(path, weights, Path(tmp) / path.name)))
    known = {o.name for o in model.graph.output}
    for node in model.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        if ATTENTION in meta.get("pkg.torch.onnx.class_hierarchy", ""):
            continue
        for name in node.output:
            if name and name not in known:
                model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
                known.add(name)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the graph as written
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def tokens_experts_capacity(shape: tuple[int, ...], tokens: set[int], experts: int, capacity: int) -> bool:
    """Whether ``shape`` has three distinct axes sized (one of ``tokens``, E, C)."""
    for i, j, k in itertools.permutations(range(len(shape)), 3):
        if shape[i] in tokens and shape[j] == experts and shape[k] == capacity:
            return True
    return False


def routing_sizes(package: Path, batch: int) -> tuple[set[int], int, list[int]]:
    """Token axis sizes (S, K*S, B*S, B*K*S), E and each MoE layer's C (one-image groups)."""
    from softmoe_models.package import read_package

    cfg = read_package(package).config
    moe, s = cfg.encoder.moe, cfg.num_tokens
    k = moe.k if moe.router == "tokens-choice" else 1
    return {s, k * s, batch * s, batch * k * s}, moe.num_experts, [moe.capacity(s)]


def offending(path: Path, package: Path, batch: int = 3) -> list[tuple[str, tuple[int, ...]]]:
    tokens, experts, capacities = routing_sizes(package, batch)
    x = np.random.default_rng(batch).uniform(-1, 1, (batch, 3, 32, 32)).astype(np.float32)
    return [(name, v.shape) for name, v in intermediates(path, {"pixel_values": x}, package / "model.safetensors").items()
            if any(tokens_experts_capacity(v.shape, tokens, experts, c) for c in capacities)]


@pytest.mark.parametrize("name, cf", CASES)
def test_fused_graphs_hold_no_einsum_and_no_tokens_experts_capacity_tensor(exported, name, cf):
    from export.onnx import op_inventory, read_metadata

    e = exported[(name, cf)]
    for graph in ("plain", "routing"):
        path = e[graph]
        ops = op_inventory(path)
        assert "Einsum" not in ops and "OneHot" not in ops, (graph, ops)
        assert read_metadata(path)["sparse_dispatch"] == "fused"
        assert offending(path, e["package"]) == [], graph


def test_the_criterion_finds_the_einsum_forms_tensors(exported, tmp_path):
    """vmoe's einsum form, exported for the benchmarks only, holds (G, S, E, C) tensors: found."""
    from export.onnx import export_onnx, op_inventory, read_metadata

    for name in MODELS:
        pkg = exported[(name, "1.05")]["package"]
        lines: list[str] = []
        files = export_onnx(pkg, tmp_path / f"{name}.onnx", sparse_dispatch="einsum", log=lines.append)
        (f,) = files
        assert op_inventory(f.path).get("Einsum", 0) >= 2 and read_metadata(f.path)["sparse_dispatch"] == "einsum"
        # 2 outputs x batches 1, 4, and each image of batch 4 among other batch-mates
        assert [v for v in f.verification if not v.ok] == [] and len(f.verification) == 6
        found = offending(f.path, pkg)
        assert found, name
        _, e, (c,) = routing_sizes(pkg, 3)
        assert all(e in shape and c in shape for _, shape in found)


def test_einsum_form_is_for_sparse_packages_only(exported, tmp_path):
    from conftest import GOLDEN
    from export.errors import ExportError
    from export.onnx import export_onnx
    from softmoe_models.convert import convert_checkpoint

    soft, _ = convert_checkpoint(GOLDEN / "softmoe_e4p2.npz", tmp_path / "soft")
    with pytest.raises(ExportError, match="sparse V-MoE packages"):
        export_onnx(soft, tmp_path / "s.onnx", sparse_dispatch="einsum", log=lambda *a: None)
    with pytest.raises(ExportError, match="unknown sparse dispatch"):
        export_onnx(exported[("vmoe_ec_e4", "4.0")]["package"], tmp_path / "e.onnx", sparse_dispatch="loop",
                    log=lambda *a: None)


# ------------------------------------------------------------------ verified, equal to torch


@pytest.mark.parametrize("name, cf", CASES)
def test_every_graph_was_verified_before_the_cache_published_it(exported, name, cf):
    from export import cache

    e = exported[(name, cf)]
    lines = [line for line in e["verify"] if line.startswith("verify ")]
    # plain: logits, pre_logits; routing: those and the routing outputs; batches 1 and 4 each
    assert lines and all(line.endswith(" ok") for line in lines), lines
    for output in ("logits", "pre_logits", "combine_weights", "dropped", "expert_load"):
        for batch in (1, 4):
            assert any(line.startswith(f"verify {output} batch {batch}:") for line in lines), (output, batch)
    entry = e["plain"].parent
    assert cache.lookup(entry.parent, entry.name) is not None  # published whole, hash-checked


def _torch_graphs(package: Path) -> dict:
    from export.graphs import graphs_for
    from softmoe_models.package import load_model

    return graphs_for(load_model(package), torch.float32)


def _run_torch(graph, x: np.ndarray) -> dict[str, np.ndarray]:
    with torch.no_grad():
        out = graph.module(torch.from_numpy(x))
    out = out if isinstance(out, tuple) else (out,)
    return {k: v.numpy() for k, v in zip(graph.outputs, out)}


@pytest.mark.parametrize("name, cf", CASES)
def test_outputs_equal_torch_at_several_batch_sizes_and_per_image(exported, name, cf):
    from export.runtime import ort_session

    e = exported[(name, cf)]
    graphs = _torch_graphs(e["package"])
    golden = e["images"]  # (8, 3, 32, 32)
    others = np.random.default_rng(7).uniform(-1, 1, golden.shape).astype(np.float32)
    for role, path in (("classifier", e["plain"]), ("routing", e["routing"])):
        session = ort_session(path, weights=e["package"] / "model.safetensors")
        names = [o.name for o in session.get_outputs()]

        def run(x: np.ndarray) -> dict[str, np.ndarray]:
            return dict(zip(names, session.run(names, {"pixel_values": x})))

        full = run(golden)
        for batch in (1, 2, 3, 8):
            x = golden[:batch]
            got, want = run(x), _run_torch(graphs[role], x)
            for k in names:
                if k in EXACT:
                    assert np.array_equal(got[k], want[k]), (role, k, batch)
                else:
                    assert float(np.abs(got[k] - want[k]).max()) <= TOL, (role, k, batch)
                    assert float(np.abs(got[k] - full[k][:batch]).max()) <= TOL, (role, k, batch)
        for i in range(8):  # image i alone: the same routing, outputs within float noise
            alone = run(golden[i:i + 1])
            for k in names:
                if k in EXACT:
                    assert np.array_equal(alone[k][0], full[k][i]), (role, k, i)
                else:
                    assert float(np.abs(alone[k][0] - full[k][i]).max()) <= 1e-5, (role, k, i)
        mixed = others.copy()
        mixed[0] = golden[0]  # image 0 among 7 other images, same batch shape: bitwise the same rows
        among = run(mixed)
        for k in names:
            assert np.array_equal(among[k][0], full[k][0]), (role, k)


# ------------------------------------------------------------------ a near-tie routed the other way


def _swap_at_capacity(monkeypatch):
    """PyTorch's Experts Choice, in the first image, gives one expert's pick of token 0 (the CLS
    token, which alone reaches the logits from this last block) to the expert's next candidate:
    what a float-level difference does at a near-tie. The gates stay as computed."""
    from softmoe_models.sparse_moe import ExpertsChoice, SparseMoE

    real = SparseMoE.route

    def route(self, x):
        gates, r = real(self, x)
        expert, slot = (int(i) for i in (r.token[0] == 0).nonzero()[0])  # an expert that took the CLS token
        nxt = gates[0, :, expert].argsort(descending=True, stable=True)[r.capacity]
        token, gate = r.token.clone(), r.gate.clone()
        token[0, expert, slot], gate[0, expert, slot] = nxt, gates[0, nxt, expert]
        return gates, ExpertsChoice(token, gate, r.capacity)

    monkeypatch.setattr(SparseMoE, "route", route)


def _verify(e):
    """export.onnx.verify of the plain graph, against the (patched) PyTorch model."""
    from export.onnx import verify

    graphs = _torch_graphs(e["package"])
    return verify(e["plain"], graphs["classifier"], graphs["classifier"], "fp32", (1, 4), 2,
                  weights=e["package"] / "model.safetensors")


def test_a_near_tie_routed_the_other_way_passes_on_the_graphs_gates(exported, monkeypatch):
    e = exported[("vmoe_ec_e4", "1.05")]
    _swap_at_capacity(monkeypatch)
    results = _verify(e)
    second = [v for v in results if v.own_routing_err is not None]
    assert second and all(v.ok for v in results), [v.line() for v in results]
    assert any(v.own_routing_err > v.tol for v in second)  # PyTorch's own routing was off the graph
    assert all(v.gate_err <= 1e-6 and v.max_abs_err <= 1e-5 for v in second)
    assert "a near-tie routed the other way" in second[0].line() and second[0].line().endswith(" ok")


def test_gates_off_pytorchs_still_fail(exported, monkeypatch):
    """A graph whose router is wrong: the graph's gates half of PyTorch's."""
    from softmoe_models.sparse_moe import SparseMoE, experts_choice

    real = SparseMoE.route

    def route(self, x):
        gates, r = real(self, x)
        return 2 * gates, experts_choice(2 * gates, r.capacity)  # the same choices, twice the weights

    monkeypatch.setattr(SparseMoE, "route", route)
    results = _verify(exported[("vmoe_ec_e4", "1.05")])
    failed = [v for v in results if not v.ok]
    assert failed and all(v.gate_err is not None and v.gate_err > v.gate_tol for v in failed)
    assert failed[0].line().endswith("FAILED")


def test_a_graph_deciding_otherwise_from_its_own_gates_still_fails(exported, monkeypatch):
    """PyTorch's decision rule differs from the graph's: routed on the graph's gates, the outputs still differ."""
    import softmoe_models.sparse_moe as sparse_moe

    real = sparse_moe.experts_choice

    def other_rule(gates, capacity):
        r = real(gates, capacity)
        token = r.token.clone()
        token[:, :, -1] = (token[:, :, -1] + 1) % gates.shape[1]  # each expert's last pick: the next token
        return sparse_moe.ExpertsChoice(token, r.gate, capacity)

    monkeypatch.setattr(sparse_moe, "experts_choice", other_rule)
    results = _verify(exported[("vmoe_ec_e4", "1.05")])
    failed = [v for v in results if not v.ok]
    assert failed and all(v.own_routing_err is not None and v.gate_err <= v.gate_tol for v in failed)


def test_the_batch_mates_check_can_fail():
    """``export.onnx`` runs each image of a sparse graph's largest verify batch among other random
    batch-mates and wants the same bits: an output that mixes the batch is refused, one row-wise
    passes."""
    from export.graphs import Graph, TensorSpec, example_inputs
    from export.onnx import among_other_mates

    class Session:
        def __init__(self, mixes: bool) -> None:
            self.mixes = mixes

        def run(self, names, feeds):
            x = feeds["pixel_values"]
            rows = x.reshape(len(x), -1).sum(1, keepdims=True)
            return [rows + (x.sum() if self.mixes else 0)]

    graph = Graph("classifier", None, [TensorSpec("pixel_values", ("batch", 3, 4, 4), torch.float32)], ["logits"])
    feeds = example_inputs(graph, 4, seed=4)
    for mixes in (True, False):
        session = Session(mixes)
        outs = session.run(None, {k: v.numpy() for k, v in feeds.items()})
        (v,) = among_other_mates(session, graph, feeds, outs, 2)
        assert v.ok is not mixes and v.tol == 0.0 and "among other batch-mates" in v.output
