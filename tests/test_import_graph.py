"""The modules of miles/ import each other without cycles (function-level imports included), and its rooms (top-level
modules and folders) keep the floors declared in docs/architecture.py: a room imports only from rooms on its floor or
below, never around a circle. So every layer can be read, tested and replaced from the bottom up."""

import ast
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "miles"


def import_graph(root: Path, packages: bool = False) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its file; an import that resolves to a package's
    ``__init__`` counts only with ``packages`` (its re-exports make loops that are not cycles of modules)."""
    mods = {}
    for f in root.rglob("*.py"):
        rel = f.relative_to(root.parent).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        base = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    parts = base.split(".")
                    mod = ".".join(parts[: len(parts) - node.level + 1] + ([mod] if mod else []))
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != m and (packages or mods[t].name != "__init__.py"):
                    edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_modules_of_miles_import_each_other_without_a_cycle():
    found = cycles(import_graph(PKG))
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_sees_a_cycle_closed_by_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from pkg import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]


# ---- the declared layers ------------------------------------------------------------------------------------------
def declared_layers() -> list:
    spec = importlib.util.spec_from_file_location("architecture", REPO / "docs" / "architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LAYERS


def floors(layers: list) -> dict[str, int]:
    """room -> its floor, 0 the top one."""
    return {room: i for i, (_, rooms) in enumerate(layers) for room, _ in rooms}


def module_path(root: Path, module: str) -> str:
    rel = Path(*module.split("."))
    return f"{rel}/__init__.py" if (root.parent / rel).is_dir() else f"{rel}.py"


def room_of(path: str, rooms) -> str | None:
    """The most specific declared room holding the file ``path`` (a folder room ends in '/')."""
    holding = [r for r in rooms if path == r or (r.endswith("/") and path.startswith(r))]
    return max(holding, key=len, default=None)


def room_graph(root: Path, layers: list) -> dict[tuple[str, str], list[str]]:
    """(room, room it imports) -> the module imports that make that arrow."""
    rooms = floors(layers)
    arrows: dict[tuple[str, str], list[str]] = {}
    for a, targets in import_graph(root, packages=True).items():
        ra = room_of(module_path(root, a), rooms)
        for b in sorted(targets):
            rb = room_of(module_path(root, b), rooms)
            if ra and rb and ra != rb:
                arrows.setdefault((ra, rb), []).append(f"{a} imports {b}")
    return arrows


def undeclared_rooms(root: Path, layers: list) -> list[str]:
    """Top-level modules and folders of the package on no floor, and declared rooms that do not exist."""
    rooms = floors(layers)
    found = [f"{root.name}/{p.name}" + ("/" if p.is_dir() else "") for p in root.iterdir()]
    found = [f for f in found if f.endswith((".py", "/")) and "__pycache__" not in f]
    missing = [f for f in found if room_of(f, rooms) is None and not (f.endswith("/") and room_of(f + "x.py", rooms))]
    gone = [r for r in rooms if not (root.parent / r).exists()]
    return sorted(missing) + [f"{r} (declared, not found)" for r in gone]


def upward_arrows(root: Path, layers: list) -> list[str]:
    """Arrows from a room to a room on a floor above it, each with the imports that make it."""
    floor = floors(layers)
    return [
        f"{a} (floor {floor[a]}) -> {b} (floor {floor[b]}): {'; '.join(why)}"
        for (a, b), why in sorted(room_graph(root, layers).items())
        if floor[b] < floor[a]
    ]


def room_cycles(root: Path, layers: list) -> list[list[str]]:
    edges: dict[str, set[str]] = {r: set() for r in floors(layers)}
    for a, b in room_graph(root, layers):
        edges[a].add(b)
    return cycles(edges)


def test_every_room_of_miles_is_declared_on_one_floor_of_docs_architecture():
    layers = declared_layers()
    declared = [room for _, rooms in layers for room, _ in rooms]
    assert len(declared) == len(set(declared)), "a room declared twice in docs/architecture.py"
    assert undeclared_rooms(PKG, layers) == [], "add each to a floor of LAYERS in docs/architecture.py"


def test_no_room_of_miles_imports_a_room_on_a_floor_above_it():
    found = upward_arrows(PKG, declared_layers())
    assert found == [], (
        "upward imports (import from a lower floor, or move a room; docs/architecture.py):\n" + "\n".join(found)
    )


def test_no_two_rooms_of_miles_import_each_other_around_a_circle():
    found = room_cycles(PKG, declared_layers())
    assert found == [], "rooms in a circle: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_picture_is_drawn_from_the_declared_layers():
    spec = importlib.util.spec_from_file_location("architecture", REPO / "docs" / "architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (REPO / "docs" / "architecture.svg").read_text() == module.svg(), "run python docs/architecture.py"


def test_the_layer_check_sees_an_import_from_a_floor_above_and_a_circle_of_rooms(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "config.py").write_text("")
    (pkg / "low" / "leaf.py").write_text("def f():\n    from pkg import top\n")
    (pkg / "top.py").write_text("from pkg.low import config\n")
    layers = [("up", [("pkg/top.py", "")]), ("down", [("pkg/low/", ""), ("pkg/__init__.py", "")])]
    assert undeclared_rooms(pkg, layers) == []
    assert upward_arrows(pkg, layers) == ["pkg/low/ (floor 1) -> pkg/top.py (floor 0): pkg.low.leaf imports pkg.top"]
    assert room_cycles(pkg, layers) == [["pkg/low/", "pkg/top.py"]]
    layers = [("up", [("pkg/top.py", "")]), ("down", [("pkg/low/config.py", ""), ("pkg/__init__.py", "")])]
    assert undeclared_rooms(pkg, layers) == ["pkg/low/"]
