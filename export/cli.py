"""``softmoe export onnx|tensorrt``."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_export_onnx(args: argparse.Namespace) -> None:
    from .onnx import export_onnx

    export_onnx(
        args.package, args.out, opset=args.opset, dynamic_batch=args.batch_dim == "dynamic",
        precision=args.precision, experts=args.experts, towers=args.towers,
        external_data=True if args.external_data else None,
    )


def cmd_export_tensorrt(args: argparse.Namespace) -> None:
    from .tensorrt import BatchProfile, export_tensorrt, import_tensorrt

    import_tensorrt()  # first: a missing extra is one clear line before any work
    profile = BatchProfile(args.min_batch, args.opt_batch, args.max_batch)
    export_tensorrt(args.package, args.out, precision=args.precision, profile=profile, workspace_gib=args.workspace)


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a model package to ONNX or TensorRT (verified)")
    targets = p.add_subparsers(dest="target", required=True)

    o = targets.add_parser("onnx", help="ONNX with fused Soft MoE routing, verified in ONNX Runtime")
    o.add_argument("package", type=Path)
    o.add_argument("--out", type=Path, help="output .onnx (default PACKAGE/model.onnx)")
    o.add_argument("--opset", type=int, default=20)
    o.add_argument("--batch-dim", choices=["dynamic", "static"], default="dynamic")
    o.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32")
    o.add_argument("--experts", choices=["per-expert", "batched"], default="per-expert",
                   help="per-expert 2-D MatMuls (fastest in ONNX Runtime CPU) or batched 3-D MatMuls (GPU)")
    o.add_argument("--towers", choices=["both", "combined", "split"], default="both",
                   help="two-tower: M.onnx with both towers, M.image.onnx + M.text.onnx, or both")
    o.add_argument("--external-data", action="store_true", help="weights in M.onnx.data even under 2 GB")
    o.set_defaults(func=cmd_export_onnx)

    t = targets.add_parser("tensorrt", help="TensorRT engine(s) built on this GPU, cached and verified")
    t.add_argument("package", type=Path)
    t.add_argument("--out", type=Path, help="engine cache directory (default: $SOFTMOE_CACHE_DIR, else ~/.cache/softmoe-serve)")
    t.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default="fp16")
    t.add_argument("--min-batch", type=int, default=1)
    t.add_argument("--opt-batch", type=int, default=8)
    t.add_argument("--max-batch", type=int, default=32)
    t.add_argument("--workspace", type=float, default=4.0, help="workspace memory pool, GiB")
    t.set_defaults(func=cmd_export_tensorrt)
