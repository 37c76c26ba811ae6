"""Model control (``--model-control-mode``), with Triton's meanings:

- ``none``: the whole repository loads at start; load and unload requests are refused.
- ``explicit``: the ``--load-model`` names load at start; load and unload requests change the rest.
  A load of a loaded model reloads it from its folder (a swap without a gap, ``core.Engine.load``).
- ``poll``: the whole repository loads at start, then the folder is rescanned every
  ``--repository-poll-s``: a new or changed package loads, a removed one unloads. Requests are
  refused, as Triton refuses them while polling: the folder is the control.

``--model`` packages serve beside the repository; a load request may reload one from its path.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from server.engine.core import Engine
from server.engine.models import parse_spec
from server.engine.repository import Repository
from server.errors import Conflict, ModelLoadError, NotFound
from server.settings import Settings

log = logging.getLogger("softmoe.engine")


class ModelControl:
    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine, self.settings, self.mode = engine, settings, settings.model_control_mode
        self.repository = Repository(settings.model_repository) if settings.model_repository else None
        self.given = {}  # --model: name -> path
        for spec in settings.models:
            name, path = parse_spec(spec)
            self.given[name or (path.stem if path.suffix == ".onnx" else path.name)] = path
        self.seen: dict[str, tuple] = {}  # poll: the fingerprint each repository model was last loaded (or tried) at
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    # ------------------------------------------------------------------ requests

    def load(self, name: str, *, unload_first: bool = False) -> None:
        """Load (or reload) model ``name`` from its folder. Blocking.

        Raises:
            Conflict: control is off (none) or the folder is the control (poll); see Engine.load.
            NotFound: no such model in the repository (nor a --model of that name).
            ModelLoadError: the package cannot be served; the serving version is untouched.
        """
        self._check_mode("load")
        path = self._path(name)
        fingerprint = self.repository.fingerprint(name) if self.repository and path.parent == self.repository.root else ()
        self.engine.load(name, str(path), unload_first=unload_first)
        self.seen[name] = fingerprint

    def unload(self, name: str) -> None:
        """Unload model ``name``. Blocking until it is released.

        Raises:
            Conflict: control is off, or the model is not loaded (or busy).
            NotFound: the name is neither in the repository nor served.
        """
        self._check_mode("unload")
        if name not in self.engine.models and name not in self.engine.status:
            self._path(name)  # NotFound for a name the server never knew
        self.engine.unload(name)

    def index(self, ready_only: bool = False) -> list[dict]:
        """Every model of the repository and every model served or tried: name, version, state, reason."""
        entries = {e["name"]: e for e in self.engine.index()}
        for name in self.repository.names() if self.repository else ():
            entries.setdefault(name, {"name": name, "version": "", "state": "UNAVAILABLE", "reason": "not loaded"})
        out = [entries[n] for n in sorted(entries)]
        return [e for e in out if e["state"] == "READY"] if ready_only else out

    def describe_missing(self, name: str) -> str | None:
        """Why ``name`` serves no request now (its state), or None if the server never knew it."""
        status = self.engine.status.get(name)
        if status is not None:
            return f"{status.state}{': ' + status.reason if status.reason else ''}"
        if self.repository is not None and name in self.repository.names():
            return "UNAVAILABLE: in the repository, not loaded"
        return None

    def _check_mode(self, what: str) -> None:
        if self.mode == "none":
            raise Conflict(f"model {what} requests are refused: --model-control-mode is none (explicit takes them)")
        if self.mode == "poll":
            raise Conflict(f"model {what} requests are refused under --model-control-mode poll: the repository "
                           "folder is the control (add, change or remove a package; it is rescanned every "
                           f"{self.settings.repository_poll_s:g} s)")

    def _path(self, name: str) -> Path:
        if self.repository is not None:
            try:
                return self.repository.path(name)
            except NotFound:
                if name not in self.given:
                    raise
        if name in self.given:
            return self.given[name]
        raise NotFound(f"model {name[:100]!r} is neither in a model repository nor given by --model", param="model")

    # ------------------------------------------------------------------ poll

    def start(self) -> None:
        """Under ``poll``, remember what loaded at start and rescan the folder from now on."""
        if self.mode != "poll" or self.repository is None:
            return
        for name in self.repository.names():
            if name in self.engine.models:
                self.seen[name] = self.repository.fingerprint(name)
        self._poller = threading.Thread(target=self._poll_loop, name="softmoe-repository-poll", daemon=True)
        self._poller.start()

    def stop(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=self.settings.request_timeout_s + 10)

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.settings.repository_poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a scan that fails is logged and tried again next time
                log.exception("rescanning the model repository failed")

    def poll(self) -> None:
        """One rescan: load new and changed packages, unload removed ones (each one log line)."""
        assert self.repository is not None
        names = self.repository.names()
        for name in names:
            if self._stop.is_set():
                return
            fingerprint = self.repository.fingerprint(name)
            if self.seen.get(name) == fingerprint:
                continue
            self.seen[name] = fingerprint  # a broken package is tried again once it changes
            try:
                self.engine.load(name, str(self.repository.root / name))
            except (Conflict, ModelLoadError):
                pass  # logged by the engine, its reason in the index
        for name in [n for n in self.seen if n not in names]:
            del self.seen[name]
            if name in self.engine.models and name not in self.given:
                try:
                    self.engine.unload(name)
                except Conflict:
                    pass
