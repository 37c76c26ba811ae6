"""A model repository, as Triton's: a folder whose every sub-folder is a model package, the
sub-folder's name the model's name. Names starting with ``.`` are skipped (editors' and copy
tools' temporary folders), so a new version can be written beside and renamed into place."""

from __future__ import annotations

import re
from pathlib import Path

from server.errors import NotFound

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


class Repository:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def names(self) -> list[str]:
        """The models the folder holds now (sorted)."""
        try:
            entries = sorted(self.root.iterdir())
        except OSError:
            return []
        return [p.name for p in entries if p.is_dir() and NAME.fullmatch(p.name)]

    def path(self, name: str) -> Path:
        """The folder of model ``name``.

        Raises:
            NotFound: no such model in the repository (naming what it holds).
        """
        if not NAME.fullmatch(name) or not (self.root / name).is_dir():
            held = self.names()
            raise NotFound(f"model {name[:100]!r} is not in the model repository {self.root} (it holds "
                           f"{', '.join(held) if held else 'no model'})", param="model")
        return self.root / name

    def fingerprint(self, name: str) -> tuple:
        """What changes when a package is rewritten: each file's path, size and modification time.
        (Its content is checked by its hash when it loads.)"""
        folder = self.root / name
        out = []
        try:
            for p in sorted(folder.rglob("*")):
                if p.is_file():
                    st = p.stat()
                    out.append((str(p.relative_to(folder)), st.st_size, st.st_mtime_ns))
        except OSError:
            return ()
        return tuple(out)
