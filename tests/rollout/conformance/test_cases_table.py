"""CASES.md, the review's 70 cases re-run: one row per case, each naming tests that exist in this directory (a
renamed or deleted test would leave a case without its check)."""

from __future__ import annotations

import ast
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = {n: f"test_conformance_{n}.py" for n in ("control", "generate", "openai", "weights", "broadcast", "client")}


def rows() -> list[list[str]]:
    with open(os.path.join(HERE, "CASES.md")) as f:
        lines = [ln for ln in f if re.match(r"\| [SC]\d\d \|", ln)]
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]


def defined_tests(file: str) -> dict[str, str]:
    """Test function name -> the source of its decorators (where its parametrize ids are)."""
    with open(os.path.join(HERE, file)) as f:
        src = f.read()
    return {
        node.name: "".join(ast.get_source_segment(src, d) for d in node.decorator_list)
        for node in ast.parse(src).body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def test_cases_md_has_the_reviews_70_cases_once_each():
    ids = [r[0] for r in rows()]
    assert len(ids) == 70 and len(set(ids)) == 70
    assert sum(i.startswith("S") for i in ids) == 56


def test_every_case_names_tests_that_exist_with_their_parameters():
    known = {short: defined_tests(file) for short, file in FILES.items()}
    for case in rows():
        refs = [r.strip() for r in case[-1].split(",")]
        assert refs and all(refs), case[0]
        for ref in refs:
            short, _, name = ref.partition("::")
            func, _, param = name.partition("[")
            assert func in known[short], f"{case[0]}: {ref} is not a test in {FILES[short]}"
            if param:
                assert param.rstrip("]") in known[short][func], f"{case[0]}: {ref} has no such parameter"


def test_the_counts_stated_match_the_rows():
    assert all(r[3].startswith("pass") for r in rows())
    with open(os.path.join(HERE, "CASES.md")) as f:
        text = f.read()
    deliberate = sum("deliberate:" in r[3] for r in rows())
    assert f"**70 of 70 pass**; {deliberate} of them" in text
    assert sum(r[2] == "pass" for r in rows()) == 30 and "read 30 passed and 40 failed" in text
