"""``softmoe serve``: the flags are generated from :class:`server.settings.Settings`.

pydantic-settings' own command-line source (``CliSettingsSource``) adds one argument per
Settings field to the ``serve`` subparser and parses them back, so a new field is a new flag
with nothing to keep in step: ``--kebab-case`` names, ``--x/--no-x`` for booleans, the choices
of ``Literal`` fields, ``--models`` repeatable (``--model`` is the same list). The help of each
flag names its environment variable. Precedence: flag > ``SOFTMOE_*`` environment variable >
default.

Every start-up error (a setting, a model, the device, the port) prints one line ``error: ...``
on stderr and exits with status 2; the traceback is logged at debug level only.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import uvicorn
from pydantic import ValidationError
from pydantic_settings import CliSettingsSource, SettingsError

from server.engine.prepare import prepare
from server.engine.startup import StartupError, describe
from server.jobs import cli as jobs_cli  # eval and embed: the served numerics over a dataset
from server.observability import logs
from server.run import serve
from server.settings import Settings

ENV_PREFIX = str(Settings.model_config.get("env_prefix") or "")
MODEL_METAVAR = "[NAME=]PKG"


def flag_of(field: str) -> str:
    """The command-line flag of a Settings field: ``max_batch_size`` -> ``--max-batch-size``."""
    return "--" + field.replace("_", "-")


def env_of(field: str) -> str:
    """The environment variable of a Settings field: ``port`` -> ``SOFTMOE_PORT``."""
    return (ENV_PREFIX + field).upper()


def _add_argument(parser: argparse.ArgumentParser, *names: str, **kwargs) -> argparse.Action:
    """pydantic-settings' ``add_argument``, plus the field's environment variable in its help."""
    field = kwargs.get("dest")
    if field in Settings.model_fields:
        help_text = kwargs.get("help") or ""
        if field == "models":
            kwargs["metavar"] = MODEL_METAVAR
            help_text = help_text.replace("(default factory: list)", "(repeatable; also --model)")
        kwargs["help"] = f"{help_text} [env {env_of(field)}]".strip()
    return parser.add_argument(*names, **kwargs)


def settings_source(parser: argparse.ArgumentParser):
    """Add every Settings field to ``parser``; returns the source that reads them back."""
    return CliSettingsSource(
        Settings, root_parser=parser, cli_kebab_case=True, cli_implicit_flags=True,
        add_argument_method=_add_argument,
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed ``softmoe serve`` arguments, then the environment, then defaults.

    Raises:
        pydantic.ValidationError, pydantic_settings.SettingsError: a value is invalid.
    """
    return Settings(_cli_settings_source=args.settings_source(parsed_args=args))


def describe_settings_error(error: Exception, args: argparse.Namespace) -> str:
    """One line naming the flag (or the environment variable it came from) of each bad value."""
    if not isinstance(error, ValidationError):  # a SettingsError: a value pydantic-settings cannot decode
        text = str(error)
        env_field = re.search(r'field "(\w+)" from source "EnvSettingsSource"', text)
        if env_field:
            return f"{env_of(env_field[1])}: cannot parse the value (this field takes JSON, e.g. a list as [\"a\", \"b\"])"
        cli_field = re.match(r"Parsing error encountered for (\w+): (.*)", text, re.S)
        if cli_field:
            return one_line(f"{flag_of(cli_field[1])}: {cli_field[2]}")
        return one_line(text)
    given = {k for k, v in vars(args).items() if v is not None}
    env = {k.upper() for k in os.environ}
    parts = []
    for err in error.errors():
        loc = [str(p) for p in err.get("loc", ())]
        field = loc[0] if loc else ""
        where = env_of(field) if field not in given and env_of(field) in env else flag_of(field)
        if len(loc) > 1:
            where += "[" + ".".join(loc[1:]) + "]"
        parts.append(f"{where}: {err['msg']}")
    return one_line("; ".join(parts))


def one_line(message: str) -> str:
    return "; ".join(line.strip() for line in message.splitlines() if line.strip()) or "unknown error"


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def cmd_serve(args: argparse.Namespace) -> None:
    try:
        settings = settings_from_args(args)
    except (ValidationError, SettingsError) as e:
        _fail(describe_settings_error(e, args))
    try:
        serve(settings)
    except StartupError as e:
        _fail(one_line(str(e)))
    except KeyboardInterrupt:  # Ctrl-C while loading: no traceback
        raise SystemExit(130) from None


def cmd_prepare(args: argparse.Namespace) -> None:
    try:
        settings = settings_from_args(args)
    except (ValidationError, SettingsError) as e:
        _fail(describe_settings_error(e, args))
    logs.configure(uvicorn.config.LOG_LEVELS.get(settings.log_level.lower(), 20), settings.log_format)
    try:
        prepare(settings)
    except StartupError as e:
        _fail(one_line(str(e)))
    except Exception as e:  # noqa: BLE001 - a model that cannot load: one line, as serve says it
        _fail(one_line(describe(e)))
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def user_errors() -> tuple[type[BaseException], ...]:
    """The dataset jobs' (``serve`` turns its own errors into the one ``error:`` line, ``cmd_serve``)."""
    return jobs_cli.user_errors()


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``serve`` and ``prepare`` (one flag per Settings field each), ``eval`` and ``embed`` to ``softmoe``."""
    p = sub.add_parser(
        "serve", help="serve models over HTTP (see README for the endpoints)",
        description="Serve models over HTTP. Every flag is also a SOFTMOE_* environment variable; flags win.",
    )
    source = settings_source(p)
    p.add_argument("--model", dest="models", action="append", default=argparse.SUPPRESS, metavar=MODEL_METAVAR,
                   help=f"same as --models [env {env_of('models')}]")
    p.set_defaults(func=cmd_serve, settings_source=source)

    p = sub.add_parser(
        "prepare", help="build what serving needs (graphs, engines, start-up proofs) into the cache, then exit",
        description="Load the models as `softmoe serve` with the same flags would, building every artifact into "
                    "--cache-dir (ONNX graphs or bound weights, TensorRT engines, the start-up proofs of this kind "
                    "of machine), and exit without serving. A server with the same flags and cache then exports "
                    "and proves nothing, and may read the cache from a read-only volume.",
    )
    source = settings_source(p)
    p.add_argument("--model", dest="models", action="append", default=argparse.SUPPRESS, metavar=MODEL_METAVAR,
                   help=f"same as --models [env {env_of('models')}]")
    p.set_defaults(func=cmd_prepare, settings_source=source)
    jobs_cli.add_commands(sub)
