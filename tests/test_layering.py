"""Imports flow one way: server -> export -> softmoe_models, never back; inside server, down its
own layers (below); and inside each layer no two modules import each other, directly or around a
circle. The benchmark scripts (loadtests) are held to the same: no circles.

The model layer converts and runs models without the export or serving stacks, and export builds
artifacts without the server; a newcomer can read each layer knowing only the ones below it. The
`softmoe` command that offers every layer's subcommands is therefore composed at the top
(server/main.py). Every import is checked, not only the module-level ones: an import inside a
function is the same arrow, merely taken later. Relative imports are resolved, and
``importlib.import_module("...")`` / ``__import__("...")`` with a literal name count as imports.

Inside server, from the bottom: what every part shares (settings, errors, metrics, context); the
parts that run a model function, decode an image and batch (backends, pipeline, batching); the
engine that owns models' lives; what the doors share (api) and the engine's own process (workers);
the doors (http, grpc_api, jobs), none of which imports another; the process and the command
(run, cli, main). A package may import its own modules and anything of a lower rank, nothing of its
rank or above.

Inside a layer, an import circle (``a`` imports ``b`` and ``b`` imports ``a``, perhaps inside a
function so that it loads at all) means neither module can be read, tested or moved without the
other: whatever two modules share belongs in the lower one, and each names its dependencies one
way.
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


# server's own layers, bottom up: a module's part is its first name under server (a package or a module).
SERVER_RANKS = (
    ("settings", "errors", "metrics", "context"),
    ("observability",),  # log lines and traces: read settings, metrics and context; every process and door uses them
    ("backends",),
    ("pipeline", "batching"),
    ("engine",),
    ("api", "workers"),
    ("http", "grpc_api", "jobs"),
    ("run",),
    ("cli",),
    ("main",),
    ("__main__", ""),
)
SERVER_RANK = {part: i for i, parts in enumerate(SERVER_RANKS) for part in parts}


def server_part(module: str) -> str:
    """``server.engine.core`` -> ``engine``; ``server`` itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def server_problems(source: str, module: str, where: str, is_package: bool = False) -> list[str]:
    """``where:line: part -> part (imports m)`` for each import inside server of a part of the same or
    a higher rank (its own part excepted)."""
    if module.split(".")[0] != "server":
        return []
    package = module if is_package else module.rpartition(".")[0]
    mine = server_part(module)
    problems = []
    for line, target, theirs in _server_imports(ast.parse(source, filename=where), package):
        if theirs not in SERVER_RANK or mine not in SERVER_RANK:
            problems.append(f"{where}:{line}: server.{mine or '__init__'} or server.{theirs} has no rank in SERVER_RANKS")
        elif theirs != mine and SERVER_RANK[theirs] >= SERVER_RANK[mine]:
            problems.append(f"{where}:{line}: server.{mine} -> server.{theirs} (imports {target})")
    return problems


def _server_imports(tree: ast.AST, package: str) -> list[tuple[int, str, str]]:
    """(line, module, part) of every import of server's modules in ``tree``; ``from server import x``
    imports the part ``x``."""
    found = []
    for line, target in imported_modules(tree, package):
        if target.split(".")[0] == "server" and target != "server":
            found.append((line, target, server_part(target)))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and resolve(node.module, node.level, package) == "server":
            found += [(node.lineno, f"server.{alias.name}", alias.name) for alias in node.names]
    return sorted(found)


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


def test_server_imports_flow_down_its_own_layers():
    problems = []
    for path in layer_sources():
        module, is_package = module_of(path)
        problems += server_problems(path.read_text(encoding="utf-8"), module, str(path.relative_to(ROOT)), is_package)
    assert not problems, "server's layers: a part imports only lower ranks (SERVER_RANKS):\n" + "\n".join(problems)


