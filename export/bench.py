"""Benchmark: reference-einsum ONNX vs fused ONNX vs PyTorch eager on a paper-shaped Soft MoE stack.

    python -m export.bench [--layers 3] [--batches 1 8] [--rounds 15]

The stack is ``--layers`` encoder blocks of Soft MoE S/16 (d=384, 6 heads, 128 experts of
width 1536, one slot each, 196 tokens: the MoE half of ``soft-s16-e128``). Every form runs in
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
from .onnx import _export_one, op_inventory
from .runtime import ort_session

D, HEADS, MLP, EXPERTS, TOKENS = 384, 6, 1536, 128, 196


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


def build_stack(layers: int, seed: int = 0) -> Encoder:
    torch.manual_seed(seed)
    cfg = EncoderConfig(D, layers, HEADS, MLP, moe=MoEConfig(tuple(range(layers)), EXPERTS, 1))
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
    graph = Graph("stack", _Tokens(stack), [TensorSpec("tokens", ("batch", TOKENS, D), torch.float32)], ["hidden"])
    _export_one(graph, path, opset=20, dynamic=True, metadata={}, external=True)
    configure_routing(stack, fused=True, experts_form="batched")
    return op_inventory(path)


def run(layers: int, batches: list[int], rounds: int, workdir: Path) -> dict[str, float]:
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    stack = build_stack(layers)
    forms: dict[str, Path] = {}
    print(f"machine: {machine()}")
    print(f"stack: {layers} Soft MoE S/16 blocks (d={D}, {EXPERTS} experts x 1 slot, {TOKENS} tokens), "
          f"{sum(p.numel() for p in stack.parameters()) / 1e6:.0f}M params")
    for name, fused, experts in (("ort_reference_einsum", False, "batched"),
                                 ("ort_fused_per_expert", True, "per_expert"),
                                 ("ort_fused_batched", True, "batched")):
        t0 = time.perf_counter()
        ops = _export(stack, workdir / f"{name}.onnx", fused=fused, experts=experts)
        forms[name] = workdir / f"{name}.onnx"
        print(f"exported {name}: {sum(ops.values())} nodes, Einsum={ops.get('Einsum', 0)}, {time.perf_counter() - t0:.1f}s")
    sessions = {name: ort_session(path) for name, path in forms.items()}

    def eager(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return stack(torch.from_numpy(x)).numpy()

    runners = {"torch_eager_fused": eager}
    for name, sess in sessions.items():
        runners[name] = lambda x, s=sess: s.run(None, {"tokens": x})[0]

    rng = random.Random(0)
    times: dict[tuple[str, int], list[float]] = {(n, b): [] for n in runners for b in batches}
    inputs = {b: np.random.default_rng(b).standard_normal((b, TOKENS, D)).astype(np.float32) for b in batches}
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
            f"fused_vs_reference_ort_b{b}": ("ort_reference_einsum", "ort_fused_per_expert"),
            f"reference_ort_vs_eager_b{b}": ("ort_reference_einsum", "torch_eager_fused"),
            f"eager_vs_fused_ort_b{b}": ("torch_eager_fused", "ort_fused_per_expert"),
            f"batched_vs_per_expert_ort_b{b}": ("ort_fused_batched", "ort_fused_per_expert"),
        }
        for key, (slow, fast) in pairs.items():
            ratios[key] = round(med[(slow, b)] / med[(fast, b)], 3)
            print(f"  {key:34} {slow} / {fast} = {ratios[key]:.2f}x")
    return ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="softmoe-bench-") as tmp:
        ratios = run(args.layers, args.batches, args.rounds, Path(tmp))
    print(f"command: python -m export.bench --layers {args.layers} --batches {' '.join(map(str, args.batches))} --rounds {args.rounds}")
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
