"""The README cannot drift: every command of its Quickstart runs against a live `softmoe serve` of
the built-in models, and its output matches the output block printed under it in the README
(numbers to 1e-3, everything else exactly). Also: the README stays short."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def quickstart() -> list[tuple[str, str, str]]:
    """(language, command, expected output) for each command block of the Quickstart section."""
    text = README.read_text()
    start = text.index("\n## Quickstart\n")
    end = text.index("\n## ", start + 1)
    blocks = FENCE.findall(text[start:end])
    pairs = []
    for (lang, code), (out_lang, out) in zip(blocks[::2], blocks[1::2]):
        assert lang in ("bash", "python") and out_lang in ("json", "text"), (lang, out_lang)
        pairs.append((lang, code, out))
    return pairs


def tokens(text: str) -> tuple[list[float], list[str]]:
    """The numbers in ``text``, and what is between them."""
    return [float(n) for n in NUMBER.findall(text)], [s.strip() for s in NUMBER.split(text)]


def same_output(got: str, want: str) -> bool:
    (gn, gs), (wn, ws) = tokens(got), tokens(want)
    return gs == ws and len(gn) == len(wn) and all(math.isclose(g, w, rel_tol=1e-3, abs_tol=2e-3) for g, w in zip(gn, wn))


def test_same_output_is_a_real_comparison():
    assert same_output('{"score":0.91534}', '{"score":0.9153499}')
    assert not same_output('{"label":"7","score":0.91}', '{"label":"1","score":0.91}')
    assert not same_output('[{"label":"7","index":8}]', '[{"label":"7","index":7}]')
    assert not same_output("64 0.974 -0.125", "64 0.974 0.125")


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200


def test_quickstart_has_every_kind_of_request():
    text = "\n".join(code for _, code, _ in quickstart())
    for needle in ("application/json", "-F image=@", "--data-binary", "httpx", "from openai", "tritonclient.http", "tritonclient.grpc"):
        assert needle in text, needle


@pytest.fixture(scope="module")
def server():
    from loadtests.run import ServerProcess, wait_ready

    with tempfile.TemporaryDirectory() as tmp:
        proc = ServerProcess("", Path(tmp) / "server.log")
        try:
            wait_ready(proc.url, 300, proc)
            yield proc
        finally:
            proc.stop()


@pytest.mark.parametrize("index", range(len(quickstart())))
def test_quickstart_command_gives_the_readme_output(server, index):
    lang, code, want = quickstart()[index]
    code = code.replace("localhost:8000", f"localhost:{server.port}").replace("localhost:8001", f"localhost:{server.grpc_port}")
    if lang == "bash":
        assert shutil.which("curl"), "the Quickstart uses curl"
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        cmd = [sys.executable, "-c", code]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert same_output(r.stdout, want), f"README says:\n{want}\ngot:\n{r.stdout}"
