"""Run the app under uvicorn with a graceful drain on SIGTERM/SIGINT.

On the signal: readiness turns false and new requests get 503 (Retry-After) for
``drain_seconds`` (so load balancers and Kubernetes endpoints stop sending), then uvicorn stops
accepting, finishes the requests in flight (the batcher drains its queue), and the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from .app import create_app
from .settings import Settings

log = logging.getLogger("softmoe.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_seconds: float) -> None:
        super().__init__(config)
        self.drain_seconds = drain_seconds
        self._draining = False

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._begin_drain, sig)

    def _begin_drain(self, sig: signal.Signals) -> None:
        if self._draining:
            self.should_exit = True  # a second signal: stop now (in-flight requests still finish)
            return
        self._draining = True
        app = self.config.app
        app.state.draining = True
        log.info("%s: draining for %.1fs, then shutting down", sig.name, self.drain_seconds)
        asyncio.get_running_loop().call_later(self.drain_seconds, self._stop)

    def _stop(self) -> None:
        self.should_exit = True


def serve(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=max(30, settings.request_timeout_s + 5), access_log=False)
    DrainingServer(config, settings.drain_seconds).run()
