"""`softmoe embed` over a folder of JPEGs vs the raw backend on the same model and machine.

    python -m loadtests.embed_bench [--package DIR] [--images 512] [--rounds 3] [--seconds 30]

The raw side is the backend as `softmoe serve` builds it (the same settings: their defaults),
called at a full batch of pixels already in memory, as many calls at once as the server runs
(``loadtests.raw_backend.RawBackend``). The job side is `softmoe embed PKG DIR --out OUT` in its own
process, with its defaults, on ``--images`` 640x480 JPEGs: the reading, the decode and
preprocessing in its process pool, the batcher, the Parquet shards; its images/s is its
_summary.json's, from the first sample read to the last row written (the model's loading and
start-up proofs excluded, as the raw side's are). The two alternate, round by round.

Printed, as one JSON line: ``embed_over_raw`` (the job's images/s over the raw backend's: the issue
asks for 0.9 or more), both medians and the windows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from loadtests.harness import heavy_package, jpeg, median, pick, report
from loadtests.raw_backend import RawBackend, warm_cache


def write_images(folder: Path, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"img-{i:05d}.jpg").write_bytes(jpeg(640, 480, i))


def run(package: str, *, images: int, rounds: int, seconds: float, workdir: Path, log=print) -> dict[str, Any]:
    from softmoe_models.package import read_package

    size = read_package(package).preprocess.image_size
    data = workdir / "embed-images"
    write_images(data, images)
    warm_cache(package)
    raw = RawBackend(package, 8, size)  # the server's default max batch size, the job's too
    raw_rates, job_rates = [], []
    try:
        for r in range(rounds):
            raw_rates.append(raw.window(seconds))
            out = workdir / f"embed-out-{r}"
            shutil.rmtree(out, ignore_errors=True)
            done = subprocess.run([sys.executable, "-m", "server.main", "embed", package, str(data), "--out", str(out)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"softmoe embed failed: {done.stderr.strip()[-500:]}")
            summary = json.loads((out / "_summary.json").read_text())
            if summary["n"] != images:
                raise RuntimeError(f"softmoe embed wrote {summary['n']} rows for {images} images")
            job_rates.append(summary["images_per_second"])
            log(f"  round {r + 1}: raw backend {raw_rates[-1]:8.2f} img/s   softmoe embed {job_rates[-1]:8.2f} img/s")
    finally:
        raw.close()
    return {"embed_over_raw": round(median(job_rates) / median(raw_rates), 3),
            "embed_img_per_s": round(median(job_rates), 2), "embed_raw_img_per_s": round(median(raw_rates), 2),
            "embed_windows": [round(v, 2) for v in job_rates], "embed_raw_windows": [round(v, 2) for v in raw_rates]}


def section(mode: str, workdir: Path) -> dict[str, Any]:
    """`make bench`'s embed section: soft-s16-e128 (digits in --smoke)."""
    from server.engine.defaults import SHIPPED

    package = heavy_package(mode, workdir) or SHIPPED / "digits"
    images, rounds, seconds = pick(mode, (512, 3, 30.0), (192, 1, 15.0), (24, 1, 0.3))
    print(f"\nsoftmoe embed vs the raw backend, {package.name}, {images} 640x480 JPEGs, {rounds} rounds:")
    return run(str(package), images=images, rounds=rounds, seconds=seconds, workdir=workdir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", help="model package (default: `softmoe init soft-s16-e128` in a temporary dir)")
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0, help="each raw backend window")
    args = parser.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="softmoe-embed-bench-") as tmp:
        package = args.package or str(heavy_package("full", Path(tmp)))
        result = run(package, images=args.images, rounds=args.rounds, seconds=args.seconds, workdir=Path(tmp),
                     log=lambda m: print(m, file=sys.stderr, flush=True))
    report(result, "loadtests.embed_bench", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
