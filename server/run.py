"""Run the app under uvicorn with a graceful drain on SIGTERM/SIGINT.

On the signal: readiness turns false and new requests get 503 (Retry-After) for
``drain_seconds`` (so load balancers and Kubernetes endpoints stop sending), then uvicorn stops
accepting, finishes the requests in flight (the batcher drains its queue), and the process exits.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import uvicorn

from .app import create_app
from .settings import Settings

log = logging.getLogger("softmoe.server")


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain phase between the signal and closing the listener."""

    def __init__(self, config: uvicorn.Config, drain_seconds: float) -> None:
        super().__init__(config)
        self.drain_seconds = drain_seconds
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining:  # a second signal: stop now (in-flight requests still finish)
            self.should_exit = True
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        self._draining = True
        self.config.app.state.draining = True
        self.config.app.state.metrics.server_ready.set(0)
        log.info("%s: not ready; draining for %.1fs, then finishing in-flight requests", signal.Signals(sig).name,
                 self.drain_seconds)
        timer = threading.Timer(self.drain_seconds, self._stop)
        timer.daemon = True
        timer.start()

    def _stop(self) -> None:
        self.should_exit = True


def serve(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=max(30, settings.request_timeout_s + 5), access_log=False)
    DrainingServer(config, settings.drain_seconds).run()
