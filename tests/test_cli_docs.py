"""docs/cli.md quotes the usage of every subcommand as argparse prints it; this keeps the quote
current, so the flags are declared once (in the parsers) and never hand-copied."""

from __future__ import annotations

import re
from pathlib import Path

from server.main import usage

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_docs_quote_the_parsers_usage():
    text = DOC.read_text()
    m = re.search(r"<!-- generated: python -m server.main --usage[^\n]*-->\n```\n(.*?)\n```\n", text, re.S)
    assert m, "docs/cli.md lost its generated usage block"
    assert m.group(1) == usage(), "docs/cli.md is stale: paste the output of `python -m server.main --usage`"


def test_usage_names_every_subcommand_but_serve_and_prepare():
    text = usage()
    for cmd in ("models", "convert", "init", "train-demo", "eval", "export onnx", "export tensorrt", "cache list",
                "cache prune"):
        assert f"softmoe {cmd} [-h]" in text, cmd
    assert "softmoe serve" not in text and "softmoe prepare" not in text
