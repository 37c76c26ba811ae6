"""The bench's peers section: the same exported ONNX graph with the same batching limits, decode
and threads behind `softmoe serve --backend onnxruntime` (strict, and loose), LitServe and Ray
Serve (loadtests/peers/), one server measured at a time with the others frozen.

    python -m loadtests.bench --skip decode,zeroshot,serving,frontend,routing,layers,gpu [--peers-model NAME]
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from loadtests.harness import (ROOT, Child, Load, b64, interleave, jpeg, json_request, load, median, paired, pick,
                               proven_line, wait_answers)
from loadtests.procs import descendants, frozen, mem_available
from loadtests.run import ServerProcess, free_port, wait_ready


PEERS = {"litserve": ("litserve", "loadtests.peers.litserve_app"), "ray_serve": ("ray.serve", "loadtests.peers.ray_app")}


def _importable(python: str, module: str) -> bool:
    r = subprocess.run([python, "-c", f"import {module}"], cwd=ROOT, capture_output=True, timeout=120)
    return r.returncode == 0


# Our second server beside the peers (``--peers-ours-variant``): its flags, after our defaults.
# concurrent2: two batches at once on one thread each, whether alone or not (--no-wide-lone-batches;
# our default runs a lone batch on every thread), without the routing graph (the peers have none
# either), as they are served.
# spinoff: ONNX Runtime's intra-op threads never spinning (our default spins within a batch).
OURS_VARIANTS = {"loose": ["--no-strict-determinism"],
                 "concurrent2": ["--concurrent-batches", "2", "--no-wide-lone-batches", "--no-routing"],
                 "spinoff": ["--ort-spinning", "off", "--no-routing"]}


def section(mode: str, workdir: Path, python: str, model: str, variant: str = "loose",
            session: str = "ort-defaults", rounds: int | None = None,
            seconds: float | None = None) -> dict[str, float | str]:
    """The peers section of loadtests/bench.py (see its docstring); the last JSON line's peer keys.
    ``variant``: our second server, ``ours_<variant>`` (``OURS_VARIANTS``); ``session``: the peers'
    ONNX Runtime session (loadtests/peers/common.py: ``ort-defaults`` or ``softmoe``); ``rounds`` and
    ``seconds``: the interleaved rounds and each window's length (default: the mode's). Each peer's
    throughput and c1 p50 also get a verdict from the rounds (``harness.paired``): ours ahead or
    behind only where a sign test over the rounds says so (p < 0.05: 5 of 5 rounds, 9 of 10), else
    a tie."""
    available = [name for name, (module, _) in PEERS.items() if _importable(python, module)]
    skipped = sorted(set(PEERS) - set(available))
    if skipped:
        print(f"\npeers: {', '.join(skipped)} not importable by {python}: skipped "
              "(pip install 'softmoe-serve[peers]', or --peers-python an interpreter that has them)")
    if not available:
        return {"peers": "none installed"}
    from export.onnx import read_metadata
    from export.weights_file import write_standalone
    from server.backends.onnxruntime_backend import exported_files
    from server.engine.defaults import SHIPPED
    from server.settings import Settings

    if model == "digits":
        pkg = SHIPPED / "digits"
    else:
        pkg = workdir / model
        subprocess.run([sys.executable, "-m", "softmoe_models.cli", "init", model, "--out", str(pkg)], check=True,
                       stdout=subprocess.DEVNULL)
    t0 = time.perf_counter()
    files = exported_files(pkg, "", "fp32", log=lambda m: None)  # the cache `softmoe serve` below reuses
    cached = next(f for f in files if read_metadata(f).get("graph") == "classifier")
    # the peers open the file themselves: a copy that holds its weights (the cached one reads the package's)
    onnx = write_standalone(cached, pkg / "model.safetensors", workdir / "peers" / "model.onnx")
    print(f"\npeers: {model} exported to ONNX in {time.perf_counter() - t0:.1f}s (or reused from the cache): {onnx}")
    defaults = Settings.model_fields
    batch, delay = defaults["max_batch_size"].default, defaults["max_delay_ms"].default
    threads = len(os.sched_getaffinity(0))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    peer_flags = ["--onnx", str(onnx), "--name", model, "--max-batch-size", str(batch), "--max-delay-ms", str(delay),
                  "--threads", str(threads), "--session", session]
    photos = [jpeg(640, 480, i) for i in range(pick(mode, 32, 16, 4))]
    requests = [(json_request("/v1/classify", {"images": [b64(p)]}), 1) for p in photos]
    servers: dict[str, ServerProcess] = {}
    skipped_memory: list[str] = []
    weights = sum(p.stat().st_size for p in onnx.parent.iterdir() if p.name.startswith(onnx.name))
    try:
        ours = ["--backend", "onnxruntime", "--model", f"{model}={pkg}", "--threads", str(threads)]
        starts: dict[str, Callable[[], ServerProcess]] = {
            "ours": lambda: ServerProcess(shlex.join([*ours, "--log-level", "info"]),  # info: its proven shapes
                                          Path(tempfile.mkdtemp(prefix="softmoe-bench-")) / "server.log"),
        }
        for name in available:
            def start(name=name) -> ServerProcess:
                port = free_port()
                return Child([python, "-m", PEERS[name][1], *peer_flags, "--port", str(port)], port, env)
            starts[name] = start
        # Ours with other flags too, last, the one left out where memory is short: without strict
        # determinism (loose) it tells how much of a gap at concurrency 1 is the padding;
        # concurrent2 runs two batches at once.
        second = f"ours_{variant}"
        starts[second] = lambda: ServerProcess(shlex.join([*ours, *OURS_VARIANTS[variant]]),
                                               Path(tempfile.mkdtemp(prefix="softmoe-bench-")) / "server.log")
        # One at a time, each ready before the next starts: start-up peaks (export checks, the
        # proofs) never add up. A server whose expected footprint does not fit what is left is
        # not started: each holds its weights once (ours serves the plain function from the
        # routing graph's session).
        for name, start in starts.items():
            need, free = weights + (1 << 30), mem_available()
            if name != "ours" and free < need:
                skipped_memory.append(name)
                print(f"peers: {name} not started: it needs about {need / 2**30:.1f} GiB, "
                      f"{free / 2**30:.1f} GiB are available")
                continue
            servers[name] = start()
            if name.startswith("ours"):
                wait_ready(servers[name].url, 600, servers[name])
            else:
                wait_answers(servers[name], requests[0][0], 300)
        load([s.port for s in servers.values()], requests, pick(mode, 2.0, 1.0, 0.2), 2 * len(servers))  # warm all
        window, default_rounds, conc = pick(mode, (5.0, 8, 32), (3.0, 2, 32), (0.3, 1, 8))
        window, rounds = seconds or window, rounds or default_rounds
        def alone(s: ServerProcess, concurrency: int) -> Load:
            with frozen([o for o in servers.values() if o is not s]):  # its CPU: every process below it
                return load([s.port], requests, window, concurrency, pids=descendants(s.proc.pid), label="peers")

        windows = {}
        for name, s in servers.items():
            windows[(name, "saturation")] = lambda s=s: alone(s, conc)
            windows[(name, "c1")] = lambda s=s: alone(s, 1)
        res = interleave(windows, rounds, seed=4)
        tput = {name: median([w.rps for w in res[(name, "saturation")]]) for name in servers}
        p50 = {name: median([w.ms(50) for w in res[(name, "c1")]]) for name in servers}
        p99 = {name: median([w.ms(99) for w in res[(name, "c1")]]) for name in servers}
        # CPU-ms a server spends per request at saturation (all its processes; the load generator
        # is not in it): where the model takes nearly all of it, throughputs can only tie.
        cpu = {name: median([1000 * w.server_cpu / w.requests if w.server_cpu is not None and w.requests else
                             float("nan") for w in res[(name, "saturation")]]) for name in servers}
        print(f"peers side by side: {model} ({onnx.name}), ONNX Runtime CPU, {threads} intra-op threads (the peers' "
              f"session: {session}), max batch "
              f"{batch}, max delay {delay:g} ms, 640x480 JPEGs as base64 JSON, the server's decode+preprocess; ours = "
              f"`softmoe serve --backend onnxruntime` defaults (strict determinism; {proven_line(servers['ours'])}), "
              f"{second} = the same with {' '.join(OURS_VARIANTS[variant])}; {conc} clients at saturation; the other servers frozen in each window; median of windows:")
        print(f"  {'server':16} {'req/s sat.':>10} {'CPU ms/req':>10} {'c1 p50 ms':>10} {'c1 p99 ms':>10} "
              f"{'vs ours: tput':>14} {'p50':>6} {'p99':>6} {'CPU':>6}")
        out: dict[str, float | str] = {"peers": ",".join(n for n in available if n in servers), "peers_model": model,
                                       "peers_session": session, "peers_rounds": rounds,
                                       "peers_ours_rps": round(tput["ours"], 1), "peers_ours_c1_p50_ms": round(p50["ours"], 2),
                                       "peers_ours_c1_p99_ms": round(p99["ours"], 2),
                                       "peers_ours_cpu_ms_per_request": round(cpu["ours"], 2)}
        if skipped_memory:
            out["peers_skipped_memory"] = ",".join(skipped_memory)
        for name in servers:
            ratios = (tput[name] / tput["ours"], p50[name] / p50["ours"], p99[name] / p99["ours"], cpu[name] / cpu["ours"])
            print(f"  {name:16} {tput[name]:10.1f} {cpu[name]:10.2f} {p50[name]:10.2f} {p99[name]:10.2f} "
                  f"{ratios[0]:14.2f} {ratios[1]:6.2f} {ratios[2]:6.2f} {ratios[3]:6.2f}")
            if name != "ours":
                prefix = f"peers_{name}" if name == second else f"peer_{name}"
                out[f"{prefix}_throughput_ratio"] = round(ratios[0], 3)
                out[f"{prefix}_c1_p50_ratio"] = round(ratios[1], 3)
                out[f"{prefix}_c1_p99_ratio"] = round(ratios[2], 3)
                out[f"{prefix}_cpu_per_request_ratio"] = round(ratios[3], 3)
        print(f"  round by round (theirs / ours; ahead or behind only where a sign test over the {rounds} rounds "
              "gives p < 0.05):")
        for name in servers:
            if name == "ours":
                continue
            prefix = f"peers_{name}" if name == second else f"peer_{name}"
            for what, key, better in (("req/s at saturation", "saturation", True), ("c1 p50", "c1", False)):
                pair = paired([w.rps if better else w.ms(50) for w in res[("ours", key)]],
                              [w.rps if better else w.ms(50) for w in res[(name, key)]], higher_is_better=better)
                print(f"    {name:16} {what:20} {' '.join(f'{r:.2f}' for r in pair.ratios)}: ours better in "
                      f"{pair.ahead} of {pair.rounds} (p {pair.p_ahead:.3f}), worse in {pair.behind} (p "
                      f"{pair.p_behind:.3f}): {pair.verdict}")
                stem = "throughput" if better else "c1_p50"
                out[f"{prefix}_{stem}_rounds_ahead"] = pair.ahead
                out[f"{prefix}_{stem}_verdict"] = pair.verdict
        return out
    finally:
        for s in servers.values():
            s.stop()
