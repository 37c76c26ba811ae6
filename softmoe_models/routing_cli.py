"""Compute a package's reference routing profile: the statistics its drift is measured against.

    python -m softmoe_models.routing_cli profile PKG [--images DIR] [--limit N]

Runs the package's torch model over calibration images (the files of ``--images``, decoded and
preprocessed by the package's contract; without it, the held-out digits of a ``softmoe
train-demo`` package), writes ``PKG/routing_profile.json`` and names it, with its sha256, in
``PKG/config.json``. What the profile holds and how drift is measured: :mod:`softmoe_models.routing`.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m softmoe_models.routing_cli", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("profile", help="compute a package's reference routing profile from calibration images")
    p.add_argument("package", type=Path)
    p.add_argument("--images", type=Path, default=None, help="calibration image directory (default: the "
                   "package's held-out digits, for train-demo packages)")
    p.add_argument("--limit", type=int, default=None, help="use at most this many images")
    args = parser.parse_args(argv)
    # heavy (torch), imported once the arguments are read: --help and usage errors answer at once
    import torch

    # torch too, through the package and the models
    from .package import load_model
    # torch too, through the package (the digits load scikit-learn when read)
    from .demo.calibration import calibration_pixels
    # torch too
    from .routing import compute_profile, write_profile

    torch.manual_seed(0)
    pixels, source = calibration_pixels(args.package, args.images, args.limit)
    profile = compute_profile(load_model(args.package), pixels, source)
    print(f"wrote {write_profile(args.package, profile)} ({len(pixels)} images: {source})")


if __name__ == "__main__":
    main()
