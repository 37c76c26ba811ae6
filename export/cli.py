"""``softmoe export onnx|tensorrt`` and ``softmoe cache list|prune``: this layer's subcommands (``add_commands``) and the exceptions
whose message is a user-facing error (``user_errors``), for :mod:`server.main` to compose. Imports
nothing from the server (imports flow server -> export -> softmoe_models).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from softmoe_models.config import PRECISIONS

from . import cache_space as space
from .cache import CacheError, default_root
from .errors import ExportError
from .onnx import export_onnx
from .tensorrt import BatchProfile, export_tensorrt, import_tensorrt


def cmd_export_onnx(args: argparse.Namespace) -> None:
    export_onnx(
        args.package, args.out, opset=args.opset, dynamic_batch=args.batch_dim == "dynamic",
        precision=args.precision, experts=args.experts, towers=args.towers,
        external_data=True if args.external_data else None,
    )


def cmd_export_tensorrt(args: argparse.Namespace) -> None:
    import_tensorrt()  # first: a missing extra is one clear line before any work
    profile = BatchProfile(args.min_batch, args.opt_batch, args.max_batch)
    export_tensorrt(args.package, args.out, precision=args.precision, profile=profile, workspace_gib=args.workspace)


_AGE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """Seconds of ``30d``, ``12h``, ``90m``, ``45s``, ``2w`` or a number of seconds."""
    m = _AGE.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r}: an age such as 30d, 12h, 90m or seconds")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def parse_max_size(text: str) -> int:
    try:
        size, share = space.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size is None:
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 10G or 512Mi")
    return size


def _row(item: space.Item) -> dict:
    return {"kind": item.kind, "key": item.key, "path": str(item.path), "bytes": item.bytes,
            "last_use": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(item.last_use)), "in_use": item.in_use,
            "model": item.model, "package": item.package}


def _table(rows: list[dict]) -> str:
    """Rows for people: kind, key (its start), bytes, last use, in use, model, package."""
    head = ("KIND", "KEY", "BYTES", "LAST USE", "IN USE", "MODEL", "PACKAGE")
    cells = [(r["kind"], r["key"][:12], f"{r['bytes']:,}", r["last_use"].replace("T", " ").rstrip("Z"),
              "yes" if r["in_use"] else "", r["model"] or "-", r["package"] or "-") for r in rows]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]
    lines = ["  ".join(c[i].rjust(widths[i]) if i == 2 else c[i].ljust(widths[i]) for i in range(len(head))).rstrip()
             for c in [head, *cells]]
    return "\n".join(lines)


def _summary(home: Path) -> dict:
    found = space.usage(home)
    return {"cache": str(home), "bytes": found.total, "cap": found.limit.cap, "floor": found.limit.floor,
            "free": found.free}


def cmd_cache_list(args: argparse.Namespace) -> None:
    home = args.cache_dir or default_root()
    rows = [_row(i) for i in space.items(home, in_use=True)]
    total = _summary(home)
    if args.json:
        print(json.dumps({**total, "entries": rows}, indent=1))
        return
    if rows:
        print(_table(rows))
    print(f"{len(rows)} entries, {total['bytes']:,} bytes in {home} (cap {total['cap']:,}; "
          f"{total['free']:,} bytes free on the volume, floor {total['floor']:,})")


def cmd_cache_prune(args: argparse.Namespace) -> None:
    home = args.cache_dir or default_root()
    try:
        removed, held = space.prune(home, older_than=args.older_than, max_size=args.max_size)
    except OSError as e:
        raise CacheError(f"the cache at {home} cannot be pruned ({e.strerror}: {e.filename})") from None
    freed = sum(i.bytes for i in removed)
    total = _summary(home)
    if args.json:
        print(json.dumps({**total, "freed": freed, "removed": [_row(i) for i in removed],
                          "in_use": [_row(i) for i in held]}, indent=1))
        return
    if removed:
        print(_table([_row(i) for i in removed]))
    print(f"removed {len(removed)} entries ({freed:,} bytes); {len(held)} in use kept; {total['bytes']:,} bytes "
          f"left in {home}")


def user_errors() -> tuple[type[BaseException], ...]:
    """This layer's exceptions whose message is meant for the user (one line, exit status 2)."""
    return (ExportError,)


