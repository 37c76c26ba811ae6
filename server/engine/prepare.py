"""``softmoe prepare``: everything a start-up builds, built ahead of time into the cache directory.

It starts the models exactly as ``softmoe serve`` with the same flags would, on the same code path
(``Engine.bring_up``), and stops before serving: each package's
graphs are exported (or its weights bound into a cached graph of its structure) and verified,
TensorRT engines built on a GPU, and the start-up proofs and measurements made and kept for this
kind of machine (``proof_cache``). A server given the same cache directory and flags, on a machine
of this kind, then exports nothing and proves nothing, and can read the cache from a read-only
volume; on a machine of another kind it proves again (a proof holds per machine).

Flags that change what is built or proven (``--backend``, ``--device``, ``--precision``,
``--max-batch-size``, ``--threads``, ``--concurrent-batches``, ...) must be the server's: each is
part of an entry's key, and a server whose flags differ finds no entry.
"""

from __future__ import annotations

import contextlib
import logging
import time

from export import cache
from server.engine import proof_cache
from server.engine.core import Engine
from server.engine.startup import StartupError, check_backend
from server.metrics import Metrics
from server.settings import Settings

log = logging.getLogger("softmoe.server")


def prepare(settings: Settings, say=log.info) -> None:
    """Build every configured model's artifacts into ``settings.cache_dir``; ``say`` gets each
    model's start-up line (how it will be served, what its load did) and a last line naming the
    cache directory.

    Raises:
        StartupError: a model cannot be loaded, or its findings could not be kept (the cache
            cannot be written).
    """
    started = time.perf_counter()
    check_backend(settings)
    engine = Engine(settings, Metrics(), say=say)
    models = engine.bring_up(serve=False)
    try:
        for m in models:
            if settings.warmup and proof_cache.inputs(m, settings) is not None \
                    and proof_cache.read(m, settings, say=lambda line: None) is None:
                raise StartupError(f"{m.name}: its start-up proofs could not be kept in {proof_cache.root(settings)}")
    finally:
        for m in models:
            with contextlib.suppress(Exception):
                m.backend.close()
    say(f"prepared {len(models)} model{'s' if len(models) != 1 else ''} in {time.perf_counter() - started:.1f} s: "
        f"serve with the same flags and --cache-dir {cache.default_root(settings.cache_dir)}")
