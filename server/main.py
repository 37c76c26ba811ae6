"""``softmoe``: the command line, composed here at the top layer (the ``softmoe`` entry point).

Imports flow one way, server -> export -> softmoe_models (tests/test_layering.py), so the one command
that offers every layer's subcommands lives in the top layer. Each layer's ``cli`` module adds its
own subcommands next to the code they drive (``add_commands``) and names the exceptions whose message
is meant for the user (``user_errors``); the shared parser and ``run`` live in the lowest layer,
:mod:`softmoe_models.cli`.

Errors a user can fix print one line ``error: ...`` and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from export import cli as export_cli
from softmoe_models import cli as models_cli

from server import cli as serve_cli

LAYERS = (models_cli, export_cli, serve_cli)  # bottom up: the order of the subcommands in --help


def build_parser() -> models_cli.Parser:
    parser, sub = models_cli.new_parser("softmoe", "Soft MoE model conversion, export and serving")
    for layer in LAYERS:
        layer.add_commands(sub)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    return tuple(error for layer in LAYERS for error in layer.user_errors())


def usage() -> str:
    """The usage line of every subcommand except ``serve`` and ``prepare`` (whose flags are Settings'
    fields: see ``softmoe serve --help``), as argparse prints it. docs/cli.md quotes this text, and
    tests/test_cli_docs.py checks that it still does, so the flags are declared in one place."""
    lines = []

    def walk(parser: argparse.ArgumentParser) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            lines.append(parser.format_usage().removeprefix("usage: ").rstrip())
            return
        for name, child in subs[0].choices.items():
            if child.prog.split()[1:2] not in (["serve"], ["prepare"]):
                walk(child)

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width: fix it
    try:
        walk(build_parser())
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    models_cli.run(build_parser(), argv, user_errors())


if __name__ == "__main__" and sys.argv[1:] == ["--usage"]:  # regenerates docs/cli.md's usage block
    print(usage())
elif __name__ == "__main__":  # run through the package module, as `python -m server` does
    from server.main import main as _main

    _main()
