"""Pick the checkpoint reader from the path and return params as flat numpy arrays.

Accepted forms (see :data:`ACCEPTED_FORMS`):

* ``npz``: a ``.npz`` file of flattened flax params ('/'-joined keys, optionally under ``params/``);
* ``vmoe-partitioned``: the prefix ``X`` of ``X.index`` + ``X.data-NNNNN-of-NNNNN``, or ``X.index``;
* ``orbax``: ``ckpt/<step>/state``, ``ckpt/<step>`` or ``ckpt`` (highest complete step).

Anything else raises :class:`ConversionError` naming the path and listing these forms.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Union

import numpy as np

from .errors import ConversionError
from .legacy import index_path, read_partitioned, split_prefix
from .npz import read_npz, split_params
from .orbax import METADATA_FILE, STATE_ITEM, is_complete_step, read_orbax, step_dirs

PathLike = Union[str, "os.PathLike[str]"]

FORMAT_NPZ = "npz"
FORMAT_PARTITIONED = "vmoe-partitioned"
FORMAT_ORBAX = "orbax"

ACCEPTED_FORMS = (
    "accepted checkpoint forms:\n"
    "  - a .npz file of flattened flax params ('/'-joined keys, optionally under 'params/')\n"
    "  - a vmoe partitioned checkpoint: its prefix X (or X.index), with files X.index and "
    "X.data-00000-of-NNNNN ...\n"
    "  - an orbax checkpoint directory: <workdir>/ckpt/<step>/state, <workdir>/ckpt/<step> or "
    "<workdir>/ckpt (the highest complete step is used)"
)

_DATA_SHARD = re.compile(r"^(?P<prefix>.+)\.data-\d{5}-of-\d{5}$")


def _is_orbax_dir(path: Path) -> bool:
    """Whether ``path`` is an orbax state dir, step dir, or a dir of step dirs.

    Args:
        path: an existing directory.
    """
    if (path / METADATA_FILE).is_file() or (path / STATE_ITEM / METADATA_FILE).is_file():
        return True
    try:
        return any(is_complete_step(d) for _, d in step_dirs(path))
    except OSError:
        return False


def _unrecognised(path: Path, why: str) -> ConversionError:
    """Error for a path that is no checkpoint we know.

    Args:
        path: the path given.
        why: what is wrong with it.
    """
    return ConversionError(f"{path}: {why}\n{ACCEPTED_FORMS}")


def _hint_for_file(path: Path) -> str:
    """Explain why a file was not recognised, with a hint for near misses.

    Args:
        path: an existing file.
    """
    match = _DATA_SHARD.match(path.name)
    if match:
        prefix = path.with_name(match["prefix"])
        return (
            f"is one data shard of a vmoe partitioned checkpoint; pass its prefix {prefix} "
            "(or the .index file) instead"
        )
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if head.startswith(b"\x89PNG"):
        kind = "a PNG image"
    elif head.startswith(b"\xff\xd8\xff"):
        kind = "a JPEG image"
    elif head.startswith(b"PK"):
        kind = "a zip archive without the .npz extension"
    elif not head:
        kind = "an empty file"
    else:
        return (
            f"is not a checkpoint: a file with extension '{path.suffix or '(none)'}', "
            "neither .npz nor .index"
        )
    return f"is not a checkpoint: it looks like {kind}"


def _hint_for_dir(path: Path) -> str:
    """Explain why a directory was not recognised, with a hint for near misses.

    Args:
        path: an existing directory.
    """
    indexes = sorted(path.glob("*.index"))
    if indexes:
        names = ", ".join(str(p.with_suffix("")) for p in indexes[:3])
        return f"is a directory; it holds vmoe partitioned checkpoint(s), pass the prefix: {names}"
    if any(path.glob("*.npz")):
        return "is a directory; pass one of the .npz files in it"
    steps = [d for _, d in step_dirs(path)]
    if steps:
        return (
            f"is a directory of numbered steps, but none holds {STATE_ITEM}/{METADATA_FILE} "
            "(incomplete orbax checkpoints)"
        )
    return f"is a directory without {METADATA_FILE}, {STATE_ITEM}/{METADATA_FILE} or step directories"


def detect_format(src: PathLike) -> str:
    """Name the format of a checkpoint path.

    Args:
        src: the path given by the user.

    Returns:
        ``'npz'``, ``'vmoe-partitioned'`` or ``'orbax'``.

    Raises:
        ConversionError: the path does not exist or is no accepted form.
    """
    path = Path(src)
    if os.fspath(src).endswith(".index") or index_path(path).is_file():
        if index_path(split_prefix(src)).is_file():
            return FORMAT_PARTITIONED
        raise _unrecognised(path, "vmoe partitioned index file does not exist")
    if not path.exists():
        raise _unrecognised(path, "does not exist")
    if path.is_dir():
        if _is_orbax_dir(path):
            return FORMAT_ORBAX
        raise _unrecognised(path, _hint_for_dir(path))
    if path.is_file() and path.suffix.lower() == ".npz":
        return FORMAT_NPZ
    raise _unrecognised(path, _hint_for_file(path))


def read_checkpoint(src: PathLike) -> tuple[dict[str, np.ndarray], list[str], str]:
    """Read the params of any supported checkpoint.

    Args:
        src: a ``.npz`` file, a vmoe partitioned prefix (or its ``.index``), or an orbax
            ``ckpt``/``ckpt/<step>``/``ckpt/<step>/state`` directory.

    Returns:
        Params keyed by '/'-joined flax path (no ``params/`` prefix), notices about what was
        skipped or chosen, and the format name.

    Raises:
        ConversionError: unknown form, missing or corrupt files.
    """
    try:
        fmt = detect_format(src)
    except OSError as e:  # unreadable directory while probing
        raise _unrecognised(Path(src), f"cannot be inspected ({e.strerror or e})") from e
    if fmt == FORMAT_NPZ:
        params, notices = read_npz(src)
    elif fmt == FORMAT_PARTITIONED:
        params, notices = split_params(read_partitioned(src))
    else:
        params, notices = read_orbax(src)
    if not params:
        raise ConversionError(f"{src}: the checkpoint holds no parameter arrays")
    return params, notices, fmt


def sha256_of(files: list[Path], root: Path | None = None) -> str:
    """sha256 over files in order; with ``root``, relative names are hashed too."""
    h = hashlib.sha256()
    for f in files:
        if root is not None:
            h.update(str(f.relative_to(root)).encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
