"""Time to a first answer: a start with nothing cached, a start from a prepared cache, and a package
of the same structure with other weights loaded while a server runs (`make bench`'s coldstart section).

    python -m loadtests.coldstart_bench [--model soft-s16-e128] [--clients 8] [--work DIR]

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
* ``reload_new_weights_loaded_s``: the same call while ``--clients`` clients classify on ``a`` in a
  closed loop, with ``reload_new_weights_failures`` their non-200 answers (goal 0) (digits: goal <= 2 s);
* ``disk_over_weights``: the package's bytes plus the prepared cache's over the weight bytes (goal <= 1.1).
"""

from __future__ import annotations

import argparse
import json
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

from loadtests.harness import jpeg
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


def run(model: str = "soft-s16-e128", clients: int = 8, work: Path | None = None, log=print) -> dict[str, Any]:
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
        server.stop()
        disk = (disk_bytes(package) + disk_bytes(prepared_cache)) / weights
        log(f"  softmoe prepare {prepare_s:.1f} s; then a fresh server ready after {prepared_s:.1f} s "
            f"({prepared_s / read_s:.1f}x the read); package + cache on disk {disk:.2f}x the weights")

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
        stop, statuses = threading.Event(), []
        threads = _clients(server.url, jpeg(size, size, seed=0), clients, stop, statuses)
        time.sleep(2.0)  # the clients are in their loop
        t0 = time.perf_counter()
        r = httpx.post(f"{server.url}/v2/repository/models/c/load", timeout=3600)
        loaded_s = time.perf_counter() - t0
        stop.set()
        for t in threads:
            t.join(timeout=300)
        r.raise_for_status()
        failures = sum(1 for s in statuses if s != 200)
        log(f"  other weights: loaded in {idle_s:.2f} s idle, {loaded_s:.2f} s under {clients} clients "
            f"({len(statuses)} requests, {failures} not 200)")
        return {"coldstart_read_s": round(read_s, 4), "coldstart_first_s": round(first_s, 2),
                "coldstart_prepare_s": round(prepare_s, 2), "coldstart_prepared_s": round(prepared_s, 2),
                "coldstart_prepared_over_read": round(prepared_s / read_s, 2),
                "reload_new_weights_s": round(idle_s, 2), "reload_new_weights_loaded_s": round(loaded_s, 2),
                "reload_new_weights_failures": failures, "disk_over_weights": round(disk, 3),
                "coldstart_model": model}
    finally:
        for s in servers:
            s.stop()
        if owned:
            shutil.rmtree(work, ignore_errors=True)


def section(mode: str, workdir: Path) -> dict[str, Any]:
    """`make bench`'s coldstart section: soft-s16-e128 and digits (digits alone in --smoke)."""
    print()
    out: dict[str, Any] = {} if mode == "smoke" else run("soft-s16-e128", 8, workdir / "coldstart-big")
    digits = run("digits", 8 if mode != "smoke" else 2, workdir / "coldstart-digits")
    if mode == "smoke":  # every key, from digits
        out.update(digits)
    out["reload_new_weights_digits_s"] = digits["reload_new_weights_loaded_s"]
    out.pop("coldstart_model", None)
    return out

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="soft-s16-e128", help="a variant (random weights) or 'digits'")
    parser.add_argument("--clients", type=int, default=8, help="clients classifying while the other weights load")
    parser.add_argument("--work", type=Path, default=None, help="where the packages are made (default: a temp dir)")
    args = parser.parse_args(argv)
    result = run(args.model, args.clients, args.work, log=lambda m: print(m, file=sys.stderr, flush=True))
    result["command"] = "python -m loadtests.coldstart_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
