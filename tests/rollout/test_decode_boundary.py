"""The decode loop and the engine meet through a data structure (miles.rollout.rows) and the engine's public
calls: neither file reaches into the other's private names (the loop once shared 8 of the engine's)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROLLOUT = Path(__file__).resolve().parents[2] / "miles" / "rollout"


def private_reaches(source: str) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` (dunders aside): a private name of another object."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


@pytest.mark.parametrize("name", ["decode_loop.py", "engine.py", "rows.py"])
def test_the_decode_loop_and_the_engine_use_no_private_name_of_another_object(name):
    assert private_reaches((ROLLOUT / name).read_text()) == []


def test_the_check_sees_a_private_name_reached_through_another_object():
    src = (
        "class L:\n    def f(self):\n        e = self.e\n        e._lock\n        self.e._step()\n        self._own()\n"
    )
    assert private_reaches(src) == ["line 4: e._lock", "line 5: self.e._step"]
