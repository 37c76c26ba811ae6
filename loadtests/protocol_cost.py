"""What bounding request heads costs (server.http.connection): the CPU time per request of uvicorn's
httptools protocol against the bounded one, side by side in one run.

    python -m loadtests.protocol_cost [--requests 20000] [--rounds 7]

No network and no model: each protocol instance is fed a typical keep-alive request (an httpx
POST's eight headers and a small JSON body) on a transport that only records the response, and
answers it from a minimal ASGI app, on uvloop, request after request. Rounds alternate the two
protocols; the figures are the medians over rounds of the microseconds per request, and their
ratio. The last line is one JSON object. From loadtests/bench.py: ``section(mode)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

REQUEST = (b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nUser-Agent: python-httpx/0.28.1\r\n"
           b"Accept: */*\r\nAccept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\n"
           b"Content-Type: application/json\r\nContent-Length: 20\r\n\r\n" b'{"images": ["abcd"]}')


async def _app(scope, receive, send) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


class _Transport(asyncio.Transport):
    """Takes the response bytes; resolves ``done`` at the end of each response."""

    def __init__(self) -> None:
        super().__init__()
        self.closing, self.done = False, None

    def write(self, data) -> None:
        if bytes(data).endswith(b"{}") and self.done is not None:
            self.done.set_result(None)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _per_request_us(protocol_class, requests: int) -> float:
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    config = Config(_app, log_level="warning")
    config.load()
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = _Transport()
    protocol.connection_made(transport)
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    for _ in range(requests):
        transport.done = loop.create_future()
        protocol.data_received(REQUEST)
        await transport.done
        await asyncio.sleep(0)  # let the request's task finish and the response-complete callback run
    elapsed = time.perf_counter() - start
    protocol.connection_lost(None)
    return elapsed / requests * 1e6


async def measure(requests: int, rounds: int) -> dict:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from server.http.connection import bounded_protocol
    from server.metrics import Metrics
    from server.settings import Settings

    s = Settings()
    bounded = bounded_protocol(s.header_timeout_s, s.max_header_bytes, s.request_timeout_s, 10000, Metrics())
    times: dict[str, list[float]] = {"httptools": [], "bounded": []}
    for _ in range(rounds):
        for name, cls in (("httptools", HttpToolsProtocol), ("bounded", bounded)):
            times[name].append(await _per_request_us(cls, requests))
    plain, ours = statistics.median(times["httptools"]), statistics.median(times["bounded"])
    return {"requests": requests, "rounds": rounds, "httptools_us_per_request": round(plain, 2),
            "bounded_us_per_request": round(ours, 2), "added_us_per_request": round(ours - plain, 2),
            "bounded_over_httptools": round(ours / plain, 3)}


def section(mode: str) -> dict[str, float]:
    """The bench's ``protocol`` section (mode "full", "quick" or "smoke")."""
    import uvloop

    requests, rounds = {"full": (20000, 7), "quick": (5000, 3), "smoke": (200, 1)}[mode]
    out = uvloop.run(measure(requests, rounds))
    print(f"\nprotocol: bounded request heads (server.http.connection) vs uvicorn's httptools, {requests} keep-alive "
          f"requests x {rounds} rounds\n  httptools {out['httptools_us_per_request']} us/request, bounded "
          f"{out['bounded_us_per_request']} us/request: +{out['added_us_per_request']} us "
          f"({out['bounded_over_httptools']}x of the protocol's own cost)")
    return {"protocol_added_us_per_request": out["added_us_per_request"],
            "protocol_bounded_over_httptools": out["bounded_over_httptools"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20000, help="requests per protocol per round")
    p.add_argument("--rounds", type=int, default=7, help="rounds (each runs both protocols)")
    args = p.parse_args(argv)
    import uvloop

    out = uvloop.run(measure(args.requests, args.rounds))
    print(f"httptools {out['httptools_us_per_request']} us/request, bounded heads {out['bounded_us_per_request']} "
          f"us/request: +{out['added_us_per_request']} us ({out['bounded_over_httptools']}x)")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
