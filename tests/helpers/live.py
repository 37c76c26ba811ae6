"""A real uvicorn server on loopback for tests (HTTP behaviour lives in the server, not the app)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(url: str, timeout: float, alive=lambda: True, what: str = "server") -> None:
    """Poll ``url`` until it answers 200; fail when ``alive()`` turns false or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if not alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready at {url}")
        time.sleep(0.1)


@contextlib.contextmanager
def live_server(app, timeout: float = 120.0):
    """Run ``app`` on 127.0.0.1 in a thread, with the HTTP protocol and options ``softmoe serve``
    gives uvicorn; yields the base URL once /v2/health/ready is 200."""
    from server.run import uvicorn_options

    port = free_port()
    options = {**uvicorn_options(app.state.settings, app.state.metrics), "host": "127.0.0.1", "port": port,
               "log_level": "warning"}
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(f"{url}/v2/health/ready", timeout, thread.is_alive)
    except RuntimeError:
        server.should_exit = True
        raise
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(60)


def stop_process(proc, timeout: float = 30.0) -> None:
    """SIGTERM ``proc`` (a subprocess.Popen) and wait; SIGKILL it if it has not exited in ``timeout``."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
