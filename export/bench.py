"""Benchmark: reference-einsum ONNX vs fused ONNX vs PyTorch eager on a paper-shaped Soft MoE stack.

    python -m export.bench [--layers 3] [--batches 1 8] [--rounds 15]

The stack is ``--layers`` encoder blocks of Soft MoE S/16 (d=384, 6 heads, 128 experts of
width 1536, one slot each, 196 tokens: the MoE half of ``soft-s16-e128``), or of B/16 with
``--width B`` (d=768, 12 heads, experts of width 3072). Every form runs in
this one process, interleaved in a shuffled order each round, single intra-op thread pool per
runtime with spinning off; medians are reported with ratios against the fused ONNX graph and
eager PyTorch. Not a test: it prints numbers, the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from softmoe_models.config import EncoderConfig, MoEConfig
from softmoe_models.layers import Encoder
from softmoe_models.soft_moe import configure_routing

from .graphs import Graph, TensorSpec
from .onnx import export_one, op_inventory
from .runtime import ort_session

TOKENS, EXPERTS = 196, 128
WIDTHS = {"S": (384, 6, 1536), "B": (768, 12, 3072)}  # d, heads, expert width (paper S/16, B/16)


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} CPUs, torch {torch.__version__}"


def build_stack(layers: int, width: str = "S", seed: int = 0) -> Encoder:
    torch.manual_seed(seed)
    d, heads, mlp = WIDTHS[width]
    cfg = EncoderConfig(d, layers, heads, mlp, moe=MoEConfig(tuple(range(layers)), EXPERTS, 1))
    stack = Encoder(cfg, TOKENS).eval().requires_grad_(False)
    for m in stack.modules():
        if hasattr(m, "fold"):
            m.fold()
    return stack


class _Tokens(torch.nn.Module):
    def __init__(self, stack: Encoder) -> None:
        super().__init__()
        self.stack = stack

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.stack(tokens)


def _export(stack: Encoder, path: Path, *, fused: bool, experts: str) -> dict[str, int]:
    configure_routing(stack, fused=fused, experts_form=experts)
    d = stack.norm.normalized_shape[0]
    graph = Graph("stack", _Tokens(stack), [TensorSpec("tokens", ("batch", TOKENS, d), torch.float32)], ["hidden"])
    export_one(graph, path, opset=20, dynamic=True, metadata={}, external=True)
    configure_routing(stack, fused=True, experts_form="batched")
    return op_inventory(path)


def run(layers: int, batches: list[int], rounds: int, workdir: Path, width: str = "S", suffix: str = "") -> dict[str, float]:
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    stack = build_stack(layers, width)
    d = WIDTHS[width][0]
    forms: dict[str, Path] = {}
    print(f"machine: {machine()}")
    print(f"stack: {layers} Soft MoE {width}/16 blocks (d={d}, {EXPERTS} experts x 1 slot, {TOKENS} tokens), "
          f"{sum(p.numel() for p in stack.parameters()) / 1e6:.0f}M params")
    for name, fused, experts in (("ort_reference_einsum", False, "batched"),
                                 ("ort_fused_per_expert", True, "per_expert"),
                                 ("ort_fused_batched", True, "batched")):
        t0 = time.perf_counter()
        ops = _export(stack, workdir / f"{name}.onnx", fused=fused, experts=experts)
        forms[name] = workdir / f"{name}.onnx"
        print(f"exported {name}: {sum(ops.values())} nodes, Einsum={ops.get('Einsum', 0)}, {time.perf_counter() - t0:.1f}s")
    sessions = {name: ort_session(path) for name, path in forms.items()}

    def eager(x: np.ndarray, fused: bool = True) -> np.ndarray:
        configure_routing(stack, fused=fused)
        try:
            with torch.inference_mode():
                return stack(torch.from_numpy(x)).numpy()
        finally:
            configure_routing(stack, fused=True)

    runners = {"torch_eager_fused": eager, "torch_eager_reference": lambda x: eager(x, fused=False)}
    for name, sess in sessions.items():
        runners[name] = lambda x, s=sess: s.run(None, {"tokens": x})[0]

    rng = random.Random(0)
    times: dict[tuple[str, int], list[float]] = {(n, b): [] for n in runners for b in batches}
    inputs = {b: np.random.default_rng(b).standard_normal((b, TOKENS, d)).astype(np.float32) for b in batches}
    for b in batches:  # warm-up and agreement check
        outs = {n: r(inputs[b]) for n, r in runners.items()}
        base = outs["torch_eager_fused"]
        for n, o in outs.items():
            print(f"  batch {b} {n}: max abs diff vs eager {float(np.abs(o - base).max()):.1e}")
    for _ in range(rounds):
        order = [(n, b) for n in runners for b in batches]
        rng.shuffle(order)
        for n, b in order:
            t0 = time.perf_counter()
            runners[n](inputs[b])
            times[(n, b)].append(time.perf_counter() - t0)

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"\nmedian ms over {rounds} interleaved rounds")
    print(f"{'form':24}" + "".join(f"{'b=' + str(b):>12}" for b in batches))
    for n in runners:
        print(f"{n:24}" + "".join(f"{med[(n, b)]:>12.1f}" for b in batches))
    ratios: dict[str, float] = {}
    print("\nratios (higher = the first is slower)")
    for b in batches:
        pairs = {
            f"fused_vs_reference_ort{suffix}_b{b}": ("ort_reference_einsum", "ort_fused_per_expert"),
            f"fused_vs_reference_eager{suffix}_b{b}": ("torch_eager_reference", "torch_eager_fused"),
            f"reference_ort_vs_eager{suffix}_b{b}": ("ort_reference_einsum", "torch_eager_fused"),
            f"eager_vs_fused_ort{suffix}_b{b}": ("torch_eager_fused", "ort_fused_per_expert"),
            f"batched_vs_per_expert_ort{suffix}_b{b}": ("ort_fused_batched", "ort_fused_per_expert"),
        }
        for key, (slow, fast) in pairs.items():
            ratios[key] = round(med[(slow, b)] / med[(fast, b)], 3)
            print(f"  {key:38} {slow} / {fast} = {ratios[key]:.2f}x")
    for (n, b), v in med.items():
        ratios[f"ms_{n}{suffix}_b{b}"] = round(v, 2)
    return ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--width", choices=list(WIDTHS), default="S")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="softmoe-bench-") as tmp:
        ratios = run(args.layers, args.batches, args.rounds, Path(tmp), args.width)
    print(f"command: python -m export.bench --layers {args.layers} --width {args.width} "
          f"--batches {' '.join(map(str, args.batches))} --rounds {args.rounds}")
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
