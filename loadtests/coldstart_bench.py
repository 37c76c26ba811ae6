"""Time to a first answer: a start with nothing cached, a start from a prepared cache, and a package
of the same structure with other weights loaded while a server runs (`make bench`'s coldstart section).

    python -m loadtests.coldstart_bench [--model soft-s16-e128] [--load 0.7 | --clients 8] [--work DIR]

The model is ``softmoe init VARIANT`` (random weights, made in ``--work``; the other weights are
``--seed 1`` and ``--seed 2``) or ``digits`` (the shipped package; the other weights are its head biases moved).
Every figure has, from the same run, the seconds to read the package's weight bytes once from the
page cache beside it (``coldstart_read_s``: the file read twice, the second read timed). One JSON line:

* ``coldstart_first_s``: a fresh ``softmoe serve`` process on an empty cache, spawn to ready;
* ``coldstart_prepare_s``: ``softmoe prepare`` into another empty cache;
* ``coldstart_prepared_s``: a fresh server on that prepared cache, spawn to ready (goal <= 10 s
  for soft-s16-e128 on 2 cores), ``coldstart_prepared_over_read`` over ``coldstart_read_s`` (goal <= 3);
* ``reload_new_weights_s``: POST /v2/repository/models/b/load of the other weights into an idle server
  that serves the package as ``a`` (its graphs bound into ``a``'s structure; goal <= 20 s);
* ``reload_new_weights_loaded_s``: the same call for a third package while ``a`` serves an open loop
  of /v1/classify at ``--load`` of its saturated throughput (goal <= 60 s), with
  ``reload_new_weights_failures`` its non-200 answers (goal 0) and ``reload_new_weights_p99_over_steady``
  the p99 of the requests sent during the call over that of a steady window before it (goal <= 2.0);
  with ``--clients N`` instead, N clients classify in a closed loop (digits: 8 clients, goal <= 2 s);
* ``disk_over_weights``: the package's bytes plus the prepared cache's over the weight bytes (goal <= 1.1),
  and ``page_cache_over_weights``: the bytes of those files in the page cache once the prepared
  server is ready, over the weight bytes (every byte a start reads is in it; it reads each once);
* ``prepared_anon_over_weights``: the prepared server's anonymous resident memory once ready (its
  own copy of the weights, prepacked, beside the interpreter and its imports) over the weight bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from safetensors.numpy import load_file, save_file

from loadtests.harness import jpeg, jpeg_request, load, open_loop_while
from loadtests.memory_bench import package_for
from loadtests.run import ServerProcess, wait_ready


def read_once_s(package: Path) -> float:
    """Seconds to read the package's weight files once, from the page cache (a first read fills it)."""
    files = sorted(package.glob("*.safetensors"))
    for timed in (False, True):
        t0 = time.perf_counter()
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.read(64 << 20):
                    pass
        if timed:
            return time.perf_counter() - t0
    raise AssertionError("unreachable")


