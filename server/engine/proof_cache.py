"""Start-up findings kept per kind of machine, so a start on a machine like the one that proved
them reads them instead of proving again.

What start-up proves and measures of a model (``server.engine.proofs``: the padded shapes bitwise
equal to the full one, whether the routing graph may stand in for the plain one, whether batches
run beside each other) are properties of the kernels the backend runs on those shapes on this
machine, not of the weights' values. They are kept as an entry of the export cache
(``export.cache``, under ``proofs/``), keyed by what decides them: the backend's structure
(``structure()``: the graphs, weights aside, the runtime's version, the device, the threads), the
model's kind, the settings the proofs read, this server's version, and the kind of machine
(``export.cache.machine_identity``: the CPU's model and flags, the CPUs this process may use). A
machine of another kind has another key, so it proves again; an entry is hash-checked as every
cache entry is, and a corrupt one is never read.

A backend without ``structure()`` (torch, TensorRT) proves at every start.
"""

from __future__ import annotations

import json
import logging
from importlib import metadata
from pathlib import Path
from typing import Any

from export import cache
from server.backends.base import structure_of
from server.engine.models import ServedModel
from server.settings import Settings

log = logging.getLogger("softmoe.startup")

ROOT = "proofs"
FILE = "findings.json"
# Bumped whenever what start-up proves, or how, changes for the same inputs.
FORMAT = 1
# The settings that decide what start-up proves and measures, or how a model is served from it.
SETTINGS = ("max_batch_size", "strict_determinism", "proven_shapes", "concurrent_batches", "wide_lone_batches",
            "wide_lone_beside", "routing", "routing_stats_sample", "device")


def inputs(model: ServedModel, settings: Settings) -> dict[str, Any] | None:
    """What ``model``'s findings depend on (None where its backend has no structure)."""
    structure = structure_of(model.backend)
    if structure is None:
        return None
    try:
        version = metadata.version("softmoe-serve")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"artifact": "proofs", "format": FORMAT, "softmoe-serve": version, "structure": structure,
            "kind": model.kind, "machine": cache.machine_identity(),
            "settings": {name: getattr(settings, name) for name in SETTINGS}}


def root(settings: Settings) -> Path:
    return cache.default_root(settings.cache_dir) / ROOT


def read(model: ServedModel, settings: Settings, say=log.info) -> tuple[dict[str, Any], Path] | None:
    """The findings kept for ``model`` on this kind of machine, and the entry they came from; None
    when there are none (``say`` tells why when they were made on a machine of another kind)."""
    wanted = inputs(model, settings)
    if wanted is None:
        return None
    entry = cache.lookup(root(settings), cache.cache_key(wanted), log=say)
    if entry is None:
        other = _from_other_machine(root(settings), wanted)
        if other is not None:
            say(f"{model.name}: the start-up proofs in {other[0]} were made on another kind of machine "
                f"({_machine(other[1])}; this one: {_machine(wanted['machine'])}); proving them here")
        return None
    try:
        found = json.loads(entry.files[FILE].read_text())
    except (KeyError, OSError, ValueError) as e:
        say(f"{entry.path}: unreadable findings ({e}); proving again")
        return None
    return found, entry.path


def keep(model: ServedModel, settings: Settings, findings: dict[str, Any], say=log.info) -> Path | None:
    """Keep ``findings`` for the next start on this kind of machine; the entry, or None where the
    cache cannot be written (a read-only volume: said once, and the server serves on)."""
    wanted = inputs(model, settings)
    if wanted is None:
        return None

    def write(tmp: Path) -> dict[str, str]:
        (tmp / FILE).write_text(json.dumps(findings, indent=1, sort_keys=True) + "\n")
        return {"model": model.name, "package": model.source}  # what `softmoe cache` lists

    try:
        return cache.build(root(settings), cache.cache_key(wanted), write, inputs=wanted, log=say).path
    except cache.CacheError as e:
        say(f"{model.name}: start-up proofs not kept ({e})")
        return None


def _from_other_machine(where: Path, wanted: dict[str, Any]) -> tuple[Path, dict] | None:
    """An entry under ``where`` whose inputs are ``wanted``'s but for the machine."""
    if not where.is_dir():
        return None
    for manifest in sorted(where.glob(f"*/{cache.MANIFEST}")):
        try:
            kept = json.loads(manifest.read_text()).get("inputs") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(kept, dict) and kept.get("machine") != wanted["machine"] and \
                {k: v for k, v in kept.items() if k != "machine"} == {k: v for k, v in wanted.items() if k != "machine"}:
            return manifest.parent, kept.get("machine") or {}
    return None


def _machine(m: dict) -> str:
    return f"{m.get('cpu', '?')}, {m.get('cpus', '?')} CPUs, flags {m.get('flags', '?')}"
