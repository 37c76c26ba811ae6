"""Imports flow one way: server -> export -> softmoe_models, never back.

The model layer converts and runs models without the export or serving stacks, and export builds
artifacts without the server; a newcomer can read each layer knowing only the ones below it. The
`softmoe` command that offers every layer's subcommands is therefore composed at the top
(server/main.py). Every import is checked, not only the module-level ones: an import inside a
function is the same arrow, merely taken later. Relative imports are resolved, and
``importlib.import_module("...")`` / ``__import__("...")`` with a literal name count as imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("softmoe_models", "export", "server")  # bottom up: each may import only those before it
RANK = {name: i for i, name in enumerate(LAYERS)}
DYNAMIC_IMPORTS = {"import_module", "__import__"}


def resolve(module: str | None, level: int, package: str) -> str | None:
    """The absolute module of an import; ``package`` is the importing module's ``__package__``.
    None for a relative import that climbs above the top-level package (Python refuses it too)."""
    if level == 0:
        return module
    parts = package.split(".") if package else []
    if level > len(parts):
        return None
    base = parts[: len(parts) - level + 1]
    return ".".join(base + ([module] if module else []))


def imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import anywhere in ``tree``, functions and classes included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(node.module, node.level, package)
            found.append((node.lineno, target if target is not None else "." * node.level + (node.module or "")))
        elif isinstance(node, ast.Call) and _dynamic_import_name(node) is not None:
            found.append((node.lineno, _dynamic_import_name(node)))
    return sorted(found, key=lambda item: item[0])  # ast.walk is breadth first


def _dynamic_import_name(call: ast.Call) -> str | None:
    """The literal module name of ``importlib.import_module("x")`` or ``__import__("x")``."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in DYNAMIC_IMPORTS or not call.args:
        return None
    arg = call.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def upward_imports(source: str, module: str, where: str, is_package: bool = False) -> list[str]:
    """``where:line: layer -> higher layer (module)`` for each import of ``module`` into a layer above it."""
    layer = module.split(".")[0]
    package = module if is_package else module.rpartition(".")[0]
    problems = []
    for line, target in imported_modules(ast.parse(source, filename=where), package):
        top = target.split(".")[0]
        if top in RANK and RANK[top] > RANK[layer]:
            problems.append(f"{where}:{line}: {layer} -> {top} (imports {target})")
    return problems


def layer_sources() -> list[Path]:
    files = [p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))]
    assert len(files) > 50, "the walk found too few files: is ROOT the repository root?"
    return files


def module_of(path: Path) -> tuple[str, bool]:
    """(dotted module name, whether it is a package's ``__init__``) of a file under ROOT."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def test_imports_never_point_up_a_layer():
    problems = []
    for path in layer_sources():
        module, is_package = module_of(path)
        where = str(path.relative_to(ROOT))
        problems += upward_imports(path.read_text(encoding="utf-8"), module, where, is_package)
    assert not problems, "imports must flow server -> export -> softmoe_models:\n" + "\n".join(problems)


# ---------------------------------------------------------------- the walker can fail


def test_the_walker_finds_upward_imports_anywhere():
    source = """
import json
import server.app
from export.errors import ExportError

def lazy():
    from server.pipeline.decode import decode
    import importlib
    return importlib.import_module("export.cli"), __import__("server")

class Later:
    def method(self):
        import export
"""
    problems = upward_imports(source, "softmoe_models.demo.data", "softmoe_models/demo/data.py")
    lines = [p.split(":")[1] for p in problems]
    assert lines == ["3", "4", "7", "9", "9", "13"], problems
    assert problems[0] == "softmoe_models/demo/data.py:3: softmoe_models -> server (imports server.app)"
    assert upward_imports("def f():\n    from server import cli\n", "export.cli", "export/cli.py") == [
        "export/cli.py:2: export -> server (imports server)"]


def test_the_walker_allows_downward_and_same_layer_imports():
    source = """
import serverless, exporter
from softmoe_models.config import Precision
from export import cli
from . import cli as serve_cli
from ..pipeline.decode import decode
"""
    assert upward_imports(source, "server.routes.v1", "server/routes/v1.py") == []
    assert upward_imports("from .config import TEXT_POOLS\n", "softmoe_models.cli", "softmoe_models/cli.py") == []


def test_relative_imports_are_resolved():
    assert resolve("decode", 2, "server.routes") == "server.decode"
    assert resolve(None, 1, "server") == "server"
    assert resolve("main", 1, "server") == "server.main"
    assert resolve("x", 2, "server") is None  # beyond the top-level package
    assert imported_modules(ast.parse("from ..pipeline import decode"), "server.routes") == [(1, "server.pipeline")]
    # an __init__ is its own package: `from .x import y` in server/__init__.py is server.x
    assert upward_imports("from .cli import main\n", "softmoe_models", "softmoe_models/__init__.py", True) == []
