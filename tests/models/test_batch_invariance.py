"""The batch-invariant forms (softmoe_models/batch_invariance.py): on this CPU an image's outputs
are the same bits at every batch size and slot, within tolerance of the stock layers, and the
forms switch back off for exports. The server then proves padded shapes 1 and 2 with torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server.backends.torch_backend import TorchBackend
from softmoe_models.batch_invariance import set_batch_invariant


def _rows(spec, n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {s.name: rng.integers(0, 2, (n, *s.shape)).astype(s.dtype) if s.dtype.kind == "i"
            else rng.uniform(-1, 1, (n, *s.shape)).astype(s.dtype) for s in spec.inputs}


def _every_shape_equal(backend, fn: str, n: int = 8) -> dict[int, bool]:
    spec = backend.routing if fn == "routing" else backend.functions[fn]
    rows = _rows(spec, n, seed=1)
    ref = backend.run(fn, rows)
    result = {}
    for size in (1, 2, 3, 4):
        same = True
        for start in range(0, n, size):
            part = {k: np.zeros((size, *v.shape[1:]), v.dtype) for k, v in rows.items()}
            got = min(size, n - start)
            for k, v in rows.items():
                part[k][:got] = v[start:start + got]
            out = backend.run(fn, part)
            same &= all(np.array_equal(out[k][:got], ref[k][start:start + got]) for k in ref)
        result[size] = bool(same)
    return result


@pytest.mark.parametrize("name", ["golden", "tt"])
def test_every_batch_size_gives_the_same_bits(packages, name):
    backend = TorchBackend(packages[name], max_batch_size=8, batch_invariant=True)
    for fn in [*backend.functions, "routing"]:
        assert _every_shape_equal(backend, fn) == {1: True, 2: True, 3: True, 4: True}, fn
    assert backend.describe()["batch_invariant"] is True


def test_stock_layers_differ_by_batch_size(packages):
    """Why the forms exist: without them, batches of 1 and 2 are not the bits of a batch of 8 here
    (if a torch upgrade made them equal, the forms could go: this test says so)."""
    backend = TorchBackend(packages["golden"], max_batch_size=8)
    shapes = _every_shape_equal(backend, "classify")
    assert shapes[4] and not (shapes[1] and shapes[2]), shapes


@pytest.mark.parametrize("name", ["golden", "tt"])
def test_forms_agree_with_the_stock_layers(packages, name):
    plain = TorchBackend(packages[name], max_batch_size=8)
    inv = TorchBackend(packages[name], max_batch_size=8, batch_invariant=True)
    for fn, spec in plain.functions.items():
        rows = _rows(spec, 5, seed=2)
        a, b = plain.run(fn, rows), inv.run(fn, rows)
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-5, err_msg=f"{fn}/{k}")


def test_switching_off_restores_the_stock_forward(packages):
    from softmoe_models.package import load_model

    model = load_model(packages["golden"])
    x = torch.from_numpy(_rows(TorchBackend(packages["golden"]).functions["classify"], 1, 3)["pixel_values"])
    with torch.inference_mode():
        before = model(x)
        set_batch_invariant(model, True)
        assert model.patch_form == "matmul" and "forward" in model.head.__dict__
        set_batch_invariant(model, False)
        assert model.patch_form == "conv" and "forward" not in model.head.__dict__
        assert torch.equal(model(x), before)


def test_strict_serving_on_cpu_proves_small_shapes(packages):
    from server.proofs import prove_shapes
    from server.registry import load_served_model
    from server.settings import Settings

    model = load_served_model(f"golden={packages['golden']}", Settings(backend="torch", max_batch_size=8))
    assert model.backend.batch_invariant
    assert prove_shapes(model, 8, log=lambda *a: None)["classify"] == (1, 2, 4, 8)
    loose = load_served_model(f"golden={packages['golden']}", Settings(backend="torch", strict_determinism=False))
    assert not loose.backend.batch_invariant  # loose mode keeps the faster unpadded batch of one
