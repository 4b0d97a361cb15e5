"""The package's layering, checked from the source: every module under kobold_backend/ is parsed with `ast`, the
package-internal imports (module level, inside functions, under TYPE_CHECKING, and string imports through
`importlib.import_module` / `importlib.util.find_spec` / `__import__`, and any string constant that names a
package module, such as a table of subcommand modules) form a graph between rooms, and the rules written down in
docs/architecture.md are applied to it.

A room is the first name under kobold_backend/ (`engine`, `ops`, `server`, `cli`, ...). Rooms not named in a
rule (errors, progress, wheels, demo, ...) may import and be imported freely, as long as no circle between rooms
appears.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

PACKAGE = "kobold_backend"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# (importing room, imported room): the arrows docs/architecture.md forbids.
FORBIDDEN = {
    "engine": {"server", "host", "cli", "bench"},
    "ops": {"engine", "server", "host", "cli", "bench"},
    "host": {"server", "cli"},
    "server": {"host", "cli"},
}
STRING_IMPORTERS = {"import_module", "find_spec", "__import__"}


@dataclass(frozen=True)
class Arrow:
    """One import of a package module by another, where it is written."""

    source: str  # importing module, dotted
    target: str  # imported module, dotted
    file: str  # path relative to the repository
    line: int

    def where(self) -> str:
        return f"{self.file}:{self.line} ({self.source} -> {self.target})"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> Optional[str]:
    """`kobold_backend.engine.gptq` -> 'engine'; `kobold_backend.cli.serve` -> 'cli'; 'tests' for the tests;
    None for modules outside both (the standard library, third parties)."""
    parts = module.split(".")
    if parts[0] == "tests":
        return "tests"
    if parts[0] != PACKAGE:
        return None
    if len(parts) == 1:
        return PACKAGE
    return parts[1]


def _resolve_relative(current: str, is_package: bool, level: int, module: Optional[str]) -> str:
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


def _string_arg(call: ast.Call) -> Optional[str]:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in STRING_IMPORTERS or not call.args:
        return None
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def imports_of(path: Path, root: Path, known: Set[str]) -> Iterator[Arrow]:
    """Every package-internal (or tests) import written in one file."""
    source = module_name(path, root)
    is_package = path.name == "__init__.py"
    rel = str(path.relative_to(root.parent))
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)

    def targets(name: str, line: int) -> Iterator[Arrow]:
        if room_of(name) is not None:
            yield Arrow(source, name, rel, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from targets(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(source, is_package, node.level, node.module) if node.level else node.module
            if base is None:
                continue
            for alias in node.names:
                # `from kobold_backend import wheels` imports the module kobold_backend.wheels
                full = f"{base}.{alias.name}"
                yield from targets(full if full in known else base, node.lineno)
        elif isinstance(node, ast.Call):
            name = _string_arg(node)
            if name is not None:
                yield from targets(name, node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
            if "." in node.value:  # a module named in a table, imported later by name
                yield from targets(node.value, node.lineno)


def package_arrows(root: Path = ROOT) -> List[Arrow]:
    files = sorted(root.rglob("*.py"))
    known = {module_name(f, root) for f in files}
    unique = {a for f in files for a in imports_of(f, root, known) if a.source != a.target}
    return sorted(unique, key=lambda a: (a.file, a.line, a.target))


def forbidden_arrows(arrows: List[Arrow]) -> List[Arrow]:
    out = []
    for a in arrows:
        src, dst = room_of(a.source), room_of(a.target)
        if dst == "tests" or dst in FORBIDDEN.get(src or "", set()):
            out.append(a)
    return out


def strongly_connected(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Each set of two or more nodes that reach one another (Tarjan's strongly connected components), sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    groups: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def room_circles(arrows: List[Arrow]) -> List[Tuple[List[str], List[Arrow]]]:
    """Each strongly connected set of two or more rooms, with the arrows that join its members."""
    graph: Dict[str, Set[str]] = {}
    for a in arrows:
        src, dst = room_of(a.source), room_of(a.target)
        if src and dst and src != dst:
            graph.setdefault(src, set()).add(dst)
    return [(g, [a for a in arrows if room_of(a.source) in g and room_of(a.target) in g
                 and room_of(a.source) != room_of(a.target)]) for g in strongly_connected(graph)]


def module_circles(arrows: List[Arrow]) -> List[Tuple[List[str], List[Arrow]]]:
    """Each set of two or more package modules that import one another, whatever kind of import (module level,
    in a function, under TYPE_CHECKING, by name), with the arrows that join them. A module importing its own
    package's __init__ on the way to a sibling is no arrow (Python runs that __init__ first anyway)."""
    joins = [a for a in arrows if room_of(a.target) not in (None, "tests") and not a.source.startswith(a.target + ".")]
    graph: Dict[str, Set[str]] = {}
    for a in joins:
        graph.setdefault(a.source, set()).add(a.target)
    return [(g, [a for a in joins if a.source in g and a.target in g]) for g in strongly_connected(graph)]


