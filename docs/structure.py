"""The house in numbers, for docs/structure.md: ``python docs/structure.py [CHECKOUT]`` measures the miles/ of a
checkout (default: this one) the way the structure reviews do, and prints the rows as JSON.

- sizes: the package formatted with ``ruff format --line-length 120`` on a scratch copy; a file's length is its
  physical lines; a function runs from its first decorator to its last line (docstring and nested functions
  included), every ``def`` counted, methods and nested ones too;
- top level: the flat modules directly under miles/ (``__init__.py`` not counted) and the folders;
- upward arrows: the checkout's import graph (tests/test_import_graph.py's, function-level imports included) laid
  over THIS checkout's declared floors (docs/architecture.py LAYERS), so two checkouts are measured against one
  picture (a file since moved is read at its room of today: ``MOVED``); a module no room holds is reported.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def formatted_copy(checkout: Path, tmp: Path) -> Path:
    pkg = tmp / "miles"
    shutil.copytree(checkout / "miles", pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run(["ruff", "format", "--quiet", "--line-length", "120", str(pkg)], check=True, cwd=tmp)
    return pkg


def function_lengths(tree: ast.AST) -> list[int]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            out.append(node.end_lineno - first + 1)
    return out


def _p90(values: list[int]) -> int:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def sizes(pkg: Path) -> dict:
    files = sorted(pkg.rglob("*.py"))
    lines = {str(f.relative_to(pkg.parent)): len(f.read_text().splitlines()) for f in files}
    funcs = [n for f in files for n in function_lengths(ast.parse(f.read_text()))]
    per_file = list(lines.values())
    return {
        "modules": len(files),
        "lines": sum(per_file),
        "file median / p90 / max": [statistics.median(per_file), _p90(per_file), max(per_file)],
        "files over 500 lines": {k: v for k, v in sorted(lines.items(), key=lambda kv: -kv[1]) if v > 500},
        "files over 400 lines": sum(v > 400 for v in per_file),
        "functions": len(funcs),
        "function median / p90 / max": [statistics.median(funcs), _p90(funcs), max(funcs)],
        "functions over 50 lines": sum(n > 50 for n in funcs),
    }


def top_level(pkg: Path) -> dict:
    flat = sorted(p.name for p in pkg.glob("*.py") if p.name != "__init__.py")
    folders = sorted(p.name for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    return {"flat modules": len(flat), "folders": len(folders), "names": flat}


# files since moved into a folder of their own, read at their room of today (so an older checkout is measured
# against today's floors)
MOVED = {
    "miles/cli.py": "miles/cli/__init__.py",
    "miles/handoff.py": "miles/handoff/plan.py",
    "miles/planner.py": "miles/handoff/planner.py",
    "miles/plan_executor.py": "miles/handoff/executor.py",
    "miles/hardware.py": "miles/handoff/hardware.py",
    "miles/planner_view.py": "miles/handoff/view.py",
}


def upward(pkg: Path) -> dict:
    graph = _load(HERE / "tests" / "test_import_graph.py", "_import_graph")
    layers = _load(HERE / "docs" / "architecture.py", "_architecture").LAYERS
    floor = graph.floors(layers)

    def room(module: str) -> str | None:
        path = graph.module_path(pkg, module)
        return graph.room_of(MOVED.get(path, path), floor)

    arrows: dict[tuple[str, str], list[str]] = {}
    edges = graph.import_graph(pkg, packages=True)
    for a, targets in edges.items():
        for b in sorted(targets):
            ra, rb = room(a), room(b)
            if ra and rb and ra != rb and floor[rb] < floor[ra]:
                arrows.setdefault((ra, rb), []).append(f"{a} imports {b}")
    found = [
        f"{a} (floor {floor[a]}) -> {b} (floor {floor[b]}): {'; '.join(w)}" for (a, b), w in sorted(arrows.items())
    ]
    unplaced = sorted(graph.module_path(pkg, m) for m in edges if room(m) is None)
    return {"upward arrows": len(found), "arrows": found, "modules on no floor": unplaced}


def measure(checkout: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="miles-structure-") as tmp:
        pkg = formatted_copy(checkout, Path(tmp))
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
        return {"commit": commit.stdout.strip(), **sizes(pkg), **top_level(pkg), **upward(pkg)}


if __name__ == "__main__":
    print(json.dumps(measure(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE), indent=1))
