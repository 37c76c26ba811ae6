"""A model reloaded while it serves: failures, tail latency and memory (`make bench`'s swap section).

    python -m loadtests.swap_bench [--model soft-s16-e128] [--reloads 3] [--load 0.7] [--work DIR]
                                   [--cache-loads 50] [--only swap|cache]

The model is ``softmoe init VARIANT`` (random weights, made in ``--work``) or ``digits`` (the
shipped package), the folder ``a`` of a model repository served by ``softmoe serve
--model-control-mode explicit --load-model a`` with its defaults. First its saturated throughput
(a closed loop of clients, /v1/classify with one 224x224 JPEG each); then an open loop at
``--load`` of it (requests sent on a fixed schedule, whatever the answers do): a steady window, then
``--reloads`` reloads of ``a`` (POST /v2/repository/models/a/load: the new version is built beside
the old, traffic moves, the old one drains) with the load running throughout. Last, memory: a
second folder ``b`` (the same package) is loaded and unloaded, and the resident memory of the
server's processes is read before the load and after the unload. One JSON line:

* ``swap_failures``: non-200 answers while reloading (goal 0);
* ``swap_p99_over_steady``: p99 of the requests sent while a reload ran over p99 of the steady
  window (goal <= 2.0);
* ``swap_rss_growth_over_weights``: (resident memory after the unload - before the load) / the
  package's weight bytes (goal <= 0.25), with ``swap_rss_before_mb``, ``swap_rss_loaded_mb``,
  ``swap_rss_after_mb``;
* the figures behind them: ``swap_sat_img_s``, ``swap_offered_rps``, ``swap_p99_steady_ms``,
  ``swap_p99_during_ms``, ``swap_reload_s`` (median seconds per reload call), ``swap_requests``.

Then a bounded cache (issue 54, ``run_cache``; ``--cache-loads``): digits loaded again and again,
each time with new weights (its head biases moved), while 8 clients classify in a closed loop,
into a small cache: ``softmoe prepare`` measures one version's entry (its graphs) and everything
else a start keeps (the structure, the proofs), and the server gets ``--cache-max-size`` of those
plus two entries (the serving version, the next one and one spare). Keys:

* ``cache_bytes_after_50_loads``: the cache's bytes after the loads over one entry's bytes (goal:
  at most the cap's, ``cache_cap_over_entry``); ``cache_max_bytes_over_cap``: the most the cache
  took after any load over the cap (goal <= 1);
* ``cache_load_failures`` (goal 0), ``cache_client_errors`` (non-200 answers, goal 0),
  ``cache_loads``, ``cache_client_requests``, ``cache_evictions`` (from /metrics).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from export import cache_space
from loadtests.coldstart_bench import _clients, _prepare, other_weights
from loadtests.harness import jpeg, jpeg_request, load, open_loop_while, pick
from loadtests.memory_bench import package_for, rss_bytes
from loadtests.run import ServerProcess, scrape, wait_ready


def run(model: str = "soft-s16-e128", reloads: int = 3, fraction: float = 0.7, work: Path | None = None,
        mode: str = "full", log=print) -> dict[str, Any]:
    owned = work is None
    work = Path(tempfile.mkdtemp(prefix="softmoe-swap-")) if work is None else work
    server = None
    try:
        package = package_for(model, work)
        weights = sum(f.stat().st_size for f in package.glob("*.safetensors"))
        repo = work / "swap-repository"
        shutil.rmtree(repo, ignore_errors=True)
        repo.mkdir(parents=True)
        for name in ("a", "b"):
            shutil.copytree(package, repo / name)
        server = ServerProcess(f"--model-repository {repo} --model-control-mode explicit --load-model a "
                               f"--cache-dir {work / 'swap-cache'} --log-level info", work / "swap-server.log")
        wait_ready(server.url, 1800, server)
        size = httpx.get(f"{server.url}/v2/models/a", timeout=30).json()["inputs"][0]["shape"][-1]
        image = jpeg(size, size, seed=0)
        log(f"swap ({model}, {weights / 2**20:,.0f} MB of weights): saturation, then {fraction:.0%} of it while "
            f"{reloads} reloads run")
        load([server.port], [(jpeg_request("/v1/classify?model=a", image), 1)], pick(mode, 5, 2, 0.3), 8)  # warm
        sat = load([server.port], [(jpeg_request("/v1/classify?model=a", image), 1)], pick(mode, 20, 8, 0.5), 8,
                   label="swap saturation").items_per_s
        rate = max(sat * fraction, 1.0)
        steady_s = pick(mode, 60.0, 12.0, 1.0)
        reload_s: list[float] = []
        failures: list[str] = []

        def reload_all(window: dict) -> None:
            time.sleep(steady_s)
            for i in range(reloads):
                window["now"] = f"reload{i}"
                t0 = time.perf_counter()
                r = httpx.post(f"{server.url}/v2/repository/models/a/load", timeout=1800)
                reload_s.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    failures.append(f"reload {i}: {r.status_code} {r.text[:200]}")
                window["now"] = "between"
                time.sleep(pick(mode, 3.0, 2.0, 0.2))

        results = open_loop_while(server.url, image, rate, reload_all)
        if failures:
            raise RuntimeError("; ".join(failures))
        steady = [lat for _, lat, status, mark in results if mark == "steady" and status == 200]
        during = [lat for _, lat, status, mark in results if mark.startswith("reload") and status == 200]
        bad = [status for _, _, status, mark in results if status != 200]
        p99_steady = float(np.percentile(steady, 99)) * 1e3 if steady else float("nan")
        p99_during = float(np.percentile(during, 99)) * 1e3 if during else float("nan")
        log(f"  saturation {sat:.2f} img/s; offered {rate:.2f} req/s; p99 steady {p99_steady:.0f} ms "
            f"({len(steady)} requests), during reloads {p99_during:.0f} ms ({len(during)} requests); "
            f"reload call {statistics.median(reload_s):.1f} s (median of {reloads}); non-200: {len(bad)}")
        time.sleep(pick(mode, 5.0, 3.0, 0.5))  # the last old version drains and is released
        before = rss_bytes(server.proc.pid)
        httpx.post(f"{server.url}/v2/repository/models/b/load", timeout=1800).raise_for_status()
        loaded = rss_bytes(server.proc.pid)
        httpx.post(f"{server.url}/v2/repository/models/b/unload", timeout=600).raise_for_status()
        time.sleep(1.0)
        after = rss_bytes(server.proc.pid)
        growth = (after - before) / weights
        log(f"  resident memory: {before / 2**20:,.0f} MB before loading b, {loaded / 2**20:,.0f} MB with it, "
            f"{after / 2**20:,.0f} MB after unloading it: growth {growth:.3f}x its weights")
        return {"swap_failures": len(bad), "swap_p99_over_steady": round(p99_during / p99_steady, 3),
                "swap_rss_growth_over_weights": round(growth, 3), "swap_rss_before_mb": round(before / 2**20),
                "swap_rss_loaded_mb": round(loaded / 2**20), "swap_rss_after_mb": round(after / 2**20),
                "swap_sat_img_s": round(sat, 2), "swap_offered_rps": round(rate, 2),
                "swap_p99_steady_ms": round(p99_steady, 1), "swap_p99_during_ms": round(p99_during, 1),
                "swap_reload_s": round(statistics.median(reload_s), 2), "swap_requests": len(results)}
    finally:
        if server is not None:
            server.stop()
        if owned:
            shutil.rmtree(work, ignore_errors=True)


def run_cache(loads: int = 50, clients: int = 8, work: Path | None = None, log=print) -> dict[str, Any]:
    """digits loaded ``loads`` times with new weights under ``clients`` into a small cache (above)."""
    owned = work is None
    work = Path(tempfile.mkdtemp(prefix="softmoe-cache-")) if work is None else work
    server = None
    try:
        package = package_for("digits", work)
        repo, store = work / "cache-repository", work / "bounded-cache"
        for path in (repo, store):
            shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(package, repo / "a")
        _prepare(f"--model a={repo / 'a'} --cache-dir {store}", work / "cache-prepare.log")
        entry = max(i.bytes for i in cache_space.items(store) if i.kind == "graph")
        cap = cache_space.usage(store).total + 2 * entry
        server = ServerProcess(f"--model-repository {repo} --model-control-mode explicit --load-model a "
                               f"--cache-dir {store} --cache-max-size {cap} --log-level info", work / "cache-server.log")
        wait_ready(server.url, 1800, server)
        log(f"cache (digits): {loads} loads of new weights under {clients} clients into a cache of {cap:,} bytes "
            f"(one version's graphs: {entry:,} bytes)")
        stop, statuses, failures, most = threading.Event(), [], [], 0
        size = httpx.get(f"{server.url}/v2/models/a", timeout=30).json()["inputs"][0]["shape"][-1]
        threads = _clients(server.url, jpeg(size, size, seed=0), clients, stop, statuses)
        try:
            for i in range(loads):
                shutil.copy(other_weights("digits", package, work / "cache-weights", i + 1) / "model.safetensors",
                            repo / "a" / "model.safetensors")
                r = httpx.post(f"{server.url}/v2/repository/models/a/load", timeout=1800)
                if r.status_code != 200:
                    failures.append(f"load {i}: {r.status_code} {r.text[:300]}")
                most = max(most, cache_space.usage(store).total)
                shutil.rmtree(work / "cache-weights", ignore_errors=True)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=300)
        after = cache_space.usage(store).total
        evictions = sum(v for (name, _), v in scrape(server.url)[0].items() if name == "softmoe_cache_evictions_total")
        bad = sum(1 for s in statuses if s != 200)
        log(f"  after {loads} loads: {after:,} bytes ({after / entry:.1f} entries' worth; cap {cap / entry:.1f}), "
            f"at most {most / cap:.2f} of the cap; {evictions:.0f} entries removed; load failures {len(failures)}, "
            f"client errors {bad} of {len(statuses)}" + (f": {failures[0]}" if failures else ""))
        return {"cache_bytes_after_50_loads": round(after / entry, 2), "cache_cap_over_entry": round(cap / entry, 2),
                "cache_max_bytes_over_cap": round(most / cap, 3), "cache_load_failures": len(failures),
                "cache_client_errors": bad, "cache_loads": loads, "cache_client_requests": len(statuses),
                "cache_evictions": int(evictions)}
    finally:
        if server is not None:
            server.stop()
        if owned:
            shutil.rmtree(work, ignore_errors=True)


def section(mode: str, workdir: Path) -> dict[str, Any]:
    """`make bench`'s swap section: soft-s16-e128 (the serving section's package), or digits in --smoke;
    then the bounded cache (digits, 50 loads; 3 in --smoke)."""
    print()
    model, reloads = {"full": ("soft-s16-e128", 3), "quick": ("soft-s16-e128", 2), "smoke": ("digits", 1)}[mode]
    return {**run(model, reloads, 0.7, workdir, mode), **run_cache(pick(mode, 50, 20, 3), 8, workdir)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="soft-s16-e128", help="a variant (random weights) or 'digits'")
    parser.add_argument("--reloads", type=int, default=3)
    parser.add_argument("--load", type=float, default=0.7, help="the offered load, a fraction of saturation")
    parser.add_argument("--work", type=Path, default=None, help="where the package is made (default: a temp dir)")
    parser.add_argument("--cache-loads", type=int, default=50, help="loads of new digits weights into a small cache")
    parser.add_argument("--only", choices=["swap", "cache"], default=None, help="one part only")
    args = parser.parse_args(argv)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    result = {} if args.only == "cache" else run(args.model, args.reloads, args.load, args.work, "full", log=say)
    if args.only != "swap":
        result.update(run_cache(args.cache_loads, 8, args.work, log=say))
    result["command"] = "python -m loadtests.swap_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