def test_the_scanner_sees_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / PACKAGE
    (pkg / "engine").mkdir(parents=True)
    (pkg / "server").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "server" / "__init__.py").write_text("")
    (pkg / "server" / "web.py").write_text("")
    (pkg / "engine" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import importlib\n"
        "if TYPE_CHECKING:\n"
        "    from kobold_backend.server import web\n"
        "def f():\n"
        "    from ..server.web import x\n"
        "    importlib.import_module('kobold_backend.host.backend')\n"
        "    import tests.helpers\n"
        "SUBCOMMANDS = [('kobold_backend.server.web', 'add_parser')]\n")
    found = forbidden_arrows(package_arrows(pkg))
    assert [(a.target, a.line) for a in found] == [
        ("kobold_backend.server.web", 4), ("kobold_backend.server.web", 6), ("kobold_backend.host.backend", 7),
        ("tests.helpers", 8), ("kobold_backend.server.web", 9)]
    assert found[0].where() == "kobold_backend/engine/a.py:4 (kobold_backend.engine.a -> kobold_backend.server.web)"
    (pkg / "server" / "web.py").write_text("from kobold_backend.engine import a\n")
    circles = room_circles(package_arrows(pkg))
    assert [g for g, _ in circles] == [["engine", "server"]]


def test_no_forbidden_arrow() -> None:
    found = forbidden_arrows(package_arrows())
    if found:
        pytest.fail("imports that break the layering (docs/architecture.md, 'Allowed arrows'):\n"
                    + "\n".join("  " + a.where() for a in found))


def test_a_circle_between_modules_of_one_room_is_caught(tmp_path: Path) -> None:
    """A made-up circle inside the engine, closed by a function-level import and a TYPE_CHECKING one, as the
    engine/config <-> engine/architectures circle was."""
    pkg = tmp_path / PACKAGE
    (pkg / "engine" / "families").mkdir(parents=True)
    for init in (pkg, pkg / "engine", pkg / "engine" / "families"):
        (init / "__init__.py").write_text("")
    (pkg / "engine" / "families" / "__init__.py").write_text("from kobold_backend.engine.families import llama\n")
    (pkg / "engine" / "families" / "llama.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kobold_backend.engine.config import Config\n")
    (pkg / "engine" / "config.py").write_text("def read():\n    from kobold_backend.engine.families import lookup\n")
    (pkg / "engine" / "leaf.py").write_text("from kobold_backend.engine import config\n")
    circles = module_circles(package_arrows(pkg))
    assert [g for g, _ in circles] == [["kobold_backend.engine.config", "kobold_backend.engine.families",
                                        "kobold_backend.engine.families.llama"]]
    assert [a.line for a in circles[0][1]] == [2, 1, 3]
    assert room_circles(package_arrows(pkg)) == []  # one room: the room rule alone would not see it
    (pkg / "engine" / "families" / "llama.py").write_text("from kobold_backend.engine import families\n")
    assert module_circles(package_arrows(pkg)) == []  # a family importing its own package is no circle


def test_no_circle_between_modules() -> None:
    circles = module_circles(package_arrows())
    if circles:
        pytest.fail("modules that import each other:\n" + "\n".join(
            f"  {' <-> '.join(group)}:\n" + "\n".join("    " + a.where() for a in joins) for group, joins in circles))


def test_no_circle_between_rooms() -> None:
    circles = room_circles(package_arrows())
    if circles:
        pytest.fail("rooms that import each other:\n" + "\n".join(
            f"  {' <-> '.join(group)}:\n" + "\n".join("    " + a.where() for a in joins) for group, joins in circles))



def _reach(graph: Dict[str, Set[str]], start: str) -> Set[str]:
    seen: Set[str] = set()
    todo = list(graph.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def modules_in_circles(arrows: List[Arrow], room: str) -> List[str]:
    """Modules of one room that reach themselves through its imports (importing a package's own __init__ on the
    way to one of its modules is no arrow)."""
    graph: Dict[str, Set[str]] = {}
    for a in arrows:
        if room_of(a.source) == room == room_of(a.target) and not a.source.startswith(a.target + "."):
            graph.setdefault(a.source, set()).add(a.target)
    return sorted(m for m in graph if m in _reach(graph, m))


def test_no_circle_inside_the_cli(tmp_path: Path) -> None:
    """cli/main imports serve, model_args and split; nothing in cli/ imports main back (cli_serve used to, while
    cli imported it through importlib)."""
    pkg = tmp_path / PACKAGE
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cli" / "__init__.py").write_text("")
    (pkg / "cli" / "main.py").write_text("import importlib\nimportlib.import_module('kobold_backend.cli.serve')\n")
    (pkg / "cli" / "serve.py").write_text("def f():\n    from kobold_backend.cli.main import g\n")
    assert modules_in_circles(package_arrows(pkg), "cli") == ["kobold_backend.cli.main", "kobold_backend.cli.serve"]
    assert modules_in_circles(package_arrows(), "cli") == []
