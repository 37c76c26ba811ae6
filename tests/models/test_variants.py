"""The size table: parameter counts of the real modules (meta device) vs the paper's Table 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Table 1 of the paper (29,593-class JFT head). soft-s14-e256 is printed as "1.8B" there; vmoe's
# config (256 experts in the last 6 of 12 blocks, d=384, M=1536) counts 1.841B, which the paper
# rounds to two digits, so it is held to the rounding of its printed figure instead of 1%.
PAPER = {
    "vit-s16": (33e6, 0.01),
    "vit-b16": (108e6, 0.01),
    "vit-l16": (333e6, 0.01),
    "vit-h14": (669e6, 0.01),
    "soft-s14-e256": (1.8e9, 0.05 / 1.8),
    "soft-b16-e128": (3.7e9, 0.01),
    "soft-l16-e128": (13.1e9, 0.01),
}


@pytest.fixture(scope="module")
def table() -> dict[str, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "server", "models", "--json", "--num-classes", "29593"],
        check=True, capture_output=True, text=True,
    ).stdout
    rows = json.loads(out)
    assert isinstance(rows, list)
    return {r["name"]: r for r in rows}


@pytest.mark.parametrize("name", list(PAPER))
def test_params_match_paper(table, name):
    expected, rel = PAPER[name]
    assert abs(table[name]["params"] / expected - 1) <= rel


def test_every_variant_listed(table):
    assert set(table) >= {
        "vit-s16", "vit-b16", "vit-l16", "vit-h14",
        "soft-s16-e128", "soft-s14-e256", "soft-b16-e128", "soft-l16-e128", "soft-h14-e256",
    }
    assert table["soft-b16-e128"]["moe_layers"] == [6, 7, 8, 9, 10, 11]
    assert table["soft-l16-e128"]["moe_layers"] == list(range(12, 24))
    assert table["soft-h14-e256"]["moe_layers"] == list(range(16, 32))
    assert table["vit-b16"]["moe_layers"] == []


def test_head_size_changes_count(table):
    out = subprocess.run(
        [sys.executable, "-m", "server", "models", "--json", "--num-classes", "1000"],
        check=True, capture_output=True, text=True,
    ).stdout
    small = {r["name"]: r["params"] for r in json.loads(out)}
    assert table["vit-b16"]["params"] - small["vit-b16"] == 768 * (29593 - 1000) + (29593 - 1000)
