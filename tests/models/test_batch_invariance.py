"""Batch invariance on whatever x86-64 CPU runs the suite.

Which padded shapes give an image the bits of the full shape is a property of the CPU's kernels,
not of our code: with the batch-invariant forms (softmoe_models/batch_invariance.py), torch on an
AVX-512 machine gives shapes 1, 2 and 4 the bits of 8, and on an AVX2 machine (or with
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2) shapes 1 and 3 differ.
So no test here expects one machine's table. The server proves at start-up which shapes hold on
the machine it runs on (server.engine.proofs.prove_shapes), and these tests hold it to what it promises:

* every shape it accepts gives every row the bits of the full shape, on rows the proof never saw;
* a shape whose bits differ is refused, and a refused shape never carries a call;
* the full shape is always accepted.

What the forms buy on a given machine (the shapes each form proves, and what they cost) is a
benchmark figure: ``python -m loadtests.invariance_bench``.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from server.backends.torch_backend import TorchBackend
from server.batching.batcher import Batcher, ModelQueue
from server.engine.proofs import candidate_shapes, prove_shapes, random_rows
from server.engine.models import load_served_model
from server.settings import Settings
from softmoe_models.batch_invariance import set_batch_invariant

FULL = 8


def _quiet(*_a, **_k) -> None:
    pass


def _served(packages, name: str, **settings):
    settings = {"backend": "torch", "max_batch_size": FULL, **settings}
    return load_served_model(f"{name}={packages[name]}", Settings(**settings), log=_quiet)


def _chunks_equal(model, fn: str, rows: dict[str, np.ndarray], reference: dict[str, np.ndarray], size: int) -> bool:
    """Whether the rows, run ``size`` at a time (the last call zero-padded, as the batcher pads),
    give every row the reference's bits."""
    for start in range(0, FULL, size):
        part = {}
        for k, v in rows.items():
            part[k] = np.zeros((size, *v.shape[1:]), v.dtype)
            part[k][:len(v[start:start + size])] = v[start:start + size]
        out = model.backend.run(fn, part)
        n = min(size, FULL - start)
        if any(not np.array_equal(out[k][:n], reference[k][start:start + n]) for k in reference):
            return False
    return True


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("name", ["golden", "tt"])
def test_accepted_shapes_give_the_bits_of_the_full_shape(packages, tmp_path, name, backend):
    model = _served(packages, name, backend=backend, cache_dir=str(tmp_path))
    proven = prove_shapes(model, FULL, log=_quiet)
    assert set(proven) == set(model.backend.functions)
    rng = np.random.default_rng(7)  # not the proof's rows (seed 0)
    for fn, shapes in proven.items():
        assert shapes[-1] == FULL and list(shapes) == sorted(set(shapes)), (fn, shapes)
        assert set(shapes) <= {*candidate_shapes(FULL), FULL}, (fn, shapes)
        rows = random_rows(model.backend.functions[fn], FULL, rng, model.vocab_size)
        reference = model.backend.run(fn, rows)
        for size in shapes:
            assert _chunks_equal(model, fn, rows, reference, size), f"{fn}: shape {size} was proven but differs"


def test_a_shape_whose_bits_differ_is_refused_and_never_carries_a_call(packages):
    """The backend nudges every output of a 2-row call by one ulp: the proof refuses 2, and two
    requests queued together run at a proven shape and get the full shape's bits."""
    model = _served(packages, "golden")
    backend, real_run, seen = model.backend, model.backend.run, []

    def nudged(fn, rows):
        out = real_run(fn, rows)
        n = len(next(iter(rows.values())))
        seen.append(n)
        return {k: np.nextafter(v, np.inf) for k, v in out.items()} if n == 2 else out

    backend.run = nudged
    queue = model.queues["classify"] = ModelQueue(
        "golden/classify", "golden", lambda rows: backend.run("classify", rows), max_batch_size=FULL,
        max_delay_s=0.05, max_queue=64, pad=True)
    shapes = prove_shapes(model, FULL, log=_quiet)["classify"]
    assert 2 not in shapes and queue.shapes == shapes and shapes[-1] == FULL
    assert all(queue.shape_for(n) in shapes and queue.shape_for(n) >= n for n in range(1, FULL + 1))

    rows = random_rows(backend.functions["classify"], FULL, np.random.default_rng(3), None)
    reference = real_run("classify", rows)
    seen.clear()
    batcher = Batcher("cpu", None)
    batcher.add_queue(queue)

    async def two_together():
        futs = [batcher.submit(queue, {k: v[i] for k, v in rows.items()}, 30) for i in range(2)]
        batcher.start()
        return await asyncio.wait_for(asyncio.gather(*futs), 60)

    try:
        results = asyncio.run(two_together())
    finally:
        batcher.stop(timeout=10)
    assert seen == [queue.shape_for(2)] and 2 not in seen
    for i, r in enumerate(results):
        for k, v in r.outputs.items():
            assert np.array_equal(v, reference[k][i]), k


@pytest.mark.parametrize("name", ["golden", "tt"])
def test_forms_agree_with_the_stock_layers(packages, name):
    plain = TorchBackend(packages[name], max_batch_size=FULL)
    inv = TorchBackend(packages[name], max_batch_size=FULL, batch_invariant=True)
    rng = np.random.default_rng(2)
    for fn, spec in plain.functions.items():
        rows = random_rows(spec, 5, rng, 2)
        a, b = plain.run(fn, rows), inv.run(fn, rows)
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-5, err_msg=f"{fn}/{k}")


def test_switching_off_restores_the_stock_forward(packages):
    from softmoe_models.package import load_model

    model = load_model(packages["golden"])
    spec = TorchBackend(packages["golden"]).functions["classify"]
    x = torch.from_numpy(random_rows(spec, 1, np.random.default_rng(3), None)["pixel_values"])
    with torch.inference_mode():
        before = model(x)
        set_batch_invariant(model, True)
        assert model.patch_form == "matmul" and "forward" in model.head.__dict__
        set_batch_invariant(model, False)
        assert model.patch_form == "conv" and "forward" not in model.head.__dict__
        assert torch.equal(model(x), before)


def test_strict_serving_on_cpu_runs_the_invariant_forms(packages):
    """Strict mode serves torch on CPU in the batch-invariant forms; loose mode keeps the stock
    forms (the faster unpadded batch of one)."""
    assert _served(packages, "golden").backend.batch_invariant
    assert not _served(packages, "golden", strict_determinism=False).backend.batch_invariant
