"""`softmoe init soft-s16-e128` then `softmoe export onnx`: weights over 2 GB go to external data.

The slowest test in the suite (about 4.5 minutes and 11.5 GB peak on 2 cores), kept because it is
the product's public contract for large models.
"""

from __future__ import annotations

import subprocess
import sys

import onnx
import pytest

from export.onnx import op_inventory, read_metadata

pytestmark = pytest.mark.slow


def test_soft_s16_e128_exports_with_external_data(tmp_path):
    softmoe = [sys.executable, "-m", "server"]
    r = subprocess.run([*softmoe, "init", "soft-s16-e128", "--out", str(tmp_path / "pkg")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*softmoe, "export", "onnx", str(tmp_path / "pkg"), "--out", str(tmp_path / "out" / "s16.onnx")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "verify logits batch 4" in r.stdout and "FAILED" not in r.stdout
    onnx_file, data = tmp_path / "out" / "s16.onnx", tmp_path / "out" / "s16.onnx.data"
    assert data.stat().st_size > 2**31 and onnx_file.stat().st_size < 64 << 20
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["s16.onnx", "s16.onnx.data"]
    ops = op_inventory(onnx_file)
    assert "Einsum" not in ops and "Gather" in ops  # Gathers left only on activations
    model = onnx.load(str(onnx_file), load_external_data=False)
    expert_weights = [i for i in model.graph.initializer if len(i.dims) == 2 and tuple(i.dims) == (384, 1536)]
    assert len(expert_weights) >= 6 * 128  # each expert its own 2-D constant
    assert read_metadata(onnx_file)["variant"] == "soft-s16-e128"
