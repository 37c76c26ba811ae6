"""The model layer's subcommands of ``softmoe``: models, convert, init, train-demo (``eval``, which runs
the served numerics, is the server layer's: server/jobs/cli.py).

The ``softmoe`` command itself is composed at the top, in :mod:`server.main`: imports flow one way,
server -> export -> softmoe_models (tests/test_layering.py), so only the top layer may know every
layer's subcommands. Each layer's ``cli`` module offers the same two functions to it:
``add_commands(subparsers)`` and ``user_errors()``. This module also holds what they share, the
parser whose usage errors are one line and ``run``, and runs this layer's commands alone as
``python -m softmoe_models.cli``.

Errors a user can fix print one line ``error: ...`` and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .config import DISPATCH_DTYPES, TEXT_POOLS, VARIANTS, variant_config
from .convert import convert_checkpoint
from .convert.errors import ConversionError
from .convert.presets import PRESETS
from .convert.sparse import SPARSE_ROUTERS
from .models import build_model, count_params
from .package import PackageError, save_package


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line too: ``error: ...``, exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def new_parser(prog: str, description: str) -> tuple[Parser, argparse._SubParsersAction]:
    """A command with required subcommands, for the layers' ``add_commands`` to fill."""
    parser = Parser(prog=prog, description=description)
    return parser, parser.add_subparsers(dest="command", required=True)


ARGV: list[str] = []  # the arguments of the command being run (reports name the command that made them)


def run(parser: argparse.ArgumentParser, argv: list[str] | None, errors: tuple[type[BaseException], ...]) -> None:
    """Parse ``argv`` and run the chosen subcommand; one of ``errors`` is one stderr line and exit 2."""
    ARGV[:] = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parser.parse_args(argv)
    try:
        args.func(args)
        sys.stdout.flush()  # here, where a reader that went away is told apart from a failure
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except BrokenPipeError:  # the reader stopped early (`| head`): it read what it wanted, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's last flush
        raise SystemExit(1) from None


def _parse_size(text: str) -> float:
    units = {"K": 1e3, "M": 1e6, "B": 1e9}
    return float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)


def cmd_models(args: argparse.Namespace) -> None:
    rows = []
    for name, v in VARIANTS.items():
        cfg = v.config(num_classes=args.num_classes, image_size=args.image_size)
        params = count_params(cfg)
        row = {
            "name": name,
            "params": params,
            "width": v.width,
            "patch_size": v.patch_size,
            "layers": cfg.encoder.num_layers,
            "num_experts": v.num_experts,
            "moe_layers": list(cfg.encoder.moe.layers) if cfg.encoder.moe else [],
            "paper_params": v.paper_params,
        }
        if v.paper_params:
            row["vs_paper"] = round(params / _parse_size(v.paper_params) - 1, 4)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'name':16} {'params':>16} {'paper':>7} {'vs paper':>9}  moe layers")
    for r in rows:
        vs = f"{r['vs_paper']:+.2%}" if "vs_paper" in r else ""
        print(f"{r['name']:16} {r['params']:>16,} {r['paper_params'] or '':>7} {vs:>9}  {r['moe_layers']}")


def cmd_convert(args: argparse.Namespace) -> None:
    labels = None
    if args.labels:
        try:
            labels = _read_labels(Path(args.labels))
        except (OSError, ValueError) as e:
            raise CLIError(f"cannot read labels {args.labels}: {e}") from None
    if args.tokenizer and not Path(args.tokenizer).is_file():
        raise CLIError(f"tokenizer file not found: {args.tokenizer}")
    pkg, notices = convert_checkpoint(
        args.src, args.out, labels=labels, tokenizer=args.tokenizer, head_activation=args.head_activation,
        text_pool=args.text_pool, text_padding_mask=args.text_padding_mask, preset=args.preset,
        router=args.router, experts_per_token=args.experts_per_token, capacity_factor=args.capacity_factor,
        batch_priority=args.batch_priority, dispatch_dtype=args.dispatch_dtype,
    )
    for notice in notices:
        print(f"note: {notice}", file=sys.stderr)
    meta = json.loads((pkg / "config.json").read_text())
    print(f"wrote {pkg} ({meta['kind']}, {meta['num_params']:,} params, from {meta['provenance']['format']})")


def _read_labels(path: Path) -> list[str]:
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError("expected a JSON list of strings")
        return [str(x) for x in data]
    return [line.strip() for line in text.splitlines() if line.strip()]


def cmd_init(args: argparse.Namespace) -> None:
    try:
        cfg = variant_config(args.variant, num_classes=args.num_classes, image_size=args.image_size)
    except ValueError as e:
        raise CLIError(str(e)) from None
    torch.manual_seed(args.seed)
    model = build_model(cfg)
    _init_weights(model)
    labels = [f"class_{i}" for i in range(cfg.num_classes)] if cfg.num_classes else None
    pkg = save_package(
        model, cfg, args.out, labels=labels, variant=args.variant,
        provenance={"source": f"softmoe init {args.variant}", "format": "random-init", "seed": args.seed},
    )
    print(f"wrote {pkg} ({args.variant}, {sum(p.numel() for p in model.parameters()):,} params, seed {args.seed})")


