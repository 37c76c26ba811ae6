"""Serving under a slow-client attack: the same server's legitimate throughput with and without
clients that trickle bodies, trickle heads or connect and say nothing, in interleaved windows.

    python -m loadtests.attack_bench [--rounds 6] [--seconds 5] [--clients 16] [--body 100] [--head 50] [--idle 50]

One `softmoe serve` with its defaults and the built-in models. The attackers run in a separate
process, one thread each, and reconnect as soon as the server cuts them off (the case the
server's bounds cannot stop: docs/design.md); they are switched on for the "attack" windows and
off for the "quiet" ones. The legitimate load is a closed loop of ``--clients`` posting one digit
PNG per /v1/classify request. Printed, as one JSON line: ``attack_throughput_ratio`` (median
requests/s under attack over quiet), ``attack_errors`` (non-200 answers to the legitimate
clients under attack: 0 expected) and ``attack_clients_cut`` (attackers the server closed with
408, from its counters). From loadtests/bench.py: ``section(mode)``.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.harness import ERRORS, interleave, json_request, load, median, serve

ROOT = Path(__file__).resolve().parents[1]


def _attacker(port: int, kind: str, on, stop) -> None:
    """One slow client: while ``on``, connect and trickle (a body, a head) or sit idle; reconnect when cut."""
    while not stop.is_set():
        if not on.wait(0.1):
            continue
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
        except OSError:
            time.sleep(0.05)
            continue
        try:
            s.settimeout(0.2)
            if kind == "body":
                s.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100000\r\n\r\n{")
            elif kind == "head":
                s.sendall(b"POST /v1/classify HTTP/1.1\r\nHo")
            while on.is_set() and not stop.is_set():
                try:
                    if not s.recv(4096):
                        break  # cut off: reconnect
                except socket.timeout:
                    if kind != "idle":
                        s.sendall(b" " if kind == "body" else b"s")
        except OSError:
            pass
        finally:
            s.close()


def _attackers(port: int, kinds: list[str], on, stop) -> None:
    threads = [threading.Thread(target=_attacker, args=(port, k, on, stop), daemon=True) for k in kinds]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(5)


def _cut(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(r'softmoe_requests_rejected_total\{model="none",reason="slow_client"\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def run(*, rounds: int, seconds: float, clients: int, body: int, head: int, idle: int, log=print) -> dict[str, Any]:
    server = serve([])
    ctx = multiprocessing.get_context("spawn")
    on, stop = ctx.Event(), ctx.Event()
    attack = ctx.Process(target=_attackers, args=(server.port, ["body"] * body + ["head"] * head + ["idle"] * idle,
                                                  on, stop), daemon=True)
    attack.start()
    errors = {"quiet": 0, "attack": 0}
    png = (ROOT / "docs" / "examples" / "seven.png").read_bytes()
    requests = [(json_request("/v1/classify", {"images": [base64.b64encode(png).decode()], "top_k": 1}), 1)]
    try:
        load([server.port], requests, min(2.0, seconds), clients)  # warm

        def window(mode: str) -> float:
            (on.set if mode == "attack" else on.clear)()
            time.sleep(min(1.0, seconds))  # attackers connected (or gone) before measuring
            out = load([server.port], requests, seconds, clients)
            errors[mode] += out.errors
            return out.rps

        cut0 = _cut(server.url)
        rps = interleave({"quiet": lambda: window("quiet"), "attack": lambda: window("attack")}, rounds, seed=7)
        on.clear()
        cut = _cut(server.url) - cut0
    finally:
        stop.set()
        on.set()  # wake the threads waiting to attack, so they see stop
        attack.join(10)
        if attack.is_alive():
            attack.kill()
        server.stop()
    out = {"attack_throughput_ratio": round(median(rps["attack"]) / median(rps["quiet"]), 3),
           "attack_errors": errors["attack"], "attack_quiet_errors": errors["quiet"], "attack_clients_cut": cut,
           "attack_rps_quiet": round(median(rps["quiet"]), 1), "attack_rps_attack": round(median(rps["attack"]), 1)}
    if errors["attack"] or errors["quiet"]:
        ERRORS["attack"] = ERRORS.get("attack", 0) + errors["attack"] + errors["quiet"]
    for mode in ("quiet", "attack"):
        log(f"  {mode:6} req/s {median(rps[mode]):8.1f}  windows {[round(v, 1) for v in rps[mode]]}  "
            f"non-200 {errors[mode]}")
    log(f"  slow clients cut off (408) while measuring: {cut:.0f}")
    return out


def section(mode: str) -> dict[str, Any]:
    """`make bench`'s attack section."""
    rounds, seconds, attackers = {"full": (6, 5.0, (100, 50, 50)), "quick": (3, 4.0, (100, 50, 50)),
                                  "smoke": (1, 0.5, (4, 2, 2))}[mode]
    body, head, idle = attackers
    print(f"\nattack: digits, 16 clients, {rounds} rounds x {seconds:g} s; {body} body-trickling, {head} "
          f"head-trickling and {idle} idle attackers, reconnecting when cut off:")
    return run(rounds=rounds, seconds=seconds, clients=16, body=body, head=head, idle=idle)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=16, help="legitimate closed-loop clients")
    parser.add_argument("--body", type=int, default=100, help="attackers trickling a body")
    parser.add_argument("--head", type=int, default=50, help="attackers trickling a head")
    parser.add_argument("--idle", type=int, default=50, help="attackers connecting and sending nothing")
    args = parser.parse_args(argv)
    result = run(rounds=args.rounds, seconds=args.seconds, clients=args.clients, body=args.body, head=args.head,
                 idle=args.idle, log=lambda m: print(m, file=sys.stderr, flush=True))
    result["command"] = "python -m loadtests.attack_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