def module_edges(source: str, module: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every import of a module in ``known`` (``from p import m`` names the
    submodule ``p.m`` when there is one, else the package ``p``)."""
    package = module if is_package else module.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            target = resolve(node.module, node.level, package)
            for alias in node.names if target is not None else []:
                sub = f"{target}.{alias.name}"
                if sub in known or target in known:
                    edges.append((node.lineno, sub if sub in known else target))
        elif isinstance(node, ast.Import):
            edges += [(node.lineno, alias.name) for alias in node.names if alias.name in known]
        elif isinstance(node, ast.Call) and _dynamic_import_name(node) in known:
            edges.append((node.lineno, _dynamic_import_name(node)))
    return sorted({e for e in edges if e[1] != module})


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The circles of ``graph`` (module -> {imported module: line}) between modules of one layer:
    each strongly connected component of two or more modules, as one circle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w.split(".")[0] != v.split(".")[0]:
                continue  # between layers: test_imports_never_point_up_a_layer
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, set(c)) for c in components]


def _circle(graph: dict[str, dict[str, int]], members: set[str]) -> list[str]:
    """A shortest circle through the first member, staying inside ``members``: [a, b, ..., a]."""
    start = min(members)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                return paths[v] + [start]
            if w in members and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError("a strongly connected component without a circle")


def test_no_import_circles_inside_a_layer():
    files = {module_of(p): p for p in layer_sources() + sorted((ROOT / "loadtests").rglob("*.py"))}
    known = {module for module, _ in files}
    graph, lines = {}, {}
    for (module, is_package), path in files.items():
        edges = module_edges(path.read_text(encoding="utf-8"), module, is_package, known)
        graph[module] = {target: line for line, target in edges}
        lines[module] = str(path.relative_to(ROOT))
    cycles = import_cycles(graph)
    described = [" -> ".join(f"{a} ({lines[a]}:{graph[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}"
                 for c in cycles]
    assert not cycles, "modules that import each other (move what they share into the lower one):\n" + \
        "\n".join(described)


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


def test_the_cycle_finder_finds_circles_and_only_circles():
    graph = {"server.a": {"server.b": 1}, "server.b": {"server.c": 2}, "server.c": {"server.a": 3, "server.d": 4},
             "server.d": {}, "server.e": {"export.x": 5}, "export.x": {"server.e": 6}}
    assert import_cycles(graph) == [["server.a", "server.b", "server.c", "server.a"]]
    assert import_cycles({"server.a": {"server.b": 1}, "server.b": {}}) == []
    source = "from . import b\nfrom .c import thing\n\ndef later():\n    from server.pkg import d\n"
    known = {"server.pkg.a", "server.pkg.b", "server.pkg.c", "server.pkg", "server.pkg.d"}
    assert module_edges(source, "server.pkg.a", False, known) == [
        (1, "server.pkg.b"), (2, "server.pkg.c"), (5, "server.pkg.d")]


def test_the_server_walker_refuses_the_same_rank_and_above():
    source = """
from server.engine.core import Engine
from server.errors import NotFound

def later():
    from server.grpc_api import service
    import server.run
"""
    problems = server_problems(source, "server.http.app", "server/http/app.py")
    assert [p.split(": ", 1)[1] for p in problems] == [
        "server.http -> server.grpc_api (imports server.grpc_api)", "server.http -> server.run (imports server.run)"]
    assert server_problems("from server.http.routes import v1\n", "server.http.app", "server/http/app.py") == []
    assert server_problems("from server.api import oip\n", "server.engine.core", "server/engine/core.py") == [
        "server/engine/core.py:1: server.engine -> server.api (imports server.api)"]
    assert "no rank" in server_problems("from server.novel import x\n", "server.api.oip", "server/api/oip.py")[0]


# Imports placed inside a function, per room (a layer; inside server, its part). Each hides an
# arrow until the function runs; the ones that stay keep a heavy optional dependency out of a
# process that does not need it, or break a real cycle (issue 44). The counts may only fall:
# a new one fails here, and one removed asks for its room's figure to be lowered.
IMPORTS_IN_FUNCTIONS = {
    "softmoe_models": 8, "export": 34, "server": 0, "server.api": 0, "server.backends": 9,
    "server.engine": 1, "server.http": 0, "server.jobs": 5, "server.observability": 6,
    "server.pipeline": 2, "server.workers": 0,
}


def imports_in_functions(tree: ast.AST) -> list[int]:
    """Lines of the import statements inside a function (or a method) of ``tree``, each once
    however deep the functions nest."""
    found: dict[int, int] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found[id(node)] = node.lineno
    return sorted(found.values())


def room_of(module: str) -> str:
    """``server.engine.core`` -> ``server.engine``; a module directly under server, or any
    module of the other layers -> its layer."""
    parts = module.split(".")
    if parts[0] == "server" and len(parts) > 2:
        return f"server.{parts[1]}"
    return parts[0]


def test_imports_inside_functions_never_grow_per_room():
    counts: dict[str, list[str]] = {}
    for path in layer_sources():
        module, _ = module_of(path)
        for line in imports_in_functions(ast.parse(path.read_text(), filename=str(path))):
            counts.setdefault(room_of(module), []).append(f"{path.relative_to(ROOT)}:{line}")
    grew = {room: len(where) for room, where in counts.items() if len(where) > IMPORTS_IN_FUNCTIONS.get(room, 0)}
    fell = {room: len(counts.get(room, [])) for room, n in IMPORTS_IN_FUNCTIONS.items() if len(counts.get(room, [])) < n}
    assert not grew, f"imports inside functions grew (room: count now): {grew}; place them at the top of the module"
    assert not fell, f"imports inside functions fell (room: count now): {fell}; lower IMPORTS_IN_FUNCTIONS to match"


def test_the_function_import_counter_counts_nested_imports_once_and_module_imports_never():
    tree = ast.parse("import os\n"
                     "def f():\n    import json\n    def g():\n        from x import y\n"
                     "class C:\n    def m(self):\n        import re\n")
    assert imports_in_functions(tree) == [3, 5, 8]
    assert room_of("server.engine.core") == "server.engine" and room_of("server.cli") == "server"
    assert room_of("export.onnx") == "export"


# A function a reader can hold (issue 44): none longer than this in server/, export/ or
# softmoe_models/; loadtests' mains may run longer.
MAX_FUNCTION_LINES = 100


def long_functions(tree: ast.AST, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of each function or method of ``tree`` longer than ``limit``,
    decorators left out, nested functions counted in their own right and in their parent."""
    return [(fn.name, fn.lineno, fn.end_lineno - fn.lineno + 1) for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.end_lineno - fn.lineno + 1 > limit]


def test_no_function_is_longer_than_a_reader_can_hold():
    found = [f"{path.relative_to(ROOT)}:{line} {name} ({n} lines)" for path in layer_sources()
             for name, line, n in long_functions(ast.parse(path.read_text(), filename=str(path)))]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines; split them into named steps: {found}"


def test_the_length_check_measures_from_def_to_the_last_line():
    tree = ast.parse("@decorated\ndef f():\n" + "    x = 1\n" * 4 + "\ndef g():\n    def h():\n        pass\n")
    assert long_functions(tree, 4) == [("f", 2, 5)]
    assert long_functions(tree, 2) == [("f", 2, 5), ("g", 8, 3)]