def _init_weights(model: "torch.nn.Module") -> None:  # noqa: F821
    """Random weights with sensible scales: position embeddings N(0, 0.02), the rest as built."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("pos_embed"):
                p.normal_(0.0, 0.02)


def cmd_train_demo(args: argparse.Namespace) -> None:
    # heavy: scikit-learn (the digits) only for the command that trains on them
    from .demo.train import train_demo

    train_demo(args.out, seed=args.seed, epochs=args.epochs, lit_steps=args.lit_steps)


def _add_variant_shape(p: argparse.ArgumentParser, num_classes: int, num_classes_help: str | None = None) -> None:
    """The head and input size a variant is instantiated with (``models`` and ``init``)."""
    p.add_argument("--num-classes", type=int, default=num_classes, help=num_classes_help)
    p.add_argument("--image-size", type=int, default=224)


def _add_sparse_flags(p: argparse.ArgumentParser) -> None:
    """What a sparse V-MoE checkpoint's parameters cannot show (softmoe_models/convert/sparse.py)."""
    g = p.add_argument_group("sparse V-MoE (checkpoints with Moe/Router/dense/kernel)")
    g.add_argument("--preset", choices=list(PRESETS), metavar="NAME",
                   help="a public V-MoE checkpoint (gs://vmoe_checkpoints/NAME): sets router, K, batch priority and "
                        "the evaluation capacity factor of its vmoe config and checks the sizes; E³ (eee_*) is "
                        f"refused. One of: {', '.join(PRESETS)}")
    g.add_argument("--router", choices=SPARSE_ROUTERS,
                   help="vmoe NoisyTopExpertsPerItemRouter (tokens-choice) or NoisyTopItemsPerExpertRouter "
                        "(experts-choice); required for a sparse checkpoint unless --preset sets it")
    g.add_argument("--experts-per-token", type=int, metavar="K",
                   help="tokens-choice: experts per token (vmoe num_selected_experts); required unless --preset")
    g.add_argument("--capacity-factor", type=float, metavar="CF",
                   help="expert capacity factor at serving (default 4.0, vmoe's evaluation value, or the preset's)")
    g.add_argument("--batch-priority", action=argparse.BooleanOptionalAction, default=None,
                   help="tokens-choice: claims in descending top-1 gate order (default off, or the preset's)")
    g.add_argument("--dispatch-dtype", choices=DISPATCH_DTYPES,
                   help="float32 (default) or bfloat16: vmoe's Bfloat16Dispatcher, its exact outputs")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add this layer's subcommands to ``softmoe`` (or to ``python -m softmoe_models.cli``)."""
    p = sub.add_parser("models", help="list the model variants (the paper's size table)")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    _add_variant_shape(p, 29593, "head size (default: the paper's 29,593-class JFT head)")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("convert", help="convert a vmoe checkpoint (npz, legacy partitioned, orbax) or a Hugging Face "
                                       "SigLIP directory to a package")
    p.add_argument("src", help="a .npz file, a legacy checkpoint prefix (or its .index), an orbax ckpt/<step> dir, "
                               "or a Hugging Face SigLIP directory (SiglipModel, SiglipVisionModel)")
    p.add_argument("--out", required=True, help="output package directory")
    p.add_argument("--labels", help="class names: a JSON list or one name per line")
    p.add_argument("--tokenizer", help="SentencePiece .model of the text tower (two-tower)")
    p.add_argument("--head-activation", choices=["softmax", "sigmoid"], help="classifier scores (default softmax)")
    p.add_argument("--text-pool", choices=TEXT_POOLS,
                   help="two-tower text pooling, the vmoe TextTransformer pool_type of the training config "
                        "('last' when it does not set it); required unless the parameters show it (map)")
    p.add_argument("--text-padding-mask", choices=["auto", "on", "off"], default="auto",
                   help="Hugging Face SigLIP: mask the text padding in attention (on: as transformers does when "
                        "given the processor's attention_mask; off: as SigLIP was trained); auto: on when the "
                        "checkpoint's tokenizer returns an attention_mask (default)")
    _add_sparse_flags(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("init", help="write a randomly initialised package of a variant")
    p.add_argument("variant", help="e.g. soft-s16-e128 (see `softmoe models`)")
    p.add_argument("--out", required=True)
    _add_variant_shape(p, 1000)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("train-demo", help="train the built-in default models on scikit-learn's digits (CPU, minutes)")
    p.add_argument("--out", required=True, help="directory for the digits and digits-lit packages")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=100, help="classifier epochs")
    p.add_argument("--lit-steps", type=int, default=1500, help="text-tower training steps")
    p.set_defaults(func=cmd_train_demo)



def user_errors() -> tuple[type[BaseException], ...]:
    """This layer's exceptions whose message is meant for the user (one line, exit status 2)."""
    return (CLIError, ConversionError, PackageError)


def build_parser() -> Parser:
    """This layer's commands alone; ``softmoe`` (:func:`server.main.build_parser`) has them all."""
    parser, sub = new_parser("python -m softmoe_models.cli", "Soft MoE models: list, convert, init, demo")
    add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """``python -m softmoe_models.cli``: the model layer's commands, without export or serve."""
    run(build_parser(), argv, user_errors())


if __name__ == "__main__":  # run through the package module so exception classes are shared
    from softmoe_models.cli import main as _main

    _main()