def add_precision(p: argparse.ArgumentParser, default: str) -> None:
    """``--precision``: the choices are the model layer's ``PRECISIONS``, as ``softmoe serve --precision``'s."""
    p.add_argument("--precision", choices=PRECISIONS, default=default)


def _target(targets: argparse._SubParsersAction, name: str, summary: str, out_help: str) -> argparse.ArgumentParser:
    """An export target's subcommand with what every target takes: the package and where to write."""
    p = targets.add_parser(name, help=summary)
    p.add_argument("package", type=Path)
    p.add_argument("--out", type=Path, help=out_help)
    return p


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``export onnx``, ``export tensorrt``, ``cache list`` and ``cache prune`` to ``softmoe``."""
    _add_export(sub)
    _add_cache(sub)


def _add_cache(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="list the export cache's entries, or remove unused ones")
    actions = p.add_subparsers(dest="action", required=True)
    where = dict(type=Path, default=None, help="the cache (default: $SOFTMOE_CACHE_DIR, else ~/.cache/softmoe-serve)")
    out = dict(action="store_true", help="JSON for scripts instead of a table")
    ls = actions.add_parser("list", help="every entry: kind, bytes, last use, in use, the model and package that "
                            "made it")
    ls.add_argument("--cache-dir", **where)
    ls.add_argument("--json", **out)
    ls.set_defaults(func=cmd_cache_list)
    pr = actions.add_parser("prune", help="remove entries no loaded model uses: all of them, or those older than "
                            "--older-than, or the least recently used down to --max-size")
    pr.add_argument("--cache-dir", **where)
    pr.add_argument("--older-than", type=parse_age, default=None, metavar="AGE",
                    help="entries last used more than AGE ago (30d, 12h, 90m, seconds)")
    pr.add_argument("--max-size", type=parse_max_size, default=None, metavar="SIZE",
                    help="the least recently used entries until the cache takes at most SIZE (10G, 512Mi, bytes)")
    pr.add_argument("--json", **out)
    pr.set_defaults(func=cmd_cache_prune)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a model package to ONNX or TensorRT (verified)")
    targets = p.add_subparsers(dest="target", required=True)

    o = _target(targets, "onnx", "ONNX with fused Soft MoE routing, verified in ONNX Runtime",
                "output .onnx (default PACKAGE/model.onnx)")
    o.add_argument("--opset", type=int, default=20)
    o.add_argument("--batch-dim", choices=["dynamic", "static"], default="dynamic")
    add_precision(o, default="fp32")
    o.add_argument("--experts", choices=["per-expert", "batched"], default="per-expert",
                   help="per-expert 2-D MatMuls (fastest in ONNX Runtime CPU) or batched 3-D MatMuls (GPU)")
    o.add_argument("--towers", choices=["both", "combined", "split"], default="both",
                   help="two-tower: M.onnx with both towers, M.image.onnx + M.text.onnx, or both")
    o.add_argument("--external-data", action="store_true", help="weights in M.onnx.data even under 2 GB")
    o.set_defaults(func=cmd_export_onnx)

    t = _target(targets, "tensorrt", "TensorRT engine(s) built on this GPU, cached and verified",
                "engine cache directory (default: $SOFTMOE_CACHE_DIR, else ~/.cache/softmoe-serve)")
    add_precision(t, default="fp16")
    t.add_argument("--min-batch", type=int, default=1)
    t.add_argument("--opt-batch", type=int, default=8)
    t.add_argument("--max-batch", type=int, default=32)
    t.add_argument("--workspace", type=float, default=4.0, help="workspace memory pool, GiB")
    t.set_defaults(func=cmd_export_tensorrt)
