"""``softmoe export onnx|tensorrt``: this layer's subcommands (``add_commands``) and the exceptions
whose message is a user-facing error (``user_errors``), for :mod:`server.main` to compose. Imports
nothing from the server (imports flow server -> export -> softmoe_models).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from softmoe_models.config import PRECISIONS

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
    """Add ``export onnx`` and ``export tensorrt`` to ``softmoe``."""
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
