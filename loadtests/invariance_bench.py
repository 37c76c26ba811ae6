"""What the batch-invariant layer forms cost on CPU, and what they buy strict mode at low load.

    python -m loadtests.invariance_bench [--model soft-s16-e128] [--rounds 3]

One torch backend (``TorchBackend.run``, the server's call) on a random-weight model of the
variant, its forms switched between calls (``softmoe_models.batch_invariance``), every
measurement once per round in a shuffled order, medians. Printed, as one JSON line:

* ``invariance_shapes_stock`` / ``invariance_shapes_invariant``: the padded shapes (of 1, 2, 4, 8)
  whose per-row outputs are bitwise those of 8, for each form;
* ms per call at batch 1, 4 and 8 in each form, and at each form's smallest proven shape;
* ``invariance_strict_c1_speedup``: a lone image in strict mode before (at the smallest shape the
  stock forms prove) over after (at the smallest the invariant forms prove);
* ``invariance_b1_cost`` and ``invariance_b8_cost``: invariant over stock at batch 1 (what loose mode
  would pay, so it keeps the stock forms) and at batch 8.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

BATCHES = (1, 4, 8)


def _model(variant: str):
    import torch

    from softmoe_models.config import variant_config
    from softmoe_models.models import build_model

    if variant == "digits":
        from server.engine.defaults import SHIPPED
        from softmoe_models.package import load_model

        return load_model(SHIPPED / "digits")
    torch.manual_seed(0)
    model = build_model(variant_config(variant)).eval().requires_grad_(False)
    for m in model.modules():
        if hasattr(m, "fold"):
            m.fold()
    return model


def proven(backend, x: np.ndarray, name: str) -> list[int]:
    """The shapes of 1, 2, 4 (and 8) whose rows are bitwise the rows of one call of 8."""
    ref = backend.run("classify", {name: x})
    good = []
    for size in (1, 2, 4):
        same = True
        for start in range(0, len(x), size):
            out = backend.run("classify", {name: x[start:start + size]})
            same &= all(np.array_equal(out[k], ref[k][start:start + size]) for k in ref)
        if same:
            good.append(size)
    return good + [len(x)]


def run(variant: str = "soft-s16-e128", rounds: int = 3, calls: int = 3, log=print) -> dict[str, Any]:
    from server.backends.torch_backend import TorchBackend
    from softmoe_models.batch_invariance import set_batch_invariant

    backend = TorchBackend(_model(variant), max_batch_size=8)
    spec = backend.functions["classify"].inputs[0]
    x = np.random.default_rng(0).uniform(-1, 1, (8, *spec.shape)).astype(np.float32)
    out: dict[str, Any] = {"invariance_model": variant}
    for form, on in (("stock", False), ("invariant", True)):
        set_batch_invariant(backend.model, on)
        out[f"invariance_shapes_{form}"] = proven(backend, x, spec.name)
    # A lone image in strict mode runs at the smallest shape its form proves, whichever that is on
    # this CPU (1 on AVX-512 machines, 2 where AVX2 kernels give 1 other bits): timed as well.
    lone = {form: min(out[f"invariance_shapes_{form}"]) for form in ("stock", "invariant")}
    batches = sorted({*BATCHES, *lone.values()})
    times: dict[tuple[str, int], list[float]] = {}
    rng = random.Random(0)
    for _ in range(rounds):
        order = [(form, b) for form in ("stock", "invariant") for b in batches]
        rng.shuffle(order)
        for form, b in order:
            set_batch_invariant(backend.model, form == "invariant")
            rows = {spec.name: x[:b]}
            backend.run("classify", rows)
            t0 = time.perf_counter()
            for _ in range(calls):
                backend.run("classify", rows)
            times.setdefault((form, b), []).append((time.perf_counter() - t0) / calls)
    med = {k: statistics.median(v) for k, v in times.items()}
    for (form, b), v in sorted(med.items()):
        out[f"invariance_ms_{form}_b{b}"] = round(v * 1e3, 2)
    out["invariance_strict_c1_speedup"] = round(med[("stock", lone["stock"])] / med[("invariant", lone["invariant"])], 3)
    out["invariance_b1_cost"] = round(med[("invariant", 1)] / med[("stock", 1)], 3)
    out["invariance_b8_cost"] = round(med[("invariant", 8)] / med[("stock", 8)], 3)
    log(f"invariance ({variant}): proven shapes stock {out['invariance_shapes_stock']}, invariant "
        f"{out['invariance_shapes_invariant']}; " + ", ".join(f"{form} b{b} {v * 1e3:.1f} ms" for (form, b), v in sorted(med.items())))
    backend.close()
    return out


def section(mode: str) -> dict[str, Any]:
    """`make bench`'s invariance section, in a child process: its random soft-s16-e128 (3.5 GB)
    goes back when it exits. Shapes become comma lists (the bench's JSON holds scalars)."""
    model, rounds = {"full": ("soft-s16-e128", 3), "quick": ("soft-s16-e128", 2), "smoke": ("digits", 1)}[mode]
    r = subprocess.run([sys.executable, "-m", "loadtests.invariance_bench", "--model", model, "--rounds", str(rounds)],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, check=True)
    print("\n" + r.stderr.strip().splitlines()[-1])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out.pop("command")
    for key in ("invariance_shapes_stock", "invariance_shapes_invariant"):
        out[key] = ",".join(map(str, out[key]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="cost and benefit of the batch-invariant layer forms (one JSON line)")
    parser.add_argument("--model", default="soft-s16-e128", help="a variant (random weights) or 'digits'")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    result = run(args.model, args.rounds, log=lambda m: print(m, file=sys.stderr, flush=True))
    result["command"] = f"python -m loadtests.invariance_bench --model {args.model} --rounds {args.rounds}"
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
