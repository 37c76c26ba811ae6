"""``softmoe``: the command line, composed here at the top layer (the ``softmoe`` entry point).

Imports flow one way, server -> export -> softmoe_models (tests/test_layering.py), so the one command
that offers every layer's subcommands lives in the top layer. Each layer's ``cli`` module adds its
own subcommands next to the code they drive (``add_commands``) and names the exceptions whose message
is meant for the user (``user_errors``); the shared parser and ``run`` live in the lowest layer,
:mod:`softmoe_models.cli`.

Errors a user can fix print one line ``error: ...`` and exit with status 2.
"""

from __future__ import annotations

from export import cli as export_cli
from softmoe_models import cli as models_cli

from . import cli as serve_cli

LAYERS = (models_cli, export_cli, serve_cli)  # bottom up: the order of the subcommands in --help


def build_parser() -> models_cli.Parser:
    parser, sub = models_cli.new_parser("softmoe", "Soft MoE model conversion, export and serving")
    for layer in LAYERS:
        layer.add_commands(sub)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    return tuple(error for layer in LAYERS for error in layer.user_errors())


def main(argv: list[str] | None = None) -> None:
    models_cli.run(build_parser(), argv, user_errors())


if __name__ == "__main__":  # run through the package module, as `python -m server` does
    from server.main import main as _main

    _main()
