"""API keys (``--api-key``, ``--api-key-file``): what both doors check before admitting a request.

Every inference, metadata and model control request needs ``Authorization: Bearer KEY`` (gRPC:
``authorization`` metadata) with a key the server accepts; health, readiness, ``/metrics`` and the
page (which asks for a key when it gets a 401) stay open. A key is compared with every accepted key
in constant time (``hmac.compare_digest``, no early exit), so neither the time of a refusal nor its
answer tells which key came close. Keys are never logged: Settings holds ``--api-key`` as a
SecretStr, and nothing here writes a key or a header.

``--api-key-file``: one key a line (blank lines and ``#`` comments skipped), reread when its
modification time or size changes (looked at no more than once a second), so keys rotate without a
restart. A file that cannot be read, or holds no key, at a reread keeps the keys of the last good
read (logged once); at start-up it stops the server.
"""

from __future__ import annotations

import hmac
import logging
import os
import time

from server.errors import Unauthorized
from server.settings import Settings

log = logging.getLogger("softmoe.keys")
RECHECK_S = 1.0


class KeyFileError(ValueError):
    """``--api-key-file`` cannot be read or holds no key (at start-up)."""


def read_key_file(path: str) -> list[bytes]:
    """The keys of ``path``, one a line.

    Raises:
        KeyFileError: unreadable, or no key in it.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"--api-key-file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    keys = [line.strip().encode() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise KeyFileError(f"--api-key-file {path}: holds no key (one a line)")
    return keys


class Keys:
    """The keys a request may present; ``enabled`` is False when no key is configured (all open)."""

    def __init__(self, settings: Settings) -> None:
        flag = settings.api_key.get_secret_value().strip()
        self._flag = [flag.encode()] if flag else []
        self.path = settings.api_key_file
        self._file: list[bytes] = []
        self._seen: tuple[float, int] | None = None
        self._checked = 0.0
        self._warned = False
        if self.path:
            self._seen = self._stat()
            self._file = read_key_file(self.path)
        self.enabled = bool(self._flag or self.path)

    def _stat(self) -> tuple[float, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return
        self._checked = now
        seen = self._stat()
        if seen == self._seen and seen is not None:
            return
        try:
            self._file = read_key_file(self.path)
            self._seen, self._warned = seen, False
            log.info("--api-key-file %s reread: %d key(s)", self.path, len(self._file))
        except KeyFileError as e:
            if not self._warned:
                log.warning("%s; keeping the %d key(s) of the last good read", e, len(self._file))
                self._warned = True

    def accepts(self, authorization: str | bytes | None) -> bool:
        """Whether an ``Authorization`` header (or gRPC ``authorization`` metadata) value carries an
        accepted key: ``Bearer KEY``, the scheme in any case."""
        if not self.enabled:
            return True
        if self.path:
            self._refresh()
        if isinstance(authorization, str):
            authorization = authorization.encode("utf-8", "surrogateescape")
        scheme, _, given = (authorization or b"").strip().partition(b" ")
        if scheme.lower() != b"bearer":
            given = b""
        given = given.strip()
        ok = False
        for key in self._flag + self._file:  # every key compared, whatever matched
            ok |= hmac.compare_digest(given, key)
        return ok and bool(given)

    @staticmethod
    def refusal(authorization) -> Unauthorized:
        if not authorization:
            return Unauthorized("this server needs an API key: send 'Authorization: Bearer KEY'")
        return Unauthorized("the API key was not accepted (send 'Authorization: Bearer KEY' with a key this server "
                            "was given)")