def other_weights(model: str, package: Path, work: Path, seed: int) -> Path:
    """A package of ``package``'s structure with other weights: ``softmoe init --seed SEED`` of the
    same variant, or for digits its head biases moved by ``seed``."""
    out = work / f"{model}-seed{seed}"
    if out.exists():
        return out
    if model != "digits":
        subprocess.run([sys.executable, "-m", "softmoe_models.cli", "init", model, "--seed", str(seed), "--out", str(out)],
                       check=True, stdout=subprocess.DEVNULL)
        return out
    shutil.copytree(package, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["head.bias"] = (weights["head.bias"] + seed * np.arange(weights["head.bias"].size, dtype=np.float32)).astype(np.float32)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "softmoe-package"})
    return out


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def cached_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` that are in the page cache (``mincore`` of a private map
    of each: its pages are the page cache's until written, and nothing writes them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page, total = mmap.PAGESIZE, 0
    for f in (p for p in path.rglob("*") if p.is_file() and p.stat().st_size):
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as m:
            vec = ctypes.create_string_buffer((len(m) + page - 1) // page)
            start = ctypes.c_char.from_buffer(m)
            failed = libc.mincore(ctypes.addressof(start), len(m), vec)
            del start  # the map closes only once nothing points into it
            if failed:
                raise OSError(ctypes.get_errno(), f"mincore of {f}")
            total += min(len(m), page * sum(b & 1 for b in vec.raw))
    return total


def anon_bytes(pid: int) -> int:
    """RssAnon of ``pid`` (resident memory no file backs), in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:"))


def _start(args: str, log_path: Path) -> tuple[ServerProcess, float]:
    """A fresh server process with ``args``; it and the seconds from spawn to ready."""
    t0 = time.perf_counter()
    server = ServerProcess(args + " --log-level info", log_path)
    wait_ready(server.url, 3600, server)
    return server, time.perf_counter() - t0


def _prepare(args: str, log_path: Path) -> float:
    t0 = time.perf_counter()
    with open(log_path, "wb") as out:
        subprocess.run([sys.executable, "-m", "server", "prepare", *args.split()], check=True, stdout=out,
                       stderr=subprocess.STDOUT)
    return time.perf_counter() - t0


def _clients(url: str, body: bytes, n: int, stop: threading.Event, statuses: list[int]) -> list[threading.Thread]:
    def loop() -> None:
        with httpx.Client(base_url=url, timeout=300) as client:
            while not stop.is_set():
                try:
                    statuses.append(client.post("/v1/classify?model=a", content=body,
                                                headers={"content-type": "image/jpeg"}).status_code)
                except httpx.HTTPError:
                    statuses.append(0)
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def _load_under_clients(url: str, body: bytes, clients: int) -> tuple[float, int, int, None]:
    """Seconds of POST .../models/c/load while ``clients`` classify on ``a`` in a closed loop; their
    non-200 answers and their requests."""
    stop, statuses = threading.Event(), []
    threads = _clients(url, body, clients, stop, statuses)
    time.sleep(2.0)  # the clients are in their loop
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v2/repository/models/c/load", timeout=3600)
    loaded_s = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join(timeout=300)
    r.raise_for_status()
    return loaded_s, sum(1 for s in statuses if s != 200), len(statuses), None


def _load_under_open_loop(server: ServerProcess, body: bytes, fraction: float, steady_s: float
                          ) -> tuple[float, int, int, float]:
    """Seconds of POST .../models/c/load while ``a`` serves an open loop at ``fraction`` of its
    saturated throughput (8 closed-loop clients); the loop's non-200 answers, its requests, and the
    p99 of the requests sent during the call over that of the ``steady_s`` window before it."""
    request = [(jpeg_request("/v1/classify?model=a", body), 1)]
    load([server.port], request, min(3.0, steady_s), 8)  # warm
    sat = load([server.port], request, min(15.0, steady_s), 8, label="coldstart saturation").items_per_s
    rate = max(fraction * sat, 0.5)
    took: list[float] = []

    def reload(window: dict) -> None:
        time.sleep(steady_s)
        window["now"] = "load"
        t0 = time.perf_counter()
        r = httpx.post(f"{server.url}/v2/repository/models/c/load", timeout=3600)
        took.append(time.perf_counter() - t0)
        r.raise_for_status()

    results = open_loop_while(server.url, body, rate, reload)
    if not took:
        raise RuntimeError("the load call did not finish")
    p99 = {w: float(np.percentile([lat for _, lat, status, mark in results if mark == w and status == 200] or [np.nan], 99))
           for w in ("steady", "load")}
    return took[0], sum(1 for r in results if r[2] != 200), len(results), p99["load"] / p99["steady"]


def run(model: str = "soft-s16-e128", clients: int = 8, work: Path | None = None, log=print,
        fraction: float | None = None, steady_s: float = 30.0) -> dict[str, Any]:
    """The figures of the module's docstring; the third package loads under an open loop at
    ``fraction`` of saturation (after ``steady_s`` of it), or under ``clients`` closed-loop clients
    when ``fraction`` is None."""
    owned = work is None
    work = Path(tempfile.mkdtemp(prefix="softmoe-coldstart-")) if work is None else work
    work.mkdir(parents=True, exist_ok=True)
    servers: list[ServerProcess] = []
    try:
        package = package_for(model, work)
        weights = sum(f.stat().st_size for f in package.glob("*.safetensors"))
        read_s = read_once_s(package)
        log(f"coldstart ({model}, {weights / 2**20:,.0f} MB of weights; read once from the page cache in {read_s:.3f} s)")
        first_cache, prepared_cache = work / "coldstart-first", work / "coldstart-prepared"
        for d in (first_cache, prepared_cache):
            shutil.rmtree(d, ignore_errors=True)

        server, first_s = _start(f"--model a={package} --cache-dir {first_cache}", work / "coldstart-first.log")
        servers.append(server)
        server.stop()
        log(f"  nothing cached: ready after {first_s:.1f} s")

        prepare_s = _prepare(f"--model a={package} --cache-dir {prepared_cache}", work / "coldstart-prepare.log")
        server, prepared_s = _start(f"--model a={package} --cache-dir {prepared_cache}", work / "coldstart-prepared.log")
        servers.append(server)
        paged = (cached_bytes(package) + cached_bytes(prepared_cache)) / weights
        anon = anon_bytes(server.proc.pid) / weights
        server.stop()
        disk = (disk_bytes(package) + disk_bytes(prepared_cache)) / weights
        log(f"  softmoe prepare {prepare_s:.1f} s; then a fresh server ready after {prepared_s:.1f} s "
            f"({prepared_s / read_s:.1f}x the read); package + cache on disk {disk:.2f}x the weights, "
            f"{paged:.2f}x in the page cache; anonymous memory {anon:.2f}x")

        repo = work / "coldstart-repository"
        shutil.rmtree(repo, ignore_errors=True)
        repo.mkdir()
        shutil.copytree(package, repo / "a")
        for seed, name in ((1, "b"), (2, "c")):  # each load binds weights no cache entry holds
            shutil.copytree(other_weights(model, package, work, seed), repo / name)
        server, _ = _start(f"--model-repository {repo} --model-control-mode explicit --load-model a "
                           f"--cache-dir {first_cache}", work / "coldstart-reload.log")
        servers.append(server)
        t0 = time.perf_counter()
        httpx.post(f"{server.url}/v2/repository/models/b/load", timeout=3600).raise_for_status()
        idle_s = time.perf_counter() - t0
        size = httpx.get(f"{server.url}/v2/models/a", timeout=30).json()["inputs"][0]["shape"][-1]
        body = jpeg(size, size, seed=0)
        if fraction is None:
            loaded_s, failures, requests, tail = _load_under_clients(server.url, body, clients)
            under = f"{clients} clients"
        else:
            loaded_s, failures, requests, tail = _load_under_open_loop(server, body, fraction, steady_s)
            under = f"{fraction:.0%} of saturation (p99 during the call {tail:.2f}x the steady one's)"
        log(f"  other weights: loaded in {idle_s:.2f} s idle, {loaded_s:.2f} s under {under} "
            f"({requests} requests, {failures} not 200)")
        extra = {} if tail is None else {"reload_new_weights_p99_over_steady": round(tail, 3)}
        return {"coldstart_read_s": round(read_s, 4), "coldstart_first_s": round(first_s, 2),
                "coldstart_prepare_s": round(prepare_s, 2), "coldstart_prepared_s": round(prepared_s, 2),
                "coldstart_prepared_over_read": round(prepared_s / read_s, 2),
                "reload_new_weights_s": round(idle_s, 2), "reload_new_weights_loaded_s": round(loaded_s, 2),
                "reload_new_weights_failures": failures, "disk_over_weights": round(disk, 3),
                "page_cache_over_weights": round(paged, 3), "prepared_anon_over_weights": round(anon, 3), **extra,
                "coldstart_model": model}
    finally:
        for s in servers:
            s.stop()
        if owned:
            shutil.rmtree(work, ignore_errors=True)


def section(mode: str, workdir: Path) -> dict[str, Any]:
    """`make bench`'s coldstart section: soft-s16-e128 and digits (digits alone in --smoke)."""
    print()
    out: dict[str, Any] = {} if mode == "smoke" else run("soft-s16-e128", 8, workdir / "coldstart-big", fraction=0.7)
    # smoke: digits with every key, its other weights loaded under the open loop too
    digits = run("digits", 8, workdir / "coldstart-digits", **({"fraction": 0.7, "steady_s": 2.0} if mode == "smoke" else {}))
    if mode == "smoke":  # every key, from digits
        out.update(digits)
    out["reload_new_weights_digits_s"] = digits["reload_new_weights_loaded_s"]
    out.pop("coldstart_model", None)
    return out

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="soft-s16-e128", help="a variant (random weights) or 'digits'")
    parser.add_argument("--load", type=float, default=0.7, help="the open loop's share of saturation while the other "
                        "weights load (0: --clients closed-loop clients instead)")
    parser.add_argument("--clients", type=int, default=8, help="with --load 0, clients classifying in a closed loop")
    parser.add_argument("--work", type=Path, default=None, help="where the packages are made (default: a temp dir)")
    args = parser.parse_args(argv)
    result = run(args.model, args.clients, args.work, log=lambda m: print(m, file=sys.stderr, flush=True),
                 fraction=args.load or None)
    result["command"] = "python -m loadtests.coldstart_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
